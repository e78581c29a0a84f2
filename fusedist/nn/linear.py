"""Tensor-parallel linears with the Megatron / vLLM conventions.

ColumnParallelLinear  Y = X A^T + b, A [out, in] split by rows (output features):
    rank r holds A_r [out/W, in] and b_r. Input X replicated [M, in] -> Y_r = X A_r^T + b_r
    [M, out/W]; gather_output=True all-gathers the columns into [M, out]. With
    sequence_parallel=True the input is this rank's row shard [m, in] and the all-gather of X
    is fused with the GEMM: Y_r = ag_gemm(X_shard, A_r^T) [W m, out/W].
RowParallelLinear     Y = X A^T + b, A [out, in] split by columns (input features):
    rank r holds A_r [out, in/W]. input_is_parallel=True: X_r [M, in/W] -> Y = all_reduce(X_r
    A_r^T) + b via gemm_ar [M, out]; input_is_parallel=False: the module slices its columns
    of X first. With sequence_parallel=True the output is reduce-scattered by rows (gemm_rs):
    [M / W, out]. The bias is added once, after the reduction.
Weights load from the full matrix with from_full()/load_full(), which take this rank's shard.
linear(x, w, bias)    x @ w^T (+ bias) for a local [out, in] weight, no communication: the
    GEMM dispatch every projection of fusedist's model layers shares (fusedist.gemm's `auto`
    rules for CUDA bf16/fp16, F.linear where fusedist.gemm takes no such call; an FP8Weight
    goes through fusedist.nn.quant.fp8_linear).
FP8 weights (fusedist.nn.quant.FP8Weight): from_full() / load_full() take one and keep it FP8,
sharded by FP8Weight.shard (per-channel scales follow the rows, block scales are cut along the
split dimension, on multiples of 128). The GEMM is fp8_linear; the communication is the
all-gather / all-reduce of the bf16 output (the fused ag_gemm / gemm_rs / gemm_ar engines and
sequence_parallel take bf16 / fp16 weights only).
Any number of tokens, 0 included (then every rank of the group has 0: the collectives need the
same M everywhere, and an empty call skips them on every rank alike).
These are inference modules: parameters do not require grad (the ops write into preallocated
outputs, which autograd does not support).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..comm.communicator import GroupLike, get_communicator
from ..ops.gemm import gemm
from ..ops.allreduce import all_reduce
from ..ops.gemm_comm import ag_gemm, gemm_ar, gemm_rs
from .quant import FP8Rows, FP8Weight, fp8_linear


def linear(x, w, bias: Optional[torch.Tensor] = None, *,
           x_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., in] @ w^T (+ bias [out]) for a row-major nn.Linear weight w [out, in].
    CUDA bf16/fp16 with in and out multiples of 8 (16-byte TMA rows) go through
    fusedist.gemm(kernel="auto"): fusedist's decode or sm90 kernel where the tuning table's
    rules measured it faster than torch.matmul at that (M, K, N), torch.matmul (cuBLAS)
    everywhere else. Other calls (CPU, fp32, odd sizes) are F.linear. An FP8Weight goes
    through fusedist.nn.quant.fp8_linear (the GEMV to 16 rows, torch._scaled_mm, or its
    dequantized weight; on CPU the fp32 reference), the output in x's dtype; x_scale=: x is
    e4m3 with those per-token scales (fp8_linear's pre-quantized input, bf16 output), or
    x = FP8Rows(e4m3 rows, their scales), the same."""
    if isinstance(x, FP8Rows):
        if x_scale is not None:
            raise ValueError("fusedist.nn.linear: x is FP8Rows, which carries its scales; pass "
                             "x_scale=None")
        x, x_scale = x
    if isinstance(w, FP8Weight):
        return fp8_linear(x, w, bias, x_scale=x_scale)
    if x_scale is not None:
        raise ValueError("fusedist.nn.linear: x_scale (an e4m3 x quantized per token) needs an "
                         "FP8Weight; this weight is a tensor: pass x in its dtype")
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype and \
            w.dim() == 2 and w.shape[0] % 8 == 0 and w.shape[1] % 8 == 0 and \
            w.stride(1) == 1 and w.stride(0) % 8 == 0:
        x2 = x.reshape(-1, x.shape[-1])
        y = gemm(x2 if x2.is_contiguous() else x2.contiguous(), w.t(), bias)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])
    return F.linear(x, w, bias)


def _param(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t, requires_grad=False)


