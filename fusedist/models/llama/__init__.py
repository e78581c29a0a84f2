"""Llama-family decoders (Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5, Qwen3) and their
mixture-of-experts variants (Mixtral, Qwen2-MoE, Qwen3-MoE) on fusedist: config.py
(LlamaConfig from config.json, MoeConfig), weights.py (checkpoint readers and the TP shard
rules), model.py (fusedist's model), baseline.py (the plain-torch baseline on the same
weights), moe.py (both with a mixture of experts in the sparse layers)."""

import torch

from .baseline import TorchTransformer
from .config import NAMED, SUPPORTED_ARCHITECTURES, LlamaConfig, MoeConfig, WeightQuant
from .model import Transformer
from .moe import MoeTransformer, TorchMoeTransformer
from .weights import (QUANTIZE, RandomWeights, SafetensorsWeights, WeightSource, open_weights,
                      resolve_quant)

# backend -> the model class (the CLI's --baseline torch / torch-compile build "torch").
BACKENDS = {"fusedist": Transformer, "torch": TorchTransformer}
# The same for a config with a mixture of experts (cfg.moe).
MOE_BACKENDS = {"fusedist": MoeTransformer, "torch": TorchMoeTransformer}


def build_model(cfg: LlamaConfig, src: WeightSource, *, backend: str = "fusedist", group=None,
                dtype=torch.bfloat16, device=None, max_position: int = 0, progress=None,
                quantize=None, ep: bool = False):
    """The model for cfg on this rank's group (`backend`: "fusedist", or "torch" for the
    plain-torch baseline), loaded from src (progress(i, n) per layer), in eval mode.
    Projection weights: FP8 as an FP8 checkpoint stores them (cfg.quant, from its
    quantization_config), or quantized at load with quantize="fp8" (per output channel;
    "fp8-tensor", "fp8-block" for the other scale layouts), else `dtype`
    (weights.resolve_quant). ep=True: a mixture of experts' experts sharded over the group
    (expert parallelism; attention stays tensor-parallel; the fusedist backend only)."""
    if backend not in BACKENDS:
        raise ValueError(f"fusedist.models: backend must be one of {tuple(BACKENDS)}, got "
                         f"{backend!r}")
    if not isinstance(ep, bool):
        raise TypeError(f"fusedist.models: ep must be True or False, got {ep!r}")
    if ep and backend != "fusedist":
        raise ValueError(f"fusedist.models: ep=True (expert parallelism) runs on the fusedist "
                         f"backend; the {backend} baseline shards every expert's intermediate "
                         "(build it with ep=False)")
    classes = MOE_BACKENDS if cfg.moe is not None else BACKENDS
    m = classes[backend](cfg, group=group, dtype=dtype, device=device,
                         max_position=max_position, quant=resolve_quant(cfg, quantize, src),
                         ep=ep)
    return m.load(src, progress).eval()


__all__ = ["LlamaConfig", "MoeConfig", "NAMED", "SUPPORTED_ARCHITECTURES", "Transformer",
           "TorchTransformer", "MoeTransformer", "TorchMoeTransformer", "build_model", "BACKENDS",
           "MOE_BACKENDS", "WeightSource", "SafetensorsWeights", "RandomWeights",
           "open_weights", "WeightQuant", "QUANTIZE", "resolve_quant"]
