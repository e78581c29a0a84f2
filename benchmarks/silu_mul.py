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

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # not the checkout: fusedist stays the installed one
import _harness as H  # noqa: E402
from add_rmsnorm import OPS, REPS, ROUNDS, fmt, parser, run, sweep  # noqa: E402

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
    args = parser(__doc__, "inter", "14336").parse_args()
    run("silu_mul", lambda hbm: (time_row(T, i, dt, hbm) for dt, i, T in sweep(args, "inter")),
        markdown)


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    main()
