"""Attention benchmarks on one GPU: paged decode (fusedist) against torch SDPA (cuDNN and flash
backends) and FlashInfer's paged decode (when `import flashinfer` works), on the same data, in
the same run.

    python benchmarks/attention.py --quick          # the headline shapes (< 60 s with a warm
                                                    #   FlashInfer JIT cache)
    python benchmarks/attention.py                  # the grid (~6-8 min on an H200): every
                                                    #   head config, batch 1-256 x context
                                                    #   1K-128K, head_dim 64/128/256, page
                                                    #   sizes 16-256, fp8 KV
    python benchmarks/attention.py --no-flashinfer  # without the FlashInfer rows
    python benchmarks/attention.py --what decode    # sections: decode (more may be added)

Decode rows: one query token per sequence, every sequence of the row at the same context.
fusedist reads a paged cache [pages, page_size, kv_heads, head_dim] through a shuffled block
table ("paged") or an identity one ("contiguous"); FlashInfer (BatchDecodeWithPagedKVCacheWrapper,
CUDA-core and use_tensor_cores=True, use_cuda_graph=True) reads the same caches, as its NHD
layout with separate K and V, through the same pages (the block table as CSR); its figure is
the faster of its two wrappers, and its output is checked against fusedist's once per shape.
SDPA reads contiguous [B, kv_heads, S, head_dim] tensors with enable_gqa. Each timing is the
median per-call time of CUDA-graph replays of 20 calls (4 above 4 GB of KV per call); the
calls rotate over enough copies of the cache (separate pages for fusedist and FlashInfer,
separate tensors for SDPA) that the KV read never sits in L2. TB/s = K + V bytes read (and
fp8 scales) / time; % HBM = that over a device-to-device copy measured in the same run (bytes
read + written / time); vs best = the fastest peer's time (cuDNN, flash, FlashInfer) /
fusedist's. A shape whose caches do not fit in the free GPU memory is skipped with a note.
Results: benchmarks/results/<gpu>-w1/attention.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # not the checkout: fusedist stays the installed one
import _flashinfer as FI  # noqa: E402
import _harness as H  # noqa: E402
from fusedist.ops.attention import _decode as ad  # noqa: E402

OPS = 20      # calls per captured graph
REPS = 15     # timed replays (median)
BIG_OPS, BIG_REPS, BIG_BYTES = 4, 7, 4 << 30   # above BIG_BYTES of KV per call (a call >= 1 ms)
D = 128       # head_dim unless a row says otherwise
FP8 = getattr(torch, "float8_e4m3fn", None)
DEV = "cuda"  # where the rows' tensors live (the CPU tests dry-run the rows on "cpu")

# (q_heads, kv_heads, batch, context): the headline shapes (Llama-3-8B at TP 1 and TP 2)
HEADLINE = [(16, 4, 1, 4096), (16, 4, 1, 32768), (16, 4, 16, 4096), (16, 4, 64, 4096),
            (32, 8, 1, 4096), (32, 8, 1, 32768), (32, 8, 64, 8192)]
# Targets: (q, kv, B, ctx) -> ("us" upper bound | "TB/s" lower bound, value)
TARGETS = {(16, 4, 1, 4096): ("us", 4.0), (16, 4, 1, 32768): ("us", 16.0),
           (16, 4, 16, 4096): ("TB/s", 4.2), (16, 4, 64, 4096): ("TB/s", 4.5),
           (32, 8, 1, 4096): ("us", 5.0), (32, 8, 1, 32768): ("us", 31.0),
           (32, 8, 64, 8192): ("TB/s", 4.6)}

# The grid (not the cartesian product: ~90 rows, ~6-8 min on an H200 with FlashInfer's JIT).
# q / kv heads per rank: Llama-3-8B TP 1 / Llama-3-70B TP 2 (and 8B at TP 1 doubled), MQA-like
# 8/1 (70B at TP 8), 70B at TP 1, Qwen2-7B (28/4, group 7), 40/8 (group 5).
HEADS = [(16, 4), (32, 8), (8, 1), (64, 8), (28, 4), (40, 8)]
# every head configuration at these (batch, context) points (head_dim 128, page 16); batch 1
# at 128K is the long-context row of every configuration
HEAD_POINTS = [(1, 8192), (1, 131072), (16, 4096), (64, 8192), (256, 2048)]
# batch x context for the Llama-3-8B configurations, up to GRID_TOKENS cached tokens a row
GRID_HEADS = [(16, 4), (32, 8)]
GRID_BATCHES = (1, 4, 16, 64, 256)
GRID_CONTEXTS = (1024, 4096, 16384, 32768, 131072)
GRID_TOKENS = 1 << 21
# head_dim 64 and 256 at a split-bound and a bandwidth-bound point (128 is every other row)
HEAD_DIM_POINTS = [(32, 8, 1, 32768), (32, 8, 64, 4096)]
# page sizes (16 is every other row) at the same two kinds of point
PAGE_SIZES = (32, 64, 128, 256)
PAGE_POINTS = [(16, 4, 1, 32768), (16, 4, 64, 4096)]
# the largest caches: 32 GB and 34 GB of KV (one copy each; SDPA's contiguous copy after)
BIG = [(32, 8, 256, 32768), (64, 8, 256, 16384)]
# shapes left out of the timing when free memory is short: bytes kept free besides the caches
MEMORY_HEADROOM = 4 << 30


def hbm_ceiling_tbs() -> float:
    """TB/s of a 2 GiB device-to-device copy (bytes read + written): the faster of a copy
    kernel in a CUDA graph and eager copy_ calls (a graph may turn copy_ into a copy-engine
    memcpy node), after warm-up."""
    n = 1 << 30
    a = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    kernel = H.time_graph(lambda i: torch.mul(a, 1, out=b), 1, 20, warmup=20)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    eager = []
    for _ in range(20):
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        eager.append(start.elapsed_time(end) * 1e3)
    t = min(kernel, sorted(eager)[len(eager) // 2])
    return 2 * n * 2 / (t * 1e-6) / 1e12


def copies_for(nbytes: int) -> int:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(1, min(OPS, math.ceil(3 * l2 / max(nbytes, 1))))


def graph_size(nbytes: int) -> tuple[int, int]:
    """(calls per graph, timed replays): fewer above BIG_BYTES of KV per call, where one call
    takes milliseconds and launch overhead is nothing next to it."""
    return (BIG_OPS, BIG_REPS) if nbytes > BIG_BYTES else (OPS, REPS)


def kv_bytes(B, ctx, kv_heads, fp8, head_dim=D) -> int:
    per = head_dim * (1 if fp8 else 2) + (4 if fp8 else 0)
    return 2 * B * ctx * kv_heads * per


def memory_note(need: int) -> str | None:
    """Why `need` bytes cannot be allocated now (free memory less MEMORY_HEADROOM), or None."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    if need + MEMORY_HEADROOM <= free:
        return None
    return (f"skipped: needs {need / 2**30:.1f} GiB of caches, {free / 2**30:.1f} of "
            f"{total / 2**30:.0f} GiB free")


