"""The dtype tables, once: torch dtype <-> fusedist._C dtype codes (the DType enum of
csrc/include/fusedist/common/common.h), the FP8 format fusedist stores (e4m3, torch.float8_e4m3fn; None on a torch without
it), its largest finite value and its block-scale layout."""

from __future__ import annotations

import torch

FLOAT32, FLOAT16, BFLOAT16, FLOAT8_E4M3 = 0, 1, 2, 3

_CODES = {torch.float32: FLOAT32, torch.float16: FLOAT16, torch.bfloat16: BFLOAT16}
if hasattr(torch, "float8_e4m3fn"):
    _CODES[torch.float8_e4m3fn] = FLOAT8_E4M3

FP8 = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0   # largest finite e4m3 value
FP8_BLOCK = 128   # block scales: one per 128 x 128 weights, one per 128 k of a token


def expand_block_scales(s: torch.Tensor, rows: int, cols: int,
                        rows_per: int = FP8_BLOCK) -> torch.Tensor:
    """Block scales s [ceil(rows / rows_per), ceil(cols / 128)] as one multiplier per element
    [rows, cols], in s's dtype (rows_per 128: 128 x 128 weight blocks; 1: a token's 128-k
    groups)."""
    return s.repeat_interleave(rows_per, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]

REDUCE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def code(dtype: torch.dtype) -> int:
    return _CODES[dtype]
