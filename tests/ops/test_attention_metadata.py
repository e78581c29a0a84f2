"""Paged metadata out of range never reaches memory: a page id outside the cache, a length
longer than its block-table row (or negative), a slot past the cache, a position outside the
RoPE table. CPU tensors raise MetadataError at once, before anything is written; the CUDA
kernels (decode, rope_append) and the CUDA paths of prefill / the decode fallback record the
first bad value in the device's error record, read nothing outside the tensors, and poison the
affected rows with NaN; fusedist.check_device_errors() (and the next eager call) raises naming
the op, the row and the value. The GPU cases run eagerly and in CUDA graphs; run them under
compute-sanitizer memcheck to see that no access leaves the tensors."""

from __future__ import annotations

import pytest
import torch

import fusedist
from fusedist.errors import MetadataError
from fusedist.ops import attention as A

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
Hq, Hkv, D, PS = 8, 2, 128, 16


def _cache(device, pages=12, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(3)
    kc = torch.randn((pages, PS, Hkv, D), generator=g).to(device=device, dtype=dtype)
    vc = torch.randn((pages, PS, Hkv, D), generator=g).to(device=device, dtype=dtype)
    return kc, vc


def _decode_inputs(device, batch=3, cols=4, lens=(20, 33, 64), dtype=torch.bfloat16):
    kc, vc = _cache(device, dtype=dtype)
    q = torch.randn((batch, Hq, D), generator=torch.Generator().manual_seed(5)).to(device, dtype)
    bt = torch.arange(batch * cols, dtype=torch.int32).view(batch, cols).remainder(12)
    return q, kc, vc, bt.to(device), torch.tensor(lens, dtype=torch.int32, device=device)


@pytest.fixture
def clean_record():
    if torch.cuda.is_available():
        fusedist.clear_device_errors("all")
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        fusedist.clear_device_errors("all")


# ---- CPU: raise at once, name the row and the value ------------------------------------------
@pytest.mark.parametrize("page", [12, 1000, -1])
def test_decode_cpu_rejects_a_page_outside_the_cache(page):
    q, kc, vc, bt, lens = _decode_inputs("cpu")
    bt[1, 2] = page                     # row 1 reads columns 0..2 (33 tokens)
    with pytest.raises(MetadataError, match=rf"sequence 1 reads block_table\[1, 2\] = {page}, "
                                            r"outside the cache's 12 pages"):
        A.decode(q, kc, vc, bt, lens)


def test_decode_cpu_ignores_unread_columns():
    q, kc, vc, bt, lens = _decode_inputs("cpu")
    bt[0, 3] = 10_000                   # row 0 has 20 tokens: columns 0..1 only
    out = A.decode(q, kc, vc, bt, lens)
    assert torch.isfinite(out.float()).all()


@pytest.mark.parametrize("n", [65, -1])
def test_decode_cpu_rejects_a_length_outside_the_row(n):
    q, kc, vc, bt, lens = _decode_inputs("cpu")
    lens[2] = n                         # 4 columns x 16 = 64 tokens at most
    with pytest.raises(MetadataError, match=rf"seq_lens\[2\] = {n} is outside \[0, 64\]"):
        A.decode(q, kc, vc, bt, lens)


def _prefill_inputs(device, n=5, L=40, dtype=torch.bfloat16):
    kc, vc = _cache(device, dtype=dtype)
    q = torch.randn((n, Hq, D)).to(device, dtype)
    bt = torch.tensor([[3, 7, 1, 0]], dtype=torch.int32, device=device)
    lens = torch.tensor([L], dtype=torch.int32, device=device)
    cu = torch.tensor([0, n], dtype=torch.int32, device=device)
    return q, kc, vc, bt, lens, cu


@pytest.mark.parametrize("page", [-1, 12])
def test_prefill_cpu_rejects_a_page_outside_the_cache(page):
    q, kc, vc, bt, lens, cu = _prefill_inputs("cpu")
    bt[0, 1] = page                     # -1 used to wrap to the last page
    with pytest.raises(MetadataError, match=rf"block_table\[0, 1\] = {page}"):
        A.prefill(q, kc, vc, bt, lens, cu)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["one run", "out=", "two runs", "fresh", "fp8 cache"])
