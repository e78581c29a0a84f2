"""Llama-family decoders (Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5) on fusedist."""

from .config import NAMED, SUPPORTED_ARCHITECTURES, LlamaConfig
from .model import BACKENDS, Transformer, build_model
from .weights import RandomWeights, SafetensorsWeights, WeightSource, open_weights

__all__ = ["LlamaConfig", "NAMED", "SUPPORTED_ARCHITECTURES", "Transformer", "build_model",
           "BACKENDS", "WeightSource", "SafetensorsWeights", "RandomWeights", "open_weights"]
