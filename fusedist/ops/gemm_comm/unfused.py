"""The unfused engine: the collective and one cuBLAS GEMM (torch.matmul), back to back; on
CPU tensors (gloo) the plain-torch reference path, fp32 accumulation rounded once."""

from __future__ import annotations

from typing import Optional

import torch

from .base import Call, Engine, mm


class Unfused(Engine):
    name = "unfused"

    def why_not(self, call: Call) -> Optional[str]:
        return None  # takes every call

    def run(self, call: Call) -> torch.Tensor:
        if call.comm.device.type == "cpu":
            return {"ag_gemm": _ag_cpu, "gemm_rs": _rs_cpu, "gemm_ar": _ar}[call.op](call)
        return {"ag_gemm": _ag, "gemm_rs": _rs, "gemm_ar": _ar}[call.op](call)


ENGINE = Unfused()


def _ag(call: Call) -> torch.Tensor:
    comm, x = call.comm, call.x
    gathered = torch.empty((call.rows, call.k), dtype=x.dtype, device=x.device)
    comm.check_nccl_call("all_gather", x.dtype, x.numel())
    comm.nccl.all_gather(x, gathered)
    return mm(gathered, call.w, call.out, call.bias)


def _rs(call: Call) -> torch.Tensor:
    part = torch.matmul(call.x, call.w)
    call.comm.check_nccl_call("reduce_scatter", part.dtype, part.numel())
    call.comm.nccl.reduce_scatter(part, call.out)
    return call.out.add_(call.bias) if call.bias is not None else call.out


def _ar(call: Call) -> torch.Tensor:
    out = call.out
    torch.matmul(call.x, call.w, out=out)
    call.comm.all_reduce(out, out=out)
    return out.add_(call.bias) if call.bias is not None else out


def _ag_cpu(call: Call) -> torch.Tensor:
    comm, x_shard = call.comm, call.x
    comm.check_same_call("all_gather", x_shard)
    parts = [torch.empty_like(x_shard, dtype=torch.float32) for _ in range(call.world)]
    torch.distributed.all_gather(parts, x_shard.float(), group=comm.group.pg)
    ref = torch.cat(parts) @ call.w.float()
    if call.bias is not None:
        ref += call.bias.float()
    return call.out.copy_(ref)


def _rs_cpu(call: Call) -> torch.Tensor:
    comm = call.comm
    m, n = call.out.shape
    part = call.x.float() @ call.w.float()
    comm.check_same_call("reduce_scatter", part)
    # gloo lacks reduce_scatter: all_reduce, then this rank's block.
    torch.distributed.all_reduce(part, group=comm.group.pg)
    r = comm.group.rank
    res = part[r * m:(r + 1) * m]
    if call.bias is not None:
        res += call.bias.float()
    return call.out.copy_(res)
