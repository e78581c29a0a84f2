"""A TP run over gloo that the test kills a rank of (tests/models/test_peer_loss.py): every
rank builds the tiny model at TP = world size, prints "rank R generating", and generates until
it fails. The survivors of a SIGKILL must exit non-zero on their own, with a
fusedist.PeerLostError naming the lost rank. Started without torchrun (whose agent would
terminate the survivors itself): RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR
and MASTER_PORT come from the test."""

from __future__ import annotations

import sys
import time

import torch

import fusedist
from fusedist.models import LlamaConfig, Runner, SamplingParams, build_model
from fusedist.models.llama import RandomWeights


def main() -> None:
    rt = fusedist.init(backend="gloo")
    # tiny, with heads and MLP width that 2 and 3 ranks divide
    cfg = LlamaConfig.named("tiny").replace(num_heads=6, num_kv_heads=6, head_dim=32,
                                            intermediate_size=384)
    m = build_model(cfg, RandomWeights(cfg, seed=6), group=rt.tp, dtype=torch.float32,
                    device=rt.device)
    r = Runner(m, max_batch=2, max_seq_len=512)
    r.generate([[1, 2, 3]], 2)                          # every rank is up
    print(f"rank {rt.rank} generating", flush=True)
    t0 = time.time()
    seed = 0
    while time.time() - t0 < 120:
        r.generate([[5, 6, 7, 8], [9, 10]], 400,
                   SamplingParams(greedy=False, temperature=0.9, seed=seed))
        seed += 1
    print(f"rank {rt.rank}: nobody was killed", flush=True)
    sys.exit(3)


if __name__ == "__main__":
    main()
