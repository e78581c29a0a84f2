"""Models built from fusedist's layers and ops: a tensor-parallel Llama family (llama/) and
the runner that prefills and decodes it with CUDA graphs (runner.py)."""

from .llama import LlamaConfig, Transformer, build_model
from .runner import GenerationResult, Runner
from .sampling import SamplingParams, sample

__all__ = ["LlamaConfig", "Transformer", "build_model", "Runner", "SamplingParams", "sample",
           "GenerationResult"]
