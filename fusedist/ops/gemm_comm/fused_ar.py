"""gemm_ar's fused engine, fused_ar (M <= GEMM_AR_FUSED_MAX_M): one CUDA kernel
(csrc/include/fusedist/gemm/gemm_comm.cuh) streams the weight through a TMA ring into tensor-core
MMAs, 64 output columns per block, and each block exchanges its finished strip with the peers
through the communicator's symmetric buffers (one-shot protocol) while other blocks still
stream weights. bf16/fp16, N and K multiples of 8, w as [K, N] or as the .t() of an [N, K]
nn.Linear weight; NVLink peers only."""

from __future__ import annotations

from typing import Optional

import torch

from ... import _dtypes, _ext
from ...comm.communicator import Communicator
from ..gemm import launch_decode
from .base import Call, Engine, fused_common_why_not


class FusedGemmAr(Engine):
    name = "fused_ar"

    def why_not(self, call: Call) -> Optional[str]:
        if call.op != "gemm_ar":
            return f"the fused gemm_ar kernel all-reduces; {call.op} has no fused_ar engine"
        return _fused_ar_why_not(call.comm, call.x, call.w)

    def run(self, call: Call) -> torch.Tensor:
        return launch_decode(call.comm, call.x, call.w, call.bias, call.out,
                             call.comm.launch_stream())


ENGINE = FusedGemmAr()


def _fused_ar_why_not(comm: Communicator, x: torch.Tensor, w: torch.Tensor) -> Optional[str]:
    """None when gemm_ar's fused kernel takes (x, w) on this communicator, else why not."""
    why = fused_common_why_not(comm, x, w)
    if why is not None:
        return why
    C = _ext.load()
    M, K = x.shape
    N = w.shape[1]
    if M > C.GEMM_AR_FUSED_MAX_M:
        return f"M = {M} rows (the fused kernel takes at most {C.GEMM_AR_FUSED_MAX_M})"
    cap = C.allreduce_max_numel(comm.symm.handle, _dtypes.code(x.dtype), C.ALGO_ONE_SHOT)
    if M * N > cap:
        return (f"the [M, N] output has {M * N} elements, more than the communicator's one-shot "
                f"slot ({cap}); create fusedist.Communicator(max_bytes=...) larger")
    return None
