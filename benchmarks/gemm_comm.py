"""GEMM + collective benchmark: fusedist's engines beside unfused and torch async-TP.

    torchrun --nproc-per-node 2 benchmarks/gemm_comm.py            # the default shapes
    torchrun --nproc-per-node 2 benchmarks/gemm_comm.py --quick    # a subset

Shapes: w is the per-rank [K, N] weight. ag_gemm: x_shard [M / world, K] -> [M, N];
gemm_rs: x [M, K] -> [M / world, N]; gemm_ar: x [M, K] -> [M, N] (K is per rank).
Rows: time_us (slowest rank's median; CUDA-graph replays), TFLOP/s of the GEMM (2 M N K per
rank), overlap efficiency E = (t_unfused - t_engine) / t_collective, speedups vs unfused and
vs torch async-TP (torch.ops.symm_mem.fused_all_gather_matmul / fused_matmul_reduce_scatter).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from statistics import median
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed._symmetric_memory  # noqa: E402,F401  registers torch.ops.symm_mem.*

import fusedist  # noqa: E402
from _harness import (init_gpus, metadata, slowest, time_graphs_interleaved,  # noqa: E402
                      write_results)
from fusedist.ops.gemm import gemm as fd_gemm  # noqa: E402


ROUNDS, REPS = 4, 5  # interleaved rounds per shape, timed replays per step and round


def shapes(quick: bool):
    ms = [4096, 8192] if quick else [2048, 4096, 8192, 16384]
    ns = [8192] if quick else [8192, 14336]
    out = [("ag_gemm", m, n, 8192) for m in ms for n in ns]
    out += [("gemm_rs", m, n, 8192) for m in ms for n in ns]
    out += [("gemm_ar", m, 8192, 4096) for m in ([2048, 4096] if quick else [2048, 4096, 8192])]
    out += [("gemm_ar", m, n, k) for m in ([1, 32] if quick else [1, 8, 32, 128])
            for (k, n) in ((4096, 8192), (14336, 8192))]
    return out


def _without_nccl_call_check(comm, step):
    """step with the communicator's NCCL call check off for its duration (every rank alike)."""
    def run(i):
        prev, comm.nccl_call_check = comm.nccl_call_check, False
        try:
            return step(i)
        finally:
            comm.nccl_call_check = prev
    return run

