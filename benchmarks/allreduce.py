"""All-reduce benchmark: fusedist's algorithms beside NCCL and torch symmetric memory.

    torchrun --nproc-per-node 2 benchmarks/allreduce.py            # full sweep 4 KB .. 256 MB
    torchrun --nproc-per-node 2 benchmarks/allreduce.py --quick    # a few sizes
    torchrun --nproc-per-node 2 benchmarks/allreduce.py --tune     # also write the dispatch table
    torchrun --nproc-per-node 2 benchmarks/allreduce.py --fused    # + all_reduce_add_rmsnorm

On a CPU-only machine (gloo) it compares fusedist's reference path with torch.distributed.
Rows: time_us (slowest rank's median, CUDA-graph replays), algbw = bytes / time,
busbw = algbw * 2 (n-1) / n, and speedups of fusedist over each baseline measured in this run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fusedist  # noqa: E402
from _harness import (fmt_bytes, metadata, parse_bytes, size_range, slowest,  # noqa: E402
                      time_eager, time_graph, time_graphs_interleaved, write_results)
from fusedist import tuning  # noqa: E402

BASELINES = ("nccl_torch", "nccl4py", "symm_one_shot", "symm_two_shot")
FUSEDIST = ("fd_one_shot", "fd_two_shot", "fd_auto")
FULL_SIZES = [1 << s for s in range(12, 29)]  # 4 KB .. 256 MB
QUICK_SIZES = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
CPU_SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20]
ROUNDS = 3  # interleaved rounds per size (GPU)


def plan(nbytes: int) -> tuple[int, int]:
    """(ops per graph, replays): enough work per replay to dwarf launch gaps."""
    if nbytes <= 1 << 20:
        return 20, 50
    if nbytes <= 16 << 20:
        return 10, 20
    return 4, 10


class SymmInputs:
    """Inputs in torch symmetric memory (its all-reduce needs them there)."""

    def __init__(self, n, dtype, device, group_name, count):
        import torch.distributed._symmetric_memory as symm_mem

        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            try:
                symm_mem.enable_symm_mem_for_group(group_name)
            except Exception:
                pass
        self.bufs = []
        for _ in range(count):
            t = symm_mem.empty(n, dtype=dtype, device=device)
            symm_mem.rendezvous(t, group_name)
            self.bufs.append(t)


def run_gpu_size(rt, comm, nbytes, dtype, ref_check=True) -> list[dict]:
    W = rt.tp.size
    n = nbytes // torch.tensor([], dtype=dtype).element_size()
    ops, reps = plan(nbytes)
    nbuf = max(1, min(ops, (256 << 20) // nbytes))
    dev = rt.device
    g = torch.Generator(device=dev)
    g.manual_seed(1234 + rt.rank)
    xs = [torch.randn(n, generator=g, device=dev, dtype=torch.float32).to(dtype) for _ in range(nbuf)]
    outs = [torch.empty_like(xs[0]) for _ in range(nbuf)]
    gname = rt.tp.pg.group_name if hasattr(rt.tp.pg, "group_name") else "0"
    steps = {
        "nccl_torch": lambda i: dist.all_reduce(xs[i % nbuf], group=rt.tp.pg),
        "nccl4py": lambda i: comm.nccl.all_reduce(xs[i % nbuf], outs[i % nbuf]),
        "fd_one_shot": lambda i: comm.all_reduce(xs[i % nbuf], algo="one_shot", out=outs[i % nbuf]),
        "fd_two_shot": lambda i: comm.all_reduce(xs[i % nbuf], algo="two_shot", out=outs[i % nbuf]),
        "fd_auto": lambda i: comm.all_reduce(xs[i % nbuf], out=outs[i % nbuf]),
    }
    symm = None
    try:
        symm = SymmInputs(n, dtype, dev, gname, min(nbuf, 4))
        sb = symm.bufs
        for b in sb:
            b.copy_(xs[0])
        steps["symm_one_shot"] = lambda i: torch.ops.symm_mem.one_shot_all_reduce_out(
            sb[i % len(sb)], "sum", gname, outs[i % nbuf])
        steps["symm_two_shot"] = lambda i: torch.ops.symm_mem.two_shot_all_reduce_(
            sb[i % len(sb)], "sum", gname)
    except Exception as e:
        if rt.rank == 0:
            print(f"  torch symmetric memory unavailable at {fmt_bytes(nbytes)}: {e}")

    # Correctness spot check of every backend before timing it.
    x0 = torch.randn(n, generator=g, device=dev, dtype=torch.float32).to(dtype)
    parts = [torch.empty_like(x0) for _ in range(W)]
    dist.all_gather(parts, x0, group=rt.tp.pg)
    ref = sum(p.double() for p in parts)
    rows = []
    checked = {}
    for name, step in steps.items():
        status = "ok"
        try:
            if ref_check:
                xs[0].copy_(x0)
                if name.startswith("symm"):
                    symm.bufs[0].copy_(x0)
                step(0)
                got = {"nccl_torch": xs[0], "symm_two_shot": symm.bufs[0] if symm else None}.get(
                    name, outs[0])
                err = ((got.double() - ref).abs() / (ref.abs() + 1e-2)).max().item()
                if not err < 2e-2:
                    status = f"WRONG (max rel err {err:.3g})"
        except Exception as e:  # a backend that cannot run this size is reported, not fatal
            status = f"n/a ({type(e).__name__}: {str(e)[:80]})"
        checked[name] = status
    # Every backend timed in interleaved rounds (_harness.time_graphs_interleaved), so each
    # sees the same mix of GPU clock states; no backend is timed alone in a block of its own.
    # The set must be the same on every rank (each burst ends in a barrier).
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, checked)
    runnable = {name: step for name, step in steps.items()
                if not any(c.get(name, "n/a").startswith("n/a") for c in every)}
    med, _, timed = time_graphs_interleaved(runnable, ops, ROUNDS, max(1, reps // ROUNDS))
    for name in steps:
        status = checked[name] if checked[name] != "ok" else timed.get(name, "n/a")
        t = slowest(med.get(name, float("nan")))
        algbw = nbytes / t / 1e3 if t == t else float("nan")
        rows.append({"op": "all_reduce", "backend": name, "bytes": nbytes, "dtype": str(dtype),
                     "world": W, "time_us": t, "algbw_GBps": algbw,
                     "busbw_GBps": algbw * 2 * (W - 1) / W, "status": status,
                     "algo": comm.choose_algo(nbytes, dtype) if name == "fd_auto" else None})
    comm.check()
    del symm
    return rows


def run_cpu_size(rt, comm, nbytes, dtype) -> list[dict]:
    W = rt.tp.size
    n = nbytes // torch.tensor([], dtype=dtype).element_size()
    x = torch.randn(n).to(dtype)
    out = torch.empty_like(x)
    steps = {"gloo_torch": lambda i: dist.all_reduce(x, group=rt.tp.pg),
             "fd_auto": lambda i: comm.all_reduce(x, out=out)}
    rows = []
    for name, step in steps.items():
        t = slowest(time_eager(step, 5, 5))
        algbw = nbytes / t / 1e3
        rows.append({"op": "all_reduce", "backend": name, "bytes": nbytes, "dtype": str(dtype),
                     "world": W, "time_us": t, "algbw_GBps": algbw,
                     "busbw_GBps": algbw * 2 * (W - 1) / W, "status": "ok", "algo": "cpu"})
    return rows


def run_fused(rt, comm, dtype, tokens_list, hiddens) -> list[dict]:
    """Fused all_reduce + residual + RMSNorm vs the unfused NCCL + torch baseline."""
    dev, eps, rows = rt.device, 1e-6, []
    for hidden in hiddens:
        for tokens in tokens_list:
            nbytes = tokens * hidden * torch.tensor([], dtype=dtype).element_size()
            x = torch.randn(tokens, hidden, device=dev).to(dtype)
            res = torch.randn(tokens, hidden, device=dev).to(dtype)
            w = torch.randn(hidden, device=dev).to(dtype)
            out = torch.empty_like(x)
            y = torch.empty_like(x)

            def unfused_nccl(i):
                # Exactly the baseline's work: an out-of-place NCCL all-reduce (no copy of x
                # first), the residual add and torch's RMSNorm.
                comm.nccl.all_reduce(x, y)
                h = y + res
                torch.nn.functional.rms_norm(h, (hidden,), w, eps)

            steps = {
                "fd_auto": lambda i: fusedist.all_reduce_add_rmsnorm(x, res, w, eps, group=comm),
                "fd_fused": lambda i: fusedist.all_reduce_add_rmsnorm(x, res, w, eps, group=comm,
                                                                      fused=True),
                "fd_unfused": lambda i: fusedist.all_reduce_add_rmsnorm(x, res, w, eps, group=comm,
                                                                        fused=False),
                "nccl_torch_unfused": unfused_nccl,
                "fd_allreduce_only": lambda i: comm.all_reduce(x, out=out),
            }
            for name, step in steps.items():
                try:
                    t = time_graph(step, 20, 30)
                    status = "ok"
                except Exception as e:
                    t, status = float("nan"), f"n/a ({type(e).__name__}: {str(e)[:80]})"
                rows.append({"op": "all_reduce_add_rmsnorm", "backend": name, "tokens": tokens,
                             "hidden": hidden, "bytes": nbytes, "dtype": str(dtype),
                             "world": rt.tp.size, "time_us": slowest(t), "status": status})
    return rows


def table(rows, names) -> str:
    sizes = sorted({r["bytes"] for r in rows if r["op"] == "all_reduce"})
    by = {(r["bytes"], r["backend"]): r for r in rows if r["op"] == "all_reduce"}
    base = [b for b in names if not b.startswith("fd_")]
    head = ["size"] + [f"{b} us" for b in names] + ["auto algo", "auto busbw GB/s"] + \
        [f"auto vs {b}" for b in base] + ["auto vs best"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in sizes:
        cells = [fmt_bytes(s)]
        for b in names:
            r = by.get((s, b))
            cells.append("-" if r is None else (f"{r['time_us']:.2f}" if r["status"] == "ok"
                                                else r["status"][:12]))
        a = by.get((s, "fd_auto"))
        cells += [a["algo"] if a else "-", f"{a['busbw_GBps']:.1f}" if a else "-"]
        best = None
        for b in base:
            r = by.get((s, b))
            ok = r is not None and r["status"] == "ok" and a is not None
            cells.append(f"{r['time_us'] / a['time_us']:.2f}x" if ok else "-")
            if ok:
                best = r["time_us"] if best is None else min(best, r["time_us"])
        cells.append(f"{best / a['time_us']:.2f}x" if best and a else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fused_table(rows) -> str:
    """Every shape; headline: fd_auto (fused=None, what a user gets) against the unfused
    NCCL + torch baseline; the forced variants are diagnostics."""
    keyed = {}
    for r in rows:
        if r["op"] == "all_reduce_add_rmsnorm":
            keyed.setdefault((r["hidden"], r["tokens"]), {})[r["backend"]] = r["time_us"]
    lines = ["| tokens x hidden | **auto us** | nccl+torch unfused us | **nccl+torch / auto** "
             "| fused=True us | fused=False us | fd all_reduce us | auto / all_reduce |",
             "|" + "---|" * 8]
    nan = float("nan")
    for (h, t), d in sorted(keyed.items()):
        a, u = d.get("fd_auto", nan), d.get("nccl_torch_unfused", nan)
        ar = d.get("fd_allreduce_only", nan)
        lines.append(f"| {t} x {h} | **{a:.2f}** | {u:.2f} | **{u / a:.2f}x** | "
                     f"{d.get('fd_fused', nan):.2f} | {d.get('fd_unfused', nan):.2f} | {ar:.2f} "
                     f"| {a / ar:.2f} |")
    return "\n".join(lines)


def tune_table(rows, world) -> dict:
    """Fastest fusedist algorithm per size -> ascending thresholds (never slower than NCCL)."""
    by = {}
    for r in rows:
        if r["op"] == "all_reduce" and r["status"] == "ok" and r["backend"] in (
                "fd_one_shot", "fd_two_shot", "nccl4py"):
            by.setdefault(r["bytes"], {})[r["backend"]] = r["time_us"]
    name = {"fd_one_shot": "one_shot", "fd_two_shot": "two_shot", "nccl4py": "nccl"}
    rules = []
    for s in sorted(by):
        best = name[min(by[s], key=by[s].get)]
        if rules and rules[-1]["algo"] == best:
            rules[-1]["max_bytes"] = s
        else:
            rules.append({"max_bytes": s, "algo": best})
    if rules:
        rules[-1]["max_bytes"] = None
    return {"allreduce": {str(world): rules}}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few sizes only")
    ap.add_argument("--sizes", type=str, default=None,
                    help="comma-separated sizes: bytes or K / M / G, e.g. 4K,64K,4M")
    ap.add_argument("-b", "--begin", help="first size of a sweep (nccl-tests' -b), e.g. 8K")
    ap.add_argument("-e", "--end", help="last size of the sweep (-e), e.g. 256M")
    ap.add_argument("-f", "--factor", type=int, default=2, help="sweep step factor (-f)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--fused", action="store_true", help="also benchmark all_reduce_add_rmsnorm")
    ap.add_argument("--tune", action="store_true", help="write the measured dispatch table")
    ap.add_argument("--max-bytes", type=int, default=None, help="fusedist symmetric capacity")
    args = ap.parse_args()
    try:
        if args.sizes and (args.begin or args.end):
            raise ValueError("give --sizes or -b/-e, not both")
        if bool(args.begin) != bool(args.end):
            raise ValueError("-b/--begin and -e/--end go together")
        chosen = [parse_bytes(s) for s in args.sizes.split(",")] if args.sizes else \
            size_range(args.begin, args.end, args.factor) if args.begin else None
    except ValueError as e:
        ap.error(str(e))

    rt = fusedist.init()
    dtype = getattr(torch, args.dtype)
    gpu = rt.device.type == "cuda"
    if chosen:
        sizes = chosen
    else:
        sizes = (QUICK_SIZES if args.quick else FULL_SIZES) if gpu else CPU_SIZES
    max_bytes = args.max_bytes or (max(sizes) if gpu else 1 << 20)
    comm = fusedist.Communicator(rt.tp, max_bytes=max_bytes, one_shot_max_bytes=min(max_bytes, 8 << 20))
    meta = metadata(rt.tp.size)
    meta["dtype"] = args.dtype
    meta["dispatch_table"] = comm.table.get("source")
    meta["dispatch_sources"] = comm.table.get("sources")
    rows = []
    for s in sizes:
        rows += run_gpu_size(rt, comm, s, dtype) if gpu else run_cpu_size(rt, comm, s, dtype)
        if rt.rank == 0:
            r = {x["backend"]: x for x in rows if x["bytes"] == s}
            print(f"{fmt_bytes(s):>8}: " + "  ".join(
                f"{k}={v['time_us']:.2f}" for k, v in r.items()), flush=True)
    names = (BASELINES + FUSEDIST) if gpu else ("gloo_torch", "fd_auto")
    md = f"## all_reduce ({args.dtype}, world {rt.tp.size}, us per call)\n\n" + table(rows, names)
    if args.fused and gpu:
        tokens = [1, 8, 32, 128] if args.quick else [1, 8, 32, 128, 512]
        rows += run_fused(rt, comm, dtype, tokens, [4096, 8192])
        md += "\n\n## all_reduce_add_rmsnorm\n\n" + fused_table(rows)
    if rt.rank == 0:
        def plot(path):
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(8, 5))
            for b in names:
                pts = sorted((r["bytes"], r["time_us"]) for r in rows
                             if r["op"] == "all_reduce" and r["backend"] == b and r["status"] == "ok")
                if pts:
                    ax.loglog(*zip(*pts), marker="o", label=b)
            ax.set_xlabel("bytes")
            ax.set_ylabel("us per all-reduce")
            ax.set_title(f"all_reduce {args.dtype}, {rt.tp.size} x {meta.get('gpu', 'CPU')}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
            fig.savefig(path, dpi=120, bbox_inches="tight")

        paths = write_results("allreduce", meta, rows, md, plot)
        print("\n" + md + "\n")
        print("results: " + ", ".join(map(str, paths)))
        if args.tune and gpu:
            t = tune_table(rows, rt.tp.size)
            p = tuning.cache_path(meta["gpu"], rt.tp.size)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(t, indent=1))
            print(f"dispatch table -> {p}\n{json.dumps(t)}")
    comm.close()
    fusedist.shutdown()


if __name__ == "__main__":
    main()