class PagedKV:
    """`copies` caches of B x ctx tokens in one page pool: copy c owns pages [c P, (c+1) P)
    (P = B x ceil(ctx / page_size)), and every copy is read through one block table of page
    ids relative to its slice, shuffled (paged) or in order (contiguous); copy(c) gives copy
    c's K, V (and fp8 scales) as views, the layout fusedist and FlashInfer both read."""

    def __init__(self, B, ctx, kv_heads, head_dim, page_size, kv_dtype, copies, shuffle):
        self.P = B * math.ceil(ctx / page_size)
        shape = (self.P * copies, page_size, kv_heads, head_dim)
        self.fp8 = kv_dtype == FP8
        if self.fp8:
            self.k = torch.randn(shape, device=DEV).to(FP8)
            self.v = torch.randn(shape, device=DEV).to(FP8)
            self.ks = torch.rand(shape[:3], device=DEV) * 0.01 + 0.005
            self.vs = torch.rand(shape[:3], device=DEV) * 0.01 + 0.005
        else:
            self.k = torch.randn(shape, device=DEV, dtype=kv_dtype)
            self.v = torch.randn(shape, device=DEV, dtype=kv_dtype)
            self.ks = self.vs = None
        ids = torch.randperm(self.P, device=DEV) if shuffle else \
            torch.arange(self.P, device=DEV)
        self.table = ids.view(B, -1).int().contiguous()
        self.lens = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
        self.ctx, self.page_size = ctx, page_size

    def copy(self, c):
        s = slice(c * self.P, (c + 1) * self.P)
        return (self.k[s], self.v[s], None if self.ks is None else self.ks[s],
                None if self.vs is None else self.vs[s])


