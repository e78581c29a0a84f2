"""Where a step's time goes: one call under torch.profiler, its kernels classed as GEMM /
attention / communication / other by name (the same classes for fusedist and the baselines);
and the timeline of graph replays: how much of the wall time no kernel runs (the bubbles)."""

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


def profile_timeline(fn, device: torch.device, reps: int = 5, top: int = 5) -> dict:
    """fn() `reps` times back to back under torch.profiler (CUDA only; fn is meant to be a
    graph replay): timeline() of the device activity, per call."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    if device.type != "cuda":
        raise ValueError(f"profile_timeline: needs a CUDA device (kernel start and end times), "
                         f"got {device}")
    if reps < 1:
        raise ValueError(f"profile_timeline: reps must be >= 1, got {reps}")
    torch.cuda.synchronize(device)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize(device)
    spans = [(e.name, float(e.time_range.start), float(e.time_range.end))
             for e in prof.events() if "CUDA" in str(getattr(e, "device_type", ""))]
    if not spans:
        raise RuntimeError("profile_timeline: the profiler recorded no device activity (CUPTI "
                           "unavailable, or fn launched nothing)")
    return timeline(spans, calls=reps, top=top)


def timeline(spans, calls: int = 1, top: int = 5) -> dict:
    """The device timeline of `calls` back-to-back calls, from (name, start_us, end_us) spans
    of their kernels (and copies): per call, "wall_us" (first start to last end), "busy_us"
    (the union of the spans: time at least one kernel runs; overlapping kernels, as with
    programmatic dependent launch, count once), "kernel_us" (the spans' sum), "bubble_us"
    (wall - busy: the device idle between kernels: launch latency, host work, dependency
    waits), "bubble_pct" of wall, "kernels" per call, and "gaps": the `top` largest idle
    gaps over all calls as (us, kernel before, kernel after)."""
    if calls < 1:
        raise ValueError(f"timeline: calls must be >= 1, got {calls}")
    spans = sorted((float(s), float(e), str(n)) for n, s, e in spans)
    if not spans:
        raise ValueError("timeline: no spans")
    if any(e < s for s, e, _ in spans):
        raise ValueError("timeline: a span ends before it starts")
    wall = max(e for _, e, _ in spans) - spans[0][0]
    busy = 0.0
    gaps = []
    cur_s, cur_e, cur_n = spans[0]
    for s, e, n in spans[1:]:
        if s > cur_e:                 # idle from cur_e to s
            busy += cur_e - cur_s
            gaps.append((s - cur_e, cur_n[:80], n[:80]))
            cur_s, cur_e, cur_n = s, e, n
        elif e > cur_e:
            cur_e, cur_n = e, n
    busy += cur_e - cur_s
    kernel = sum(e - s for s, e, _ in spans)
    gaps.sort(key=lambda g: -g[0])
    return {"wall_us": wall / calls, "busy_us": busy / calls, "kernel_us": kernel / calls,
            "bubble_us": (wall - busy) / calls,
            "bubble_pct": 100.0 * (wall - busy) / wall if wall > 0 else 0.0,
            "kernels": len(spans) / calls, "gaps": gaps[:top]}
