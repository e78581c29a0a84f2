"""Sampling the next token: greedy, temperature, top-k, top-p. Multinomial sampling in its
exponential-race form (argmax of p / Exp(1) noise) from a seeded torch.Generator: reproducible
for a seed, and identical on every rank that holds the same logits and generator state."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class SamplingParams:
    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0          # 0: off
    top_p: float = 1.0      # 1.0: off
    seed: int = 0

    def __post_init__(self):
        if type(self.greedy).__name__ == "bool_":      # numpy.bool_
            self.greedy = bool(self.greedy)
        if not isinstance(self.greedy, bool):
            raise ValueError(f"SamplingParams: greedy must be a bool, got {self.greedy!r}")
        if _is_int(self.top_k):
            self.top_k = int(self.top_k)
        if _is_int(self.seed):
            self.seed = int(self.seed)
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or \
                t < 0:
            raise ValueError(f"SamplingParams: temperature must be a finite number >= 0 (0: "
                             f"greedy), got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 < p <= 1.0:
            raise ValueError(f"SamplingParams: top_p must be in (0, 1] (1.0: off), got {p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"SamplingParams: top_k must be an int >= 0 (0: off), got "
                             f"{self.top_k!r}")
        if not _is_int(self.seed) or not -2 ** 63 <= self.seed < 2 ** 64:
            raise ValueError(f"SamplingParams: seed must be an int in [-2**63, 2**64), got "
                             f"{self.seed!r}")


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)

def nan_rows(logits: torch.Tensor) -> torch.Tensor:
    """bool [n]: the rows of logits [n, vocab] that hold a NaN (on logits' device, no sync)."""
    return torch.isnan(logits).any(dim=-1)


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: Optional[torch.Generator], check: Optional[bool] = None) -> torch.Tensor:
    """Next token ids [n] (int64) from logits [n, vocab]. A row holding NaN has no next token
    (argmax would pick the NaN's index, typically 0): check=True refuses one with a ValueError
    naming the rows; None (default) checks CPU logits (no synchronization) and leaves CUDA
    logits to the caller (the Runner checks every step's rows once at the end of the call);
    False does not check."""
    if check or (check is None and logits.device.type == "cpu"):
        bad = nan_rows(logits)
        if bool(bad.any()):
            rows = bad.nonzero().flatten().tolist()
            raise ValueError(f"fusedist.models.sample: logits rows {rows[:8]} of "
                             f"{logits.shape[0]} hold NaN; there is no token to sample from "
                             "them (check the model's weights and inputs)")
    if params.greedy or params.temperature == 0.0:
        return logits.argmax(dim=-1)
    lg = logits.float() / params.temperature
    if params.top_k and params.top_k < lg.shape[-1]:
        kth = torch.topk(lg, params.top_k, dim=-1).values[:, -1:]
        lg = lg.masked_fill(lg < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_lg, idx = torch.sort(lg, dim=-1, descending=True)
        cum = sorted_lg.softmax(-1).cumsum(-1)
        drop = (cum - sorted_lg.softmax(-1)) > params.top_p   # keeps at least the top token
        lg = lg.scatter(-1, idx, sorted_lg.masked_fill(drop, float("-inf")))
    probs = lg.softmax(-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)