def time_fusedist(kv, qs, out, hq, hkv, head_dim, kv_dtype, num_splits, ops, reps, stages=0,
                  fp8_direct=None, merge=None):
    """(us per call, the plan): fusedist's decode kernel over kv's copies, in a graph."""
    B = kv.table.shape[0]
    plan = ad.plan_kernel(B, hq, hkv, head_dim, kv.page_size, kv.ctx, num_splits=num_splits,
                          dtype=torch.bfloat16, kv_dtype=kv_dtype, stages=stages,
                          fp8_direct=fp8_direct, merge=merge)
    copies = len(qs)

    def step(i):
        k, v, ks, vs = kv.copy(i % copies)
        ad.run_kernel(plan, qs[i % copies], k, v, kv.table, kv.lens, out, None, ks, vs)

    return H.time_graph(step, ops, reps), plan


def reference_seq0(kv, q, hq, hkv, head_dim) -> torch.Tensor:
    """Float64 attention of sequence 0 of copy 0 ([hq, head_dim]): says which side is off
    when FlashInfer's output and fusedist's differ."""
    k, v, _, _ = kv.copy(0)
    n = math.ceil(kv.ctx / kv.page_size)
    pages = kv.table[0, :n].long()
    g = hq // hkv
    out = torch.empty((hq, head_dim), dtype=torch.float64, device=q.device)
    for h in range(hkv):
        kh = k[pages, :, h].reshape(-1, head_dim)[:kv.ctx].double()
        vh = v[pages, :, h].reshape(-1, head_dim)[:kv.ctx].double()
        s = q[0, h * g:(h + 1) * g].double() @ kh.T * head_dim ** -0.5
        out[h * g:(h + 1) * g] = torch.softmax(s, -1) @ vh
    return out


BROKEN: dict = {}   # (wrapper, head_dim) -> why its JIT build failed (not retried per shape)


def time_flashinfer(fi, kv, qs, hq, hkv, head_dim, tensor_cores, ref, ops, reps):
    """FlashInfer's paged decode on kv's caches and pages: (us or None, check, note). The
    output of copy 0 is checked against fusedist's (ref) before timing; a wrong output is
    timed but not counted as a peer."""
    B = kv.table.shape[0]
    name = "tensor-core" if tensor_cores else "CUDA-core"
    if not tensor_cores and hq // hkv not in FI.CUDA_CORE_GROUPS:
        return None, None, f"{name}: group size {hq // hkv} not served"
    if (name, head_dim) in BROKEN:
        return None, None, f"{name}: {BROKEN[name, head_dim]}"
    dev = qs[0].device
    try:
        indptr, indices, last = FI.csr(kv.table, [kv.ctx] * B, kv.page_size)
        w = fi.BatchDecodeWithPagedKVCacheWrapper(
            FI.workspace(dev), "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
            paged_kv_indptr_buffer=torch.empty_like(indptr),
            paged_kv_indices_buffer=torch.empty_like(indices),
            paged_kv_last_page_len_buffer=torch.empty_like(last))
        w.plan(indptr, indices, last, hq, hkv, head_dim, kv.page_size,
               q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
               sm_scale=head_dim ** -0.5)
        out = torch.empty_like(qs[0])
        pdl = FI.pdl(dev)
        copies = len(qs)
        w.run(qs[0], kv.copy(0)[:2], out=out, enable_pdl=pdl)
        ok, frac = FI.check(out, ref)
        check = FI.check_note(ok, frac)

        def step(i):
            w.run(qs[i % copies], kv.copy(i % copies)[:2], out=out, enable_pdl=pdl)

        t = H.time_graph(step, ops, reps)
        return t, check, None if ok else f"{name}: output {check}"
    except Exception as e:  # noqa: BLE001 - a baseline that cannot take the shape: a note
        H.sync_quietly()
        if FI.is_build_failure(e):
            BROKEN[name, head_dim] = FI.why(e)
            print(str(e)[-3000:], flush=True)
        return None, None, f"{name}: {FI.why(e)}"


