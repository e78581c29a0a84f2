"""benchmarks/attention.py and attention_prefill.py on the CPU: the decode grid's coverage, the
FlashInfer page-table mapping and output check, and dry runs of the decode rows and prefill
cases against a plain-torch stand-in for FlashInfer's wrappers (its documented semantics: NHD
pages given as a (k, v) tuple, CSR page table, bottom-right causal prefill), with the CUDA
timing replaced by one call of each step. What runs only on a GPU: the kernels, the graphs
and FlashInfer itself (docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import _flashinfer as FI  # noqa: E402
import attention as dec  # noqa: E402  (benchmarks/attention.py)
import attention_prefill as pre  # noqa: E402
from fusedist.ops.attention import decode_reference  # noqa: E402


# ---- a plain-torch stand-in for FlashInfer's paged wrappers ---------------------------------

def _csr_tokens(cache, indptr, indices, last, b):
    """Sequence b's tokens [len, heads, D] of an NHD cache, read as FlashInfer reads its CSR
    page table."""
    pages = indices[int(indptr[b]):int(indptr[b + 1])].long()
    ps = cache.shape[1]
    n = (len(pages) - 1) * ps + int(last[b])
    return cache[pages].flatten(0, 1)[:n].float()


def _attend(q, k, v, scale, causal_from=None):
    """q [n, Hq, D] over k, v [L, Hkv, D]; causal_from: query i sees keys [0, causal_from + i]."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale
    if causal_from is not None:
        n, L = q.shape[0], k.shape[0]
        allowed = torch.arange(L)[None, :] <= (causal_from + torch.arange(n))[:, None]
        s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(s, -1), v)


class _Wrapper:
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,
                 use_tensor_cores=False, backend="auto", **buffers):
        assert kv_layout == "NHD" and float_workspace_buffer.dtype == torch.uint8
        if use_cuda_graph:
            assert all(isinstance(b, torch.Tensor) for b in buffers.values()) and buffers
        self.tc, self.backend, self.plan_args = use_tensor_cores, backend, None


class FakeDecode(_Wrapper):
    swap_kv = False   # a misconfigured baseline (tests set it)

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, *, q_data_type, kv_data_type, sm_scale=None):
        if not self.tc and num_qo_heads // num_kv_heads not in (1, 2, 3, 4, 8):
            raise RuntimeError(f"Unsupported group_size: {num_qo_heads // num_kv_heads}")
        self.plan_args = (indptr.clone(), indices.clone(), last_page_len.clone(),
                          sm_scale or head_dim ** -0.5)

    def run(self, q, paged_kv_cache, *, out=None, enable_pdl=None):
        k, v = paged_kv_cache[::-1] if self.swap_kv else paged_kv_cache
        indptr, indices, last, scale = self.plan_args
        for b in range(q.shape[0]):
            o = _attend(q[b:b + 1], _csr_tokens(k, indptr, indices, last, b),
                        _csr_tokens(v, indptr, indices, last, b), scale)
            out[b] = o[0]
        return out


class FakePrefill(_Wrapper):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim_qk, page_size, *, causal, q_data_type,
             kv_data_type, sm_scale=None):
        if self.backend == "fa3":
            raise RuntimeError("Ninja build failed. Ninja output:\n[1/2] nvcc ...\n"
                               "fatal error: curand_kernel.h: No such file or directory")
        assert causal
        self.plan_args = (qo_indptr.clone(), paged_kv_indptr.clone(), paged_kv_indices.clone(),
                          paged_kv_last_page_len.clone(), sm_scale or head_dim_qk ** -0.5)

    def run(self, q, paged_kv_cache, *, out=None, enable_pdl=None):
        qo, indptr, indices, last, scale = self.plan_args
        k, v = paged_kv_cache
        for b in range(len(qo) - 1):
            a, e = int(qo[b]), int(qo[b + 1])
            kb = _csr_tokens(k, indptr, indices, last, b)
            vb = _csr_tokens(v, indptr, indices, last, b)
            out[a:e] = _attend(q[a:e], kb, vb, scale, causal_from=kb.shape[0] - (e - a))
        return out


