"""fusedist.ep in one process: the send / receive order every mode follows (against brute force),
the combine sum (bitwise fusedist.ops.moe.unpermute_reference), the single-process references,
the cost model's all-to-all and EP forms, and the errors' messages."""

from __future__ import annotations

import ctypes
import math
import os
import subprocess

import pytest
import torch

from fusedist import ep
from fusedist.comm import cost_model as cm
from fusedist.comm import symmetric
from fusedist.distributed.groups import Group
from fusedist.distributed.peers import process_identity
from fusedist.ep import low_latency as ll
from fusedist.errors import CollectiveMismatchError, CommunicatorTimeoutError, PeerLostError
from fusedist.ops.moe import sort_by_expert_reference, unpermute_reference


def _ids(T, k, E, g, distinct=True):
    if T == 0:
        return torch.empty(0, k, dtype=torch.int32)
    if distinct:
        return torch.multinomial(torch.ones(T, E), k, generator=g).to(torch.int32)
    return torch.randint(0, E, (T, k), generator=g, dtype=torch.int32)


@pytest.mark.parametrize("T,k,W,L,distinct", [(0, 2, 2, 3, True), (1, 1, 1, 1, True),
                                               (13, 3, 4, 2, True), (29, 4, 3, 5, False),
                                               (7, 8, 2, 4, True)])