def time_sdpa(hq, hkv, B, ctx, backend, head_dim=D):
    """(us or None, why not or None): torch SDPA with one backend on contiguous copies."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    nbytes = kv_bytes(B, ctx, hkv, False, head_dim)
    copies = copies_for(nbytes)
    ks = [torch.randn((B, hkv, ctx, head_dim), device=DEV, dtype=torch.bfloat16)
          for _ in range(copies)]
    vs = [torch.randn_like(k) for k in ks]
    qs = [torch.randn((B, hq, 1, head_dim), device=DEV, dtype=torch.bfloat16)
          for _ in range(copies)]
    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]

    def step(i):
        c = i % copies
        with sdpa_kernel([be]):
            F.scaled_dot_product_attention(qs[c], ks[c], vs[c], enable_gqa=True)

    try:   # the tensors go with the frame on return
        return H.time_graph(step, *graph_size(nbytes)), None
    except Exception as e:  # a backend that cannot take the shape (or graphs) on this build
        H.sync_quietly()
        return None, f"SDPA {backend}: {type(e).__name__}: {str(e)[:120]}"


def best_peer(r: dict) -> None:
    """r["best_peer"], r["best_peer_us"], r["vs_best"]: the fastest of the peers timed (SDPA
    cuDNN, SDPA flash, FlashInfer's faster wrapper whose output passed the check)."""
    peers = {"cuDNN": r.get("sdpa_cudnn_us"), "flash": r.get("sdpa_flash_us"),
             "FlashInfer": r.get("flashinfer_us")}
    peers = {k: v for k, v in peers.items() if v}
    if peers:
        name = min(peers, key=peers.get)
        r["best_peer"], r["best_peer_us"] = name, peers[name]
        r["vs_best"] = peers[name] / r["fusedist_us"]


def decode_shapes(quick: bool, sweep: bool) -> list[dict]:
    """The rows to time, in order, as keyword arguments of the row function (kind, heads,
    batch, context, head_dim, page size, KV dtype, layout, baselines, splits); repeats of a
    shape under a later kind are dropped."""
    out = []

    def add(kind, hq, hkv, B, ctx, head_dim=D, ps=16, kv_dtype="bf16", layout="paged",
            baselines=True, num_splits=None):
        out.append(dict(kind=kind, hq=hq, hkv=hkv, B=B, ctx=ctx, head_dim=head_dim, ps=ps,
                        kv_dtype=kv_dtype, layout=layout, baselines=baselines,
                        num_splits=num_splits))

    for hq, hkv, B, ctx in HEADLINE:
        add("decode", hq, hkv, B, ctx)
    # paged (shuffled pages) against contiguous (identity table), batch >= 16
    for hq, hkv, B, ctx in [(16, 4, 16, 4096), (16, 4, 64, 4096), (32, 8, 64, 8192)]:
        add("layout", hq, hkv, B, ctx, layout="contiguous", baselines=False)
    for hq, hkv, B, ctx in [(16, 4, 64, 4096), (16, 4, 1, 32768), (32, 8, 64, 8192)]:
        add("fp8", hq, hkv, B, ctx, kv_dtype="fp8", baselines=False)
    if not quick:
        for hq, hkv in HEADS:
            for B, ctx in HEAD_POINTS:
                add("heads", hq, hkv, B, ctx)
        for hq, hkv in GRID_HEADS:
            for B in GRID_BATCHES:
                for ctx in GRID_CONTEXTS:
                    if B * ctx <= GRID_TOKENS:
                        add("grid", hq, hkv, B, ctx)
        for hq, hkv, B, ctx in HEAD_DIM_POINTS:
            for hd in (64, 256):
                add("head_dim", hq, hkv, B, ctx, head_dim=hd)
        for hq, hkv, B, ctx in PAGE_POINTS:
            for ps in PAGE_SIZES:
                add("page", hq, hkv, B, ctx, ps=ps)
        for hq, hkv, B, ctx in BIG:
            add("big", hq, hkv, B, ctx)
    if sweep:
        # fixed costs: a 16-token and a 128-token sequence, one split and 32 (31 empty + merge)
        for ctx in (16, 128):
            for s in (1, 32):
                add("sweep", 16, 4, 1, ctx, baselines=False, num_splits=s)
        for hq, hkv, B, ctx in [(16, 4, 1, 4096), (16, 4, 1, 32768), (32, 8, 1, 4096),
                                (16, 4, 16, 4096), (32, 8, 4, 8192)]:
            for s in (1, 2, 4, 8, 16, 24, 32, 48, 64):
                add("sweep", hq, hkv, B, ctx, baselines=False, num_splits=s)
    seen, rows = set(), []
    for s in out:
        key = tuple(v for k, v in s.items() if k not in ("kind", "baselines"))
        if key not in seen:
            seen.add(key)
            rows.append(s)
    return rows


def decode_rows(quick: bool, ceiling: float, sweep: bool, fi=None) -> list[dict]:
    rows = []
    sdpa_cache = {}   # SDPA reads no pages: a page-size row reuses its shape's times

    def row(kind, hq, hkv, B, ctx, head_dim, ps, kv_dtype, layout, baselines, num_splits):
        kvd = FP8 if kv_dtype == "fp8" else torch.bfloat16
        if kvd is None:
            return None
        fp8 = kvd == FP8
        nbytes = kv_bytes(B, ctx, hkv, fp8, head_dim)
        copies = copies_for(nbytes)
        ops, reps = graph_size(nbytes)
        r = {"section": "decode", "kind": kind, "q_heads": hq, "kv_heads": hkv, "batch": B,
             "context": ctx, "head_dim": head_dim, "page_size": ps, "layout": layout,
             "kv_dtype": str(kvd).replace("torch.", ""), "kv_bytes": nbytes,
             "graph_calls": ops, "notes": []}
        # fp8 caches are made in fp32 first
        skip = memory_note(copies * nbytes + (copies * nbytes * 2 if fp8 else 0))
        if skip:
            r["skipped"] = skip
            rows.append(r)
            print(f"  {kind:8s} {hq}/{hkv} d{head_dim} B{B} x {ctx}: {skip}", flush=True)
            return r
        kv = PagedKV(B, ctx, hkv, head_dim, ps, kvd, copies, layout == "paged")
        qs = [torch.randn((B, hq, head_dim), device=DEV, dtype=torch.bfloat16)
              for _ in range(copies)]
        out = torch.empty_like(qs[0])
        t, plan = time_fusedist(kv, qs, out, hq, hkv, head_dim, kvd, num_splits, ops, reps)
        splits = plan.num_splits
        r.update(num_splits=splits, merge=plan.merge, fusedist_us=t,
                 tbs=nbytes / (t * 1e-6) / 1e12)
        if 2 <= splits <= ad.MAX_CLUSTER_SPLITS and ad.cluster_merge_available(
                torch.device(DEV)):   # diagnostic: the other merge at the same splits
            other = "workspace" if plan.merge == "cluster" else "cluster"
            tw, pw = time_fusedist(kv, qs, out, hq, hkv, head_dim, kvd, splits, ops, reps,
                                   merge=other)
            r["fusedist_other_merge"], r["fusedist_other_merge_us"] = other, tw
            del pw
        r["pct_hbm"] = 100 * r["tbs"] / ceiling
        if fp8:   # diagnostics beside the default (direct fragments, 4 CTAs per SM): the
            # fp16 slab in shared memory (2 CTAs per SM) and its 2-stage ring (3 CTAs per SM)
            k0, v0, ks0, vs0 = kv.copy(0)
            a = ad.run_kernel(plan, qs[0], k0, v0, kv.table, kv.lens, out, None, ks0,
                              vs0).clone()
            for key, kw in (("2stage", {"stages": 2}), ("slab", {"fp8_direct": False})):
                t2, plan2 = time_fusedist(kv, qs, out, hq, hkv, head_dim, kvd, num_splits,
                                          ops, reps, **kw)
                b = ad.run_kernel(plan2, qs[0], k0, v0, kv.table, kv.lens, out, None, ks0,
                                  vs0).float()
                r[f"fusedist_{key}_us"] = t2
                r[f"fusedist_{key}_equal"] = bool(torch.equal(a.float(), b))
                r[f"fusedist_{key}_rel_diff"] = float((b - a.float()).norm() /
                                                      a.float().norm().clamp_min(1e-30))
                del plan2
        if baselines and fi is not None and not fp8:
            k0, v0, _, _ = kv.copy(0)
            ref = ad.run_kernel(plan, qs[0], k0, v0, kv.table, kv.lens, out).clone()
            best = None
            for tc, key in ((False, "cuda_core"), (True, "tensor_cores")):
                tf, check, note = time_flashinfer(fi, kv, qs, hq, hkv, head_dim, tc, ref,
                                                  ops, reps)
                r[f"flashinfer_{key}_us"], r[f"flashinfer_{key}_check"] = tf, check
                if note:
                    r["notes"].append("FlashInfer " + note)
                if check and not check.startswith("ok") and "fusedist_check" not in r:
                    r["fusedist_check"] = FI.check_note(*FI.check(
                        ref[0], reference_seq0(kv, qs[0], hq, hkv, head_dim)))
                    r["notes"].append(f"fusedist vs float64 (sequence 0): {r['fusedist_check']}")
                if tf is not None and check and check.startswith("ok") and \
                        (best is None or tf < best[0]):
                    best = (tf, "tc" if tc else "cc")
            if best:
                r["flashinfer_us"], r["flashinfer_wrapper"] = best
                r["vs_flashinfer"] = best[0] / t
        del kv, qs, out, plan
        if baselines:
            for be in ("cudnn", "flash"):
                key = (hq, hkv, B, ctx, head_dim, be)
                if key not in sdpa_cache:
                    skip = memory_note(copies * nbytes)
                    sdpa_cache[key] = (None, f"SDPA {be} {skip}") if skip else \
                        time_sdpa(hq, hkv, B, ctx, be, head_dim)
                tb, why = sdpa_cache[key]
                if why:
                    r["notes"].append(why)
                r[f"sdpa_{be}_us"] = tb
                r[f"vs_{be}"] = None if tb is None else tb / t
            best_peer(r)
        tgt = TARGETS.get((hq, hkv, B, ctx)) if kind == "decode" and layout == "paged" \
            and ps == 16 and head_dim == D and not fp8 else None
        if tgt:
            r["target"] = f"{'<=' if tgt[0] == 'us' else '>='} {tgt[1]} {tgt[0]}"
            r["met"] = t <= tgt[1] if tgt[0] == "us" else r["tbs"] >= tgt[1]
        rows.append(r)
        if CHECKPOINT is not None:
            CHECKPOINT(rows)
        peer = f" | best peer {r['best_peer']} {r['best_peer_us']:.2f} us ({r['vs_best']:.2f}x)" \
            if r.get("best_peer") else ""
        print(f"  {kind:8s} {hq}/{hkv} d{head_dim} B{B:<3d} x {ctx:<6d} ps{ps:<3d} "
              f"{r['kv_dtype']:13s} {layout:10s} splits {splits:3d}: {t:8.2f} us "
              f"{r['tbs']:5.2f} TB/s ({r['pct_hbm']:.0f}%){peer}", flush=True)
        for n in r["notes"]:
            print(f"    note: {n}", flush=True)
        return r

    for s in decode_shapes(quick, sweep):
        row(**s)
    return rows


CHECKPOINT = None  # main() sets it: rows so far -> result files (a cut-short run keeps them)
SECTIONS = {"decode": decode_rows}  # further sections: name -> fn(quick, ceiling, sweep, fi)


def fmt(v, p=2):
    return "-" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))


