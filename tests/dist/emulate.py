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


def watch_stalls(stall_s: float) -> None:
    """FUSEDIST_EMULATE_STALL_S=N: when a rank's thread has not moved for N seconds (stuck, for
    instance behind a kernel that waits for a peer that never launched), print every thread's
    stack to stderr: where each emulated rank is while the wait is still on."""
    import sys
    import threading
    import time
    import traceback

    def snapshot():
        return {t: tuple((f.f_code, f.f_lineno) for f, _ in traceback.walk_stack(fr))
                for t, fr in sys._current_frames().items() if t != threading.get_ident()}

    def loop():
        seen, since, dumped = {}, {}, set()
        while True:
            time.sleep(0.5)
            now, t_now = snapshot(), time.monotonic()
            for t, stack in now.items():
                if seen.get(t) != stack:
                    seen[t], since[t] = stack, t_now
                    dumped.discard(t)
            stuck = [t for t in now if t not in dumped and t_now - since[t] >= stall_s and
                     any(c.co_name == "rank_main" for c, _ in now[t])]
            if not stuck:
                continue
            dumped.update(stuck)
            names = {t.ident: t.name for t in threading.enumerate()}
            lines = [f"emulate.py: {', '.join(str(names.get(t, t)) for t in stuck)} did not "
                     f"move for {stall_s:g} s; every thread's stack:"]
            for t, fr in sys._current_frames().items():
                if t != threading.get_ident():
                    lines.append(f"--- thread {names.get(t, t)}")
                    lines += [ln.rstrip() for ln in traceback.format_stack(fr)[-8:]]
            print("\n".join(lines), file=sys.stderr, flush=True)

    threading.Thread(target=loop, name="stall-watch", daemon=True).start()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("worker", help="a worker of tests/dist, e.g. worker_allreduce.py")
    ap.add_argument("--world", type=int, default=2, help="emulated ranks (default 2)")
    args = ap.parse_args()
    stall_s = float(os.environ.get("FUSEDIST_EMULATE_STALL_S", "0") or 0)
    if stall_s > 0:
        watch_stalls(stall_s)
    importlib.import_module(Path(args.worker).stem)  # registers its checks in _checks
    from _checks import emulated_main

    emulated_main(args.world)


if __name__ == "__main__":
    main()
