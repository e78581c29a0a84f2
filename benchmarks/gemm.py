"""fusedist's GEMMs without communication against torch.matmul (cuBLAS), at decode and small
prefill row counts: the shapes where the choice of kernel and tile decides the speed.

One GPU. For N = 8192, K in {4096, 14336} (gemm_ar's per-rank weights), w [K, N] row-major
("kn") and the .t() of an nn.Linear [N, K] weight ("nk"), and M from 1 to 512 rows: the time
of torch.matmul, of the decode kernel (M <= 128), of every Hopper tile configuration this build
has (fusedist._C.GEMM_SM90_TILES) in every tile order (GEMM_SM90_RASTERS: sm90_<tile>_<raster>)
and of fusedist.gemm(kernel="auto"); and the kernels cuBLAS runs (kn). Each call reads a
different weight (a ring of copies larger than L2), as a decode step's layers do, so weights
stream from HBM for every kernel alike. CUDA graphs; every fusedist output is checked against
torch.matmul's before it is timed. Timing (--timing): "paced" (default) replays every kernel's
graph in interleaved rounds, each burst after ~30 ms of torch.matmul, so all see the clock of
a GPU under sustained load, as in a serving loop and in benchmarks/gemm_comm.py (the median of
all timed replays); "blocks" times each kernel alone, one after another (sessions 8-9): the
GPU runs cooler and faster there, and tiles do not gain alike from it (benchmarks/NOTES.md,
session 10). x[:M] is a slice of a buffer of
max(--ms) rows, so below that the sm90 GEMMs read whole tiles of rows
(fusedist.ops.gemm.launch_sm90). Diagnoses, not kernels: sm90_<narrow|mid|swap>_exact, the
tile on a copy of x[:M] (its last tile's loads run past the end); sm90_narrow_pad, x copied
into zero rows to a whole tile, both copies included.

    python3 benchmarks/gemm.py            # results: benchmarks/results/gemm-<gpu>.*
"""

from __future__ import annotations

import argparse
import sys
from statistics import median
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (kernels, metadata, time_graph, time_graphs_interleaved,  # noqa: E402
                      write_results)

import fusedist  # noqa: E402
from fusedist import _ext  # noqa: E402
from fusedist.ops.gemm import launch_sm90  # noqa: E402