def markdown(meta: dict, ceiling: float, rows: list[dict]) -> str:
    fi = meta.get("flashinfer")
    pdl = {True: "on", False: "off", None: "?"}
    fi_line = (f"FlashInfer {fi} (BatchDecodeWithPagedKVCacheWrapper, use_cuda_graph=True, "
               f"the faster of the CUDA-core (cc) and tensor-core (tc) wrappers whose output "
               f"matched fusedist's; PDL {pdl[meta.get('flashinfer_pdl')]}) on the same caches "
               "and pages as fusedist") if fi else \
        f"FlashInfer: {meta.get('flashinfer_note', 'not timed')}; its column is left out"
    out = [f"# attention on {meta.get('gpu')}", "",
           f"commit {meta['commit']}, torch {meta['torch']}, CUDA {meta.get('cuda')}, driver "
           f"{meta.get('driver')}; `{meta['command']}`; {meta['time']}", "",
           f"HBM ceiling (device-to-device copy, read + write): {ceiling:.2f} TB/s. Decode: "
           f"bf16 q/out, CUDA graphs of {OPS} calls ({BIG_OPS} above {BIG_BYTES >> 30} GB of "
           "KV), caches rotated past L2; TB/s = KV bytes read / time; fusedist PDL "
           f"{'off' if meta.get('FUSEDIST_PDL') in ('0', 'false', 'no', 'off') else 'on'}. "
           f"{fi_line}. vs best = the fastest peer's time / fusedist's (above 1: fusedist is "
           "faster).", ""]
    head = ["kind", "q/kv heads", "head_dim", "batch x ctx", "page", "KV", "layout", "splits",
            "merge",
            "fusedist us", "TB/s", "% HBM", "SDPA cuDNN us", "SDPA flash us"]
    head += ["FlashInfer us"] if fi else []
    head += ["best peer", "vs best", "target", "met"]
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = []
    for r in rows:
        if r["section"] != "decode":
            continue
        shape = (f"{r['q_heads']}/{r['kv_heads']} d{r['head_dim']} B{r['batch']} x "
                 f"{r['context']} page {r['page_size']} {r['kv_dtype']}")
        if r.get("skipped"):
            notes.append(f"{r['kind']} {shape}: {r['skipped']}")
            continue
        notes += [f"{r['kind']} {shape}: {n}" for n in r.get("notes", [])]
        if r.get("fusedist_other_merge_us") is not None:
            notes.append(f"{r['kind']} {shape}: the {r['fusedist_other_merge']} merge at the "
                         f"same {r['num_splits']} splits {r['fusedist_other_merge_us']:.2f} us "
                         f"({r['fusedist_us'] / r['fusedist_other_merge_us']:.2f}x the "
                         f"default's speed)")
        for key, what in (("2stage", "2-stage ring (stages=2)"),
                          ("slab", "fp16 slab (fp8_direct=False)")):
            if r.get(f"fusedist_{key}_us") is not None:
                same = "bitwise equal" if r[f"fusedist_{key}_equal"] else \
                    f"rel diff {r[f'fusedist_{key}_rel_diff']:.1e}"
                notes.append(f"{r['kind']} {shape}: {what} {r[f'fusedist_{key}_us']:.2f} us, "
                             f"{r['fusedist_us'] / r[f'fusedist_{key}_us']:.2f}x the default's "
                             f"speed, output {same} vs the default")
        cells = [r["kind"], f"{r['q_heads']}/{r['kv_heads']}", str(r["head_dim"]),
                 f"{r['batch']} x {r['context']}", str(r["page_size"]), r["kv_dtype"],
                 r["layout"], str(r["num_splits"]), r.get("merge", "-"), fmt(r["fusedist_us"]),
                 fmt(r["tbs"]),
                 fmt(r["pct_hbm"], 0), fmt(r.get("sdpa_cudnn_us")), fmt(r.get("sdpa_flash_us"))]
        if fi:
            cells.append("-" if r.get("flashinfer_us") is None else
                         f"{r['flashinfer_us']:.2f} ({r['flashinfer_wrapper']})")
        cells += [r.get("best_peer", "-"), fmt(r.get("vs_best")), r.get("target", ""),
                  "" if "met" not in r else ("yes" if r["met"] else "no")]
        out.append("| " + " | ".join(cells) + " |")
    checked = [r for r in rows if r.get("flashinfer_cuda_core_check")
               or r.get("flashinfer_tensor_cores_check")]
    if fi:
        good = sum(all((r.get(f"flashinfer_{k}_check") or "ok").startswith("ok")
                       for k in ("cuda_core", "tensor_cores")) for r in checked)
        out += ["", f"FlashInfer's output against fusedist's (once per shape, elementwise, "
                f"|fi - fd| <= {FI.RTOL} |fd| + {FI.ATOL} rms(fd)): {good} of {len(checked)} "
                "shapes within tolerance. Not timed on FlashInfer: fp8 KV (its decode takes "
                "one scale per tensor, fusedist's cache one per token and head) and the "
                "layout and split-sweep rows."]
    if notes:
        out += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    rs = [r for r in rows if r["section"] == "decode" and not r.get("skipped")
          and r["kind"] in ("decode", "heads", "grid") and r["head_dim"] == D]
    if not rs:
        return None
    labels = [f"{r['q_heads']}/{r['kv_heads']}\nB{r['batch']}x{r['context'] // 1024}K" for r in rs]
    x = range(len(rs))
    series = [("fusedist paged", "fusedist_us"), ("SDPA cudnn", "sdpa_cudnn_us"),
              ("SDPA flash", "sdpa_flash_us")]
    if any(r.get("flashinfer_us") for r in rs):
        series.append(("FlashInfer", "flashinfer_us"))
    w = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(8, 0.5 * len(rs)), 4.5))
    for k, (name, key) in enumerate(series):
        ax.bar([i + (k - (len(series) - 1) / 2) * w for i in x],
               [0 if not r.get(key) else r["kv_bytes"] / r[key] / 1e6 for r in rs], w,
               label=name)
    ax.set_xticks(list(x), labels, fontsize=6)
    ax.set_ylabel("KV read TB/s")
    ax.set_title("decode attention, head_dim 128, bf16, CUDA graphs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the headline shapes only (< 60 s)")
    ap.add_argument("--what", default="decode", help="comma-separated sections: "
                    + ", ".join(SECTIONS))
    ap.add_argument("--sweep-splits", action="store_true",
                    help="also time fixed split counts at small batches (planner tuning)")
    ap.add_argument("--no-flashinfer", action="store_true",
                    help="leave FlashInfer out even when it imports")
    ap.add_argument("--out", default=None, help="results root (default FUSEDIST_RESULTS_DIR or "
                    "benchmarks/results); files go to <root>/<gpu>-w1/")
    return ap.parse_args(argv)