def _split(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise ValueError(f"fusedist.nn: {what}={n} is not divisible by the tensor-parallel size "
                         f"{parts}; pick a size that is")
    return n // parts


class _TPLinear(torch.nn.Module):
    def __init__(self, group: GroupLike, engine: str):
        super().__init__()
        self.comm = get_communicator(group)
        self.tp_size = self.comm.group.size
        self.tp_rank = self.comm.group.rank
        self.engine = engine

    @classmethod
    def from_full(cls, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, **kw):
        """Build the module for a full [out, in] weight (and bias) and load this rank's shard.
        An FP8Weight stays FP8; the module's dtype (activations, bias) is then dtype=, else the
        bias's, else bfloat16."""
        fp8 = isinstance(weight, FP8Weight)
        dtype = kw.pop("dtype", None) or (weight.dtype if not fp8 else
                                          bias.dtype if bias is not None else torch.bfloat16)
        device = kw.pop("device", weight.device if fp8 else None)
        m = cls(weight.shape[1], weight.shape[0], bias is not None, dtype=dtype, device=device,
                **kw)
        return m.load_full(weight, bias)

    def _fp8_shard(self, weight: FP8Weight, dim: int, what: str) -> None:
        """Keep this rank's shard of an FP8 weight in place of the bf16 / fp16 parameter."""
        if self.sequence_parallel:
            raise ValueError(f"{what}: sequence_parallel=True takes bf16 / fp16 weights (the "
                             "fused GEMM + collective engines); FP8 weights run with "
                             "sequence_parallel=False")
        shard = weight.shard(dim, self.tp_rank, self.tp_size, what).to(self.weight.device)
        self._parameters.pop("weight", None)
        self.weight = shard

    def _flat(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{type(self).__name__}: x must be a torch.Tensor, got "
                            f"{type(x).__name__}")
        dtype = self.weight.dtype if not isinstance(self.weight, FP8Weight) else \
            (self.bias.dtype if self.bias is not None else x.dtype)
        if x.dtype != dtype:
            raise TypeError(f"{type(self).__name__}: x is {x.dtype}, this module's weights are "
                            f"{dtype}; pass x.to({dtype}) (or build the module with "
                            f"dtype={x.dtype})")
        lead = tuple(x.shape[:-1])
        return x.reshape(-1, x.shape[-1]).contiguous(), lead


class ColumnParallelLinear(_TPLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 group: GroupLike = None, dtype=None, device=None, engine: str = "auto"):
        super().__init__(group, engine)
        self.in_features, self.out_features = in_features, out_features
        self.out_per_rank = _split(out_features, self.tp_size, "out_features")
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        device = device if device is not None else self.comm.device
        self.weight = _param(torch.empty(self.out_per_rank, in_features, dtype=dtype,
                                         device=device))
        self.bias = _param(torch.zeros(self.out_per_rank, dtype=dtype, device=device)) \
            if bias else None

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"ColumnParallelLinear.load_full: weight must be "
                             f"[{self.out_features}, {self.in_features}], got {tuple(weight.shape)}")
        rows = slice(self.tp_rank * self.out_per_rank, (self.tp_rank + 1) * self.out_per_rank)
        if isinstance(weight, FP8Weight):
            self._fp8_shard(weight, 0, "ColumnParallelLinear.load_full")
        else:
            self.weight.copy_(weight[rows])
        if self.bias is not None:
            if bias is None:
                raise ValueError("ColumnParallelLinear.load_full: the module has a bias; pass bias=")
            self.bias.copy_(bias[rows])
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2, lead = self._flat(x)
        if isinstance(self.weight, FP8Weight):
            y = linear(x2, self.weight, self.bias)
        elif self.sequence_parallel:
            y = ag_gemm(x2, self.weight.t(), self.bias, group=self.comm, engine=self.engine)
            lead = (y.shape[0],)
        elif self.bias is not None:
            y = torch.addmm(self.bias, x2, self.weight.t())
        else:
            y = x2 @ self.weight.t()
        if self.gather_output and self.tp_size > 1:
            y = _gather_columns(self.comm, y)
        return y.reshape(*lead, y.shape[-1])


class RowParallelLinear(_TPLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 group: GroupLike = None, dtype=None, device=None, engine: str = "auto"):
        super().__init__(group, engine)
        self.in_features, self.out_features = in_features, out_features
        self.in_per_rank = _split(in_features, self.tp_size, "in_features")
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        device = device if device is not None else self.comm.device
        self.weight = _param(torch.empty(out_features, self.in_per_rank, dtype=dtype,
                                         device=device))
        self.bias = _param(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"RowParallelLinear.load_full: weight must be "
                             f"[{self.out_features}, {self.in_features}], got {tuple(weight.shape)}")
        cols = slice(self.tp_rank * self.in_per_rank, (self.tp_rank + 1) * self.in_per_rank)
        if isinstance(weight, FP8Weight):
            self._fp8_shard(weight, 1, "RowParallelLinear.load_full")
        else:
            self.weight.copy_(weight[:, cols])
        if self.bias is not None:
            if bias is None:
                raise ValueError("RowParallelLinear.load_full: the module has a bias; pass bias=")
            self.bias.copy_(bias)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = x[..., self.tp_rank * self.in_per_rank:(self.tp_rank + 1) * self.in_per_rank]
        x2, lead = self._flat(x)
        if isinstance(self.weight, FP8Weight):
            y = linear(x2, self.weight)
            if self.tp_size > 1 and y.shape[0]:
                y = all_reduce(y, group=self.comm)
            if self.bias is not None:
                y = y + self.bias
            return y.reshape(*lead, y.shape[-1])
        if self.sequence_parallel:
            y = gemm_rs(x2, self.weight.t(), self.bias, group=self.comm, engine=self.engine)
            return y
        y = gemm_ar(x2, self.weight.t(), self.bias, group=self.comm, engine=self.engine)
        return y.reshape(*lead, y.shape[-1])


def _gather_columns(comm, y: torch.Tensor) -> torch.Tensor:
    """[M, n] per rank -> [M, W n] with rank r's columns at block r."""
    W = comm.group.size
    if y.shape[0] == 0:  # no tokens on any rank (M is the same everywhere): nothing to gather
        return y.new_empty((0, W * y.shape[1]))
    if comm.device.type == "cpu":
        parts = [torch.empty_like(y) for _ in range(W)]
        torch.distributed.all_gather(parts, y.contiguous(), group=comm.group.pg)
        return torch.cat(parts, dim=-1)
    stacked = torch.empty((W * y.shape[0], y.shape[1]), dtype=y.dtype, device=y.device)
    comm.check_nccl_call("all_gather", y.dtype, y.numel())
    comm.nccl.all_gather(y.contiguous(), stacked)
    return stacked.view(W, y.shape[0], y.shape[1]).permute(1, 0, 2).reshape(y.shape[0], -1)
