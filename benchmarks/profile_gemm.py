"""One call each of torch.matmul (cuBLAS) and of every sm90 GEMM tile of fusedist at a few
decode-sized shapes, in that order, for Nsight Compute to read their counters:

    ncu --clock-control none --print-kernel-base function -k regex:"nvjet|device_kernel|splitK" \
        --section SpeedOfLight --section MemoryWorkloadAnalysis \
        python3 benchmarks/profile_gemm.py --ms 128,256

(tests/gpu/run.sh, stage "ncu"; cuBLAS's kernels are nvjet_*, CUTLASS's device_kernel). One
GPU; N = 8192, K = 4096, w [K, N]; x[:M] is a slice of a 512-row buffer, as in
benchmarks/gemm.py. One weight: at K = 4096 it does not fit in L2 (64 MB), but a profiled
kernel starts with L2 flushed (ncu's default cache control) anyway.
"""

from __future__ import annotations

import argparse

import torch

import fusedist  # noqa: F401
from fusedist import _ext
from fusedist.ops.gemm import launch_sm90


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="128,256")
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--k", type=int, default=4096)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/profile_gemm.py needs a GPU")
        return
    C = _ext.load()
    dt, dev = torch.bfloat16, torch.device("cuda", 0)
    w = torch.randn(args.k, args.n, device=dev).to(dt)
    x = torch.randn(512, args.k, device=dev).to(dt)
    stream = torch.cuda.current_stream()
    for m in map(int, args.ms.split(",")):
        xm = x[:m]
        out = torch.empty(m, args.n, dtype=dt, device=dev)
        calls = {"torch": lambda: torch.matmul(xm, w, out=out)}
        for name, code in C.GEMM_SM90_TILES.items():
            calls[f"sm90_{name}"] = (lambda code: lambda: launch_sm90(
                xm, w, None, out, stream, tile=code))(code)
        for what, call in calls.items():
            call()
            torch.cuda.synchronize()
            print(f"profiled {what} M={m}", flush=True)


if __name__ == "__main__":
    main()
