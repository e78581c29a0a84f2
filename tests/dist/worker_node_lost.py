"""A node lost mid-run (2 emulated nodes x 2 CPU ranks): rank 3's process ends without a
word while the others run two-level all-reduces and FP8 all-reduces (or, mode all_reduce, rank
3 shuts fusedist down and exits cleanly while the others run plain fusedist.all_reduce); every
survivor must end with fusedist.PeerLostError within the groups' timeout
(FUSEDIST_INIT_TIMEOUT_S), naming rank 3 where it can tell (its process was on this host)."""

from __future__ import annotations

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _runtime_util import emulate_nodes  # noqa: E402

import torch  # noqa: E402

import fusedist  # noqa: E402
from fusedist.comm import fp8  # noqa: E402
from fusedist.comm.hierarchical import HierarchicalCommunicator  # noqa: E402


def main(what: str) -> None:
    emulate_nodes()
    rt = fusedist.init()
    hc = HierarchicalCommunicator()
    x = torch.randn(1 << 16)
    hc.all_reduce(x, algo="hierarchical")       # everyone is there once
    rt.world.barrier()
    if rt.rank == 3:
        if what == "all_reduce":                  # a clean exit: shutdown, then the end
            fusedist.shutdown()
            sys.exit(0)
        os._exit(0)                               # gone: no shutdown, no goodbye
    t0 = time.time()
    try:
        for _ in range(1000):
            if what == "fp8":
                fp8.fp8_all_reduce(x, rt.world, check=False)
            elif what == "all_reduce":
                fusedist.all_reduce(x, group=rt.world)
            else:
                hc.all_reduce(x, algo="hierarchical", chunks=2)
    except fusedist.PeerLostError as e:
        took = time.time() - t0
        print(f"[lost] rank {rt.rank} after {took:.1f}s: {e}", flush=True)
        limit = float(os.environ.get("FUSEDIST_INIT_TIMEOUT_S", "300")) + 30
        ok = took < limit and "group world" in str(e)
        print(f"rank {rt.rank}: {'all checks passed' if ok else 'FAILED'}", flush=True)
        os._exit(0 if ok else 1)                   # the world cannot be shut down cleanly
    print(f"rank {rt.rank}: FAILED (no error after the peer left)", flush=True)
    os._exit(1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "hierarchical")
