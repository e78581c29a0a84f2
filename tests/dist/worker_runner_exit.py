"""A scripted TP-2 session over gloo that must end with exit status 0 on every rank (run many
times by tests/models/test_runner.py): sampled generate calls, a CollectiveMismatchError the
script catches, more generate calls, then

    shutdown  fusedist.shutdown(): afterwards no gloo thread is left in the process
    exit      no shutdown() call: the interpreter exits with fusedist initialized
    pending   as exit, with rank 0 leaving an all-gather of its own tensors in flight (rank 1
              joins it a second later): the gloo thread finishes it while rank 0 exits

Before fusedist.shutdown() released its process groups (and ran at exit), a gloo worker
thread could still hold the last collective's work when the interpreter finalized; freeing
its tensors then needed the GIL, and the thread's forced exit aborted the process
("terminate called without an active exception", SIGABRT)."""

from __future__ import annotations

import os
import sys

import torch

import fusedist
from fusedist.models import LlamaConfig, Runner, SamplingParams, build_model
from fusedist.models.llama import RandomWeights


def gloo_threads() -> list:
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        if "gloo" in name:
            names.append(name)
    return names


def main(mode: str) -> None:
    rt = fusedist.init(backend="gloo")
    cfg = LlamaConfig.named("tiny")
    m = build_model(cfg, RandomWeights(cfg, seed=2), group=rt.tp, dtype=torch.float32,
                    device=rt.device)
    r = Runner(m, max_batch=2, max_seq_len=64)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    for seed in range(3):
        r.generate(prompts, 6, SamplingParams(greedy=False, temperature=0.8, top_p=0.9,
                                              seed=seed))
    try:
        fusedist.all_reduce(torch.ones(3 if rt.rank == 0 else 5))
    except fusedist.CollectiveMismatchError:
        pass
    else:
        raise AssertionError("all_reduce of different sizes raised nothing")
    ids = r.generate(prompts, 8, SamplingParams(greedy=False, temperature=0.7, seed=9)).ids
    assert len(ids) == 2 and all(len(row) == 8 for row in ids), ids
    if mode == "shutdown":
        fusedist.shutdown()
        left = gloo_threads()
        assert not left, f"gloo threads alive after fusedist.shutdown(): {left}"
    elif mode == "pending":
        import time

        import torch.distributed as dist

        x = torch.full((1 << 16,), float(rt.rank))
        parts = [torch.empty_like(x) for _ in range(rt.tp.size)]
        if rt.rank == 0:
            dist.all_gather(parts, x, group=rt.tp.pg, async_op=True)   # left in flight
        else:
            time.sleep(1.0)
            dist.all_gather(parts, x, group=rt.tp.pg)
        del x, parts
    elif mode != "exit":
        raise SystemExit(f"worker_runner_exit.py: mode must be shutdown, exit or pending, got "
                         f"{mode!r}")
    print(f"rank {rt.rank}: all checks passed", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "shutdown")