def _fake_fi():
    return SimpleNamespace(__version__="0.0-test", BatchDecodeWithPagedKVCacheWrapper=FakeDecode,
                           BatchPrefillWithPagedKVCacheWrapper=FakePrefill)


@pytest.fixture
def cpu_bench(monkeypatch):
    """The benchmarks' rows on the CPU: tensors on "cpu", each CUDA-graph timing one call of
    every step (a fixed time per name), fusedist's kernel replaced by its plain-torch path."""
    monkeypatch.setattr(dec, "DEV", "cpu")
    monkeypatch.setattr(pre, "DEV", "cpu")
    monkeypatch.setattr(FI, "WORKSPACE_BYTES", 1024)
    monkeypatch.setattr(FI, "pdl", lambda device: True)
    FI._STATE.pop(("ws", "cpu"), None)
    monkeypatch.setattr(dec, "copies_for", lambda nbytes: 2)
    monkeypatch.setattr(dec, "memory_note", lambda need: None)
    calls = []

    def time_graph(step, ops, reps, warmup=3):
        for i in range(ops):
            step(i)
        calls.append(ops)
        return 10.0 + len(calls)   # distinct, rising: a later-timed peer is slower

    monkeypatch.setattr(dec.H, "time_graph", time_graph)
    monkeypatch.setattr(dec.H, "time_eager", lambda step, ops, reps: (step(0), 7.0)[1])
    monkeypatch.setattr(dec.ad, "plan_kernel",
                        lambda *a, num_splits=None, **k: SimpleNamespace(num_splits=1,
                                                                         merge="none"))

    def run_kernel(plan, q, k, v, bt, lens, out, scale=None, ks=None, vs=None):
        return decode_reference(q, k, v, bt, lens, out=out, k_scale=ks, v_scale=vs)

    monkeypatch.setattr(dec.ad, "run_kernel", run_kernel)
    monkeypatch.setattr(dec, "time_sdpa", lambda hq, hkv, B, ctx, be, head_dim=128:
                        {"cudnn": (30.0, None), "flash": (None, "SDPA flash: RuntimeError")}[be])
    yield calls
    FI._STATE.pop(("ws", "cpu"), None)


# ---- the decode grid ------------------------------------------------------------------------

def test_decode_grid_covers_the_shapes_and_stays_bounded():
    quick = dec.decode_shapes(quick=True, sweep=False)
    full = dec.decode_shapes(quick=False, sweep=False)
    assert len(quick) == 13 and all(s["ps"] == 16 and s["head_dim"] == 128 for s in quick)
    keys = [tuple(v for k, v in s.items() if k not in ("kind", "baselines")) for s in full]
    assert len(keys) == len(set(keys))                         # no shape timed twice
    assert 60 <= len(full) <= 110                              # ~6-8 min on an H200
    timed = [s for s in full if s["baselines"]]
    assert {(s["hq"], s["hkv"]) for s in timed} == set(dec.HEADS)
    assert {s["head_dim"] for s in timed} == {64, 128, 256}
    assert {s["ps"] for s in timed} == {16, 32, 64, 128, 256}
    assert {s["B"] for s in timed} >= {1, 4, 16, 64, 256}
    assert min(s["ctx"] for s in timed) == 1024 and max(s["ctx"] for s in timed) == 131072
    for hq, hkv in dec.HEADS:   # every head configuration at batch 1 x 128K
        assert any((s["hq"], s["hkv"], s["B"], s["ctx"]) == (hq, hkv, 1, 131072) for s in full)
    big = max(dec.kv_bytes(s["B"], s["ctx"], s["hkv"], False, s["head_dim"]) for s in full)
    assert big <= 40e9                                         # one copy fits beside SDPA's
    assert dec.graph_size(big) == (dec.BIG_OPS, dec.BIG_REPS) and dec.graph_size(1 << 20) == \
        (dec.OPS, dec.REPS)
    sweep = dec.decode_shapes(quick=True, sweep=True)
    assert any(s["kind"] == "sweep" and s["num_splits"] == 64 for s in sweep)