def bench_shape(rt, comm, op, M, N, K, dtype):
    W, dev = rt.tp.size, rt.device
    gname = rt.tp.pg.group_name
    g = torch.Generator(device=dev)
    g.manual_seed(7 + rt.rank)

    def rnd(*s):
        return torch.randn(*s, generator=g, device=dev, dtype=torch.float32).to(dtype) * 0.1

    w = rnd(K, N)
    hopper = torch.cuda.get_device_capability(dev)[0] == 9
    steps = {}
    if op == "ag_gemm":
        x = rnd(M // W, K)
        gathered = rnd(M, K)  # the gemm_only / gemm_fd90 input (and NCCL's all-gather output)
        out = torch.empty(M, N, dtype=dtype, device=dev)
        steps["gemm_only"] = lambda i: torch.matmul(gathered, w, out=out)
        steps["collective_only"] = lambda i: comm.nccl.all_gather(x, gathered)
        steps["unfused"] = lambda i: fusedist.ag_gemm(x, w, group=comm, engine="unfused", out=out)
        steps["fd_auto"] = lambda i: fusedist.ag_gemm(x, w, group=comm, out=out)  # auto
        steps["fd_overlap"] = lambda i: fusedist.ag_gemm(x, w, group=comm, engine="overlap",
                                                         transport="collective", out=out)
        steps["fd_overlap_ce"] = lambda i: fusedist.ag_gemm(x, w, group=comm, engine="overlap",
                                                            transport="copy_engine", out=out)
        steps["torch_async_tp"] = lambda i: torch.ops.symm_mem.fused_all_gather_matmul(
            x, [w], 0, gname, return_A=False)
        if hopper:
            steps["fd_fused"] = lambda i: fusedist.ag_gemm(x, w, group=comm, engine="fused",
                                                           out=out)
            steps["gemm_fd90"] = lambda i: fd_gemm(gathered, w, out=out, kernel="sm90")
    elif op == "gemm_rs":
        x = rnd(M, K)
        part = torch.empty(M, N, dtype=dtype, device=dev)
        out = torch.empty(M // W, N, dtype=dtype, device=dev)
        steps["gemm_only"] = lambda i: torch.matmul(x, w, out=part)
        steps["collective_only"] = lambda i: comm.nccl.reduce_scatter(part, out)
        steps["unfused"] = lambda i: fusedist.gemm_rs(x, w, group=comm, engine="unfused", out=out)
        steps["fd_auto"] = lambda i: fusedist.gemm_rs(x, w, group=comm, out=out)  # auto
        for c in (2, 4):
            steps[f"fd_overlap_c{c}"] = (lambda c: lambda i: fusedist.gemm_rs(
                x, w, group=comm, engine="overlap", chunks=c, transport="collective", out=out))(c)
        for c, name in ((2, "fd_overlap_ce"), (4, "fd_overlap_ce_c4")):
            steps[name] = (lambda c: lambda i: fusedist.gemm_rs(
                x, w, group=comm, engine="overlap", transport="copy_engine", chunks=c,
                out=out))(c)
        m = M // W
        if fusedist.tuning.wave_row_bounds(m, N, 2, fusedist.tuning.gemm_waves(comm.table)) != \
                [0, m // 2, m]:  # A/B: the same 2 chunks, even
            steps["fd_overlap_ce_nowave"] = lambda i: fusedist.gemm_rs(
                x, w, group=comm, engine="overlap", transport="copy_engine",
                chunks=[m // 2, m - m // 2], out=out)
        steps["torch_async_tp"] = lambda i: torch.ops.symm_mem.fused_matmul_reduce_scatter(
            x, w, "sum", 0, gname)
        if hopper:
            steps["fd_fused"] = lambda i: fusedist.gemm_rs(x, w, group=comm, engine="fused",
                                                           out=out)
            steps["fd_fused_c4"] = lambda i: fusedist.gemm_rs(x, w, group=comm, engine="fused",
                                                              chunks=4, out=out)
            steps["gemm_fd90"] = lambda i: fd_gemm(x, w, out=part, kernel="sm90")
    else:
        x = rnd(M, K)
        out = torch.empty(M, N, dtype=dtype, device=dev)
        steps["gemm_only"] = lambda i: torch.matmul(x, w, out=out)
        steps["collective_only"] = lambda i: comm.all_reduce(out, out=out)
        steps["unfused"] = lambda i: fusedist.gemm_ar(x, w, group=comm, engine="unfused", out=out)
        steps["fd_auto"] = lambda i: fusedist.gemm_ar(x, w, group=comm, out=out)  # auto
        for c in (2, 4):
            steps[f"fd_overlap_c{c}"] = (lambda c: lambda i: fusedist.gemm_ar(
                x, w, group=comm, engine="overlap", chunks=c, transport="collective",
                out=out))(c)
        if hopper and M > 32:
            steps["gemm_fd90"] = lambda i: fd_gemm(x, w, out=out, kernel="sm90")
        if M > 128:
            for c, name in ((2, "fd_overlap_ce"), (3, "fd_overlap_ce_c3"), (4, "fd_overlap_ce_c4")):
                steps[name] = (lambda c: lambda i: fusedist.gemm_ar(
                    x, w, group=comm, engine="overlap", transport="copy_engine", chunks=c,
                    out=out))(c)
        if M <= 128:
            w_nk = rnd(N, K)  # an nn.Linear weight [N, K], used as w_nk.t()
            steps["fd_fused"] = lambda i: fusedist.gemm_ar(x, w, group=comm, engine="fused",
                                                           out=out)
            steps["fd_fused_nk"] = lambda i: fusedist.gemm_ar(x, w_nk.t(), group=comm,
                                                              engine="fused", out=out)
            # The fused kernel's GEMM alone (no exchange) beside torch.matmul (gemm_only).
            steps["gemm_fd"] = lambda i: fd_gemm(x, w, out=out, kernel="decode")
            steps["gemm_only_nk"] = lambda i: torch.matmul(x, w_nk.t(), out=out)
            steps["gemm_fd_nk"] = lambda i: fd_gemm(x, w_nk.t(), out=out, kernel="decode")
    # The unfused baseline is the NCCL + GEMM a user would run without fusedist: no NCCL call
    # check in front of its collective (fusedist's engines, auto included, keep theirs).
    steps["unfused"] = _without_nccl_call_check(comm, steps["unfused"])
    ref = steps["unfused"](0).clone()  # correctness of what is about to be timed
    for name in [b for b in steps if b.startswith("fd_overlap_ce") or b.startswith("fd_fused")
                 and op in ("ag_gemm", "gemm_rs")]:
        got = steps[name](0).clone()
        err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        if not err < 2e-2:
            raise RuntimeError(f"{name} M={M} N={N} K={K}: rel err {err:.3g} vs the "
                               "unfused path; not timing a wrong kernel")
    if "gemm_fd90" in steps:
        ref = steps["gemm_only"](0).clone()
        got = steps["gemm_fd90"](0).clone()
        err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        if not err < 2e-2:
            raise RuntimeError(f"gemm_fd90 M={M} N={N} K={K}: rel err {err:.3g} vs "
                               "torch.matmul; not timing a wrong kernel")
    if M <= 128 and op == "gemm_ar":
        for name in ("fd_fused", "gemm_fd"):
            ref = fusedist.gemm_ar(x, w, group=comm, engine="unfused") if name == "fd_fused" \
                else torch.matmul(x, w)
            got = steps[name](0).clone()
            err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            if not err < 2e-2:
                raise RuntimeError(f"{name} M={M} N={N} K={K}: rel err {err:.3g} vs the "
                                   "unfused path; not timing a wrong kernel")
    flops = 2.0 * M * N * K  # this rank's GEMM
    # Prefill: 3 calls per graph, decode 10. Every step is timed in ROUNDS interleaved rounds
    # of REPS replays (_harness.time_graphs_interleaved), each burst after ~30 ms of the plain
    # GEMM (the pacer): the GPU's clock falls under sustained load (power limit), so steps
    # timed in single blocks each saw their own clock and the same engine under two names
    # differed by up to 8%. `spread`: (slowest - fastest round) / median, rounds' medians.
    ops = 10 if M <= 128 else 3
    clocks = {}
    med, per_round, status = time_graphs_interleaved(steps, ops, ROUNDS, REPS,
                                                     pacer="gemm_only", clocks=clocks)
    nan = float("nan")
    times = {name: (slowest(med.get(name, nan)), status[name]) for name in steps}
    rounds_us = {name: [slowest(t) for t in per_round.get(name, [])] for name in steps}
    spread = {name: (max(p) - min(p)) / median(p) if p else nan for name, p in rounds_us.items()}
    rows = []
    tu = times["unfused"][0]
    tc = times["collective_only"][0]
    ttp = times.get("torch_async_tp", (float("nan"), "n/a"))[0]
    for name, (t, status) in times.items():
        rows.append({"op": op, "backend": name, "M": M, "N": N, "K": K, "world": W,
                     "dtype": str(dtype), "time_us": t, "status": status,
                     "spread": spread[name], "rounds_us": rounds_us[name],
                     "sm_clock_mhz": ranks_clock(clocks.get(name, [])),
                     "tflops": flops / t / 1e6 if t == t else float("nan"),
                     "E": (tu - t) / tc if name.startswith("fd_") else None,
                     "speedup_vs_unfused": tu / t, "speedup_vs_async_tp": ttp / t})
    return rows


def ranks_clock(mhz: list) -> list:
    """Every rank's median SM clock (MHz, NVML) while a step ran, rank order; None per rank
    without readings."""
    mine = median(mhz) if mhz else None
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def clock_line(rows) -> str:
    """One sentence on the SM clocks the steps ran at (the lowest-clocked rank's), or ''."""
    got = sorted((min(c), r["backend"], r["op"], r["M"], r["N"]) for r in rows
                 if r["status"] == "ok" and r.get("sm_clock_mhz")
                 and None not in r["sm_clock_mhz"] for c in [r["sm_clock_mhz"]])
    if not got:
        return ""
    return (f"SM clock while each step ran (NVML, the median of its rounds, the lower rank's): "
            f"{got[0][0]:.0f}-{got[-1][0]:.0f} MHz over all steps; lowest {got[0][1]} "
            f"({got[0][2]} {got[0][3]} x {got[0][4]}), highest {got[-1][1]} ({got[-1][2]} "
            f"{got[-1][3]} x {got[-1][4]}); per step in the JSON (`sm_clock_mhz`).")


def table(rows) -> str:
    """One row per shape, every shape. Headline: fd_auto, what a user gets; the fastest
    fusedist variant is a diagnostic column (a minimum over several variants against one
    measurement of each baseline is biased upward by the noise)."""
    keyed = {}
    for r in rows:
        keyed.setdefault((r["op"], r["M"], r["N"], r["K"]), {})[r["backend"]] = r
    lines = ["| op | M | N | K | gemm us | coll us | unfused us | async-TP us | **auto us** "
             "| auto TFLOP/s | auto E | **auto vs unfused** | **auto vs async-TP** "
             "| best variant (diagnostic) | its us | its vs unfused |", "|" + "---|" * 16]

    def fmt(r):
        return f"{r['time_us']:.1f}" if r is not None and r["status"] == "ok" else "-"

    def x(v):
        return f"{v:.2f}x" if v == v else "-"

    for (op, M, N, K), d in keyed.items():
        head = (f"| {op} | {M} | {N} | {K} | {fmt(d.get('gemm_only'))} | "
                f"{fmt(d.get('collective_only'))} | {fmt(d.get('unfused'))} | "
                f"{fmt(d.get('torch_async_tp'))} |")
        a = d.get("fd_auto")
        if a is None or a["status"] != "ok":
            head += " - | - | - | - | - |"
        else:
            head += (f" **{a['time_us']:.1f}** | {a['tflops']:.0f} | {a['E']:.2f} | "
                     f"**{x(a['speedup_vs_unfused'])}** | **{x(a['speedup_vs_async_tp'])}** |")
        fds = {k: v for k, v in d.items() if k.startswith("fd_") and k != "fd_auto"
               and v["status"] == "ok"}
        if not fds:
            lines.append(head + " - | - | - |")
            continue
        best = min(fds, key=lambda k: fds[k]["time_us"])
        b = fds[best]
        lines.append(head + f" {best} | {b['time_us']:.1f} | {x(b['speedup_vs_unfused'])} |")
    return "\n".join(lines)


def gemm_table(rows) -> str:
    """fusedist's GEMMs alone vs cuBLAS (gemm_only, torch.matmul) on the same shape: the decode
    kernel (gemm_fd, [K, N] and w.t()) and the Hopper wgmma kernel (gemm_fd90). Ratios > 1 are
    faster than torch.matmul."""
    keyed = {}
    for r in rows:
        if r["backend"] in ("gemm_only", "gemm_fd", "gemm_fd_nk", "gemm_fd90") \
                and r["status"] == "ok":
            keyed.setdefault((r["op"], r["M"], r["N"], r["K"]), {})[r["backend"]] = r["time_us"]
    keyed = {k: v for k, v in keyed.items() if "gemm_only" in v and len(v) > 1}
    if not keyed:
        return ""
    lines = ["| op | M | N | K | torch.matmul us | fusedist decode us | ratio | "
             "fusedist sm90 us | ratio | sm90 TFLOP/s |", "|" + "---|" * 10]
    def cells(t0, t):  # time and ratio, "-" where the kernel did not run
        return (f"{t:.1f} | {t0 / t:.2f}x") if t is not None else "- | -"

    for (op, M, N, K), d in keyed.items():
        t0 = d["gemm_only"]
        decode = [d[b] for b in ("gemm_fd", "gemm_fd_nk") if b in d]
        td = min(decode) if decode else None
        t9 = d.get("gemm_fd90")
        tf = f"{2.0 * M * N * K / t9 / 1e6:.0f}" if t9 is not None else "-"
        lines.append(f"| {op} | {M} | {N} | {K} | {t0:.1f} | {cells(t0, td)} | "
                     f"{cells(t0, t9)} | {tf} |")
    return "\n".join(lines)


PLOT_BACKENDS = ("torch_async_tp", "fd_auto", "fd_overlap", "fd_overlap_ce", "fd_overlap_ce_c3",
                 "fd_overlap_ce_c4",
                 "fd_overlap_c2", "fd_overlap_c4", "fd_fused", "fd_fused_nk")


def plot_rows(rows, meta, path) -> None:
    """Speedup over `unfused` (1.0 = no gain) per shape and backend, one panel per op group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [("ag_gemm", lambda r: r["op"] == "ag_gemm"),
              ("gemm_rs", lambda r: r["op"] == "gemm_rs"),
              ("gemm_ar prefill", lambda r: r["op"] == "gemm_ar" and r["M"] > 128),
              ("gemm_ar decode", lambda r: r["op"] == "gemm_ar" and r["M"] <= 128)]
    groups = [(t, f) for t, f in groups if any(f(r) for r in rows)]
    fig, axes = plt.subplots(len(groups), 1, figsize=(11, 3.2 * len(groups)), squeeze=False)
    for ax, (title, keep) in zip(axes[:, 0], groups):
        shapes_ = sorted({(r["M"], r["N"], r["K"]) for r in rows if keep(r)})
        by = {(r["M"], r["N"], r["K"], r["backend"]): r for r in rows if keep(r)}
        backends = [b for b in PLOT_BACKENDS if any(k[3] == b for k in by)]
        width = 0.8 / max(1, len(backends))
        for i, b in enumerate(backends):
            xs, ys = [], []
            for j, sh in enumerate(shapes_):
                r, u = by.get(sh + (b,)), by.get(sh + ("unfused",))
                if r and u and r["status"] == "ok" and r["time_us"] == r["time_us"]:
                    xs.append(j + (i - (len(backends) - 1) / 2) * width)
                    ys.append(u["time_us"] / r["time_us"])
            ax.bar(xs, ys, width, label=b)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(shapes_)))
        ax.set_xticklabels([f"{m}x{n}x{k}" for m, n, k in shapes_], fontsize=7, rotation=20)
        ax.set_ylabel("speedup vs unfused")
        ax.set_title(f"{title} (M x N x K)", fontsize=9)
        ax.legend(fontsize=7, ncol=4)
    fig.suptitle(f"GEMM + collective, {meta.get('world_size')} x {meta.get('gpu', 'CPU')}, "
                 f"{meta.get('dtype')}, commit {meta.get('commit')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def replot(json_path: str) -> None:
    """Redraw the PNG of a saved results JSON (no GPUs needed)."""
    data = json.loads(Path(json_path).read_text())
    out = Path(json_path).with_suffix(".png")
    plot_rows(data["rows"], data["meta"], out)
    print(f"plot -> {out}")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--ops", default="ag_gemm,gemm_rs,gemm_ar",
                    help="comma-separated subset of ops")
    ap.add_argument("--max-m", type=int, default=None, help="only shapes with M <= this")
    ap.add_argument("--min-m", type=int, default=None, help="only shapes with M >= this")
    ap.add_argument("--shape", action="append", default=None, metavar="OP:M:N:K",
                    help="time these shapes instead of the default ones (repeatable)")
    ap.add_argument("--tag", default="", help="suffix of the results files' stem")
    ap.add_argument("--replot", metavar="RESULTS_JSON", default=None,
                    help="only redraw the PNG of a saved results file, then exit")
    args = ap.parse_args()
    if args.replot:
        replot(args.replot)
        return
    rt = init_gpus("gemm_comm benchmark")
    if rt is None:
        return
    dtype = getattr(torch, args.dtype)
    if args.shape:
        try:
            todo_shapes = [(op, int(M), int(N), int(K)) for op, M, N, K in
                           (sh.split(":") for sh in args.shape)]
        except ValueError:
            raise SystemExit(f"--shape {args.shape}: expected op:M:N:K")
    else:
        todo_shapes = shapes(args.quick)
    # Staging for the copy-engine transports and the fused engines: ag_gemm's gathered input
    # (M x K; the copy-engine overlap needs only the shard), gemm_rs's (both engines) and
    # prefill gemm_ar's partials (M x N).
    esize = torch.finfo(dtype).bits // 8
    stage = max([M * K * esize for op, M, N, K in todo_shapes if op == "ag_gemm"] +
                [M * N * esize for op, M, N, K in todo_shapes
                 if op == "gemm_rs" or (op == "gemm_ar" and M > 128)] + [0])
    comm = fusedist.Communicator(rt.tp, max_bytes=64 << 20, staging_bytes=stage)
    rows = []
    ops = set(args.ops.split(","))
    todo = [sh for sh in todo_shapes if sh[0] in ops and
            (args.max_m is None or sh[1] <= args.max_m) and
            (args.min_m is None or sh[1] >= args.min_m)]
    for op, M, N, K in todo:
        rows += bench_shape(rt, comm, op, M, N, K, dtype)
        if rt.rank == 0:
            d = {r["backend"]: r["time_us"] for r in rows if (r["op"], r["M"], r["N"], r["K"]) ==
                 (op, M, N, K)}
            print(f"{op} M={M} N={N} K={K}: " + "  ".join(f"{k}={v:.1f}" for k, v in d.items()),
                  flush=True)
    meta = metadata(rt.tp.size)
    meta["dtype"] = args.dtype
    md = "## GEMM + collective (us per call)\n\n" + table(rows)
    ok = sorted((r["spread"], r["backend"], r["op"], r["M"], r["N"]) for r in rows
                if r["status"] == "ok" and r.get("spread") == r.get("spread"))
    if ok:
        md += (f"\n\nEach time is the median of {ROUNDS} interleaved rounds x {REPS} replays "
               f"(the slowest rank's). Spread of the rounds' medians: median "
               f"{100 * ok[len(ok) // 2][0]:.1f}%, largest {100 * ok[-1][0]:.1f}% ({ok[-1][1]}, "
               f"{ok[-1][2]} {ok[-1][3]} x {ok[-1][4]}).")
    cl = clock_line(rows)
    if cl:
        md += "\n\n" + cl
    gl = gemm_table(rows)
    if gl:
        md += "\n\n## fusedist GEMM without communication vs torch.matmul (us)\n\n" + gl
    if rt.rank == 0:
        paths = write_results("gemm_comm" + args.tag, meta, rows, md,
                              lambda path: plot_rows(rows, meta, path))
        print("\n" + md + "\n\nresults: " + ", ".join(map(str, paths)))
    dist.barrier()
    comm.close()
    fusedist.shutdown()


if __name__ == "__main__":
    main()
