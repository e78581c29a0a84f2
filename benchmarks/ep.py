"""Expert-parallel dispatch / combine: fusedist.ep.Buffer's modes beside
torch.distributed.all_to_all_single (NCCL) in the same run, with DeepEP's columns and the cost
model's prediction on every row.

    torchrun --nproc-per-node 8 benchmarks/ep.py                 # real ranks, one GPU each
    torchrun --nproc-per-node 8 benchmarks/ep.py --tokens 128 --hidden 7168 --top-k 8 --experts 256
    python3 benchmarks/ep.py --emulate 8                         # 8 ranks emulated on ONE GPU
    torchrun --nproc-per-node 2 benchmarks/ep.py --cpu --quick   # the gloo path (a smoke run)

Rows: tokens per rank, hidden, top-k, experts, routing (balanced: experts uniform; skewed:
expert e drawn with weight 1 / (e + 1)), mode (low_latency: the symmetric-memory kernels in
CUDA graphs, bf16 and FP8 dispatch; high_throughput: the all-to-all-v path, eager: its host
waits for the counts), dispatch / combine us (median per call, the slowest rank), GB/s (the
bytes this rank's rows carry, dispatch: bf16 or FP8 + scales, combine: bf16, over the time, as
DeepEP counts them), the model's dispatch / combine us (fusedist.comm.cost_model.ep_predict)
and, on real ranks, torch.distributed.all_to_all_single over NCCL moving the same dispatch rows
with the same splits (a2a_us, and vs_a2a = a2a_us / dispatch_us).

Emulated ranks (--emulate N) share one GPU's SMs and memory and talk through its memory, not
NVLink: their times are each rank's own work under that sharing, NOT a multi-GPU result (the
output says so), and they have no NCCL (no high-throughput rows, no all-to-all baseline).
Results: benchmarks/results/<gpu>-w<N>/ep.{json,md} (emulated: ep_emulated).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _harness import metadata, write_results  # noqa: E402

EMULATED_NOTE = ("EMULATED: {w} ranks share one GPU (its SMs, memory bandwidth; peers reached "
                 "through local memory, not NVLink): each time is one rank's work under that "
                 "sharing, not a multi-GPU result; no NCCL, so no high-throughput rows and no "
                 "all-to-all baseline")


def routing(kind: str, T: int, E: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = torch.ones(E, dtype=torch.float64)
    if kind == "skewed":
        p = 1.0 / (torch.arange(E, dtype=torch.float64) + 1.0)
    return torch.multinomial(p.expand(T, E), k, replacement=False, generator=g).to(torch.int32)


def _events_us(fn, ops: int, reps: int, sync) -> float:
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        sync()
        times.append(a.elapsed_time(b) * 1e3 / ops)
    return median(times)


def bench_low_latency(rt, buf, x, ids, w, ops: int, reps: int, emulated: bool):
    """(dispatch_us, combine_us): ops calls captured in one CUDA graph each, replayed."""
    from fusedist import ep  # noqa: F401

    dev = buf.device
    if emulated:
        from fusedist.testing.emulated import synchronize_rank

        def sync():
            synchronize_rank(dev)
    else:
        def sync():
            torch.cuda.synchronize()
    recv_x, counts, h = buf.dispatch(x, ids, w)
    y = recv_x.clone()
    buf.combine(y, h)
    sync()
    rt.world.barrier()
    gd, gc = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    if emulated:      # ranks as threads of one process capture together (capture_graph)
        from fusedist.testing.emulated import capture_graph
    else:
        def capture_graph(graph, body, device):
            with torch.cuda.graph(graph, stream=torch.cuda.Stream(device)):
                body()

    def dispatches():
        for _ in range(ops):
            buf.dispatch(x, ids, w)

    def combines():
        for _ in range(ops):
            buf.combine(y, h)

    capture_graph(gd, dispatches, dev)
    rt.world.barrier()
    capture_graph(gc, combines, dev)
    rt.world.barrier()
    for g in (gd, gc):
        g.replay()
    sync()
    rt.world.barrier()
    t_d = _events_us(gd.replay, ops, reps, sync)
    rt.world.barrier()
    t_c = _events_us(gc.replay, ops, reps, sync)
    buf.check()
    return t_d, t_c


def bench_eager(rt, fn, reps: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(reps):
        rt.world.barrier()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e6)
    return median(times)


def slowest(rt, t: float) -> float:
    return max(rt.world.all_gather_object(t))


def run_rank(rt, args, emulated: bool) -> list:
    from fusedist import ep

    W = rt.world_size
    dev = rt.device
    cuda = dev.type == "cuda"
    sync = (lambda: torch.cuda.current_stream().synchronize()) if cuda else (lambda: None)
    rows = []
    for T in args.tokens:
        for E in args.experts:
            if E % W:
                continue
            for kind in args.routings:
                ids = routing(kind, T, E, args.top_k, 1000 * rt.rank + T).to(dev)
                g = torch.Generator().manual_seed(rt.rank)
                x = torch.randn(T, args.hidden, generator=g).to(torch.bfloat16 if cuda else
                                                                  torch.float32).to(dev)
                w = torch.rand(T, args.top_k, generator=g).to(dev)
                modes = []
                if cuda:
                    modes += [("low_latency", False), ("low_latency", True)]
                if not emulated:
                    modes.append(("high_throughput", False))
                for mode, fp8 in modes:
                    if fp8 and args.hidden % 128:
                        continue
                    try:
                        buf = ep.Buffer(None, args.hidden, T, E, args.top_k, x.dtype, fp8=fp8,
                                        mode=mode)
                    except ValueError as e:       # every rank alike: this size has no such mode
                        if rt.rank == 0:
                            print(f"skipped {mode}{'/fp8' if fp8 else ''} at {T} tokens: {e}",
                                  flush=True)
                        continue
                    pred = buf.predict(mode, T)
                    if mode == "low_latency":
                        t_d, t_c = bench_low_latency(rt, buf, x, ids, w, args.ops, args.reps,
                                                     emulated)
                    else:
                        holder = {}

                        def d():
                            holder["r"] = buf.dispatch(x, ids, w)

                        t_d = bench_eager(rt, d, args.reps, sync)
                        recv_x, _, h = holder["r"]
                        t_c = bench_eager(rt, lambda: buf.combine(recv_x, h), args.reps, sync)
                    a2a = None
                    if not emulated and mode == "high_throughput" and W > 1:
                        lay = ep.send_layout(ids, buf.placement)
                        send = x.index_select(0, lay.order // args.top_k)
                        splits = lay.per_rank.tolist()
                        every = rt.world.all_gather_object(splits)
                        recv = [every[s][rt.rank] for s in range(W)]
                        out = torch.empty(sum(recv), args.hidden, dtype=x.dtype, device=dev)
                        a2a = bench_eager(rt, lambda: dist.all_to_all_single(
                            out, send, recv, splits, group=rt.world.pg), args.reps, sync)
                        a2a = slowest(rt, a2a)
                    t_d, t_c = slowest(rt, t_d), slowest(rt, t_c)
                    row = {"tokens": T, "hidden": args.hidden, "top_k": args.top_k,
                           "experts": E, "routing": kind, "world": W,
                           "mode": mode + ("/fp8" if fp8 else ""),
                           "how": pred["how"], "dispatch_us": t_d, "combine_us": t_c,
                           "dispatch_gbps": pred["dispatch_bytes"] / (t_d * 1e3),
                           "combine_gbps": pred["combine_bytes"] / (t_c * 1e3),
                           "model_dispatch_us": pred["dispatch_us"],
                           "model_combine_us": pred["combine_us"],
                           "a2a_us": a2a, "vs_a2a": (a2a / t_d) if a2a else None,
                           "emulated": emulated}
                    rows.append(row)
                    if rt.rank == 0:
                        print(line(row), flush=True)
                    buf.close()
    return rows


HEAD = ("| tokens | hidden | top-k | experts | routing | mode | dispatch us | combine us | "
        "dispatch GB/s | combine GB/s | model dispatch us | model combine us | a2a us | "
        "vs a2a |\n" + "|---" * 14 + "|")


def line(r: dict) -> str:
    f = (lambda v, p=1: "n/a" if v is None else f"{v:.{p}f}")
    return (f"| {r['tokens']} | {r['hidden']} | {r['top_k']} | {r['experts']} | {r['routing']} "
            f"| {r['mode']} | {f(r['dispatch_us'])} | {f(r['combine_us'])} | "
            f"{f(r['dispatch_gbps'])} | {f(r['combine_gbps'])} | {f(r['model_dispatch_us'])} | "
            f"{f(r['model_combine_us'])} | {f(r['a2a_us'])} | {f(r['vs_a2a'], 2)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="128,4096", help="tokens per rank, comma-separated")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--experts", default="256", help="comma-separated")
    ap.add_argument("--routings", default="balanced,skewed")
    ap.add_argument("--ops", type=int, default=20, help="calls per CUDA graph")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--emulate", type=int, default=0, help="N ranks emulated on one GPU")
    ap.add_argument("--cpu", action="store_true", help="gloo ranks (a smoke run of the script)")
    ap.add_argument("--quick", action="store_true", help="small sizes")
    args = ap.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.experts = [int(e) for e in args.experts.split(",")]
    args.routings = args.routings.split(",")
    if args.quick:
        args.tokens, args.hidden, args.experts, args.ops, args.reps = [16], 256, \
            [8 * max(1, args.emulate or 1)], 4, 3
    if args.emulate:
        os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
        os.environ.setdefault("FUSEDIST_PDL", "0")
        from fusedist.testing import run_ranks

        print(EMULATED_NOTE.format(w=args.emulate), flush=True)
        print(HEAD, flush=True)
        # Tokens beyond what eight emulated ranks fit in one GPU's share: keep decode sizes.
        args.tokens = [t for t in args.tokens if t <= 512] or [128]
        results = run_ranks(args.emulate, lambda rt: run_rank(rt, args, True), timeout_s=3000)
        rows = results[0]
        meta = metadata(args.emulate)
        meta["note"] = EMULATED_NOTE.format(w=args.emulate)
        paths = write_results("ep_emulated", meta, rows,
                              meta["note"] + "\n\n" + HEAD + "\n" + "\n".join(map(line, rows)))
        print("wrote", *paths)
        return
    import fusedist

    rt = fusedist.init(backend="gloo") if args.cpu else fusedist.init()
    if not args.cpu and rt.device.type != "cuda":
        print("benchmarks/ep.py needs GPUs (or --cpu, --emulate N)")
        fusedist.shutdown()
        return
    if rt.rank == 0:
        print(HEAD, flush=True)
    rows = run_rank(rt, args, False)
    if rt.rank == 0:
        paths = write_results("ep", metadata(rt.world_size), rows,
                              HEAD + "\n" + "\n".join(map(line, rows)))
        print("wrote", *paths)
    fusedist.shutdown()


if __name__ == "__main__":
    main()