def test_csr_reads_the_pages_fusedist_reads():
    torch.manual_seed(1)
    P, ps, H, Dh = 40, 16, 2, 8
    k = torch.randn(P, ps, H, Dh)
    bt = torch.randperm(P)[:30].view(3, 10).int()
    lens = [17, 160, 1]
    indptr, indices, last = FI.csr(bt, lens, ps)
    assert indptr.tolist() == [0, 2, 12, 13] and last.tolist() == [1, 16, 1]
    assert indices.dtype == torch.int32 and indices.tolist() == \
        bt[0, :2].tolist() + bt[1].tolist() + bt[2, :1].tolist()
    for b, n in enumerate(lens):
        want = torch.cat([k[int(p)] for p in bt[b]])[:n]
        assert torch.equal(_csr_tokens(k, indptr, indices, last, b), want)
    with pytest.raises(ValueError, match="need 1 to 160 tokens"):
        FI.csr(bt, [0, 1, 1], ps)


def test_flashinfer_check_tolerance():
    torch.manual_seed(2)
    ref = torch.randn(4, 8, 64).bfloat16()
    near = (ref.double() * (1 + 4e-3)).bfloat16()
    assert FI.check(near, ref)[0]
    off = ref.clone()
    off[1, 2, 3] += 0.5
    ok, frac = FI.check(off, ref)
    assert not ok and frac > 1 and FI.check_note(ok, frac).startswith("WRONG")
    bad = ref.clone()
    bad[0, 0, 0] = float("nan")
    assert FI.check(bad, ref) == (False, float("inf"))
    assert FI.check_note(True, 0.25) == "ok (0.25 of tol)"


def test_load_reports_a_missing_flashinfer(monkeypatch):
    assert FI.load(False) == (None, "not timed (--no-flashinfer)")
    FI._STATE.pop("mod", None)
    monkeypatch.setitem(sys.modules, "flashinfer", None)    # import raises ImportError
    try:
        mod, note = FI.load(True)
        assert mod is None and note.startswith("not timed: import flashinfer failed")
    finally:
        FI._STATE.pop("mod", None)
        FI._STATE.pop("note", None)


def test_build_failure_reason():
    e = RuntimeError("Ninja build failed. Ninja output:\n[1/3] nvcc -c a.cu\n"
                     "a.cu:3:10: fatal error: curand_kernel.h: No such file or directory\n")
    assert FI.is_build_failure(e) and "curand_kernel.h" in FI.why(e)
    assert FI.why(ValueError("x" * 500)).startswith("ValueError: x") and \
        len(FI.why(ValueError("x" * 500))) < 200


# ---- decode rows, dry run -------------------------------------------------------------------

def _decode_shapes(monkeypatch, shapes):
    monkeypatch.setattr(dec, "decode_shapes", lambda quick, sweep: [
        dict(kind=k, hq=hq, hkv=hkv, B=B, ctx=ctx, head_dim=hd, ps=ps, kv_dtype=kvd,
             layout=lay, baselines=base, num_splits=None)
        for k, hq, hkv, B, ctx, hd, ps, kvd, lay, base in shapes])


def test_decode_rows_time_flashinfer_on_fusedist_pages(cpu_bench, monkeypatch, tmp_path):
    _decode_shapes(monkeypatch, [
        ("decode", 8, 2, 3, 40, 128, 16, "bf16", "paged", True),     # group 4: both wrappers
        ("heads", 14, 2, 2, 33, 64, 32, "bf16", "paged", True),      # group 7: tensor cores
        ("layout", 8, 2, 3, 40, 64, 16, "bf16", "contiguous", False),
    ])
    rows = dec.decode_rows(False, 4.0, False, _fake_fi())
    a, b, c = rows
    assert a["flashinfer_cuda_core_check"].startswith("ok")
    assert a["flashinfer_tensor_cores_check"].startswith("ok")
    # fusedist 11, CUDA-core 12, tensor-core 13 (us): the faster wrapper is FlashInfer's figure
    assert (a["fusedist_us"], a["flashinfer_us"], a["flashinfer_wrapper"]) == (11.0, 12.0, "cc")
    assert a["best_peer"] == "FlashInfer" and a["vs_best"] == pytest.approx(12 / 11)
    assert a["vs_cudnn"] == pytest.approx(30 / 11) and a["vs_flash"] is None
    assert a["notes"] == ["SDPA flash: RuntimeError"]          # SDPA's failure is a note
    assert b["flashinfer_cuda_core_us"] is None and b["flashinfer_wrapper"] == "tc"
    assert any("group size 7 not served" in n for n in b["notes"])
    assert "flashinfer_us" not in c and "sdpa_cudnn_us" not in c and "vs_best" not in c
    md = dec.markdown({"commit": "x", "torch": "t", "command": "c", "time": "now",
                       "flashinfer": "0.0-test", "flashinfer_pdl": True}, 4.0, rows)
    assert "| FlashInfer us |" in md and "12.00 (cc)" in md and "PDL on" in md
    assert "2 of 2 shapes within tolerance" in md and "group size 7 not served" in md
    json.dumps(rows)
    if importlib.util.find_spec("matplotlib"):
        assert dec.plot(rows, tmp_path / "attention.png").stat().st_size > 0


