"""Run a worker's checks on ranks emulated on this process's GPU (fusedist.testing): the checks
marked @emulated, each on `--world` fresh emulated ranks, reported as under torchrun.

    python tests/dist/emulate.py worker_allreduce.py --world 2   [FUSEDIST_TEST_ONLY=name]
"""

from __future__ import annotations

import os

# Before CUDA initializes: lazily loaded kernels may wait for the kernels on the GPU at their
# first launch, among them an emulated peer's that waits for this one (fusedist/testing).
os.environ["CUDA_MODULE_LOADING"] = "EAGER"
# Before fusedist launches a kernel: no programmatic dependent launch, whose early-scheduled
# successors would hold SMs a peer's kernel needs (fusedist/testing).
os.environ["FUSEDIST_PDL"] = "0"

import argparse  # noqa: E402
import importlib  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("worker", help="a worker of tests/dist, e.g. worker_allreduce.py")
    ap.add_argument("--world", type=int, default=2, help="emulated ranks (default 2)")
    args = ap.parse_args()
    importlib.import_module(Path(args.worker).stem)  # registers its checks in _checks
    from _checks import emulated_main

    emulated_main(args.world)


if __name__ == "__main__":
    main()
