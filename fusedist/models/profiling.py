"""Where a step's time goes: one call under torch.profiler, its kernels classed as GEMM /
attention / communication / other by name (the same classes for fusedist and the baselines)."""

from __future__ import annotations

import time

import torch


def profile(fn, device: torch.device, top: int = 12) -> dict:
    """fn() once under torch.profiler: kernel_breakdown's classes and top kernels, plus
    "wall_us", the call's host wall time (profiler overhead included)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)
    with torch_profile(activities=acts) as prof:
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        wall = (time.perf_counter() - t0) * 1e6
    out = kernel_breakdown(prof.events(), cuda, top)
    out["wall_us"] = wall
    return out


_CLASSES = (
    ("communication", ("allreduce", "all_reduce", "nccl", "allgather", "all_gather",
                       "rmsnorm_kernel", "reduce_scatter", "c10d")),
    ("attention", ("attention", "attn", "flash", "fmha", "decode_kernel", "rope", "paged",
                   "sdpa", "softmax", "merge", "cudnn", "scaled_dot_product")),
    ("gemm", ("gemm", "gemv", "sm90", "cutlass", "nvjet", "cublas", "matmul", "addmm",
              "aten::mm", "aten::bmm", "linear", "xmma", "wgmma")),
)


def kernel_breakdown(events, cuda: bool, top: int = 12) -> dict:
    """Kernel time per class (GEMM / attention / communication / other; us), "total", the
    `top` kernels by time and the kernel count, from torch.profiler events: on CUDA the
    device kernels, on CPU the outermost aten ops."""
    out = {"gemm": 0.0, "attention": 0.0, "communication": 0.0, "other": 0.0}
    kernels: dict[str, float] = {}
    count = 0
    for e in events:
        if cuda:
            if "CUDA" not in str(getattr(e, "device_type", "")):
                continue
            us = float(getattr(e, "device_time_total", 0.0) or
                       getattr(e, "cuda_time_total", 0.0))
        else:
            if not e.name.startswith("aten::") or _under_aten(e):
                continue
            us = float(e.cpu_time_total)
        out[classify_kernel(e.name)] += us
        kernels[e.name[:120]] = kernels.get(e.name[:120], 0.0) + us
        count += 1
    out["total"] = sum(out.values())
    out["top"] = sorted(kernels.items(), key=lambda kv: -kv[1])[:top]
    out["kernels"] = count
    return out


def _under_aten(e) -> bool:
    """Whether a profiler event runs inside an aten op (its time is its caller's)."""
    p = e.cpu_parent
    while p is not None:
        if p.name.startswith("aten::"):
            return True
        p = p.cpu_parent
    return False


def classify_kernel(name: str) -> str:
    low = name.lower()
    for cls, keys in _CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other"
