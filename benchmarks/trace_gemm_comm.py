"""GPU timeline of one GEMM + collective call per configuration, from torch.profiler (CUPTI):
every kernel and copy with its stream, start and length, per rank. It shows where an overlap
pipeline waits (a barrier that found no free SM, a pull that outlasts its GEMM, ...).

    torchrun --nproc-per-node 2 benchmarks/trace_gemm_comm.py \
        --cfg gemm_ar:2048:8192:4096:copy_engine:2 --cfg gemm_rs:4096:14336:8192:copy_engine:2

--cfg op:M:N:K:transport:chunks (transport nccl|collective|copy_engine|unfused, or fused for
the fused engine with `chunks` copy pieces per block). One CUDA-graph replay per configuration
is traced (--eager: an eager call). Prints each rank's timeline (us from that rank's first GPU
event of the call: ranks' clocks are not aligned) and writes every rank's events to
FUSEDIST_RESULTS_DIR (default benchmarks/results)/trace_gemm_comm-rank<r>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fusedist  # noqa: E402
from _harness import init_gpus, metadata  # noqa: E402

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def parse_cfg(text: str) -> dict:
    try:
        op, M, N, K, transport, chunks = text.split(":")
        cfg = {"op": op, "M": int(M), "N": int(N), "K": int(K), "transport": transport,
               "chunks": int(chunks)}
    except ValueError:
        raise SystemExit(f"--cfg {text!r}: expected op:M:N:K:transport:chunks")
    if op not in ("ag_gemm", "gemm_rs", "gemm_ar"):
        raise SystemExit(f"--cfg {text!r}: op must be ag_gemm, gemm_rs or gemm_ar")
    return cfg


def make_call(rt, comm, cfg, dtype):
    W, dev = rt.tp.size, rt.device
    g = torch.Generator(device=dev)
    g.manual_seed(11 + rt.rank)
    op, M, N, K = cfg["op"], cfg["M"], cfg["N"], cfg["K"]
    w = (torch.randn(K, N, generator=g, device=dev) * 0.1).to(dtype)
    rows = M // W if op == "ag_gemm" else M
    x = (torch.randn(rows, K, generator=g, device=dev) * 0.1).to(dtype)
    fn = getattr(fusedist, op)
    kw = {"group": comm}
    if cfg["transport"] == "unfused":
        kw["engine"] = "unfused"
    elif cfg["transport"] == "fused":
        kw.update(engine="fused", chunks=cfg["chunks"])
    else:
        kw.update(engine="overlap", transport=cfg["transport"])
        if op != "ag_gemm":
            kw["chunks"] = cfg["chunks"]
    return lambda: fn(x, w, **kw)


def trace_one(call, eager: bool) -> list:
    """GPU events of one call: (name, stream, start_us, dur_us), start from the first event.
    The call is replayed from a CUDA graph (as the benchmark times it) unless `eager`: eager
    timelines are dominated by host launch gaps at these sizes."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    run = call
    if not eager:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            call()
        for _ in range(3):
            g.replay()
        run = g.replay
    torch.cuda.synchronize()
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "t.json"
        prof.export_chrome_trace(str(path))
        data = json.loads(path.read_text())
    evs = [e for e in data.get("traceEvents", []) if e.get("cat") in GPU_CATS and "dur" in e]
    if not evs:
        return []
    t0 = min(float(e["ts"]) for e in evs)
    return sorted(((e["name"], e.get("tid"), round(float(e["ts"]) - t0, 1),
                    round(float(e["dur"]), 1)) for e in evs), key=lambda e: e[2])


def short(name: str) -> str:
    for key, label in (("gemm", "GEMM"), ("sm90_xmma", "GEMM"), ("cutlass", "GEMM"),
                       ("nvjet", "GEMM"), ("allreduce", "fd all-reduce"),
                       ("Memcpy PtoP", "copy P2P"), ("Memcpy DtoD", "copy DtoD"),
                       ("nccl", "NCCL"), ("elementwise", "elementwise"), ("reduce", "reduce")):
        if key.lower() in name.lower():
            return f"{label} ({name[:48]})"
    return name[:60]


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cfg", action="append", required=True, type=parse_cfg)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--eager", action="store_true", help="trace an eager call, not a graph replay")
    args = ap.parse_args()
    rt = init_gpus("trace_gemm_comm")
    if rt is None:
        return
    dtype = getattr(torch, args.dtype)
    es = torch.finfo(dtype).bits // 8
    stage = max(c["M"] * max(c["N"], c["K"]) * es for c in args.cfg)
    comm = fusedist.Communicator(rt.tp, max_bytes=64 << 20, staging_bytes=stage)
    out = []
    for cfg in args.cfg:
        events = trace_one(make_call(rt, comm, cfg, dtype), args.eager)
        out.append({"cfg": cfg, "events": events})
        for rank in range(rt.tp.size):  # every rank's timeline, one after the other
            if rt.rank == rank:
                streams = sorted({e[1] for e in events}, key=str)
                print(f"\n== {cfg}  (rank {rank}; streams {streams})")
                for name, tid, start, dur in events:
                    col = streams.index(tid)
                    print(f"  s{col} {start:9.1f} {start + dur:9.1f} {dur:8.1f}  {short(name)}",
                          flush=True)
            dist.barrier()
    results = Path(os.environ.get("FUSEDIST_RESULTS_DIR",
                                  Path(__file__).resolve().parent / "results"))
    results.mkdir(parents=True, exist_ok=True)
    meta = metadata(rt.tp.size)
    (results / f"trace_gemm_comm-rank{rt.rank}.json").write_text(
        json.dumps({"meta": meta, "traces": out}))
    dist.barrier()
    comm.close()
    fusedist.shutdown()


if __name__ == "__main__":
    main()