def test_a_wrong_flashinfer_output_is_not_a_peer(cpu_bench, monkeypatch):
    _decode_shapes(monkeypatch, [("decode", 4, 1, 2, 48, 64, 16, "bf16", "paged", True)])
    monkeypatch.setattr(FakeDecode, "swap_kv", True)
    (r,) = dec.decode_rows(False, 4.0, False, _fake_fi())
    assert r["flashinfer_cuda_core_check"].startswith("WRONG")
    assert "flashinfer_us" not in r and r["best_peer"] == "cuDNN"
    assert r["fusedist_check"].startswith("ok")     # the float64 reference says who is off
    assert any("output WRONG" in n for n in r["notes"])


def test_decode_without_flashinfer_leaves_its_column_out(cpu_bench, monkeypatch):
    _decode_shapes(monkeypatch, [("decode", 4, 1, 2, 48, 64, 16, "bf16", "paged", True)])
    rows = dec.decode_rows(False, 4.0, False, None)
    assert "flashinfer_us" not in rows[0] and rows[0]["best_peer"] == "cuDNN"
    md = dec.markdown({"commit": "x", "torch": "t", "command": "c", "time": "now",
                       "flashinfer": None, "flashinfer_note": "not timed: import flashinfer "
                       "failed (ModuleNotFoundError: x)"}, 4.0,
                      rows + [{"section": "decode", "kind": "big", "q_heads": 32,
                               "kv_heads": 8, "head_dim": 128, "batch": 256,
                               "context": 131072, "page_size": 16, "kv_dtype": "bfloat16",
                               "skipped": "skipped: needs 128.0 GiB"}])
    assert "FlashInfer us" not in md and "import flashinfer failed" in md
    assert "needs 128.0 GiB" in md and md.count("| decode |") == 1


def test_reference_seq0_matches_fusedist(monkeypatch):
    monkeypatch.setattr(dec, "DEV", "cpu")
    torch.manual_seed(3)
    kv = dec.PagedKV(2, 37, 2, 64, 16, torch.bfloat16, copies=2, shuffle=True)
    q = torch.randn(2, 8, 64).bfloat16()
    k, v, _, _ = kv.copy(0)
    want = decode_reference(q, k, v, kv.table, kv.lens)[0].double()
    assert torch.allclose(dec.reference_seq0(kv, q, 8, 2, 64), want, atol=1e-2, rtol=1e-2)
    k1, _, _, _ = kv.copy(1)
    assert k1.data_ptr() == kv.k.data_ptr() + kv.P * kv.k[0].numel() * kv.k.element_size()


# ---- prefill --------------------------------------------------------------------------------

def test_prefill_times_every_backend_but_reference(monkeypatch):
    assert pre.prefill_backends() == [b for b in pre.AP.PREFILL_BACKENDS
                                      if b not in ("auto", "reference")]
    monkeypatch.setattr(pre.AP, "PREFILL_BACKENDS", ("auto", "sdpa", "paged", "reference"))
    assert pre.prefill_backends() == ["sdpa", "paged"]
    cases = pre.prefill_cases(quick=True)
    assert (32, 8, 512, 4096) in cases and (32, 8, 128, 4128) in cases
    assert {(n, L) for _, _, n, L in cases} >= {(1024, 1024), (4096, 4096)}
    assert set(cases) < set(pre.prefill_cases(quick=False))


