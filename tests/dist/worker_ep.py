"""fusedist.ep.Buffer checks, run on every rank: the high-throughput path over gloo (CPU) or NCCL
(one GPU per rank), the low-latency kernels on GPUs (also on ranks emulated on one GPU:
tests/ep/test_low_latency.py). Every rank rebuilds every rank's tokens, routing and weights
from the run's seed, so each checks its own results against single-process references:
dispatch bitwise against fusedist.ep.dispatch_reference (pure data movement; FP8: against the
plain-torch quantize / dequantize), combine bitwise against fusedist.ops.moe.unpermute_reference
on the same expert outputs and within the dtype's rounding of the float64 weighted sum.

    torchrun --nproc-per-node 3 tests/dist/worker_ep.py          [EP_TEST_NODES=2: 2 nodes]
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checks import (NEEDS_NCCL, check, emulated, expect_errors, is_emulated, main,  # noqa: E402
                     not_emulated, rank_seed, skip)

import torch  # noqa: E402

import fusedist  # noqa: E402
from fusedist import ep  # noqa: E402
from fusedist.errors import (CollectiveMismatchError, CommunicatorTimeoutError,  # noqa: E402
                             PeerLostError)
from fusedist.ops.moe import sort_by_expert_reference, unpermute_reference  # noqa: E402
from fusedist.ops.quantize_rows import quantize_groups_reference  # noqa: E402

ROUTINGS = ("balanced", "skewed", "zero_expert", "one_rank")


# ---- inputs every rank can rebuild ------------------------------------------------------------
def gen(seed, *parts) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(rank_seed(seed, *parts) % (1 << 62))
    return g


def tokens_of(rank: int, world: int, max_tokens: int, ragged: bool) -> int:
    """Token counts differ by rank; from 3 ranks on, the last has none (it still takes part)."""
    if not ragged:
        return max_tokens
    if world >= 3 and rank == world - 1:
        return 0
    return max(1, max_tokens - rank * (max_tokens // world))


def routing(kind: str, T: int, E: int, L: int, k: int, g: torch.Generator) -> torch.Tensor:
    """ids [T, k] int32, distinct per token, drawn from the scenario's distribution."""
    p = torch.ones(E, dtype=torch.float64)
    if kind == "skewed":
        p = 1.0 / (torch.arange(E, dtype=torch.float64) + 1.0) ** 2
    elif kind == "zero_expert":
        p[E // 2] = 0.0                              # expert E / 2 gets no token at all
    elif kind == "one_rank":
        p[L:] = 0.0                                  # every token to rank 0's experts
    if T == 0:
        return torch.empty(0, k, dtype=torch.int32)
    return torch.multinomial(p.expand(T, E), k, replacement=False, generator=g).to(torch.int32)


def world_inputs(seed, what, W, T_max, H, E, k, dtype, kind, ragged=True, device="cpu"):
    """Every rank's (x, ids, weights)."""
    L = E // W
    out = []
    for s in range(W):
        T = tokens_of(s, W, T_max, ragged)
        g = gen(seed, what, s)
        x = (torch.randn(T, H, generator=g) * 2).to(dtype)
        ids = routing(kind, T, E, L, k, g)
        w = torch.rand(T, k, generator=g, dtype=torch.float32) + 0.25
        out.append((x.to(device), ids.to(device), w.to(device)))
    return out


def expert_fn(rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """A deterministic expert: a scale and a shift that depend on the expert (same bits for
    the same row and expert wherever it runs on one device type)."""
    e = experts.to(torch.float32)[:, None]
    return (rows.float() * (1.0 + (e + 1.0) / 16.0) + (e % 5.0) / 8.0).to(rows.dtype)


def row_experts(buf: ep.Buffer, counts: torch.Tensor, rows: int) -> torch.Tensor:
    """The global expert of each row of recv_x (rows past the received ones: the last local
    expert's). No host synchronization: CUDA graphs capture it."""
    L = buf.local_experts
    cum = torch.cumsum(counts.long(), 0)
    local = torch.searchsorted(cum, torch.arange(rows, device=counts.device), right=True)
    return local.clamp_max(L - 1) + buf.group.rank * L


def recorded(buf) -> str:
    """What the buffer's device records say after the calls so far (a failed wait leaves the
    outputs unwritten: the error names why), for a failure message."""
    if buf.device.type == "cuda":   # this rank's streams only (emulated peers may still wait)
        torch.cuda.current_stream(buf.device).synchronize()
        if buf.stream is not None:
            buf.stream.synchronize()
    try:
        buf.check()
    except Exception as e:  # noqa: BLE001 - reported, not handled
        return f"{type(e).__name__}: {e}"
    return "nothing"


def check_dispatch(buf, recv_x, counts, ref, what, fp8_ref=None):
    n = int(counts.sum())
    assert counts.dtype == torch.int32 and counts.shape == (buf.local_experts,), what
    if not torch.equal(counts.cpu(), ref.counts):
        raise AssertionError(f"{what}: counts {counts.tolist()} vs {ref.counts.tolist()}; "
                             f"the buffer recorded: {recorded(buf)}")
    assert recv_x.shape[0] >= n and recv_x.shape[1] == buf.hidden, what
    want = ref.recv_x if fp8_ref is None else fp8_ref
    got = recv_x[:n].cpu()
    bad = int((got.view(torch.int16 if got.element_size() == 2 else torch.int32) !=
               want.view(torch.int16 if want.element_size() == 2 else torch.int32))
              .any(1).sum()) if n else 0
    assert bad == 0, f"{what}: {bad} of {n} received rows differ from the reference"


def check_combine(buf, out, x, ids, w, y_fn, what, dtype):
    """out bitwise unpermute_reference(expert outputs) and near the float64 weighted sum."""
    T, k = ids.shape
    E = buf.num_experts
    assert out.shape == (T, buf.hidden) and out.dtype == dtype, what
    if T == 0:
        return
    lay = sort_by_expert_reference(ids, E)
    src = lay.src_index.long()
    y_perm = y_fn(x[src // k], ids.reshape(-1)[src].long())
    want = unpermute_reference(y_perm, lay, w)
    diff = int((out != want).sum()) + int(torch.isnan(out).sum())
    assert diff == 0, f"{what}: {diff} elements differ from unpermute_reference (bitwise)"
    # Against float64: the products and the k - 1 sums are rounded in float32 (each at most
    # 2^-24 of the running sum, bounded by sum |w y|), the result once to the dtype (half an
    # ulp: 2^-24 float32, 2^-9 bfloat16; the table's margin doubles it).
    ref = torch.zeros(T, buf.hidden, dtype=torch.float64, device=out.device)
    mag = torch.zeros_like(ref)
    for j in range(k):
        term = w[:, j, None].double() * y_fn(x, ids[:, j].long()).double()
        ref += term
        mag += term.abs()
    half_ulp = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}[dtype]
    bound = 2 * k * 2.0 ** -24 * mag + half_ulp * ref.abs()
    err = (out.double() - ref).abs()
    bad = int((~(err <= bound)).sum())
    assert bad == 0, f"{what}: {bad} elements past the float32-sum / {dtype} rounding bound"


CONFIGS = (  # (hidden, local experts, top_k, max tokens): odd hidden, k > L, k == 1
    (37, 3, 2, 11),
    (64, 1, 1, 5),
    (130, 2, 3, 7),
)


def run_roundtrip(rt, seed, buf, H, E, k, T_max, dtype, kind, mode, tag, fp8=False,
                  previous=None):
    W, me = rt.world_size, buf.group.rank
    dev = buf.device
    inputs = world_inputs(seed, (tag, H, E, k, kind, str(dtype)), W, T_max, H, E, k, dtype,
                          kind)
    x, ids, w = (t.to(dev) for t in inputs[me])
    refs = ep.dispatch_reference([i[0] for i in inputs], [i[1] for i in inputs], E)
    what = f"{tag} {mode} {kind} H={H} E={E} k={k} {dtype}{' fp8' if fp8 else ''}"
    recv_x, counts, handle = buf.dispatch(x, ids, w, mode=mode)
    fp8_ref = None
    if fp8:
        q, s = quantize_groups_reference(refs[me].recv_x)
        fp8_ref = (q.float() * s.repeat_interleave(128, -1)).to(dtype)
        # the e4m3 bound: half an e4m3 step (2^-4 relative; 2^-10 x scale below the normal
        # range), then the bf16 rounding of the dequantized value (2^-8 relative)
        n = refs[me].recv_x.shape[0]
        xr = refs[me].recv_x.float()
        err = (recv_x[:n].cpu().float() - xr).abs()
        bound = (2 ** -4 + 2 ** -8) * xr.abs() + 2 ** -10 * s.repeat_interleave(128, -1)
        assert bool((err <= bound).all()), f"{what}: FP8 error past the e4m3 bound"
    check_dispatch(buf, recv_x, counts, refs[me], what, fp8_ref)
    y = expert_fn(recv_x, row_experts(buf, counts, recv_x.shape[0]))
    out = buf.combine(y, handle)
    if fp8:
        # the experts saw the dequantized tokens: the reference's expert outputs too
        xd = torch.empty_like(x)
        if x.shape[0]:
            q, s = quantize_groups_reference(x.cpu())
            xd = (q.float() * s.repeat_interleave(128, -1)).to(dtype).to(dev)
        check_combine(buf, out, xd, ids, w, expert_fn, what, dtype)
    else:
        check_combine(buf, out, x, ids, w, expert_fn, what, dtype)
    return out


# ---- the high-throughput path (gloo on CPUs, NCCL on GPUs) ------------------------------------
@check
@not_emulated(NEEDS_NCCL)
def high_throughput_matches_references(rt, seed):
    W = rt.world_size
    dtypes = (torch.float32, torch.bfloat16)
    for H, L, k, T_max in CONFIGS:
        E = W * L
        if k > E:
            continue
        for dtype in dtypes:
            # several nodes: both forms (flat, and route by node then within it)
            for two_level in ((False, True) if rt.topology.num_nodes > 1 else (None,)):
                buf = ep.Buffer(None, H, T_max, E, k, dtype, mode="high_throughput",
                                two_level=two_level)
                assert buf.mode == "high_throughput"
                assert buf.ht.two_level == bool(two_level), (buf.ht.two_level, two_level)
                for kind in ROUTINGS:
                    if kind == "one_rank" and k > L:
                        continue
                    run_roundtrip(rt, seed, buf, H, E, k, T_max, dtype, kind, None,
                                  f"ht{'2' if two_level else ''}")
                buf.close()


@check
@not_emulated(NEEDS_NCCL)
def high_throughput_async_and_two_handles(rt, seed):
    """Two dispatches in flight, combined in reverse order; the async forms' events."""
    W = rt.world_size
    H, L, k, T_max, E = 24, 2, 2, 6, 2 * W
    dtype = torch.float32
    buf = ep.Buffer(None, H, T_max, E, k, dtype, mode="high_throughput")
    dev = buf.device
    a = world_inputs(seed, "a", W, T_max, H, E, k, dtype, "balanced")
    b = world_inputs(seed, "b", W, T_max, H, E, k, dtype, "skewed")
    me = buf.group.rank
    xa, ia, wa = (t.to(dev) for t in a[me])
    xb, ib, wb = (t.to(dev) for t in b[me])
    ra, ca, ha, ev = buf.dispatch_async(xa, ia, wa)
    ev.current_stream_wait()
    rb, cb, hb = buf.dispatch(xb, ib, wb)
    yb = expert_fn(rb, row_experts(buf, cb, rb.shape[0]))
    ya = expert_fn(ra, row_experts(buf, ca, ra.shape[0]))
    ob, evb = buf.combine_async(yb, hb)
    evb.current_stream_wait()
    oa = buf.combine(ya, ha)
    check_combine(buf, oa, xa, ia, wa, expert_fn, "async a", dtype)
    check_combine(buf, ob, xb, ib, wb, expert_fn, "async b", dtype)
    buf.close()


@check
@not_emulated(NEEDS_NCCL)
def high_throughput_call_mismatch_named(rt, seed):
    """A rank that dispatches while its peers combine: CollectiveMismatchError on every rank,
    naming the calls, and the buffer goes on working (the exchange is consistent)."""
    W = rt.world_size
    H, L, k, T_max, E = 16, 1, 1, 4, W
    buf = ep.Buffer(None, H, T_max, E, k, torch.float32, mode="high_throughput")
    if buf.device.type == "cuda" and buf.ll is not None:
        buf.close()
        skip("on GPUs with symmetric memory the call check reports it (low-latency checks)")
    dev = buf.device
    x, ids, w = (t.to(dev) for t in world_inputs(seed, "mm", W, T_max, H, E, k, torch.float32,
                                                   "balanced", ragged=False)[buf.group.rank])
    recv_x, counts, h = buf.dispatch(x, ids, w)
    y = expert_fn(recv_x, row_experts(buf, counts, recv_x.shape[0]))
    try:
        if buf.group.rank == 0:
            buf.dispatch(x, ids, w)
        else:
            buf.combine(y, h)
    except CollectiveMismatchError as e:
        assert "op: rank 0: high-throughput dispatch" in str(e) and \
            "rank 1: high-throughput combine" in str(e), str(e)
    else:
        raise AssertionError("no CollectiveMismatchError")
    out = buf.combine(y, h)      # the same call everywhere now: it works
    check_combine(buf, out, x, ids, w, expert_fn, "after the mismatch", torch.float32)
    buf.close()


# ---- checks of every path -------------------------------------------------------------------
@check
@emulated
def buffer_sizes_checked_across_ranks(rt, seed):
    """Ranks that disagree on sizes get CollectiveMismatchError naming the field and every
    rank's value, before anything is allocated."""
    W = rt.world_size
    me = rt.rank
    for field, kw in (("hidden", dict(hidden=8 + 8 * (me % 2))),
                      ("num_experts", dict(num_experts=W * (1 + me % 2))),
                      ("rows_per_source", dict(rows_per_source=4 + me % 2))):
        args = dict(hidden=8, max_tokens_per_rank=4, num_experts=W, top_k=1)
        args.update(kw)
        try:
            ep.Buffer(None, args["hidden"], args["max_tokens_per_rank"], args["num_experts"],
                      args["top_k"], torch.bfloat16, rows_per_source=args.get("rows_per_source"))
        except CollectiveMismatchError as e:
            msg = str(e)
            assert f"{field}: rank" in msg and ("rank 1: " in msg or "ranks 1, " in msg), msg
        else:
            raise AssertionError(f"no CollectiveMismatchError for {field}")


@check
@emulated
def bad_arguments_are_named(rt, seed):
    W = rt.world_size
    dtype = torch.bfloat16
    buf = ep.Buffer(None, 16, 4, 2 * W, 2, dtype)
    dev = buf.device
    x = torch.zeros(3, 16, dtype=dtype, device=dev)
    ids = torch.zeros(3, 2, dtype=torch.int32, device=dev)
    ids[:, 1] = 1
    w = torch.ones(3, 2, device=dev)
    bad_ids = ids.clone()
    bad_ids[1, 0] = 2 * W
    other = ep.Buffer(None, 16, 4, 2 * W, 2, dtype)
    _, _, h_other = other.dispatch(x, ids, w)
    expect_errors((
        (lambda: buf.dispatch(x.float(), ids, w), "x has dtype torch.float32"),
        (lambda: buf.dispatch(x[:, :15], ids, w), "x has shape (3, 15), expected [?, 16]"),
        (lambda: buf.dispatch(torch.zeros(5, 16, dtype=dtype, device=dev), ids[:1].expand(5, 2),
                              w[:1].expand(5, 2)), "more than max_tokens_per_rank=4"),
        (lambda: buf.dispatch(x, ids[:, :1], w), "topk_ids has shape (3, 1), expected [3, 2]"),
        (lambda: buf.dispatch(x, ids.float(), w), "topk_ids has dtype torch.float32"),
        (lambda: buf.dispatch(x, ids, w.double()), "topk_weights has dtype torch.float64"),
        (lambda: buf.dispatch(x, bad_ids, w), f"expert ids in [0, {2 * W}), got values in "
                                              f"[0, {2 * W}]"),
        (lambda: buf.dispatch(x, ids, w, mode="fast"), "mode must be one of"),
        (lambda: buf.combine(torch.zeros(1, 16, dtype=dtype, device=dev), h_other),
         "handle must be the DispatchHandle a dispatch of this Buffer returned"),
        (lambda: ep.Buffer(None, 16, 4, 2 * W + 1, 2, dtype), "is not a multiple of the "
                                                              "expert-parallel world"),
        (lambda: ep.Buffer(None, 16, 4, 2 * W, 2 * W + 1, dtype), "exceeds num_experts"),
        (lambda: ep.Buffer(None, 0, 4, 2 * W, 2, dtype), "hidden must be a positive int"),
        (lambda: ep.Buffer(None, 16, 4, 2 * W, 2, torch.int32), "dtype must be one of"),
    ), errors=(ValueError, TypeError))
    recv_x, counts, h = buf.dispatch(x, ids, w)
    expect_errors(((lambda: buf.combine(torch.zeros(h.rows + 1, 16, dtype=dtype, device=dev), h),
                    f"y has shape ({h.rows + 1}, 16), expected [{h.rows}, 16]"),))
    buf.combine(recv_x, h)
    other.combine(torch.zeros(h_other.rows, 16, dtype=dtype, device=dev), h_other)
    buf.close()
    other.close()


@check
@emulated
def auto_follows_the_cost_model(rt, seed):
    W = rt.world_size
    buf = ep.Buffer(None, 16, 4, 2 * W, 2, torch.bfloat16)
    ok = [m for m in ("low_latency", "high_throughput") if not buf.why_not[m]]
    assert ok and buf.mode in ok, (buf.mode, buf.why_not)
    t = {m: buf.predict(m)["dispatch_us"] + buf.predict(m)["combine_us"] for m in ok}
    assert buf.mode == min(t, key=t.get), (buf.mode, t)
    if rt.device.type == "cpu":
        assert buf.mode == "high_throughput" and "CPU" in buf.why_not["low_latency"]
    buf.close()


# ---- the low-latency kernels (GPUs; ranks emulated on one GPU too) ---------------------------
def needs_low_latency(rt, buf):
    if buf.ll is None:
        why = buf.why_not["low_latency"]
        buf.close()
        skip(f"no low-latency path: {why}")


LL_CONFIGS = (  # (hidden, local experts, top_k, max tokens, fp8)
    (264, 3, 2, 9, False),       # hidden = 8 x 33: not a multiple of 64 or 128
    (2056, 1, 1, 5, False),
    (128, 2, 4, 7, False),       # k > local experts
    (384, 2, 3, 13, True),       # FP8 payload: 3 groups of 128
    (7168, 4, 8, 16, True),      # DeepSeek-V3's hidden and top-k
)


@check
@emulated
def low_latency_matches_references(rt, seed):
    if rt.device.type != "cuda":
        skip("the low-latency kernels need a GPU")
    W = rt.world_size
    for H, L, k, T_max, fp8 in LL_CONFIGS:
        E = W * L
        if k > E:
            continue
        buf = ep.Buffer(None, H, T_max, E, k, torch.bfloat16, fp8=fp8, mode="low_latency")
        needs_low_latency(rt, buf)
        for rep, kind in enumerate(ROUTINGS):
            if kind == "one_rank" and k > L:
                continue
            run_roundtrip(rt, seed, buf, H, E, k, T_max, torch.bfloat16, kind, "low_latency",
                          f"ll{rep}", fp8=fp8)
        torch.cuda.current_stream().synchronize()
        buf.check()
        buf.close()


@check
@emulated
def low_latency_async_overlap(rt, seed):
    """dispatch_async / combine_async: the exchange on the buffer's stream, the caller's
    stream free meanwhile; two dispatches in flight."""
    if rt.device.type != "cuda":
        skip("the low-latency kernels need a GPU")
    W = rt.world_size
    H, L, k, T_max = 256, 2, 2, 8
    E = W * L
    dtype = torch.bfloat16
    buf = ep.Buffer(None, H, T_max, E, k, dtype, mode="low_latency")
    needs_low_latency(rt, buf)
    dev, me = buf.device, buf.group.rank
    a = world_inputs(seed, "la", W, T_max, H, E, k, dtype, "balanced")
    b = world_inputs(seed, "lb", W, T_max, H, E, k, dtype, "skewed")
    xa, ia, wa = (t.to(dev) for t in a[me])
    xb, ib, wb = (t.to(dev) for t in b[me])
    ra, ca, ha, eva = buf.dispatch_async(xa, ia, wa)
    rb, cb, hb, evb = buf.dispatch_async(xb, ib, wb, previous_event=eva)
    eva.current_stream_wait()
    ya = expert_fn(ra, row_experts(buf, ca, ra.shape[0]))
    evb.current_stream_wait()
    yb = expert_fn(rb, row_experts(buf, cb, rb.shape[0]))
    oa, ev = buf.combine_async(ya, ha)
    ob, ev2 = buf.combine_async(yb, hb, previous_event=ev)
    ev2.current_stream_wait()
    check_combine(buf, oa, xa, ia, wa, expert_fn, "ll async a", dtype)
    check_combine(buf, ob, xb, ib, wb, expert_fn, "ll async b", dtype)
    buf.check()
    buf.close()


def _synchronize_rank(rt):
    if is_emulated(rt):
        from fusedist.testing.emulated import synchronize_rank
        synchronize_rank(rt.device)
    else:
        torch.cuda.synchronize()


@check
@emulated
def low_latency_graph_replays_new_routings(rt, seed):
    """dispatch -> experts -> combine captured once, replayed with new tokens, routings
    (balanced, skewed, one expert empty, all to one rank) and weights; each replay bitwise
    against the references. An expert id out of range inside the graph is recorded on the
    device and raised by check() (EpRoutingError); the buffer then goes on."""
    if rt.device.type != "cuda":
        skip("the low-latency kernels need a GPU")
    W = rt.world_size
    H, L, k, T = 520, 2, 2, 6
    E = W * L
    dtype = torch.bfloat16
    buf = ep.Buffer(None, H, T, E, k, dtype, fp8=False, mode="low_latency")
    needs_low_latency(rt, buf)
    dev, me = buf.device, buf.group.rank
    sx = torch.zeros(T, H, dtype=dtype, device=dev)
    sids = torch.zeros(T, k, dtype=torch.int32, device=dev)
    sids[:, 1] = 1
    sw = torch.ones(T, k, device=dev)
    holder = {}

    def step():
        recv_x, counts, h = buf.dispatch(sx, sids, sw)
        y = expert_fn(recv_x, row_experts(buf, counts, recv_x.shape[0]))
        holder["recv"], holder["counts"] = recv_x, counts
        holder["out"] = buf.combine(y, h)

    step()                                   # lazy init outside the capture
    _synchronize_rank(rt)
    rt.world.barrier()
    graph = torch.cuda.CUDAGraph()
    # Each rank captures on a stream of its own, in thread-local mode: ranks emulated as
    # threads capture at the same time.
    with torch.cuda.graph(graph, stream=torch.cuda.Stream(dev), capture_error_mode="thread_local"):
        step()
    rt.world.barrier()
    for rep, kind in enumerate(ROUTINGS * 2):
        inputs = world_inputs(seed, ("graph", rep), W, T, H, E, k, dtype, kind, ragged=False)
        x, ids, w = (t.to(dev) for t in inputs[me])
        sx.copy_(x)
        sids.copy_(ids)
        sw.copy_(w)
        graph.replay()
        torch.cuda.current_stream().synchronize()
        refs = ep.dispatch_reference([i[0] for i in inputs], [i[1] for i in inputs], E)
        what = f"replay {rep} ({kind})"
        check_dispatch(buf, holder["recv"], holder["counts"], refs[me], what)
        check_combine(buf, holder["out"], x, ids, w, expert_fn, what, dtype)
        buf.check()
    # an expert id out of range: only the device sees it inside the graph
    if me == 0:
        sids[0, 0] = E + 3
    graph.replay()
    torch.cuda.current_stream().synchronize()
    rt.world.barrier()
    if me == 0:
        try:
            buf.check()
        except ep.EpRoutingError as e:
            assert f"expert id {E + 3} of token 0, slot 0" in str(e), str(e)
        else:
            raise AssertionError("no EpRoutingError for an id out of range")
    buf.check()                              # raised once, then cleared
    buf.close()


@check
@emulated
def low_latency_overflow_names_expert_and_count(rt, seed):
    """A slot smaller than a routing needs: EpCapacityError naming the expert and the count
    on the sender and the receiver; the buffer goes on with routings that fit."""
    if rt.device.type != "cuda":
        skip("the low-latency kernels need a GPU")
    W = rt.world_size
    H, L, k, T = 64, 2, 2, 8
    E = W * L
    dtype = torch.bfloat16
    buf = ep.Buffer(None, H, T, E, k, dtype, mode="low_latency", rows_per_source=5)
    needs_low_latency(rt, buf)
    dev, me = buf.device, buf.group.rank
    x = torch.randn(T, H, device=dev).to(dtype)
    ids = torch.tensor([[0, 1]] * T, dtype=torch.int32, device=dev)   # 16 rows to rank 0
    w = torch.ones(T, k, device=dev)
    buf.dispatch(x, ids, w)
    torch.cuda.current_stream().synchronize()
    rt.world.barrier()
    try:
        buf.check()
    except ep.EpCapacityError as e:
        msg = str(e)
        assert f"routed {2 * T} rows to rank 0's experts, 5 fit a slot" in msg, msg
        assert "expert 0 (local expert 0 of rank 0) got 8 of them" in msg, msg
    else:   # every rank sends 16 rows to rank 0: every rank records it
        raise AssertionError(f"rank {me}: no EpCapacityError")
    run_roundtrip(rt, seed, buf, H, E, k, 2, dtype, "balanced", "low_latency", "after")
    buf.check()
    buf.close()


@check
@emulated
def low_latency_call_mismatch_named(rt, seed):
    """Rank 0 dispatches while its peers combine: the kernels' call descriptors differ, every
    rank's check() raises CollectiveMismatchError naming both calls, well within the timeout;
    the buffer is unusable afterwards."""
    if rt.device.type != "cuda":
        skip("the low-latency kernels need a GPU")
    W = rt.world_size
    H, L, k, T = 64, 1, 1, 4
    E = W * L
    dtype = torch.bfloat16
    buf = ep.Buffer(None, H, T, E, k, dtype, mode="low_latency", timeout_s=20.0)
    needs_low_latency(rt, buf)
    dev, me = buf.device, buf.group.rank
    x = torch.randn(T, H, device=dev).to(dtype)
    ids = torch.zeros(T, k, dtype=torch.int32, device=dev)
    w = torch.ones(T, k, device=dev)
    recv_x, counts, h = buf.dispatch(x, ids, w)
    _synchronize_rank(rt)
    rt.world.barrier()
    t0 = time.time()
    if me == 0:
        buf.dispatch(x, ids, w)
    else:
        buf.combine(recv_x, h)
    err = None
    while err is None:
        try:
            buf.check()
        except CollectiveMismatchError as e:
            err = e
        if time.time() - t0 > 15:
            raise AssertionError("no CollectiveMismatchError within 15 s")
        time.sleep(0.005)
    msg = str(err)
    assert "ranks made different calls" in msg and "ep dispatch (low-latency kernel)" in msg \
        and "ep combine (low-latency kernel)" in msg, msg
    _synchronize_rank(rt)
    try:
        buf.dispatch(x, ids, w)
    except CollectiveMismatchError:
        pass
    else:
        raise AssertionError("the buffer still ran after a mismatch")
    buf.close()


@check
@emulated
def zz_low_latency_peer_skips_call_times_out(rt, seed):
    """The last rank skips a dispatch: the others' kernels give up after the timeout and
    check() raises CommunicatorTimeoutError naming the wait (bounded time)."""
    if rt.device.type != "cuda":
        skip("the low-latency kernels need a GPU")
    W = rt.world_size
    H, L, k, T = 64, 1, 1, 4
    timeout = 3.0
    buf = ep.Buffer(None, H, T, W * L, k, torch.bfloat16, mode="low_latency", timeout_s=timeout)
    needs_low_latency(rt, buf)
    dev, me = buf.device, buf.group.rank
    x = torch.randn(T, H, device=dev).to(torch.bfloat16)
    ids = torch.zeros(T, k, dtype=torch.int32, device=dev)
    w = torch.ones(T, k, device=dev)
    buf.dispatch(x, ids, w)
    _synchronize_rank(rt)
    rt.world.barrier()
    if me != W - 1:
        t0 = time.time()
        buf.dispatch(x, ids, w)
        torch.cuda.current_stream().synchronize()
        waited = time.time() - t0
        try:
            buf.check()
        except (CommunicatorTimeoutError, PeerLostError) as e:
            assert f"waited more than {timeout:g} s for rank {W - 1}" in str(e), str(e)
        else:
            raise AssertionError("no CommunicatorTimeoutError after a peer skipped the call")
        assert waited < 5 * timeout + 10, f"took {waited:.1f}s to give up"
    rt.world.barrier()
    buf.close()


if __name__ == "__main__":
    if int(os.environ.get("EP_TEST_NODES", "1")) > 1:
        from _runtime_util import emulate_nodes
        emulate_nodes()
    main()
