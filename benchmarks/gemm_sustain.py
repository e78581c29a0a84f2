"""Does a GEMM's time depend on how long the GPU has been busy? One GPU, no communication.

For three prefill shapes, torch.matmul (cuBLAS) and fusedist.gemm(kernel="sm90") timed in
CUDA graphs of `ops` calls x `reps` replays: short bursts (2 x 10), blocks of 3 x 20
as the gemm_comm benchmark once timed, sustained (3 x 100), then short again; after each timing
nvidia-smi's SM clock, power draw and temperature. Measured on H200: the SM clock fell from 1980 MHz to ~1450-1530 MHz under sustained load
(700 W limit) and the GEMMs took 12-15% longer; hence the gemm_comm benchmark's interleaved
rounds with a pacer (docs/benchmarks.md).

    python3 benchmarks/gemm_sustain.py     # prints one line per timing
"""

import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import time_graph  # noqa: E402

from fusedist.ops.gemm import gemm as fd_gemm  # noqa: E402


def smi() -> str:
    return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                           "--format=csv,noheader", "-i", "0"], capture_output=True,
                          text=True).stdout.strip()


def main():
    if not torch.cuda.is_available():
        print("gemm_sustain needs a GPU")
        return
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    for M, N, K in ((2048, 8192, 8192), (4096, 8192, 8192), (4096, 14336, 8192)):
        x = (torch.randn(M, K, generator=g, device=dev) * 0.1).bfloat16()
        w = (torch.randn(K, N, generator=g, device=dev) * 0.1).bfloat16()
        o = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
        for ops, reps in ((2, 10), (3, 20), (3, 100), (2, 10)):
            for name, f in (("cublas", lambda: torch.matmul(x, w, out=o)),
                            ("sm90", lambda: fd_gemm(x, w, out=o, kernel="sm90")),
                            ("cublas", lambda: torch.matmul(x, w, out=o)),
                            ("sm90", lambda: fd_gemm(x, w, out=o, kernel="sm90"))):
                t = time_graph(lambda i, f=f: f(), ops, reps)
                print(f"{M}x{N}x{K} ops={ops} reps={reps} {name:6s} {t:8.1f} us  [{smi()}]",
                      flush=True)
        time.sleep(2)


if __name__ == "__main__":
    main()
