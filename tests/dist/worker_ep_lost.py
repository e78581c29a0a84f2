"""A peer lost mid-run (3 CPU ranks, gloo): the last rank's process ends without a word while the
others dispatch and combine in a loop; every survivor must end with fusedist.PeerLostError
within the buffer's timeout, naming the lost rank (its process was on this host)."""

from __future__ import annotations

import os
import sys
import time

import torch

import fusedist
from fusedist import ep

TIMEOUT_S = 10.0


def main() -> None:
    rt = fusedist.init()
    W = rt.world_size
    buf = ep.Buffer(None, 16, 8, 2 * W, 2, torch.float32, timeout_s=TIMEOUT_S)
    x = torch.randn(8, 16)
    ids = torch.stack([torch.randperm(2 * W)[:2] for _ in range(8)]).to(torch.int32)
    w = torch.rand(8, 2)
    recv_x, counts, h = buf.dispatch(x, ids, w)
    buf.combine(recv_x, h)                     # everyone is there once
    rt.world.barrier()
    if rt.rank == W - 1:
        os._exit(0)                            # gone: no shutdown, no goodbye
    t0 = time.time()
    try:
        for _ in range(1000):
            recv_x, counts, h = buf.dispatch(x, ids, w)
            buf.combine(recv_x, h)
    except fusedist.PeerLostError as e:
        took = time.time() - t0
        print(f"[lost] rank {rt.rank} after {took:.1f}s: {e}", flush=True)
        ok = took < TIMEOUT_S + 30 and f"rank {W - 1} of group world is lost" in str(e)
        print(f"rank {rt.rank}: {'all checks passed' if ok else 'FAILED'}", flush=True)
        os._exit(0 if ok else 1)               # the world cannot be shut down cleanly
    print(f"rank {rt.rank}: FAILED (no error after the peer left)", flush=True)
    os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
