"""The symmetric memory's cross-rank checks at creation over a real gloo group of CPU ranks
(tests/test_protocol.py runs it on 2 ranks), the device stood in on the host
(tests/dist/_fake_device.py): matching ranks agree on the layout; a size or timeout that
differs on one rank raises CollectiveMismatchError naming both ranks' values on every rank,
after one gather and before anything is allocated."""

from __future__ import annotations

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checks import check, main  # noqa: E402
from _fake_device import fake_device  # noqa: E402

from fusedist.comm import symmetric  # noqa: E402
from fusedist.errors import CollectiveMismatchError  # noqa: E402

BASE = dict(max_bytes=1 << 20, one_shot_max_bytes=1 << 16, timeout_s=3.0)
# (what rank 1 passes differently, the key the error names, both ranks' values in it)
DIFFER = [
    (dict(max_bytes=2 << 20), "max_bytes", "rank 0: 1048576, rank 1: 2097152"),
    (dict(one_shot_max_bytes=1 << 17), "one_shot_max_bytes", "rank 0: 65536, rank 1: 131072"),
    (dict(staging_bytes=4096), "staging_bytes", "rank 0: 0, rank 1: 4096"),
    (dict(timeout_s=5.0), "timeout_s", "rank 0: 3.0, rank 1: 5.0"),
]


class _Counted:
    """The real group, its all_gather_object calls counted."""

    def __init__(self, group):
        self._g, self.gathers = group, 0

    def __getattr__(self, name):
        return getattr(self._g, name)

    def all_gather_object(self, obj):
        self.gathers += 1
        return self._g.all_gather_object(obj)


@check
def symmetric_layout_on_matching_ranks(rt, seed):
    assert rt.tp.size == 2
    with fake_device() as C:
        s = symmetric.SymmetricMemory(rt.tp, **BASE)
        slot = max(1 << 16, (1 << 20) // 2)
        assert s.gen_bytes == 2 * slot + (1 << 20) + 128  # slots, gather region, descriptors
        assert s.staging_offset == 3 * s.gen_bytes and s.timeout_s == 3.0
        rank, world, bases, gen, slot_bytes = C.comm_args[:5]
        assert (rank, world, gen, slot_bytes) == (rt.tp.rank, 2, s.gen_bytes, slot)
        assert len(bases) == 2


@check
def symmetric_sizes_differing_across_ranks_raise_before_allocating(rt, seed):
    for theirs, key, values in DIFFER:
        kw = dict(BASE, **(theirs if rt.tp.rank == 1 else {}))
        group = _Counted(rt.tp)
        with fake_device() as C:
            try:
                symmetric.SymmetricMemory(group, **kw)
            except CollectiveMismatchError as e:
                assert re.search(re.escape(f"{key} ({values})"), str(e)), str(e)
            else:
                raise AssertionError(f"{key}: no CollectiveMismatchError on rank {rt.tp.rank}")
            assert C.allocs == [] and group.gathers == 1, (key, C.allocs, group.gathers)


if __name__ == "__main__":
    main()