def main():
    args = parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/attention.py needs a GPU")
        return
    torch.manual_seed(0)
    meta = H.metadata(1)
    fi, note = FI.load(not args.no_flashinfer)
    meta.update(FI.meta(fi, torch.device("cuda", torch.cuda.current_device())),
                flashinfer_note=note)
    print(f"FlashInfer: {note}")
    ceiling = hbm_ceiling_tbs()
    print(f"HBM ceiling (copy): {ceiling:.2f} TB/s")
    res = Path(args.out) if args.out else Path(os.environ.get("FUSEDIST_RESULTS_DIR") or H.RESULTS)
    out = res / H.machine_dir(meta)
    out.mkdir(parents=True, exist_ok=True)
    meta["hbm_ceiling_tbs"] = ceiling

    def write(done, final=False):
        (out / "attention.json").write_text(json.dumps({"meta": meta, "rows": done}, indent=1))
        md = markdown(meta, ceiling, done)
        (out / "attention.md").write_text(md)
        if final:
            plot(done, out / "attention.png")
        return md

    global CHECKPOINT
    CHECKPOINT = lambda done: write(list(done))  # noqa: E731
    rows = []
    for name in args.what.split(","):
        if name not in SECTIONS:
            raise SystemExit(f"--what: unknown section {name!r}; have {', '.join(SECTIONS)}")
        rows += SECTIONS[name](args.quick, ceiling, args.sweep_splits, fi)
    # the copy again, on a GPU that has been busy (clocks up); the larger is the ceiling
    again = hbm_ceiling_tbs()
    print(f"HBM ceiling (copy, after the rows): {again:.2f} TB/s")
    if again > ceiling:
        ceiling = again
        for r in rows:
            if "tbs" in r:
                r["pct_hbm"] = 100 * r["tbs"] / ceiling
    meta["hbm_ceiling_tbs"] = ceiling
    print(write(rows, final=True))


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    main()
