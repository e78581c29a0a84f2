"""Does cuBLAS's prefill GEMM run in waves, as the tuning table's wave model says?

One GPU, no communication. For K = 8192 and N in {8192, 14336}: torch.matmul's time for
M = 128 .. 2048 rows (step 128) beside the waves the model predicts (tuning.gemm_waves: tiles
of tile_m rows x tile_n columns, one per SM per wave), and the kernel cuBLAS picks. Then the
piece sequences the overlap engines run, without communication, cut evenly and cut by the
model (tuning.wave_row_bounds / wave_col_split):

  ag_gemm, W = 2, m rows per rank: whole blocks (2 x [m, N]) against a column cut: columns
  [0, c) per block and [2m, N - c] last, into column slices of one output, with c the cut
  that takes the fewest waves (measured faster here, but not end to end, so the engine does
  not use it: benchmarks/NOTES.md);
  gemm_rs, W = 2, m rows per block: [peers c0][peers c1][own c0][own c1] with even chunks
  against the model's.

    python3 benchmarks/gemm_waves.py            # results: benchmarks/results/<gpu>-w1/gemm_waves.*
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _harness import kernels, metadata, time_graph, write_results  # noqa: E402

from fusedist import tuning  # noqa: E402


def kernel_name(fn) -> str:
    """The name of the longest GPU kernel fn() launches (profiled once)."""
    ks = kernels(fn)
    return ks[0][0][:80] if ks else "?"


def col_cut(m: int, n: int, model: dict) -> int:
    """The column c (a multiple of tile_n, or n) with the fewest waves for 2 x [m, c] and
    [2m, n - c]."""
    def cost(c):
        return 2 * tuning._waves(m, c, model) + tuning._waves(2 * m, n - c, model)
    return min([n, *range(model["tile_n"], n, model["tile_n"])], key=lambda c: (cost(c), -c))


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=8192)
    ap.add_argument("--ns", default="8192,14336")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gemm_waves needs a GPU")
        return
    dev, dt, K = torch.device("cuda", 0), torch.bfloat16, args.k
    torch.cuda.set_device(dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    model = tuning.gemm_waves(tuning.load_table(torch.cuda.get_device_name(dev), 2)) or \
        {"tile_m": 128, "tile_n": 256, "sms": sms}
    g = torch.Generator(device=dev).manual_seed(1)

    def rnd(*s):
        return (torch.randn(*s, generator=g, device=dev) * 0.1).to(dt)

    rows, md = [], []
    x = rnd(4096, K)
    for N in map(int, args.ns.split(",")):
        w = rnd(K, N)
        out = torch.empty(4096, N, dtype=dt, device=dev)
        md += [f"\n## torch.matmul [M, {K}] x [{K}, {N}] (us)\n",
               "| M | waves (model) | us | us / wave | kernel |", "|---|---|---|---|---|"]
        for M in range(128, 2049, 128):
            def step(i, M=M):
                torch.matmul(x[:M], w, out=out[:M])
            t = time_graph(step, 5, 20)
            waves = tuning._waves(M, N, model)
            name = kernel_name(lambda: step(0)) if M in (512, 896, 1024, 1152, 2048) else ""
            rows.append({"kind": "matmul", "M": M, "N": N, "K": K, "waves": waves, "time_us": t,
                         "kernel": name})
            md.append(f"| {M} | {waves} | {t:.1f} | {t / waves:.1f} | {name} |")
        # The engines' piece sequences, compute only.
        md += [f"\n## Piece sequences at N = {N} (compute only, us)\n",
               "| sequence | m | pieces | waves (model) | us |", "|---|---|---|---|---|"]
        for m in (1024, 2048):
            xa = x[:2 * m]
            c = col_cut(m, N, model)
            seqs = {"ag whole blocks": [(slice(0, m), slice(0, N)), (slice(m, 2 * m), slice(0, N))]}
            if c < N:
                seqs["ag column cut"] = [(slice(0, m), slice(0, c)), (slice(m, 2 * m), slice(0, c)),
                                           (slice(0, 2 * m), slice(c, N))]
            even = [0, m // 2, m]
            cut = tuning.wave_row_bounds(m, N, 2, model)
            for label, b in (("rs even", even), ("rs wave", cut)):
                if label == "rs wave" and b == even:
                    continue
                # peers c0, peers c1, own c0, own c1 (the own rows are the second block)
                seqs[label] = [(slice(b[0], b[1]), slice(0, N)), (slice(b[1], b[2]), slice(0, N)),
                               (slice(m + b[0], m + b[1]), slice(0, N)),
                               (slice(m + b[1], m + b[2]), slice(0, N))]
            for label, pieces in seqs.items():
                def step(i, pieces=pieces):
                    for rs, cs in pieces:
                        torch.matmul(xa[rs], w[:, cs], out=out[rs, cs])
                t = time_graph(step, 3, 20)
                waves = sum(tuning._waves(r.stop - r.start, cc.stop - cc.start, model)
                            for r, cc in pieces)
                desc = " + ".join(f"{r.stop - r.start}x{cc.stop - cc.start}" for r, cc in pieces)
                rows.append({"kind": label, "m": m, "N": N, "K": K, "pieces": desc,
                             "waves": waves, "time_us": t})
                md.append(f"| {label} | {m} | {desc} | {waves} | {t:.1f} |")
    meta = metadata(1)
    meta["model"] = model
    text = "\n".join(md)
    paths = write_results("gemm_waves" + args.tag, meta, rows, text)
    print(text + "\n\nresults: " + ", ".join(map(str, paths)))


if __name__ == "__main__":
    main()