def test_prefill_sdpa_path_poisons_the_bad_rows(case, device):
    """The SDPA path's poisoning of the rows a plan's device check marked bad (the check
    kernel's mask on CUDA; the same mask stood in for here, on CPU tensors too): those
    sequences' rows are NaN, the others bit for bit the unpoisoned result, whether the output
    is SDPA's own (one run), the caller's out=, assembled from several runs, read from fresh
    K/V, or rounded from the fp32 SDPA of an FP8 cache."""
    fp8 = case == "fp8 cache"
    kc, vc = _cache(device, pages=16)
    kw = {}
    if fp8:
        kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
        kw = dict(k_scale=torch.rand(16, PS, Hkv, device=device) + 0.5,
                  v_scale=torch.rand(16, PS, Hkv, device=device) + 0.5)
    g = torch.Generator().manual_seed(8)
    if case == "two runs":
        ns, Ls = [3, 3, 5], [20, 20, 36]     # runs: sequences 0-1 (3 / 20), sequence 2 (5 / 36)
    elif case == "fresh":
        ns, Ls = [6, 6], [6, 6]
    else:
        ns, Ls = [4, 4], [30, 30]
    T = sum(ns)
    q = torch.randn((T, Hq, D), generator=g).to(device, torch.bfloat16)
    bt = torch.arange(len(ns) * 4, dtype=torch.int32, device=device).view(len(ns), 4)
    lens = torch.tensor(Ls, dtype=torch.int32, device=device)
    cu = torch.tensor([0] + torch.tensor(ns).cumsum(0).tolist(), dtype=torch.int32,
                      device=device)
    if case == "fresh":
        kw = dict(k_new=torch.randn((T, Hkv, D), generator=g).to(device, torch.bfloat16),
                  v_new=torch.randn((T, Hkv, D), generator=g).to(device, torch.bfloat16))

    def run(bad_rows, out=None):
        plan = A.prefill_plan(bt, lens, cu, tokens=T, page_size=PS, num_pages=16,
                              seq_lens_host=Ls, cu_seqlens_q_host=cu.tolist())
        plan.bad = None if bad_rows is None else torch.tensor(bad_rows, device=device)
        return A.prefill(q, kc, vc, bt, lens, cu, plan=plan, backend="sdpa", out=out, **kw)

    clean = run(None).clone()
    bad = [False] * len(ns)
    bad[-1] = True
    out = torch.zeros_like(q) if case == "out=" else None
    got = run(bad, out)
    if out is not None:
        assert got is out
    last = int(cu[-2])
    assert torch.isnan(got[last:].float()).all()
    assert torch.equal(got[:last], clean[:last])
    if device == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_poison_rows_marks_only_the_bad_sequences(device, dtype):
    """paged.poison_rows: the bad sequences' rows all NaN, every other element untouched
    (bit for bit), for rows laid out contiguously (the kernel on CUDA), inside a wider buffer
    (a token stride past the row) and not contiguous (the masked-fill fallback)."""
    from fusedist.ops.attention import paged
    g = torch.Generator().manual_seed(3)
    seqs, tokens, H, Dh = 5, 3, 4, 6
    bad = torch.tensor([False, True, False, False, True], device=device)
    wide = torch.randn((seqs * tokens, H, Dh + 2), generator=g).to(device, dtype)
    for out in (torch.randn((seqs * tokens, H, Dh), generator=g).to(device, dtype),
                wide[:, :, :Dh],                                  # rows not contiguous
                torch.randn((seqs * tokens, H * Dh + 8), generator=g).to(device, dtype)[:, :H * Dh]):
        before = out.clone()
        paged.poison_rows(out, bad, tokens)
        rows = bad.cpu().repeat_interleave(tokens)
        assert torch.isnan(out[rows.to(device)].float()).all()
        assert torch.equal(out[(~rows).to(device)], before[(~rows).to(device)])
    paged.poison_rows(out[:0], bad[:0], tokens)                   # nothing to do
    with pytest.raises(ValueError, match="not 5 sequences x 2"):
        paged.poison_rows(out, bad, 2)
    if device == "cuda":
        torch.cuda.synchronize()


