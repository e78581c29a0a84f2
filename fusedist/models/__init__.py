"""Models built from fusedist's layers and ops: a tensor-parallel Llama family (llama/), the
runner that prefills and decodes it with CUDA graphs (runner.py), and the Python API over both:
LLM (llm.py: load a checkpoint, generate, stream) with Hugging Face's conventions (hf.py:
tokenizer, generation_config.json, torch_dtype); continuous batching for serving: Engine
(scheduler.py, prefix_cache.py, sampler.py, detokenize.py) and AsyncEngine
(async_engine.py). docs/python_api.md describes it."""

from .hf import GenerationDefaults, Tokenizer, load_tokenizer
from .llama import LlamaConfig, Transformer, build_model
from .llm import LLM, Completion, Token
from .runner import GenerationResult, Runner
from .sampling import SamplingParams, sample
from .sampler import GenerationParams, ParamError
from .scheduler import Engine, QueueFull, RequestOutput
from .async_engine import AsyncEngine

__all__ = ["LLM", "Completion", "Token", "GenerationDefaults", "Tokenizer", "load_tokenizer",
           "LlamaConfig", "Transformer", "build_model", "Runner", "SamplingParams", "sample",
           "GenerationResult", "Engine", "AsyncEngine", "GenerationParams", "ParamError",
           "QueueFull", "RequestOutput"]
