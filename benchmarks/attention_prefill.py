"""RoPE + cache append and prefill attention on one GPU, with torch baselines in the same run.

    python benchmarks/attention_prefill.py            # both sections
    python benchmarks/attention_prefill.py --what rope|prefill [--quick]

rope: fusedist.ops.rope_append (the fused kernel) against the same work in plain torch ops
(fp32 rotation, index_copy_ into the cache), both captured as CUDA graphs of 20 calls over 20
distinct input buffers and cache regions; GB/s = bytes moved (q and k read + written, v read,
k and v cache rows written, cos/sin rows read) / time.
prefill: fusedist.ops.prefill over a paged cache (page 16, shuffled pages: gathers each
sequence's KV, then torch SDPA with the lower-right causal alignment; lengths passed on the
host, out=None, as TPAttention calls it; "fresh K/V": a sequence without a prefix reads the
keys and values just appended instead of its pages, as TPAttention passes them) against torch SDPA on
contiguous [1, heads, S, 128] tensors (cuDNN and flash backends, is_causal); eager calls
(prefill reads its lengths on the host), median of 7 x 5 calls. TFLOP/s counts the causal
half: 4 * q_heads * head_dim * sum over queries of the keys each sees.
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
import _harness as H  # noqa: E402
from fusedist.ops import attention as A  # noqa: E402
from fusedist.ops.attention import sdpa as S  # noqa: E402

OPS, REPS = 20, 15
D = 128
FP8 = getattr(torch, "float8_e4m3fn", None)
ROPE_TARGET_US = 2.5          # batch 1, CUDA graph
PREFILL_TARGET_RATIO = 0.9    # of cuDNN SDPA's TFLOP/s at 4K tokens
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
            rows.append(row)
            print(f"rope {hq}/{hkv} T={T} {row['kv_dtype']}: {t:.2f} us "
                  f"(torch {base if base is None else round(base, 2)} us)", flush=True)
            del qs, ks, vs, kc, vc
    return rows


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


def prefill_rows(quick: bool) -> list[dict]:
    cases = [(32, 8, 4096, 4096), (16, 4, 4096, 4096), (32, 8, 512, 4096)]
    if not quick:
        cases += [(32, 8, 1024, 1024), (32, 8, 8192, 8192)]
    rows = []
    for hq, hkv, n, L in cases:
        ps = 16
        pages = math.ceil(L / ps)
        kc = torch.randn((pages + 8, ps, hkv, D), device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        bt = torch.randperm(pages + 8, device="cuda")[:pages].view(1, -1).int()
        sl = torch.tensor([L], dtype=torch.int32, device="cuda")
        cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
        q = torch.randn((n, hq, D), device="cuda", dtype=torch.bfloat16)
        fl = _flops(hq, n, L)
        row = dict(section="prefill", q_heads=hq, kv_heads=hkv, new_tokens=n, context=L,
                   page_size=ps, tflops_counted=fl / 1e12)
        saved = (S.PREFILL_SDPA_BACKENDS, S.PREFILL_EXPAND_GQA)
        k_new = torch.randn((n, hkv, D), device="cuda", dtype=torch.bfloat16)
        v_new = torch.randn_like(k_new)
        for name, order, expand, fresh in (
                ("fusedist", saved[0], saved[1], False),
                ("fusedist_fresh_kv", saved[0], saved[1], True),
                ("fusedist_expand_gqa", saved[0], True, False),
                ("fusedist_flash_first", ("flash", "cudnn", "efficient", "math"), False, False)):
            if fresh and n != L:
                continue
            S.PREFILL_SDPA_BACKENDS, S.PREFILL_EXPAND_GQA = order, expand
            kw = dict(k_new=k_new, v_new=v_new) if fresh else {}
            fn = lambda i=0: A.prefill(q, kc, vc, bt, sl, cu, seq_lens_host=[L],  # noqa: E731
                                       cu_seqlens_q_host=[0, n], **kw)
            try:
                t = H.time_eager(fn, 5, 7)
                row[f"{name}_us"] = t
                row[f"{name}_tflops"] = fl / (t * 1e-6) / 1e12
                row[f"{name}_kernels"] = _kernel_names(fn)
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"  {name}: {type(e).__name__}: {str(e)[:160]}")
        S.PREFILL_SDPA_BACKENDS, S.PREFILL_EXPAND_GQA = saved
        qc = q.transpose(0, 1).unsqueeze(0).contiguous()
        kf = torch.randn((1, hkv, L, D), device="cuda", dtype=torch.bfloat16)
        vf = torch.randn_like(kf)
        for be in ("cudnn", "flash"):
            for expand in (False, True):
                k_, v_ = (kf.repeat_interleave(hq // hkv, 1), vf.repeat_interleave(hq // hkv, 1)) \
                    if expand else (kf, vf)
                key = f"sdpa_{be}{'_expanded' if expand else ''}"
                fn = lambda i=0: _sdpa_contiguous(qc, k_, v_, be, n, L)  # noqa: E731
                try:
                    t = H.time_eager(fn, 5, 7)
                    row[f"{key}_us"] = t
                    row[f"{key}_tflops"] = fl / (t * 1e-6) / 1e12
                except Exception as e:  # noqa: BLE001
                    print(f"  {key} {hq}/{hkv} {n}/{L}: {type(e).__name__}: {str(e)[:160]}")
        # cuDNN on [1, S, H, D]-strided views (the layout the paged path hands SDPA)
        qb = q.transpose(0, 1).unsqueeze(0)
        kb = kf[0].transpose(0, 1).contiguous().transpose(0, 1).unsqueeze(0)
        vb = vf[0].transpose(0, 1).contiguous().transpose(0, 1).unsqueeze(0)
        try:
            t = H.time_eager(lambda i=0: _sdpa_contiguous(qb, kb, vb, "cudnn", n, L), 5, 7)
            row["sdpa_cudnn_bshd_us"] = t
            row["sdpa_cudnn_bshd_tflops"] = fl / (t * 1e-6) / 1e12
        except Exception as e:  # noqa: BLE001
            print(f"  sdpa_cudnn_bshd: {type(e).__name__}: {str(e)[:160]}")
        best_cudnn = max((row.get(k) or 0) for k in ("sdpa_cudnn_tflops",
                                                     "sdpa_cudnn_expanded_tflops"))
        if best_cudnn and row.get("fusedist_tflops"):
            # the headline: what TPAttention runs (fresh K/V when there is no prefix)
            head = row.get("fusedist_fresh_kv_tflops") or row["fusedist_tflops"]
            row["vs_cudnn"] = head / best_cudnn
            if n == L == 4096:
                row["target"] = f">= {PREFILL_TARGET_RATIO}x cuDNN"
                row["met"] = row["vs_cudnn"] >= PREFILL_TARGET_RATIO
        rows.append(row)
        print(f"prefill {hq}/{hkv} {n}/{L}: " + ", ".join(
            f"{k[:-7]} {v:.0f}" for k, v in row.items() if k.endswith("_tflops")) + " TFLOP/s",
            flush=True)
        del kc, vc, kf, vf
    return rows


def fmt(v, p=2):
    return "-" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))


def markdown(rows) -> str:
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
    if pr:
        out += ["## Prefill (bf16, head_dim 128, batch 1; TFLOP/s of the causal half)", "",
                "| q/kv heads | new / context | fusedist (paged) | fresh K/V | +expand GQA | "
                "flash first | SDPA cuDNN | cuDNN expanded | cuDNN BSHD | SDPA flash | "
                "flash expanded | vs cuDNN | target | met |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in pr:
            g = lambda k: fmt(r.get(f"{k}_tflops"), 0)  # noqa: E731
            out.append(f"| {r['q_heads']}/{r['kv_heads']} | {r['new_tokens']} / {r['context']} "
                       f"| {g('fusedist')} | {g('fusedist_fresh_kv')} | "
                       f"{g('fusedist_expand_gqa')} | "
                       f"{g('fusedist_flash_first')} | {g('sdpa_cudnn')} | "
                       f"{g('sdpa_cudnn_expanded')} | {g('sdpa_cudnn_bshd')} | {g('sdpa_flash')} | "
                       f"{g('sdpa_flash_expanded')} | {fmt(r.get('vs_cudnn'))} | "
                       f"{r.get('target', '')} | "
                       f"{'' if 'met' not in r else ('yes' if r['met'] else 'no')} |")
        out.append("")
        out.append("Kernels (fusedist path, top 2 by time): " + " | ".join(
            f"{r['q_heads']}/{r['kv_heads']} {r['new_tokens']}/{r['context']}: "
            f"{r.get('fusedist_kernels', '')}" for r in pr))
    return "\n".join(out) + "\n"


SECTIONS = {"rope": rope_rows, "prefill": prefill_rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--what", default="rope,prefill", help="rope, prefill (comma-separated)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/attention_prefill.py needs a GPU")
        return
    torch.manual_seed(0)
    meta = H.metadata(1)
    meta["command"] = "python benchmarks/attention_prefill.py " + " ".join(sys.argv[1:])
    rows = []
    for name in args.what.split(","):
        if name not in SECTIONS:
            raise SystemExit(f"--what: unknown section {name!r}; have {', '.join(SECTIONS)}")
        rows += SECTIONS[name](args.quick)
    md = markdown(rows)
    H.write_results("attention_prefill", meta, rows, md)
    print(md)


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    main()