def test_prefill_case_dry_run(cpu_bench, monkeypatch):
    """A backend that raises for a case leaves a note, FlashInfer's fa3 build failure is noted
    (built once) and fa2 stands as its figure, an SDPA backend the CPU lacks is a note too."""
    monkeypatch.setattr(pre.AP, "PREFILL_BACKENDS", ("auto", "sdpa", "paged", "reference"))
    real = pre.A.prefill

    def prefill(q, *a, backend="auto", **kw):
        if backend == "paged" and q.shape[0] != kw["seq_lens_host"][0]:
            raise NotImplementedError("paged: a chunk behind a prefix is not served")
        return real(q, *a, backend="sdpa" if backend == "paged" else backend, **kw)

    monkeypatch.setattr(pre.A, "prefill", prefill)
    monkeypatch.setattr(pre, "prefill_cases", lambda quick: [(4, 2, 32, 32), (4, 2, 8, 40)])
    monkeypatch.setattr(pre, "_kernel_names", lambda fn: "k")
    pre.BROKEN.clear()
    rows = pre.prefill_rows(True, _fake_fi())
    fresh, chunk = rows
    for r in rows:
        assert r["fusedist_check"].startswith("ok") and r["fusedist_sdpa_check"].startswith("ok")
        assert r["flashinfer_fa2_check"].startswith("ok") and r["flashinfer_backend"] == "fa2"
        assert "flashinfer_fa3_tflops" not in r and r["flashinfer_graph_backend"] == "fa2"
        assert r["sdpa_flash_check"].startswith("ok")         # the CPU has flash, no cuDNN
        assert any(n.startswith("sdpa_cudnn: RuntimeError") for n in r["notes"])
        assert r["best_peer"] in ("sdpa_flash", "sdpa_flash_expanded", "flashinfer")
        assert r["vs_best"] == pytest.approx(r["fusedist_tflops"] /
                                             r[f"{r['best_peer']}_tflops"])
        assert r["fusedist_graph_tflops"] > 0
    assert fresh["fusedist_paged_check"].startswith("ok") and "fusedist_pages_tflops" in fresh
    assert "fusedist_paged_tflops" not in chunk and "fusedist_pages_tflops" not in chunk
    assert any(n.startswith("fusedist_paged: NotImplementedError") for n in chunk["notes"])
    assert any("fa3: JIT build failed" in n and "curand_kernel.h" in n for n in fresh["notes"])
    assert pre.BROKEN == {"fa3": pre.BROKEN["fa3"]}
    assert pre.S.PREFILL_EXPAND_GQA is False      # the sdpa knobs are put back
    md = pre.markdown(rows, {"flashinfer": "0.0-test", "flashinfer_pdl": True})
    assert "| FlashInfer | FlashInfer graph |" in md and "(fa2)" in md and "| paged |" in md
    assert "JIT build failed" in md and "PDL on" in md
    json.dumps(rows)
    md = pre.markdown(rows, {"flashinfer": None, "flashinfer_note": "not timed (--no-flashinfer)"})
    assert "| FlashInfer |" not in md and "--no-flashinfer" in md


@pytest.mark.parametrize("script", ["attention.py", "attention_prefill.py"])
def test_help_runs_without_a_gpu(script):
    from launch import python

    p = python([str(ROOT / "benchmarks" / script), "--help"], timeout=120)
    assert p.returncode == 0 and "--no-flashinfer" in p.stdout, p.stderr[-2000:]


def test_flops_count_the_causal_half():
    assert pre._flops(1, 4, 4) == 4.0 * 128 * (1 + 2 + 3 + 4)
    assert pre._flops(2, 2, 5) == 4.0 * 2 * 128 * (4 + 5)
    assert math.isclose(pre._flops(32, 4096, 4096), 4 * 32 * 128 * 4096 * 4097 / 2)