MS = (1, 16, 32, 64, 96, 112, 128, 160, 192, 256, 320, 384, 512)
L2_RING_BYTES = 3 << 27  # 384 MB of weights per shape: more than any Hopper L2 many times over


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--ks", default="4096,14336")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--tag", default="")
    ap.add_argument("--timing", default="paced", choices=["paced", "blocks"],
                    help="paced (default): every kernel timed in interleaved rounds, each burst "
                    "after ~30 ms of torch.matmul (the loaded GPU's clock); blocks: each kernel "
                    "alone, one graph after another (sessions 8-9; the GPU runs cooler)")
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds (paced)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/gemm.py needs a GPU")
        return
    dev, dt, N = torch.device("cuda", 0), torch.bfloat16, args.n
    torch.cuda.set_device(dev)
    C = _ext.load()
    hopper = torch.cuda.get_device_capability(dev)[0] == 9
    tiles = dict(C.GEMM_SM90_TILES) if hopper else {}
    rasters = dict(C.GEMM_SM90_RASTERS) if hopper else {}
    g = torch.Generator(device=dev).manual_seed(1)

    def rnd(*s):
        return (torch.randn(*s, generator=g, device=dev) * 0.1).to(dt)

    ms = [int(m) for m in args.ms.split(",")]
    rows = []
    names = ["torch", "decode"] + [f"sm90_{t}_{r}" for t in tiles for r in rasters] + \
        [f"sm90_{t}_exact" for t in ("narrow", "mid", "swap") if t in tiles] + \
        (["sm90_narrow_pad"] if "narrow" in tiles else []) + ["auto"]
    md = ["| layout | K | M | " + " | ".join(f"{n} us" for n in names) + " | best fusedist / torch |",
          "|" + "---|" * (len(names) + 4)]
    kmd = []
    cmd = ["| layout | K | M | " + " | ".join(f"{n} MHz" for n in names) + " |",
           "|" + "---|" * (len(names) + 3)]
    for K in map(int, args.ks.split(",")):
        ring = max(2, -(-L2_RING_BYTES // (K * N * 2)))
        for layout in ("kn", "nk"):
            ws = [rnd(K, N) if layout == "kn" else rnd(N, K).t() for _ in range(ring)]
            x = rnd(max(ms), K)
            for M in ms:
                xm = x[:M]
                outs = [torch.empty(M, N, dtype=dt, device=dev) for _ in range(ring)]
                calls = {"torch": lambda i, w, o: torch.matmul(xm, w, out=o)}
                if M <= C.GEMM_AR_FUSED_MAX_M:
                    calls["decode"] = lambda i, w, o: fusedist.gemm(xm, w, out=o, kernel="decode")
                for t, code in tiles.items():
                    for r, order in rasters.items():
                        calls[f"sm90_{t}_{r}"] = (lambda code, order: lambda i, w, o: launch_sm90(
                            xm, w, None, o, torch.cuda.current_stream(), tile=code,
                            raster=order))(code, order)
                if "narrow" in tiles and M % C.GEMM_SM90_BLOCK_M:
                    # Diagnosis: x in a buffer of exactly M rows, so the last tile's loads run
                    # past its end (the sm90 columns read the rows after x[:M], as a slice of
                    # a larger activation buffer lets them).
                    xe = xm.clone()
                    for t in ("narrow", "mid", "swap"):
                        if t in tiles:
                            calls[f"sm90_{t}_exact"] = (lambda code: lambda i, w, o: launch_sm90(
                                xe, w, None, o, torch.cuda.current_stream(), tile=code))(tiles[t])
                    # Diagnosis: the narrow tile with x padded by zero rows to whole tiles and
                    # the rows copied out, copies included (partial tiles measured slow).
                    mp = -(-M // C.GEMM_SM90_BLOCK_M) * C.GEMM_SM90_BLOCK_M
                    xp = torch.zeros(mp, K, dtype=dt, device=dev)
                    op = torch.empty(mp, N, dtype=dt, device=dev)

                    def padded(i, w, o, xp=xp, op=op, M=M, xm=xm):
                        xp[:M].copy_(xm)
                        launch_sm90(xp, w, None, op, torch.cuda.current_stream(),
                                    tile=tiles["narrow"])
                        o.copy_(op[:M])
                    calls["sm90_narrow_pad"] = padded
                calls["auto"] = lambda i, w, o: fusedist.gemm(xm, w, out=o)
                ref = torch.matmul(xm.float(), ws[0].float())
                times, errs, steps = {}, {}, {}
                for name, call in calls.items():
                    try:
                        outs[0].fill_(float("nan"))
                        call(0, ws[0], outs[0])
                        torch.cuda.synchronize()
                        errs[name] = ((outs[0].float() - ref).norm() / ref.norm()).item()
                        if not errs[name] < 1e-2:
                            raise RuntimeError(f"rel err {errs[name]:.3g}")
                    except (RuntimeError, ValueError) as e:
                        print(f"K={K} {layout} M={M} {name}: {e}")
                        continue
                    steps[name] = (lambda call: lambda i: call(i, ws[i % ring],
                                                               outs[i % ring]))(call)
                clocks = {}
                if args.timing == "blocks":
                    times = {name: time_graph(step, 2 * ring, 20) for name, step in steps.items()}
                else:
                    med, _, status = time_graphs_interleaved(steps, 2 * ring, args.rounds, 5,
                                                             pacer="torch", clocks=clocks)
                    times = {n: t for n, t in med.items() if status[n] == "ok"}
                mhz = {n: median(c) for n, c in clocks.items() if c}
                fd = [times[n] for n in times
                      if n != "torch" and not n.endswith(("_pad", "_exact"))]
                best = times["torch"] / min(fd) if fd and "torch" in times else float("nan")
                cublas = [(n[:90], round(t, 1)) for n, t in
                          kernels(lambda: torch.matmul(xm, ws[0], out=outs[0]))] \
                    if layout == "kn" else []
                if cublas:
                    kmd.append(f"| {K} | {M} | " + "<br>".join(f"{n} ({t} us)" for n, t in cublas)
                               + " |")
                if mhz:
                    cmd.append(f"| {layout} | {K} | {M} | " + " | ".join(
                        f"{mhz[n]:.0f}" if n in mhz else "-" for n in names) + " |")
                rows.append({"layout": layout, "M": M, "N": N, "K": K, "time_us": times,
                             "sm_clock_mhz": mhz,
                             "rel_err": errs, "best_ratio": best, "cublas_kernels": cublas,
                             "weight_GBps": {n: K * N * 2 / t / 1e3 for n, t in times.items()}})
                md.append(f"| {layout} | {K} | {M} | " + " | ".join(
                    f"{times[n]:.1f}" if n in times else "-" for n in names) + f" | {best:.2f} |")
            ws = None  # the ring is freed before the next layout allocates its own
    clock_md = ["", "SM clock while each kernel ran (NVML, MHz, the median of its rounds; "
                "paced timing only):", ""] + cmd if len(cmd) > 2 else []
    text = "\n".join(md + clock_md + ["", "cuBLAS kernels (kn; profiled once, device us):", "",
                                       "| K | M | kernels |", "|---|---|---|"] + kmd)
    paths = write_results("gemm" + args.tag, metadata(1), rows, text)
    print(text + "\n\nresults: " + ", ".join(map(str, paths)))


if __name__ == "__main__":
    main()
