"""fusedist.nn.kv_cache bookkeeping: bad arguments raise a ValueError naming the argument (a
negative append shrank a sequence, an unknown sequence id gave a bare KeyError, a duplicated
page in free() left the allocator half updated, rows below the table's sequences returned
more rows than asked), and a failed call leaves the table as it was."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fusedist.nn import BlockTable, PageAllocator, PagedKVCache, build_block_table, slot_mapping  # noqa: E402,E501


def _table(pages=8, page_size=4, max_batch=3, max_pages=3):
    t = BlockTable(PageAllocator(pages), page_size, max_batch=max_batch,
                   max_pages_per_seq=max_pages)
    t.add("a")
    t.append("a", 5)
    return t


def _state(t):
    return (dict((k, list(v)) for k, v in t.pages.items()), dict(t.lengths), list(t.order),
            t.allocator.num_free)


@pytest.mark.parametrize("n, match", [
    (-1, "n must be an int >= 0"),
    (1.5, "n must be an int >= 0"),
    (True, "n must be an int >= 0"),
    (8, "needs 4 pages, more than max_pages_per_seq=3"),
])
def test_append_bad_n(n, match):
    t = _table()
    before = _state(t)
    with pytest.raises(ValueError, match=match):
        t.append("a", n)
    assert _state(t) == before and t.seq_len("a") == 5


def test_append_zero_is_a_no_op():
    t = _table()
    assert t.append("a", 0) == [] and t.seq_len("a") == 5


@pytest.mark.parametrize("call", [
    lambda t: t.append("zz", 1), lambda t: t.remove("zz"), lambda t: t.seq_len("zz")])
def test_unknown_seq_id(call):
    t = _table()
    before = _state(t)
    with pytest.raises(ValueError, match="sequence 'zz' is not in the table"):
        call(t)
    assert _state(t) == before


def test_allocator_exhaustion_leaves_state():
    t = _table(pages=3)
    t.add("b")
    before = _state(t)
    with pytest.raises(RuntimeError, match="pages requested"):
        t.append("b", 9)
    assert _state(t) == before


@pytest.mark.parametrize("kw, match", [
    ({"page_size": 0}, "page_size must be a positive int"),
    ({"max_batch": 0}, "max_batch must be a positive int"),
    ({"max_pages_per_seq": -2}, "max_pages_per_seq must be a positive int"),
])
def test_block_table_constructor(kw, match):
    args = {"page_size": 4, "max_batch": 2, "max_pages_per_seq": 2, **kw}
    with pytest.raises(ValueError, match=match):
        BlockTable(PageAllocator(4), **args)
    with pytest.raises(TypeError, match="allocator must be a PageAllocator"):
        BlockTable(4, 4, 2, 2)


def test_rows_below_the_sequences():
    t = _table()
    t.add("b")
    for f in (t.tensor, t.seq_lens):
        with pytest.raises(ValueError, match="rows=1 is fewer than the 2 sequences"):
            f(rows=1)
    assert t.tensor(rows=2).shape == (2, 3) and t.seq_lens(rows=4).tolist() == [5, 0, 0, 0]


def test_allocator_checks():
    a = PageAllocator(4)
    for n in (-1, 1.0, None):
        with pytest.raises(ValueError, match="n must be an int >= 0"):
            a.allocate(n)
    a.allocate(3)
    with pytest.raises(ValueError, match="page 1 is listed twice"):
        a.free([1, 1])
    assert a.num_free == 1          # nothing was freed by the failed call
    a.free([1, 2])
    assert a.num_free == 3
    with pytest.raises(ValueError, match="num_pages must be a positive int"):
        PageAllocator(2.0)


def test_cache_layer_and_helpers():
    c = PagedKVCache(2, 1, 8, 4, page_size=4, dtype=torch.float32)
    assert c.layer(1)[0].shape == (4, 4, 1, 8)
    for i in (2, -1, "0"):
        with pytest.raises(ValueError, match="layer index must be an int in"):
            c.layer(i)
    with pytest.raises(ValueError, match="positions must be >= 0"):
        slot_mapping([5, 2], [-1], 16)
    with pytest.raises(ValueError, match="page_size must be a positive int"):
        slot_mapping([5, 2], [0], 0)
    with pytest.raises(ValueError, match="max_pages must be >= 0"):
        build_block_table([[1]], -1)