def _rope_inputs(device, T=6, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(11)
    q = torch.randn((T, Hq, D), generator=g).to(device, dtype)
    k = torch.randn((T, Hkv, D), generator=g).to(device, dtype)
    v = torch.randn((T, Hkv, D), generator=g).to(device, dtype)
    cos_sin = A.rope_cos_sin(D, 64, device=device)
    kc, vc = _cache(device, dtype=dtype)
    pos = torch.arange(T, dtype=torch.int64, device=device) + 3
    slots = torch.arange(T, dtype=torch.int64, device=device) * 5
    return q, k, v, pos, cos_sin, kc, vc, slots


@pytest.mark.parametrize("what, value, match", [
    ("pos", -1, r"positions\[2\] = -1 is outside the RoPE table's \[0, 64\)"),
    ("pos", 64, r"positions\[2\] = 64 is outside"),
    ("slot", 12 * PS, r"slot_mapping\[2\] = 192 is outside the cache's 192 slots"),
])
def test_rope_append_cpu_rejects_before_writing(what, value, match):
    q, k, v, pos, cos_sin, kc, vc, slots = _rope_inputs("cpu")
    (pos if what == "pos" else slots)[2] = value
    before = [t.clone() for t in (q, k, kc, vc)]
    with pytest.raises(MetadataError, match=match):
        A.rope_append(q, k, v, pos, cos_sin, kc, vc, slots)
    for t, b in zip((q, k, kc, vc), before):   # validated before anything was mutated
        assert torch.equal(t, b)


def test_rope_append_negative_slot_is_padding():
    q, k, v, pos, cos_sin, kc, vc, slots = _rope_inputs("cpu")
    slots[1] = -1
    A.rope_append(q, k, v, pos, cos_sin, kc, vc, slots)   # no error: the token is skipped


def test_check_device_errors_is_a_no_op_without_a_record():
    fusedist.check_device_errors()
    fusedist.clear_device_errors()


def test_check_device_errors_reads_a_record_in_place(monkeypatch):
    """The host side of the record, on the CPU: a record in host memory stands in for the
    host-mapped one a kernel writes; check_device_errors reads it where it lies (raising with
    the kernel's description), clear_device_errors resets it."""
    import ctypes

    from fusedist.ops import device_errors as DE
    rec = DE._Record()
    monkeypatch.setattr(DE, "_records", {0: (ctypes.addressof(rec), 0)})
    monkeypatch.setattr(DE, "_views", {0: DE._Record.from_address(ctypes.addressof(rec))})
    fusedist.check_device_errors("cuda:0")                # state 0: nothing recorded
    rec.state, rec.op, rec.what, rec.row, rec.value, rec.limit = 1, 3, 2, 5, 900, 64
    with pytest.raises(MetadataError, match=r"fusedist.prefill: seq_lens\[5\] = 900 is outside "
                                            r"\[0, 64\]"):
        fusedist.check_device_errors("cuda:0")
    with pytest.raises(MetadataError):
        fusedist.check_device_errors("all")
    fusedist.clear_device_errors("cuda:0")
    assert rec.state == 0
    fusedist.check_device_errors("cuda:0")


# ---- GPU: record, poison, never leave the tensors --------------------------------------------
def _expect_recorded(match):
    torch.cuda.synchronize()
    with pytest.raises(MetadataError, match=match):
        fusedist.check_device_errors()
    fusedist.clear_device_errors()
    fusedist.check_device_errors()     # cleared


@pytest.mark.gpu
@pytest.mark.parametrize("batch, cols, lens", [
    (3, 4, (20, 33, 64)),                 # several splits per row (merge path)
    (48, 64, tuple(range(17, 65))),       # batch that takes one split (direct path)
])
@pytest.mark.parametrize("bad", ["page", "neg_page", "len", "neg_len"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_decode_kernel_poisons_and_records(batch, cols, lens, bad, graph, clean_record):
    q, kc, vc, bt, seq = _decode_inputs("cuda", batch, cols, lens)
    plan = A.decode_plan(batch, Hq, Hkv, D, PS, cols * PS, "cuda", torch.bfloat16)
    assert plan.backend == "kernel"
    ref = A.decode(q, kc, vc, bt, seq, plan).clone()
    r = 1
    if bad == "page":
        bt[r, 1] = 12
        match = r"sequence 1 reads block_table\[1, 1\] = 12"
    elif bad == "neg_page":
        bt[r, 0] = -7
        match = r"sequence 1 reads block_table\[1, 0\] = -7"
    elif bad == "len":
        seq[r] = cols * PS + 1
        match = rf"seq_lens\[1\] = {cols * PS + 1} is outside \[0, {cols * PS}\]"
    else:
        seq[r] = -3
        match = r"seq_lens\[1\] = -3 is outside"
    out = torch.full_like(q, 7.0)
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            A.decode(q, kc, vc, bt, seq, plan, out=out)
        g.replay()
    else:
        A.decode(q, kc, vc, bt, seq, plan, out=out)
    torch.cuda.synchronize()
    assert torch.isnan(out[r].float()).all(), "the bad row is not poisoned"
    others = [b for b in range(batch) if b != r]
    assert torch.equal(out[others], ref[others]), "rows with good metadata changed"
    _expect_recorded(match)
    plan.close()


@pytest.mark.gpu
def test_decode_next_eager_call_raises_the_recorded_error(clean_record):
    q, kc, vc, bt, seq = _decode_inputs("cuda")
    plan = A.decode_plan(3, Hq, Hkv, D, PS, 64, "cuda", torch.bfloat16)
    bt[2, 0] = 99
    A.decode(q, kc, vc, bt, seq, plan)
    torch.cuda.synchronize()
    bt[2, 0] = 0
    with pytest.raises(MetadataError, match=r"block_table\[2, 0\] = 99"):
        A.decode(q, kc, vc, bt, seq, plan)
    fusedist.clear_device_errors()
    assert torch.isfinite(A.decode(q, kc, vc, bt, seq, plan).float()).all()
    plan.close()


@pytest.mark.gpu
@pytest.mark.parametrize("bad", ["slot", "pos_neg", "pos_high"])
@pytest.mark.parametrize("cache_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_rope_append_kernel_poisons_and_records(bad, cache_dtype, graph, clean_record):
    q, k, v, pos, cos_sin, kc, vc, slots = _rope_inputs("cuda")
    ks = vs = None
    if cache_dtype == "fp8":
        kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
        ks = torch.ones(kc.shape[:3], device="cuda")
        vs = torch.ones_like(ks)
    t = 2
    if bad == "slot":
        slots[t] = kc.shape[0] * PS + 3
        match = r"slot_mapping\[2\] = 195 is outside the cache's 192 slots"
    elif bad == "pos_neg":
        pos[t] = -5
        match = r"positions\[2\] = -5 is outside the RoPE table's \[0, 64\)"
    else:
        pos[t] = 1 << 40
        match = rf"positions\[2\] = {1 << 40} is outside"
    kc0, vc0 = kc.clone(), vc.clone()
    q_in, k_in = q.clone(), k.clone()
    if graph:   # the record exists (an eager call made it); the captured kernel records too
        A.rope_append(q.clone(), k.clone(), v, pos.clamp(0, 63), cos_sin, kc.clone(), vc.clone(),
                      slots.clamp(max=0), k_scale=None if ks is None else ks.clone(),
                      v_scale=None if vs is None else vs.clone())
        torch.cuda.synchronize()
        fusedist.check_device_errors()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            A.rope_append(q, k, v, pos, cos_sin, kc, vc, slots, k_scale=ks, v_scale=vs)
        g.replay()
    else:
        A.rope_append(q, k, v, pos, cos_sin, kc, vc, slots, k_scale=ks, v_scale=vs)
    torch.cuda.synchronize()
    assert torch.isnan(q[t].float()).all() and torch.isnan(k[t].float()).all()
    good = [i for i in range(q.shape[0]) if i != t]
    ref_q, ref_k = q_in.clone(), k_in.clone()
    A.rope_append_reference(ref_q, ref_k, v.clone(), pos.clamp(0, 63), cos_sin, kc0.clone(),
                            vc0.clone(), slots.clamp(max=kc.shape[0] * PS - 1),
                            k_scale=None if ks is None else ks.clone(),
                            v_scale=None if vs is None else vs.clone())
    assert torch.equal(q[good], ref_q[good]) and torch.equal(k[good], ref_k[good])
    flat_k, flat_k0 = kc.view(-1, Hkv, D), kc0.view(-1, Hkv, D)
    written = set(slots[good].tolist())
    untouched = [s for s in range(flat_k.shape[0]) if s not in written and
                 not (bad != "slot" and s == int(slots[t]))]
    assert torch.equal(flat_k[untouched].view(torch.uint8), flat_k0[untouched].view(torch.uint8))
    if bad != "slot":   # a bad position with a valid slot writes a NaN row there
        assert torch.isnan(flat_k[int(slots[t])].float()).all()
    _expect_recorded(match)


@pytest.mark.gpu
@pytest.mark.parametrize("page", [-1, 12, 1 << 30])
def test_prefill_cuda_poisons_and_records(page, clean_record):
    q, kc, vc, bt, lens, cu = _prefill_inputs("cuda")
    bt[0, 2] = page
    out = A.prefill(q, kc, vc, bt, lens, cu, seq_lens_host=[40], cu_seqlens_q_host=[0, 5])
    torch.cuda.synchronize()
    assert torch.isnan(out.float()).all()
    _expect_recorded(rf"fusedist.prefill: sequence 0 reads block_table\[0, 2\] = {page}")


@pytest.mark.gpu
@pytest.mark.parametrize("bad", ["page", "len", "span"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_prefill_paged_kernel_poisons_and_records(bad, graph, clean_record):
    """The paged kernel, lengths only on the device: sequence 1's rows are NaN, sequence 0's
    are unchanged, the record names the row and the value."""
    from conftest import require_kernel
    require_kernel("attention_prefill")
    kc, vc = _cache("cuda")
    q = torch.randn((9, Hq, D), generator=torch.Generator().manual_seed(2)).to("cuda",
                                                                              torch.bfloat16)
    bt = torch.tensor([[3, 7, 1, 0], [5, 6, 2, 4]], dtype=torch.int32, device="cuda")
    lens = torch.tensor([40, 50], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, 5, 9], dtype=torch.int32, device="cuda")
    ref = A.prefill(q, kc, vc, bt, lens, cu, backend="paged").clone()
    torch.cuda.synchronize()
    if bad == "page":
        bt[1, 3] = 12
        match = r"fusedist.prefill: sequence 1 reads block_table\[1, 3\] = 12"
    elif bad == "len":
        lens[1] = 65
        match = r"fusedist.prefill: seq_lens\[1\] = 65 is outside \[0, 64\]"
    else:
        lens[1] = 3
        match = r"fusedist.prefill: sequence 1 has 4 new tokens"
    out = torch.full_like(q, 7.0)
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            A.prefill(q, kc, vc, bt, lens, cu, out=out, backend="paged")
        g.replay()
    else:
        A.prefill(q, kc, vc, bt, lens, cu, out=out, backend="paged")
    torch.cuda.synchronize()
    assert torch.isnan(out[5:].float()).all(), "the bad sequence's rows are not poisoned"
    assert torch.equal(out[:5], ref[:5]), "rows with good metadata changed"
    _expect_recorded(match)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_decode_reference_path_on_cuda_checks_too(clean_record):
    # head_dim 96: no kernel instance, the plain-torch path on CUDA (outside a graph: raises)
    kc = torch.randn((12, PS, Hkv, 96), device="cuda", dtype=torch.bfloat16)
    q = torch.randn((2, Hq, 96), device="cuda", dtype=torch.bfloat16)
    bt = torch.tensor([[0, 1], [2, 40]], dtype=torch.int32, device="cuda")
    lens = torch.tensor([5, 30], dtype=torch.int32, device="cuda")
    with pytest.raises(MetadataError, match=r"block_table\[1, 1\] = 40"):
        A.decode(q, kc, kc, bt, lens)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_decode_reference_path_in_a_graph_poisons_and_records(clean_record):
    # head_dim 96 (no kernel instance): inside a graph the paged_check kernel flags the row,
    # the gather reads clamped pages, the row is NaN and the record names it
    kc = torch.randn((12, PS, Hkv, 96), device="cuda", dtype=torch.bfloat16)
    q = torch.randn((2, Hq, 96), device="cuda", dtype=torch.bfloat16)
    bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device="cuda")
    lens = torch.tensor([5, 30], dtype=torch.int32, device="cuda")
    plan = A.decode_plan(2, Hq, Hkv, 96, PS, 32, "cuda", torch.bfloat16)
    assert plan.backend == "reference"
    out = A.decode(q, kc, kc, bt, lens, plan).clone()
    good = out[0].clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        A.decode(q, kc, kc, bt, lens, plan, out=out)
    bt[1, 1] = 40
    g.replay()
    torch.cuda.synchronize()
    assert torch.isnan(out[1].float()).all() and torch.equal(out[0], good)
    _expect_recorded(r"fusedist.decode: sequence 1 reads block_table\[1, 1\] = 40")
    plan.close()
