"""SiLU-and-multiply on one GPU: fusedist.silu_mul beside the torch composite and
torch.compile of it, in the same run.

    python benchmarks/silu_mul.py                    # T = 1, 8, 64, 512, 4096; I = 14336; bf16
    python benchmarks/silu_mul.py --quick            # T = 1, 64, 4096
    python benchmarks/silu_mul.py --inter 14336,28672 --dtype bfloat16,float16

Each row times y = silu(gate_up[:, :I]) * gate_up[:, I:] for gate_up [T, 2I] (the model's
fused gate|up GEMM output; I = 14336 is Llama-3-8B's intermediate size at TP 1) as
  fusedist   fusedist.silu_mul(gate_up): one kernel, fp32 math, one rounding
  torch      F.silu(gate_up[:, :I]) * gate_up[:, I:] (the torch model's code: two kernels)
  compile    that composite under torch.compile(fullgraph=True)
Timing as benchmarks/add_rmsnorm.py: CUDA graphs rotating over input sets that stream at least
twice the L2 per replay, replayed interleaved; time_us = median per call; GB/s = bytes read +
written per call (3 I T elements) / fusedist's time; % HBM of a device-to-device copy in the
same run. Results: benchmarks/results/<gpu>-w1/silu_mul.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # not the checkout: fusedist stays the installed one
import _harness as H  # noqa: E402
from add_rmsnorm import DTYPES, OPS, REPS, ROUNDS, TOKENS, fmt  # noqa: E402
from attention import hbm_ceiling_tbs  # noqa: E402

import fusedist  # noqa: E402


def composite(gu):
    i = gu.shape[-1] // 2
    return F.silu(gu[:, :i]) * gu[:, i:]


def time_row(T: int, inter: int, dtype, hbm_tbs: float) -> dict:
    nbytes = 3 * T * inter * dtype.itemsize
    sets = H.rotation_sets(nbytes)
    gus = [torch.randn(T, 2 * inter, device="cuda").to(dtype) for _ in range(sets)]
    torch._dynamo.reset()   # a fresh compile per shape (no recompile limit across rows)
    compiled = torch.compile(composite, fullgraph=True, dynamic=False)
    steps = {"fusedist": lambda i: fusedist.silu_mul(gus[i % sets]),
             "torch": lambda i: composite(gus[i % sets]),
             "compile": lambda i: compiled(gus[i % sets])}
    med, _, status = H.time_graphs_interleaved(steps, max(OPS, sets), ROUNDS, REPS,
                                               pacer="torch")
    for n, st in status.items():
        if st != "ok":
            print(f"  T={T} {n}: {st}", flush=True)
    row = dict(op="silu_mul", tokens=T, inter=inter, dtype=str(dtype).replace("torch.", ""),
               world_size=1, bytes=nbytes, input_sets=sets, calls_per_graph=max(OPS, sets))
    row.update(H.rate_columns({n: t for n, t in med.items() if status[n] == "ok"}, nbytes,
                              hbm_tbs))
    del gus, compiled
    return row


def markdown(rows, hbm_tbs) -> str:
    out = [f"HBM copy in this run: {hbm_tbs:.2f} TB/s (read + written). Inputs rotate past the L2.",
           "", "| T | I | dtype | fusedist us | GB/s | % HBM | torch us | compile us | vs torch | "
           "vs compile |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['tokens']} | {r['inter']} | {r['dtype']} | {fmt(r.get('fusedist_us'))} "
                   f"| {fmt(r.get('fusedist_gbs'), 0)} | {fmt(r.get('pct_hbm'), 1)} | "
                   f"{fmt(r.get('torch_us'))} | {fmt(r.get('compile_us'))} | "
                   f"{fmt(r.get('vs_torch'))} | {fmt(r.get('vs_compile'))} |")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="T = 1, 64, 4096 only")
    ap.add_argument("--inter", default="14336", help="comma-separated intermediate sizes I")
    ap.add_argument("--dtype", default="bfloat16", help="comma-separated: " + ", ".join(DTYPES))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/silu_mul.py needs a GPU")
        return
    torch.manual_seed(0)
    hbm = hbm_ceiling_tbs()
    rows = []
    for dname in args.dtype.split(","):
        if dname not in DTYPES:
            raise SystemExit(f"--dtype: {dname!r} is not one of {', '.join(DTYPES)}")
        for inter in (int(i) for i in args.inter.split(",")):
            for T in (1, 64, 4096) if args.quick else TOKENS:
                rows.append(time_row(T, inter, DTYPES[dname], hbm))
                print(f"T={T} I={inter} {dname}: fusedist {fmt(rows[-1].get('fusedist_us'))} "
                      f"us, torch {fmt(rows[-1].get('torch_us'))}, compile "
                      f"{fmt(rows[-1].get('compile_us'))}", flush=True)
    meta = H.metadata(1)
    meta["command"] = "python benchmarks/silu_mul.py " + " ".join(sys.argv[1:])
    meta["hbm_copy_tbs"] = hbm
    paths = H.write_results("silu_mul", meta, rows, markdown(rows, hbm))
    print(markdown(rows, hbm) + "\nresults: " + ", ".join(map(str, paths)))


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    main()
