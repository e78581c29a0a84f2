"""all_reduce_add_rmsnorm: the tensor-parallel layer epilogue in one kernel.

    normed, residual = fusedist.all_reduce_add_rmsnorm(x, residual, weight, eps)
    q, residual, scale = fusedist.all_reduce_add_rmsnorm(x, residual, weight, eps,
                                                         out_dtype=torch.float8_e4m3fn)

with h = round(round(all_reduce(x)) + residual) returned as the new residual and
normed = round(h * rsqrt(mean(h^2) + eps) * weight); in FP8 mode normed is e4m3 with one fp32
scale per token (scale = amax / 448, normed_fp32 ~= q * scale). x and residual are
[..., hidden]; weight is [hidden]. On NVLink groups it runs fused on one-shot symmetric memory
when the message fits; otherwise all_reduce + an epilogue (same results up to rounding):
fusedist.add_rmsnorm's kernel on CUDA (FP8 output included), torch on CPU.

Groups that span nodes (the same number, two or more, of their ranks on each) take the
two-level form through the group's HierarchicalCommunicator (fusedist.comm.hierarchical), or
the one passed as group=: the all-reduce of a chunk of rows is a reduce-scatter inside the
node, an all-reduce of the shard across nodes and an all-gather inside, and the epilogue runs
on each chunk's rows as soon as their all-gather lands, while the next chunks' collectives run
(the chunks and flat vs two-level by the cost model, or the communicator's algo / chunks).
The all-gather of the sums is the fewest bytes that leave every rank the new residual; the
epilogue then runs on every rank, as the one-level forms do. Results are bitwise identical on
every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import _align, _dtypes, _ext, tuning
from ..comm import hierarchical
from ..comm.communicator import Communicator, GroupLike, communicator_by_name, get_communicator
from ..comm.streams import nvtx_range
from .add_rmsnorm import MAX_HIDDEN, rmsnorm_reference

FP8 = _dtypes.FP8
# Widest row of the fused kernel in 16-byte vectors (csrc/ops/comm/allreduce_rmsnorm.cu): hidden up
# to 16384 for fp16/bf16, 8192 for fp32.
MAX_FUSED_VECTORS = 2048


def _validate(comm: Communicator, x, residual, weight, eps, out_dtype):
    op = "all_reduce_add_rmsnorm"
    comm.check_open()
    comm.check_tensor(op, "x", x)
    comm.check_tensor(op, "residual", residual)
    comm.check_tensor(op, "weight", weight)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"fusedist.{op}: x must be [..., hidden] with hidden > 0, got "
                         f"{tuple(x.shape)}")
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"fusedist.{op}: residual has shape {tuple(residual.shape)} / "
                         f"{residual.dtype}; it must match x ({tuple(x.shape)} / {x.dtype})")
    if weight.shape != (x.shape[-1],) or weight.dtype != x.dtype:
        raise ValueError(f"fusedist.{op}: weight must be [{x.shape[-1]}] of {x.dtype}, got "
                         f"{tuple(weight.shape)} of {weight.dtype}")
    if not (isinstance(eps, float) and eps > 0):
        raise ValueError(f"fusedist.{op}: eps must be a positive float, got {eps!r}")
    if out_dtype is not None and out_dtype not in (x.dtype, FP8):
        raise ValueError(f"fusedist.{op}: out_dtype must be None, {x.dtype} or "
                         f"torch.float8_e4m3fn, got {out_dtype}")


def _fused_why_not(comm: Communicator, x: torch.Tensor) -> str:
    if comm.device.type != "cuda":
        return f"tensors on {comm.device}: the plain-torch reference over gloo"
    why = _ext.why_not("allreduce_rmsnorm", comm.device)
    if why:
        return why
    if comm.symm is None:
        return f"group {comm.group.name} has no symmetric memory (its ranks are not NVLink peers)"
    hidden = x.shape[-1]
    per = 16 // x.element_size()
    if hidden % per or hidden // per > MAX_FUSED_VECTORS:
        return (f"hidden {hidden}: the fused kernel takes whole 16-byte vectors, at most "
                f"{MAX_FUSED_VECTORS} of them")
    if x.numel() * x.element_size() > comm.capacity("one_shot", x.dtype):
        return f"x ({x.numel() * x.element_size()} bytes) exceeds the one-shot capacity"
    return ""


# ---- the op's shape: available / why_not / plan / run / reference ----------------------------
def available(device) -> bool:
    """The fused all-reduce + RMSNorm kernel runs on `device`."""
    return _ext.kernel_runs("allreduce_rmsnorm", device)


def why_not(x: torch.Tensor, group: GroupLike = None) -> str:
    """Why the fused kernel does not take x over `group` ("" when it does): the call then runs
    all_reduce and add_rmsnorm back to back (or the two-level form over nodes)."""
    comm, _ = hierarchical.resolve(group)
    return _fused_why_not(comm, x)


@dataclass(frozen=True)
class AllReduceRmsNormPlan:
    """"fused" (one kernel), "unfused" (all-reduce, then the add_rmsnorm epilogue),
    "two_level" (the hierarchical all-reduce, then the epilogue) or "reference" (CPU)."""
    path: str
    why: str = ""


def plan(x: torch.Tensor, group: GroupLike = None,
         fused: Optional[bool] = None) -> AllReduceRmsNormPlan:
    explicit = isinstance(group, hierarchical.HierarchicalCommunicator)
    comm, hc = hierarchical.resolve(group)
    why = _fused_why_not(comm, x)
    if not why and fused is not False and not explicit:
        return AllReduceRmsNormPlan("fused")
    if hc is not None and (explicit or comm.symm is None):
        return AllReduceRmsNormPlan("two_level", why or "a two-level group")
    if comm.device.type != "cuda":
        return AllReduceRmsNormPlan("reference", why)
    return AllReduceRmsNormPlan("unfused", why or "fused=False")


def reference(xs: list, residual: torch.Tensor, weight: torch.Tensor, eps: float,
              out_dtype=None) -> tuple:
    """What every path computes from every rank's partial: h = round(sum in fp32 in rank order
    + residual), normed = round(rmsnorm(h) * weight) (fp32 math)."""
    acc = xs[0].float()
    for t in xs[1:]:
        acc = acc + t.float()
    ar = acc.to(xs[0].dtype)
    h = (ar.float() + residual.float()).to(ar.dtype)
    normed, scale = rmsnorm_reference(h, weight, eps, out_dtype)
    return (normed, h) if scale is None else (normed, h, scale)


def all_reduce_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float = 1e-6, *, out_dtype: Optional[torch.dtype] = None,
                           group: GroupLike = None, fused: Optional[bool] = None):
    """Returns (normed, new_residual), or (normed_fp8, new_residual, scale) for FP8 output.
    fused=None picks the fused kernel when it applies; True requires it; False never uses it.
    group: as fusedist.all_reduce's, or a fusedist.HierarchicalCommunicator (its two-level
    form, with its algo and chunks; the fused kernel is one-level, so not with fused=True)."""
    explicit = isinstance(group, hierarchical.HierarchicalCommunicator)
    if hasattr(torch, "compiler") and torch.compiler.is_compiling():
        if explicit:
            raise ValueError("fusedist.all_reduce_add_rmsnorm: group= a HierarchicalCommunicator "
                             "does not pass through torch.compile (ops carry a communicator's "
                             "name); pass its group: a group that spans nodes takes the "
                             "two-level form by itself")
        comm = get_communicator(group)
        if out_dtype is not None and out_dtype == FP8:
            return torch.ops.fusedist.all_reduce_add_rmsnorm_fp8(x, residual, weight, eps,
                                                                comm.name, fused)
        return torch.ops.fusedist.all_reduce_add_rmsnorm(x, residual, weight, eps, comm.name,
                                                         fused)
    comm, hc = hierarchical.resolve(group)
    _validate(comm, x, residual, weight, eps, out_dtype)
    fp8 = out_dtype is not None and out_dtype == FP8
    with nvtx_range("fusedist.all_reduce_add_rmsnorm"):
        if fused and explicit:
            raise ValueError("fusedist.all_reduce_add_rmsnorm: fused=True runs the one-level "
                             "kernel over NVLink symmetric memory; group= a "
                             "HierarchicalCommunicator asks for the two-level form. Pass "
                             "fused=None, or the group itself for the fused kernel")
        p = plan(x, group, fused)
        if fused and p.path != "fused":
            spans = (f"; group {comm.group.name} spans nodes (its two-level form is not fused: "
                     "pass fused=None)") if hc is not None else ""
            raise ValueError(
                "fusedist.all_reduce_add_rmsnorm: fused=True but the fused kernel does not apply "
                f"(x {tuple(x.shape)} {x.dtype}: needs NVLink symmetric memory, hidden a multiple "
                f"of the 16-byte vector and <= {MAX_FUSED_VECTORS} vectors, and x within the one-shot "
                f"capacity){spans}; "
                "pass fused=None")
        if p.path == "unfused" and fused is None and comm.group.size > 1:
            tuning.warn_once(
                comm, "rmsnorm_unfused",
                f"all_reduce_add_rmsnorm runs unfused (all_reduce + add_rmsnorm) for x "
                f"{tuple(x.shape)} {x.dtype}: the fused kernel needs NVLink symmetric memory, "
                "hidden a multiple of the 16-byte vector and x within the one-shot capacity")
        return run(p, x, residual, weight, eps, out_dtype, group)


def run(p: AllReduceRmsNormPlan, x: torch.Tensor, residual: torch.Tensor,
        weight: torch.Tensor, eps: float, out_dtype=None, group: GroupLike = None) -> tuple:
    """Execute p on validated arguments (plan's docstring names the paths). A group with
    symmetric memory has every rank an NVLink peer (nodes emulated on one host): its one-level
    all-reduce beats a two-level form unless one is asked for (plan decides)."""
    comm, hc = hierarchical.resolve(group)
    fp8 = out_dtype is not None and out_dtype == FP8
    if p.path == "fused":
        return _fused(comm, x, residual, weight, eps, fp8)
    if p.path == "two_level":
        return _two_level(hc, comm, x, residual, weight, eps, out_dtype)
    return _epilogue(comm.all_reduce(x), residual, weight, eps, out_dtype)


def _epilogue(ar: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
              out_dtype) -> tuple:
    """(normed, h[, scale]) of the all-reduced rows `ar` (a fresh tensor: it may become h):
    h = round(ar + residual), normed = round(rmsnorm(h) * weight)."""
    fp8 = out_dtype is not None and out_dtype == FP8
    if ar.is_cuda and _single_gpu_epilogue(ar):
        # One kernel for the epilogue: h = residual + ar lands in ar (a fresh tensor, the
        # new residual); residual is left as it is. Its FP8 output is (q, h, scale), this
        # op's order.
        from .add_rmsnorm import add_rmsnorm
        return add_rmsnorm(residual, ar, weight, eps, out_dtype=FP8 if fp8 else None)
    h = (ar.float() + residual.float()).to(ar.dtype)
    normed, scale = rmsnorm_reference(h, weight, eps, out_dtype)
    return (normed, h, scale) if fp8 else (normed, h)


def _two_level(hc, comm: Communicator, x, residual, weight, eps, out_dtype) -> tuple:
    """The two-level form: chunks of whole rows through hc.all_reduce_pipelined, each chunk's
    epilogue as soon as it is all-gathered (the later chunks' collectives run meanwhile)."""
    if comm.device.type == "cpu":
        comm.check_same_call("all_reduce", x)  # gloo aborts on a size mismatch: name it first
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)
    res_rows = residual.reshape(-1, hidden)
    how, k = hc.choose("all_reduce", x.numel() * x.element_size())
    if how == "flat" or rows.shape[0] == 0:
        return _epilogue(hc.all_reduce(x, algo="flat"), residual, weight, eps, out_dtype)
    k = max(1, min(k, rows.shape[0]))
    bounds = tuning.even_bounds(rows.shape[0], k)
    chunks = [hc.chunk_buffer((bounds[i + 1] - bounds[i]) * hidden, x.device) for i in range(k)]
    parts: list = [None] * k

    def produce(i):
        a, b = bounds[i], bounds[i + 1]
        chunks[i][:(b - a) * hidden].view(b - a, hidden).copy_(rows[a:b])

    def consume(i):
        a, b = bounds[i], bounds[i + 1]
        ar = chunks[i][:(b - a) * hidden].view(b - a, hidden).to(x.dtype)
        parts[i] = _epilogue(ar, res_rows[a:b], weight, eps, out_dtype)

    hc.all_reduce_pipelined(chunks, produce, consume)
    outs = [torch.cat([p[j] for p in parts]) if k > 1 else parts[0][j]
            for j in range(len(parts[0]))]
    lead = x.shape[:-1]
    return tuple(o.view(*lead, hidden) if o.dim() == 2 else o.view(lead) for o in outs)


def _single_gpu_epilogue(x: torch.Tensor) -> bool:
    """fusedist.add_rmsnorm takes x's rows (whole 16-byte vectors, within its widest row)."""
    hidden = x.shape[-1]
    return hidden % 8 == 0 and hidden <= MAX_HIDDEN[x.dtype]


def _fused(comm, x, residual, weight, eps, fp8):
    C = _ext.load()
    hidden = x.shape[-1]
    tokens = x.numel() // hidden
    stream = comm.launch_stream()
    tensors = [_align.aligned_input(t) for t in (x, residual, weight)]
    xs, rs, ws = tensors
    normed = torch.empty(x.shape, dtype=FP8 if fp8 else x.dtype, device=x.device)
    res_out = torch.empty_like(x)
    scale = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device) if fp8 else None
    C.allreduce_rmsnorm(comm.symm.handle, xs.data_ptr(), rs.data_ptr(), ws.data_ptr(),
                        normed.data_ptr(), res_out.data_ptr(),
                        scale.data_ptr() if fp8 else 0, tokens, hidden, float(eps),
                        _dtypes.code(x.dtype), _dtypes.FLOAT8_E4M3 if fp8 else _dtypes.code(x.dtype),
                        stream.cuda_stream)
    comm.launched()
    return (normed, res_out, scale) if fp8 else (normed, res_out)


@torch.library.custom_op("fusedist::all_reduce_add_rmsnorm", mutates_args=())
def _op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
        comm_name: str, fused: Optional[bool] = None) -> tuple[torch.Tensor, torch.Tensor]:
    return all_reduce_add_rmsnorm(x, residual, weight, eps, group=communicator_by_name(comm_name),
                                  fused=fused)


@_op.register_fake
def _(x, residual, weight, eps, comm_name, fused=None):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("fusedist::all_reduce_add_rmsnorm_fp8", mutates_args=())
def _op_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
            comm_name: str, fused: Optional[bool] = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return all_reduce_add_rmsnorm(x, residual, weight, eps, out_dtype=FP8,
                                  group=communicator_by_name(comm_name), fused=fused)


@_op_fp8.register_fake
def _(x, residual, weight, eps, comm_name, fused=None):
    return (torch.empty(x.shape, dtype=FP8, device=x.device), torch.empty_like(x),
            torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device))
