"""The worker harness itself (tests/dist/_checks.py), on 2 CPU ranks: a check that one rank
skips and another runs must fail the worker, not pass as half-skipped; a check that fails
names the seed to rerun it with; every rank gets rank 0's seed.

    CUDA_VISIBLE_DEVICES= torchrun --nproc-per-node 2 tests/dist/worker_checks_selftest.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checks import check, main, skip  # noqa: E402


@check
def runs_everywhere(rt, seed):
    pass


@check
def seed_is_rank_0s(rt, seed):
    assert rt.world.all_gather_object(seed) == [seed] * rt.world_size


@check
def fails_with_the_seed(rt, seed):
    assert False, f"on purpose (seed {seed})"


@check
def skipped_on_rank_1_only(rt, seed):
    if rt.rank == 1:
        skip("this rank thinks it cannot run it")


if __name__ == "__main__":
    main()
