"""RoPE + cache append and prefill attention on one GPU, with torch and FlashInfer baselines in
the same run.

    python benchmarks/attention_prefill.py                 # both sections
    python benchmarks/attention_prefill.py --what rope|prefill [--quick] [--no-flashinfer]

rope: fusedist.ops.rope_append (the fused kernel) against the same work in plain torch ops
(fp32 rotation, index_copy_ into the cache), both captured as CUDA graphs of 20 calls over 20
distinct input buffers and cache regions; GB/s = bytes moved (q and k read + written, v read,
k and v cache rows written, cos/sin rows read) / time.
prefill: fusedist.ops.prefill over a paged cache (page 16, shuffled pages), batch 1, fresh
prompts (1K, 4K, 8K) and chunked prefill (512 new tokens behind 3584 cached, 128 behind 4000).
The headline is backend "auto" as TPAttention calls it (lengths on the host, the step's
PrefillPlan made once outside the timing as the runner makes it once for all layers, out=None,
the keys and values just appended passed as k_new / v_new, which a prompt without a prefix reads
instead of its pages); every other backend of PREFILL_BACKENDS but "reference" is timed as a
diagnostic (a backend that cannot take a case leaves a note). Peers on the same keys and values:
torch SDPA on contiguous [1, heads, S, 128] copies (cuDNN and flash, is_causal or lower-right
causal; GQA native and expanded; cuDNN on BSHD views) and, when `import flashinfer` works,
FlashInfer's BatchPrefillWithPagedKVCacheWrapper (causal) on the same paged cache (fa3 and fa2;
the faster is its figure). Every output is checked against the fp32 reference path before it is
timed (each head vector within 1% relative L2, the tests' bound for bf16); a peer whose output
misses is not counted. Times: eager calls (median of 7 x 5) and, where the call can be captured,
CUDA graphs of 10 calls (a failed capture leaves a note). TFLOP/s counts the causal half: 4 *
q_heads * head_dim * sum over queries of the keys each sees.
Results: benchmarks/results/<gpu>-w1/attention_prefill.{json,md}.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # not the checkout: fusedist stays the installed one
import _flashinfer as FI  # noqa: E402
import _harness as H  # noqa: E402
from fusedist.ops import attention as A  # noqa: E402
from fusedist.ops.attention import _prefill as AP  # noqa: E402
from fusedist.ops.attention import sdpa as S  # noqa: E402

OPS, REPS = 20, 15
D = 128
FP8 = getattr(torch, "float8_e4m3fn", None)
DEV = "cuda"  # where the prefill cases' tensors live (the CPU tests dry-run them on "cpu")
ROPE_TARGET_US = 2.5          # batch 1, CUDA graph
PREFILL_TARGET_RATIO = 0.95   # of cuDNN SDPA's TFLOP/s at 4K tokens (eager, `auto`)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


# ---------------------------------------------------------------------------------------------
# rope + append
# ---------------------------------------------------------------------------------------------

def _torch_rope_append(q, k, v, pos, cs, kc, vc, slots):
    """The unfused baseline: graph-capturable plain torch."""
    q.copy_(A.apply_rope_reference(q, pos, cs).to(q.dtype))
    k.copy_(A.apply_rope_reference(k, pos, cs).to(k.dtype))
    H_, D_ = kc.shape[2], kc.shape[3]
    kc.view(-1, H_, D_).index_copy_(0, slots, k)
    vc.view(-1, H_, D_).index_copy_(0, slots, v)


def rope_rows(quick: bool) -> list[dict]:
    shapes = [(32, 8, 1), (16, 4, 1), (32, 8, 16), (32, 8, 256), (32, 8, 4096)]
    if not quick:
        shapes += [(16, 4, 64), (16, 4, 4096), (8, 1, 1)]
    rows = []
    cs = A.rope_cos_sin(D, 8192, 500000.0, LLAMA3, device="cuda")
    for hq, hkv, T in shapes:
        for kv_dtype in (torch.bfloat16, FP8):
            if kv_dtype is FP8 and (FP8 is None or T not in (1, 4096)):
                continue
            row = _rope_row(hq, hkv, T, kv_dtype, cs)
            rows.append(row)
            base = row["torch_us"]
            print(f"rope {hq}/{hkv} T={T} {row['kv_dtype']}: {row['fusedist_us']:.2f} us "
                  f"(torch {base if base is None else round(base, 2)} us)", flush=True)
    return rows


def _rope_row(hq, hkv, T, kv_dtype, cs) -> dict:
    """One RoPE + append shape: its buffers live until this returns."""
    ps = 16
    pages = OPS * math.ceil(T / ps) + 1
    kc = torch.zeros((pages, ps, hkv, D), device="cuda", dtype=kv_dtype)
    vc = torch.zeros_like(kc)
    fp8 = kv_dtype is FP8
    ksc = torch.zeros((pages, ps, hkv), device="cuda") if fp8 else None
    vsc = torch.zeros_like(ksc) if fp8 else None
    qs = [torch.randn((T, hq, D), device="cuda", dtype=torch.bfloat16) for _ in range(OPS)]
    ks = [torch.randn((T, hkv, D), device="cuda", dtype=torch.bfloat16) for _ in range(OPS)]
    vs = [torch.randn((T, hkv, D), device="cuda", dtype=torch.bfloat16) for _ in range(OPS)]
    pos = [torch.randint(0, 8192, (T,), device="cuda") for _ in range(OPS)]
    perm = torch.randperm(pages * ps, device="cuda")
    slots = [perm[i * T:(i + 1) * T].contiguous() for i in range(OPS)]

    def fused(i):
        A.rope_append(qs[i], ks[i], vs[i], pos[i], cs, kc, vc, slots[i],
                      k_scale=ksc, v_scale=vsc)

    t = H.time_graph(fused, OPS, REPS)
    base = None
    if not fp8:
        base = H.time_graph(lambda i: _torch_rope_append(qs[i], ks[i], vs[i], pos[i], cs,
                                                         kc, vc, slots[i]), OPS, REPS)
    ce = 1 if fp8 else 2
    nbytes = T * D * (2 * 2 * (hq + hkv) + 2 * hkv + ce * 2 * hkv) + T * D * 4 + \
        (T * hkv * 8 if fp8 else 0)
    row = dict(section="rope", q_heads=hq, kv_heads=hkv, tokens=T, head_dim=D,
               kv_dtype=str(kv_dtype).replace("torch.", ""), fusedist_us=t,
               torch_us=base, gbs=nbytes / (t * 1e-6) / 1e9,
               vs_torch=None if base is None else base / t, bytes=nbytes)
    if T == 1 and hq == 32:
        row["target"] = f"<= {ROPE_TARGET_US} us"
        row["met"] = t <= ROPE_TARGET_US
    return row


# ---------------------------------------------------------------------------------------------
# prefill
# ---------------------------------------------------------------------------------------------

def _flops(hq, n, L) -> float:
    # query i (0-based) of n sees L - n + i + 1 keys
    keys = n * (L - n) + n * (n + 1) / 2
    return 4.0 * hq * D * keys


def _kernel_names(fn) -> str:
    try:
        ks = H.kernels(fn)
    except Exception:  # noqa: BLE001 - the profiler is a diagnostic only
        return ""
    names = [n for n, _ in sorted(ks, key=lambda x: -x[1])[:2]]
    return "; ".join(n[:60] for n in names)


def _sdpa_contiguous(q, k, v, backend, n, L):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    gqa = q.shape[1] != k.shape[1]
    with sdpa_kernel([be]):
        if n == L:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(n, L),
                                              enable_gqa=gqa)


# (q_heads, kv_heads, new tokens n, cached tokens L including them): fresh prompts (n == L)
# and chunked prefill (n new tokens behind L - n cached: 512 behind 3584, 128 behind 4000)
PREFILL_QUICK = [(32, 8, 1024, 1024), (32, 8, 4096, 4096), (16, 4, 4096, 4096),
                 (32, 8, 512, 4096), (32, 8, 128, 4128)]
PREFILL_FULL = [(32, 8, 8192, 8192), (16, 4, 1024, 1024), (16, 4, 512, 4096),
                (16, 4, 128, 4128)]
EAGER_OPS, EAGER_REPS = 5, 7      # eager: median of 7 x 5 calls
GRAPH_OPS, GRAPH_REPS = 10, 10    # graphs of 10 calls, median of 10 replays
FLASHINFER_BACKENDS = ("fa3", "fa2")   # FlashInfer's "auto" is fa3 on sm90, fa2 elsewhere
# SDPA knobs timed as diagnostics of the "sdpa" backend: (name, backend order, expand GQA)
SDPA_KNOBS = [("fusedist_expand_gqa", None, True),
              ("fusedist_flash_first", ("flash", "cudnn", "efficient", "math"), False)]
SDPA_PEERS = ("sdpa_cudnn", "sdpa_cudnn_expanded", "sdpa_cudnn_bshd", "sdpa_flash",
              "sdpa_flash_expanded")
BROKEN: dict = {}   # FlashInfer backend -> why its JIT build failed (not retried per case)


def prefill_backends() -> list[str]:
    """fusedist's prefill backends timed as diagnostics: every one in PREFILL_BACKENDS but the
    fp32 reference and "auto" (the headline), so a backend added there is timed here too."""
    return [b for b in AP.PREFILL_BACKENDS if b not in ("reference", "auto")]


def prefill_cases(quick: bool) -> list[tuple]:
    return PREFILL_QUICK + ([] if quick else PREFILL_FULL)


def _time(row, key, fn, fl, ref=None, to_thd=None, graph=True, graph_fn=None) -> bool:
    """row[key_us], [key_tflops]: eager calls of fn (median of EAGER_REPS x EAGER_OPS), and
    row[key_graph_us], [key_graph_tflops]: GRAPH_OPS calls of graph_fn() (default fn) in one
    CUDA graph. Before timing, fn's output (to_thd maps it to [n, heads, D]) is checked
    against ref (row[key_check]). A call that raises leaves a note and no time; a capture
    that fails leaves a note beside the eager time."""
    try:
        o = fn()
        if ref is not None:
            ok, frac = FI.check_rows(to_thd(o) if to_thd else o, ref)
            row[f"{key}_check"] = FI.check_note(ok, frac)
            if not ok:
                row["notes"].append(f"{key}: output {row[f'{key}_check']}")
        t = H.time_eager(lambda i=0: fn(), EAGER_OPS, EAGER_REPS)
    except Exception as e:  # noqa: BLE001 - a backend that cannot take the case: a note
        H.sync_quietly()
        row["notes"].append(f"{key}: {FI.why(e)}")
        if FI.is_build_failure(e):
            print(str(e)[-3000:], flush=True)
        return False
    row[f"{key}_us"], row[f"{key}_tflops"] = t, fl / (t * 1e-6) / 1e12
    if not graph:
        return True
    try:
        g = graph_fn() if graph_fn is not None else fn
        tg = H.time_graph(lambda i: g(), GRAPH_OPS, GRAPH_REPS)
        row[f"{key}_graph_us"], row[f"{key}_graph_tflops"] = tg, fl / (tg * 1e-6) / 1e12
    except Exception as e:  # noqa: BLE001 - not capturable: the eager time stands alone
        H.sync_quietly()
        row["notes"].append(f"{key}: not captured ({FI.why(e)}); eager time only")
    return True


def _flashinfer_prefill(fi, backend, graph, q, kc, vc, bt, n, L):
    """fn() -> out [n, q_heads, D]: FlashInfer's BatchPrefillWithPagedKVCacheWrapper, planned
    once (causal: query i sees keys [0, L - n + i], bottom-right aligned as fusedist's), on
    fusedist's caches (NHD, separate K and V) and pages (the block table as CSR)."""
    ps, hq, hkv = kc.shape[1], q.shape[1], kc.shape[2]
    indptr, indices, last = FI.csr(bt, [L], ps)
    qo = torch.tensor([0, n], dtype=torch.int32, device=q.device)
    kw = dict(use_cuda_graph=True, qo_indptr_buf=torch.empty_like(qo),
              paged_kv_indptr_buf=torch.empty_like(indptr),
              paged_kv_indices_buf=torch.empty_like(indices),
              paged_kv_last_page_len_buf=torch.empty_like(last)) if graph else {}
    w = fi.BatchPrefillWithPagedKVCacheWrapper(FI.workspace(q.device), "NHD", backend=backend,
                                               **kw)
    w.plan(qo, indptr, indices, last, hq, hkv, D, ps, causal=True,
           q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=D ** -0.5)
    out = torch.empty_like(q)
    pdl = FI.pdl(q.device)
    return lambda: w.run(q, (kc, vc), out=out, enable_pdl=pdl)


def _best(row, keys, suffix="") -> tuple:
    """(name, TFLOP/s) of the fastest of keys timed (suffix "_graph": graph timings)."""
    got = {k: row.get(f"{k}{suffix}_tflops") for k in keys}
    got = {k: v for k, v in got.items() if v}
    if not got:
        return None, None
    k = max(got, key=got.get)
    return k, got[k]


def prefill_rows(quick: bool, fi=None) -> list[dict]:
    rows, later = [], []
    for hq, hkv, n, L in prefill_cases(quick):
        rows.append(_prefill_case(hq, hkv, n, L, fi, later))
        r = rows[-1]
        print(f"prefill {hq}/{hkv} {n}/{L}: " + ", ".join(
            f"{k[:-7]} {v:.0f}" for k, v in r.items() if k.endswith("_tflops")) + " TFLOP/s",
            flush=True)
        for note in r["notes"]:
            print(f"  note: {note}", flush=True)
    # The kernels' names come from the profiler, after every timing: a profiler session can
    # leave CUPTI attached to the process (torch does not always tear it down), which slows
    # the eager launches timed after it.
    for r, fn in later:
        r["fusedist_kernels"] = _kernel_names(fn)
    return rows


def _prefill_case(hq, hkv, n, L, fi, later: list) -> dict:
    """One prefill case: every fusedist backend, the SDPA and FlashInfer peers on the same
    cache contents, each checked against the fp32 reference, eager and in graphs; (row, the
    headline's call) goes to `later` for its kernel names."""
    ps = 16
    pages = math.ceil(L / ps)
    kc = torch.randn((pages + 8, ps, hkv, D), device=DEV, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    bt = torch.randperm(pages + 8, device=DEV)[:pages].view(1, -1).int()
    sl = torch.tensor([L], dtype=torch.int32, device=DEV)
    cu = torch.tensor([0, n], dtype=torch.int32, device=DEV)
    q = torch.randn((n, hq, D), device=DEV, dtype=torch.bfloat16)
    # the sequence's keys and values in order; the last n are the ones "just appended", which
    # TPAttention passes as k_new / v_new (a prompt without a prefix then reads them)
    k_all = kc[bt[0].long()].flatten(0, 1)[:L]
    v_all = vc[bt[0].long()].flatten(0, 1)[:L]
    k_new, v_new = k_all[L - n:].contiguous(), v_all[L - n:].contiguous()
    fl = _flops(hq, n, L)
    row = dict(section="prefill", q_heads=hq, kv_heads=hkv, new_tokens=n, context=L,
               page_size=ps, head_dim=D, tflops_counted=fl / 1e12, notes=[])

    # the step's plan, made once for every layer as the runner makes it (FlashInfer's wrapper
    # below is planned once too)
    plan = A.prefill_plan(bt, sl, cu, tokens=n, page_size=ps, num_pages=kc.shape[0],
                          seq_lens_host=[L], cu_seqlens_q_host=[0, n])

    def call(backend="auto", fresh=True):
        kw = dict(k_new=k_new, v_new=v_new) if fresh else {}
        return lambda: A.prefill(q, kc, vc, bt, sl, cu, seq_lens_host=[L],
                                 cu_seqlens_q_host=[0, n], backend=backend, plan=plan, **kw)

    ref = call("reference", fresh=False)()
    # the headline: what TPAttention runs (auto; fresh K/V when there is no prefix)
    if _time(row, "fusedist", call(), fl, ref):
        later.append((row, call()))   # its kernels are listed after every case's timing
    if n == L:   # auto reading the pages back (with a prefix it is the headline's call)
        _time(row, "fusedist_pages", call(fresh=False), fl, ref)
    for b in prefill_backends():
        _time(row, f"fusedist_{b}", call(b), fl, ref)
    # the paged kernel's mma.sync 128-row tiles at head_dim 128 (run_paged's tile_rows /
    # tile_warps): 4 warps x 32 rows and 8 warps x 16
    if "paged" in prefill_backends() and D == 128:
        for w in (4, 8):
            _time(row, f"fusedist_paged128w{w}", lambda w=w: AP.run_paged(
                None, q, kc, vc, bt, sl, cu, 1 / math.sqrt(D), n, L, tile_rows=128,
                tile_warps=w, mainloop="mma"), fl, ref)
        # the wgmma mainloop (sm_90a), 64 rows of one warpgroup and 128 rows of two
        if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
            for r, w in ((64, 4), (128, 8)):
                _time(row, f"fusedist_wgmma{r}", lambda r=r, w=w: AP.run_paged(
                    None, q, kc, vc, bt, sl, cu, 1 / math.sqrt(D), n, L, tile_rows=r,
                    tile_warps=w, mainloop="wgmma"), fl, ref)
    saved = (S.PREFILL_SDPA_BACKENDS, S.PREFILL_EXPAND_GQA)
    for key, order, expand in SDPA_KNOBS:
        S.PREFILL_SDPA_BACKENDS, S.PREFILL_EXPAND_GQA = order or saved[0], expand
        try:
            _time(row, key, call("sdpa", fresh=False), fl, ref)
        finally:
            S.PREFILL_SDPA_BACKENDS, S.PREFILL_EXPAND_GQA = saved
    # SDPA on contiguous tensors of the same keys and values
    qc = q.transpose(0, 1).unsqueeze(0).contiguous()
    kf = k_all.transpose(0, 1).unsqueeze(0).contiguous()      # [1, Hkv, L, D]
    vf = v_all.transpose(0, 1).unsqueeze(0).contiguous()
    thd = lambda o: o[0].transpose(0, 1)  # noqa: E731 - [1, H, n, D] -> [n, H, D]
    for be in ("cudnn", "flash"):
        for expand in (False, True):
            k_, v_ = (kf.repeat_interleave(hq // hkv, 1), vf.repeat_interleave(hq // hkv, 1)) \
                if expand else (kf, vf)
            _time(row, f"sdpa_{be}{'_expanded' if expand else ''}",
                  lambda k_=k_, v_=v_, be=be: _sdpa_contiguous(qc, k_, v_, be, n, L), fl, ref,
                  thd)
    # cuDNN on [1, S, H, D]-strided views (the layout the paged path hands SDPA)
    qb = q.transpose(0, 1).unsqueeze(0)
    kb, vb = k_all.transpose(0, 1).unsqueeze(0), v_all.transpose(0, 1).unsqueeze(0)
    _time(row, "sdpa_cudnn_bshd", lambda: _sdpa_contiguous(qb, kb, vb, "cudnn", n, L), fl,
          ref, thd)
    if fi is not None:
        for be in FLASHINFER_BACKENDS:
            key = f"flashinfer_{be}"
            if be in BROKEN:
                row["notes"].append(f"{key}: {BROKEN[be]}")
                continue
            try:
                fn = _flashinfer_prefill(fi, be, False, q, kc, vc, bt, n, L)
            except Exception as e:  # noqa: BLE001 - a plan or JIT build that fails: a note
                H.sync_quietly()
                if FI.is_build_failure(e):
                    BROKEN[be] = FI.why(e)
                    print(str(e)[-3000:], flush=True)
                row["notes"].append(f"{key}: {FI.why(e)}")
                continue
            _time(row, key, fn, fl, ref, graph_fn=lambda be=be: _flashinfer_prefill(
                fi, be, True, q, kc, vc, bt, n, L))
        ok = [f"flashinfer_{be}" for be in FLASHINFER_BACKENDS
              if (row.get(f"flashinfer_{be}_check") or "").startswith("ok")]
        for suffix in ("", "_graph"):
            k, v = _best(row, ok, suffix)
            if k:
                row[f"flashinfer{suffix}_tflops"] = v
                row[f"flashinfer{suffix}_backend"] = k[len("flashinfer_"):]
    # peers: SDPA's variants and FlashInfer's faster backend whose output passed the check
    peers = [k for k in SDPA_PEERS if (row.get(f"{k}_check") or "").startswith("ok")] + \
        (["flashinfer"] if row.get("flashinfer_tflops") else [])
    for suffix in ("", "_graph"):
        k, v = _best(row, peers, suffix)
        head = row.get(f"fusedist{suffix}_tflops")
        if k and head:
            row[f"best_peer{suffix}"] = k
            row[f"vs_best{suffix}"] = head / v
    best_cudnn = max((row.get(k) or 0) for k in ("sdpa_cudnn_tflops",
                                                 "sdpa_cudnn_expanded_tflops"))
    if best_cudnn and row.get("fusedist_tflops"):
        row["vs_cudnn"] = row["fusedist_tflops"] / best_cudnn
        if n == L == 4096:
            row["target"] = f">= {PREFILL_TARGET_RATIO}x cuDNN"
            row["met"] = row["vs_cudnn"] >= PREFILL_TARGET_RATIO
    return row


def fmt(v, p=2):
    return "-" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))


PEER_NAMES = {"sdpa_cudnn": "cuDNN", "sdpa_cudnn_expanded": "cuDNN expanded",
              "sdpa_cudnn_bshd": "cuDNN BSHD", "sdpa_flash": "flash",
              "sdpa_flash_expanded": "flash expanded", "flashinfer": "FlashInfer"}


def markdown(rows, meta=None) -> str:
    meta = meta or {}
    out = []
    rr = [r for r in rows if r["section"] == "rope"]
    if rr:
        out += ["## RoPE + cache append (CUDA graphs, bf16 q/k/v, head_dim 128, Llama-3 scaling)",
                "", "| q/kv heads | tokens | cache | fusedist us | GB/s | torch ops us | "
                "vs torch | target | met |", "|---|---|---|---|---|---|---|---|---|"]
        for r in rr:
            out.append(f"| {r['q_heads']}/{r['kv_heads']} | {r['tokens']} | {r['kv_dtype']} | "
                       f"{fmt(r['fusedist_us'])} | {fmt(r['gbs'], 0)} | {fmt(r['torch_us'])} | "
                       f"{fmt(r['vs_torch'])} | {r.get('target', '')} | "
                       f"{'' if 'met' not in r else ('yes' if r['met'] else 'no')} |")
        out.append("")
    pr = [r for r in rows if r["section"] == "prefill"]
    if not pr:
        return "\n".join(out) + "\n"
    fi = meta.get("flashinfer")
    pdl = {True: "on", False: "off", None: "?"}[meta.get("flashinfer_pdl")]
    g = lambda r, k: fmt(r.get(f"{k}_tflops"), 0)  # noqa: E731
    out += ["## Prefill (bf16, head_dim 128, batch 1, page 16; TFLOP/s of the causal half)", "",
            "fusedist = `prefill(backend=\"auto\")` as TPAttention calls it (the step's plan "
            "made once, fresh K/V when there is no prefix); eager: median of 7 x 5 calls, "
            "graph: CUDA graphs of 10 calls (auto decides inside the capture, which may pick "
            "another backend than eager calls). "
            "vs best = fusedist / the fastest peer whose output matched the fp32 reference "
            "(SDPA cuDNN and flash on contiguous copies of the same keys and values, plain, "
            "expanded GQA and BSHD views; FlashInfer). " + (
                f"FlashInfer {fi}: BatchPrefillWithPagedKVCacheWrapper, causal, on the same "
                f"paged cache, the faster of {' and '.join(FLASHINFER_BACKENDS)}; PDL {pdl}."
                if fi else f"FlashInfer: {meta.get('flashinfer_note', 'not timed')}; its "
                "column is left out."), ""]
    head = ["q/kv heads", "new / context", "fusedist", "fusedist graph", "SDPA cuDNN",
            "SDPA flash"] + (["FlashInfer", "FlashInfer graph"] if fi else []) + \
        ["best peer", "vs best", "vs best (graph)", "vs cuDNN", "target", "met"]
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in pr:
        cells = [f"{r['q_heads']}/{r['kv_heads']}", f"{r['new_tokens']} / {r['context']}",
                 g(r, "fusedist"), g(r, "fusedist_graph"), g(r, "sdpa_cudnn"),
                 g(r, "sdpa_flash")]
        if fi:
            cells += [g(r, "flashinfer") + (f" ({r['flashinfer_backend']})"
                                            if r.get("flashinfer_backend") else ""),
                      g(r, "flashinfer_graph") + (f" ({r['flashinfer_graph_backend']})"
                                                  if r.get("flashinfer_graph_backend") else "")]
        cells += [PEER_NAMES.get(r.get("best_peer"), "-"), fmt(r.get("vs_best")),
                  fmt(r.get("vs_best_graph")), fmt(r.get("vs_cudnn")), r.get("target", ""),
                  "" if "met" not in r else ("yes" if r["met"] else "no")]
        out.append("| " + " | ".join(cells) + " |")
    # diagnostics: every variant timed, eager / graph
    keys = ["fusedist_pages"] + [f"fusedist_{b}" for b in prefill_backends()] + \
        [k for k in ("fusedist_paged128w4", "fusedist_paged128w8", "fusedist_wgmma64",
                     "fusedist_wgmma128") if any(f"{k}_us" in r for r in pr)] + \
        [k for k, _, _ in SDPA_KNOBS] + ["sdpa_cudnn_expanded", "sdpa_cudnn_bshd",
                                         "sdpa_flash_expanded"] + \
        ([f"flashinfer_{b}" for b in FLASHINFER_BACKENDS] if fi else [])
    names = {"fusedist_pages": "auto, pages", "fusedist_expand_gqa": "sdpa +expand GQA",
             "fusedist_paged128w4": "paged mma.sync, 128 rows / 4 warps",
             "fusedist_paged128w8": "paged mma.sync, 128 rows / 8 warps",
             "fusedist_wgmma64": "paged wgmma, 64 rows", "fusedist_wgmma128": "paged wgmma, 128 rows",
             "fusedist_flash_first": "sdpa flash first", **PEER_NAMES,
             **{f"flashinfer_{b}": f"FlashInfer {b}" for b in FLASHINFER_BACKENDS}}
    out += ["", "Every variant, TFLOP/s eager / graph (fusedist_<backend>: each of "
            "PREFILL_BACKENDS but reference and auto, as TPAttention calls it; \"auto, pages\": "
            "auto reading the pages back, no-prefix cases only; sdpa knobs: the sdpa backend "
            "on the pages with another backend order or GQA expanded):", "",
            "| q/kv heads | new / context | " + " | ".join(
                names.get(k, k.replace("fusedist_", "")) for k in keys) + " |",
            "|" + "---|" * (len(keys) + 2)]
    for r in pr:
        out.append(f"| {r['q_heads']}/{r['kv_heads']} | {r['new_tokens']} / {r['context']} | "
                   + " | ".join(f"{g(r, k)} / {g(r, k + '_graph')}" for k in keys) + " |")
    notes = [f"{r['q_heads']}/{r['kv_heads']} {r['new_tokens']}/{r['context']}: {n}"
             for r in pr for n in r.get("notes", [])]
    if notes:
        out += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    out.append("")
    out.append("Kernels (fusedist path, top 2 by time): " + " | ".join(
        f"{r['q_heads']}/{r['kv_heads']} {r['new_tokens']}/{r['context']}: "
        f"{r.get('fusedist_kernels', '')}" for r in pr))
    return "\n".join(out) + "\n"


SECTIONS = {"rope": lambda quick, fi: rope_rows(quick), "prefill": prefill_rows}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="fewer shapes: the headline rows (< 60 s with a warm FlashInfer JIT "
                    "cache)")
    ap.add_argument("--what", default="rope,prefill", help="rope, prefill (comma-separated)")
    ap.add_argument("--no-flashinfer", action="store_true",
                    help="leave FlashInfer out even when it imports")
    return ap.parse_args(argv)


def main():
    args = parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/attention_prefill.py needs a GPU")
        return
    torch.manual_seed(0)
    meta = H.metadata(1)
    meta["command"] = "python benchmarks/attention_prefill.py " + " ".join(sys.argv[1:])
    fi, note = FI.load(not args.no_flashinfer)
    meta.update(FI.meta(fi, torch.device("cuda", torch.cuda.current_device())),
                flashinfer_note=note)
    print(f"FlashInfer: {note}")
    rows = []
    for name in args.what.split(","):
        if name not in SECTIONS:
            raise SystemExit(f"--what: unknown section {name!r}; have {', '.join(SECTIONS)}")
        rows += SECTIONS[name](args.quick, fi)
    md = markdown(rows, meta)
    H.write_results("attention_prefill", meta, rows, md)
    print(md)


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    main()
