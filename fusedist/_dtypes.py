"""The dtype tables, once: torch dtype <-> fusedist._C dtype codes (the DType enum of
csrc/include/fusedist/common/common.h), the FP8 format fusedist stores (e4m3, torch.float8_e4m3fn; None on a torch without
it) and its largest finite value."""

from __future__ import annotations

import torch

FLOAT32, FLOAT16, BFLOAT16, FLOAT8_E4M3 = 0, 1, 2, 3

_CODES = {torch.float32: FLOAT32, torch.float16: FLOAT16, torch.bfloat16: BFLOAT16}
if hasattr(torch, "float8_e4m3fn"):
    _CODES[torch.float8_e4m3fn] = FLOAT8_E4M3

FP8 = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0   # largest finite e4m3 value

REDUCE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def code(dtype: torch.dtype) -> int:
    return _CODES[dtype]