def test_send_layout_is_by_rank_expert_then_pair(T, k, W, L, distinct):
    g = torch.Generator().manual_seed(T * 31 + k)
    E = W * L
    ids = _ids(T, k, E, g, distinct)
    lay = ep.send_layout(ids, ep.Placement(E, W))
    flat = ids.reshape(-1).tolist()
    want = sorted(range(T * k), key=lambda q: (flat[q] // L, flat[q] % L, q))
    assert lay.order.tolist() == want
    for q in range(T * k):
        d = flat[q] // L
        before = [p for p in want if flat[p] // L == d]
        assert lay.pos[q] == before.index(q), q
    assert lay.counts.sum().item() == T * k and lay.per_rank.tolist() == \
        [sum(1 for e in flat if e // L == d) for d in range(W)]
    assert lay.pos.dtype == torch.int32


def test_receive_order_is_by_expert_then_source():
    g = torch.Generator().manual_seed(5)
    W, L = 3, 4
    counts = torch.randint(0, 4, (W, L), generator=g)
    counts[1, 2] = 0
    # arrived rows tagged (source, local expert, index) in arrival order
    tags = [(s, l, i) for s in range(W) for l in range(L) for i in range(int(counts[s, l]))]
    perm = ep.receive_order(counts)
    got = [tags[p] for p in perm.tolist()]
    assert got == sorted(tags, key=lambda t: (t[1], t[0], t[2]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [1, 2, 5])
def test_weighted_sum_is_unpermute_reference_bitwise(dtype, k):
    g = torch.Generator().manual_seed(k)
    T, E, H = 17, 9, 33
    ids = _ids(T, k, E, g)
    w = torch.rand(T, k, generator=g) - 0.3
    lay = sort_by_expert_reference(ids, E)
    y_perm = torch.randn(lay.rows, H, generator=g).to(dtype)
    y_perm[0] = -0.0                      # signed zeros survive as the reference keeps them
    rows = y_perm[lay.dest_index.long()].view(T, k, H)
    got = ep.weighted_sum(rows, w)
    want = unpermute_reference(y_perm, lay, w)
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_references_route_every_pair_once():
    g = torch.Generator().manual_seed(2)
    W, L, k, H = 3, 2, 2, 5
    E = W * L
    xs = [torch.randn(T, H, generator=g, dtype=torch.float64) for T in (4, 0, 6)]
    ids = [_ids(x.shape[0], k, E, g) for x in xs]
    ws = [torch.rand(x.shape[0], k, generator=g, dtype=torch.float64) for x in xs]
    rec = ep.dispatch_reference(xs, ids, E)
    assert sum(r.recv_x.shape[0] for r in rec) == sum(x.shape[0] for x in xs) * k
    for d, r in enumerate(rec):
        assert r.counts.sum() == r.recv_x.shape[0]
        for row, (s, t, j) in zip(r.recv_x, r.origin):
            assert ids[s][t, j] // L == d and torch.equal(row, xs[s][t])
    outs = ep.combine_reference([r.recv_x * 2 for r in rec], rec, ids, ws, E)
    for s in range(W):
        assert torch.allclose(outs[s], 2 * ws[s].sum(1, keepdim=True) * xs[s])


def test_placement_is_balanced_and_named():
    pl = ep.Placement(12, 4)
    assert pl.local_experts == 3 and pl.rank_of(7) == 2 and list(pl.experts_of(3)) == [9, 10, 11]
    with pytest.raises(ValueError, match=r"num_experts=10 is not a multiple of the expert-"
                                         r"parallel world 4.*\[1, 2, 5, 10\]"):
        ep.Placement(10, 4)
    assert ep.max_rows_per_source(128, 8, 32) == 1024 and ep.max_rows_per_source(5, 8, 2) == 10


# ---- the cost model --------------------------------------------------------------------------
def test_all_to_all_forms():
    m = cm.Machine.load("h200x8-ib400")
    assert cm.all_to_all(m, 1, 1, 1e6) == 0.0
    one = cm.all_to_all(m, 1, 8, 64e6)
    intra = m.link("intra").time_us(7 / 8 * 64e6, 1)
    assert math.isclose(one, intra)
    # across nodes the NIC's share decides at large sizes
    two = cm.all_to_all(m, 2, 8, 64e6)
    assert two > one
    assert cm.all_to_all(m, 2, 8, 128e6) > two
    with pytest.raises(ValueError, match="nodes must be a positive int"):
        cm.all_to_all(m, 0, 8, 1.0)


def test_ep_predict_modes():
    m = cm.Machine.load("h200")
    ll_ = cm.ep_predict(m, "low_latency", 1, 8, 128, 7168, 8, fp8=True)
    ht_ = cm.ep_predict(m, "high_throughput", 1, 8, 128, 7168, 8)
    assert ll_["dispatch_bytes"] == 128 * 8 * (7168 + 4 * 56)      # e4m3 + scales
    assert ll_["combine_bytes"] == ht_["dispatch_bytes"] == 128 * 8 * 7168 * 2
    assert ht_["dispatch_us"] > cm.EP_HOST_SYNC_US
    # more tokens never cost less
    for mode in cm.EP_MODES:
        a = cm.ep_predict(m, mode, 1, 8, 64, 4096, 8)
        b = cm.ep_predict(m, mode, 1, 8, 1024, 4096, 8)
        assert b["dispatch_us"] > a["dispatch_us"] and b["combine_us"] > a["combine_us"]
    # two levels: a token crosses the network once per node it reaches
    m8 = cm.Machine.load("h200x8-ib400")
    two = cm.ep_predict(m8, "high_throughput", 2, 8, 4096, 7168, 8, num_experts=256,
                        two_level=True)
    flat = cm.ep_predict(m8, "high_throughput", 2, 8, 4096, 7168, 8, two_level=False)
    assert two["how"] == "two_level" and flat["how"] == "flat"
    assert two["dispatch_us"] < flat["dispatch_us"]    # top-8: stage 1 carries a token twice
    auto = cm.ep_predict(m8, "high_throughput", 2, 8, 4096, 7168, 8, num_experts=256)
    assert auto["how"] == "two_level"
    # top-1 gains nothing from two levels (no token reaches two nodes): flat
    assert cm.ep_predict(m8, "high_throughput", 2, 8, 4096, 7168, 1, num_experts=256)["how"] \
        == "flat"
    with pytest.raises(ValueError, match="inside one node"):
        cm.ep_predict(m, "low_latency", 2, 8, 1, 128, 1)
    with pytest.raises(ValueError, match="mode must be one of"):
        cm.ep_predict(m, "fast", 1, 8, 1, 128, 1)


# ---- messages --------------------------------------------------------------------------------
class _FakeSymm:
    def __init__(self, words):
        self._buf = (ctypes.c_uint32 * 16)(*words)
        self._err_host = ctypes.addressof(self._buf)

    def error_code(self):
        return self._buf[0]


def _group(n=2):
    return Group("world", tuple(range(n)), None, torch.device("cpu"))


def test_mismatch_names_both_calls():
    desc_d = (ll.OP_DISPATCH, 2, 1, 7168, 256 | 8 << 16, 1024)
    desc_c = (ll.OP_COMBINE, 2, 1, 7168, 256 | 8 << 16, 1024)
    words = [symmetric.ERR_MISMATCH, 0, 1, 5, ll.OP_DISPATCH, 0, 0, 0] + \
        symmetric.desc_words(desc_d, 5) + symmetric.desc_words(desc_c, 5)
    err = ll.protocol_error(_FakeSymm(words), _group(), (), 3.0)
    assert isinstance(err, CollectiveMismatchError)
    msg = str(err)
    assert "ep dispatch (low-latency kernel) on group world at call #5" in msg
    assert "rank 0 called ep dispatch (low-latency kernel) with hidden 7168, 256 experts, " \
        "top-k 8, 1024 rows per source, FP8 payload" in msg
    assert "rank 1 called ep combine (low-latency kernel)" in msg


def test_timeout_names_the_peer_and_a_lost_one():
    words = [symmetric.ERR_TIMEOUT, 0, 1, 9, ll.OP_COMBINE] + [0] * 11
    err = ll.protocol_error(_FakeSymm(words), _group(), (), 3.0)
    assert isinstance(err, CommunicatorTimeoutError)
    assert "rank 0 waited more than 3 s for rank 1" in str(err)
    # rank 1's process exited: PeerLostError names it
    p = subprocess.Popen(["true"])
    p.wait()
    me = process_identity()
    gone = (me[0], p.pid, None)
    err = ll.protocol_error(_FakeSymm(words), _group(), (me, gone), 3.0)
    assert isinstance(err, PeerLostError) and f"rank 1 is lost: its process (pid {p.pid}" in \
        str(err), str(err)
    assert ll.protocol_error(_FakeSymm([0] * 16), _group(), (), 3.0) is None


def test_status_record_messages():
    rec = object.__new__(ll.StatusRecord)
    buf = (ctypes.c_uint32 * 16)()
    rec.host, rec.group = ctypes.addressof(buf), _group(4)
    # rank 2 saw rank 1 route 40 rows to rank 3's experts; expert 13 got 9 of them
    buf[:12] = [ll.EP_OVERFLOW, 2, 1, 3, 13, 9, 32, 40, 77, 0, 0, ll.OP_DISPATCH]
    err = rec.take(local_experts=4)
    assert isinstance(err, ep.EpCapacityError)
    assert "rank 1 routed 40 rows to rank 3's experts, 32 fit a slot" in str(err)
    assert "expert 13 (local expert 1 of rank 3) got 9 of them" in str(err)
    assert "rows_per_source >= 40" in str(err)
    assert rec.take(4) is None                      # raised once, then cleared
    buf[:12] = [ll.EP_BAD_ID, 1, 1, -1 & 0xFFFFFFFF, 99, 0, 0, 0, 3, 5, 2, ll.OP_DISPATCH]
    err = rec.take(4)
    assert isinstance(err, ep.EpRoutingError) and "expert id 99 of token 5, slot 2 on rank 1" in \
        str(err)


def test_the_kernel_table_names_the_entry_point():
    from fusedist import _ext
    assert _ext.KERNELS["ep_low_latency"].symbol == "ep_dispatch"


if os.environ.get("FUSEDIST_TEST_EP_SHOW"):   # pragma: no cover - a debugging aid
    print(cm.ep_predict(cm.Machine.load("h200"), "low_latency", 1, 8, 128, 7168, 8, fp8=True))
