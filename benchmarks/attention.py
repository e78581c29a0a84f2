"""Attention benchmarks on one GPU: paged decode (fusedist) against torch SDPA (cuDNN and flash
backends) on the same data, in the same run.

    python benchmarks/attention.py --quick          # the headline shapes (< 60 s)
    python benchmarks/attention.py                  # + batch 1-256, context 1K-128K, page
                                                    #   sizes 16/64/256, fp8 KV, split sweep
    python benchmarks/attention.py --what decode    # sections: decode (more may be added)

Decode rows: one query token per sequence, every sequence of the row at the same context,
head_dim 128. fusedist reads a paged cache [pages, page_size, kv_heads, 128] through a shuffled
block table ("paged") or an identity one ("contiguous"); SDPA reads contiguous [B, kv_heads,
S, 128] tensors with enable_gqa. Each timing is the median per-call time of CUDA-graph replays
of 20 calls; the calls rotate over enough copies of the cache (separate pages for fusedist,
separate tensors for SDPA) that the KV read never sits in L2. TB/s = K + V bytes read (and
fp8 scales) / time; % HBM = that over a device-to-device copy measured in the same run
(bytes read + written / time). Results: benchmarks/results/<gpu>-w1/attention.{json,md,png}.
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
import _harness as H  # noqa: E402
from fusedist.ops.attention import _decode as ad  # noqa: E402

OPS = 20      # calls per captured graph
REPS = 15     # timed replays (median)
D = 128
FP8 = getattr(torch, "float8_e4m3fn", None)

# (q_heads, kv_heads, batch, context): the headline shapes (Llama-3-8B at TP 1 and TP 2)
HEADLINE = [(16, 4, 1, 4096), (16, 4, 1, 32768), (16, 4, 16, 4096), (16, 4, 64, 4096),
            (32, 8, 1, 4096), (32, 8, 1, 32768), (32, 8, 64, 8192)]
# Targets: (q, kv, B, ctx) -> ("us" upper bound | "TB/s" lower bound, value)
TARGETS = {(16, 4, 1, 4096): ("us", 4.0), (16, 4, 1, 32768): ("us", 16.0),
           (16, 4, 16, 4096): ("TB/s", 4.2), (16, 4, 64, 4096): ("TB/s", 4.5),
           (32, 8, 1, 4096): ("us", 5.0), (32, 8, 1, 32768): ("us", 31.0),
           (32, 8, 64, 8192): ("TB/s", 4.6)}


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
    del a, b
    t = min(kernel, sorted(eager)[len(eager) // 2])
    return 2 * n * 2 / (t * 1e-6) / 1e12


def copies_for(nbytes: int) -> int:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(1, min(OPS, math.ceil(3 * l2 / max(nbytes, 1))))


class PagedKV:
    """`copies` independent caches of B x ctx tokens in one page pool; copy c's block table
    points at its own pages, shuffled (paged) or in order (contiguous)."""

    def __init__(self, B, ctx, kv_heads, page_size, kv_dtype, copies, shuffle):
        pages = B * math.ceil(ctx / page_size)
        total = pages * copies
        shape = (total, page_size, kv_heads, D)
        self.fp8 = kv_dtype == FP8
        if self.fp8:
            self.k = torch.randn(shape, device="cuda").to(FP8)
            self.v = torch.randn(shape, device="cuda").to(FP8)
            self.ks = torch.rand(shape[:3], device="cuda") * 0.01 + 0.005
            self.vs = torch.rand(shape[:3], device="cuda") * 0.01 + 0.005
        else:
            self.k = torch.randn(shape, device="cuda", dtype=kv_dtype)
            self.v = torch.randn(shape, device="cuda", dtype=kv_dtype)
            self.ks = self.vs = None
        ids = torch.randperm(total, device="cuda") if shuffle else torch.arange(total, device="cuda")
        self.tables = [ids[c * pages:(c + 1) * pages].view(B, -1).int().contiguous()
                       for c in range(copies)]
        self.lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")


def kv_bytes(B, ctx, kv_heads, fp8) -> int:
    per = D * (1 if fp8 else 2) + (4 if fp8 else 0)
    return 2 * B * ctx * kv_heads * per


def time_fusedist(hq, hkv, B, ctx, page_size, kv_dtype, shuffle=True, num_splits=None):
    nbytes = kv_bytes(B, ctx, hkv, kv_dtype == FP8)
    copies = copies_for(nbytes)
    kv = PagedKV(B, ctx, hkv, page_size, kv_dtype, copies, shuffle)
    qs = [torch.randn((B, hq, D), device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    out = torch.empty_like(qs[0])
    plan = ad.plan_kernel(B, hq, hkv, D, page_size, ctx, num_splits=num_splits,
                          dtype=torch.bfloat16, kv_dtype=kv_dtype)
    scale = D ** -0.5

    def step(i):
        c = i % copies
        ad.run_kernel(plan, qs[c], kv.k, kv.v, kv.tables[c], kv.lens, out, scale, kv.ks, kv.vs)

    t = H.time_graph(step, OPS, REPS)
    del kv
    return t, plan.num_splits, nbytes


def time_sdpa(hq, hkv, B, ctx, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    nbytes = kv_bytes(B, ctx, hkv, False)
    copies = copies_for(nbytes)
    ks = [torch.randn((B, hkv, ctx, D), device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    vs = [torch.randn_like(k) for k in ks]
    qs = [torch.randn((B, hq, 1, D), device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]

    def step(i):
        c = i % copies
        with sdpa_kernel([be]):
            F.scaled_dot_product_attention(qs[c], ks[c], vs[c], enable_gqa=True)

    try:
        return H.time_graph(step, OPS, REPS)
    except Exception as e:  # a backend that cannot take the shape (or graphs) on this build
        print(f"  sdpa {backend} ({hq}/{hkv} B{B} x {ctx}): {type(e).__name__}: {str(e)[:120]}")
        return None
    finally:
        del ks, vs, qs


def decode_rows(quick: bool, ceiling: float, sweep: bool) -> list[dict]:
    rows = []

    def row(hq, hkv, B, ctx, ps=16, kv_dtype=torch.bfloat16, layout="paged", baselines=True,
            num_splits=None, kind="decode"):
        t, splits, nbytes = time_fusedist(hq, hkv, B, ctx, ps, kv_dtype, layout == "paged",
                                          num_splits)
        r = {"section": "decode", "kind": kind, "q_heads": hq, "kv_heads": hkv, "batch": B,
             "context": ctx, "head_dim": D, "page_size": ps, "layout": layout,
             "kv_dtype": str(kv_dtype).replace("torch.", ""), "num_splits": splits,
             "kv_bytes": nbytes, "fusedist_us": t, "tbs": nbytes / (t * 1e-6) / 1e12}
        r["pct_hbm"] = 100 * r["tbs"] / ceiling
        if baselines:
            for be in ("cudnn", "flash"):
                tb = time_sdpa(hq, hkv, B, ctx, be)
                r[f"sdpa_{be}_us"] = tb
                r[f"vs_{be}"] = None if tb is None else tb / t
        tgt = TARGETS.get((hq, hkv, B, ctx)) if kind == "decode" and layout == "paged" \
            and ps == 16 and kv_dtype == torch.bfloat16 else None
        if tgt:
            r["target"] = f"{'<=' if tgt[0] == 'us' else '>='} {tgt[1]} {tgt[0]}"
            r["met"] = t <= tgt[1] if tgt[0] == "us" else r["tbs"] >= tgt[1]
        rows.append(r)
        if CHECKPOINT is not None:
            CHECKPOINT(rows)
        print(f"  {kind:8s} {hq}/{hkv} B{B:<3d} x {ctx:<6d} ps{ps:<3d} {r['kv_dtype']:13s} "
              f"{layout:10s} splits {splits:3d}: {t:8.2f} us {r['tbs']:5.2f} TB/s "
              f"({r['pct_hbm']:.0f}%)", flush=True)
        return r

    for hq, hkv, B, ctx in HEADLINE:
        row(hq, hkv, B, ctx)
    # paged (shuffled pages) against contiguous (identity table), batch >= 16
    for hq, hkv, B, ctx in [(16, 4, 16, 4096), (16, 4, 64, 4096), (32, 8, 64, 8192)]:
        row(hq, hkv, B, ctx, layout="contiguous", baselines=False, kind="layout")
    if FP8 is not None:
        for hq, hkv, B, ctx in [(16, 4, 64, 4096), (16, 4, 1, 32768), (32, 8, 64, 8192)]:
            row(hq, hkv, B, ctx, kv_dtype=FP8, baselines=False, kind="fp8")
    if quick and not sweep:
        return rows
    if not quick:
        for ps in (64, 256):
            for hq, hkv, B, ctx in [(16, 4, 1, 32768), (16, 4, 64, 4096)]:
                row(hq, hkv, B, ctx, ps=ps, baselines=False, kind="page")
        for hq, hkv in ((16, 4), (32, 8)):
            for B in (1, 4, 16, 64, 256):
                for ctx in (1024, 4096, 16384, 32768, 131072):
                    if B * ctx > (1 << 21) or (hq, hkv, B, ctx) in HEADLINE:
                        continue
                    row(hq, hkv, B, ctx, kind="grid")
    if sweep:
        # fixed costs: a 16-token and a 128-token sequence, one split and 32 (31 empty + merge)
        for ctx in (16, 128):
            for s in (1, 32):
                row(16, 4, 1, ctx, baselines=False, num_splits=s, kind="sweep")
        for hq, hkv, B, ctx in [(16, 4, 1, 4096), (16, 4, 1, 32768), (32, 8, 1, 4096),
                                (16, 4, 16, 4096), (32, 8, 4, 8192)]:
            for s in (1, 2, 4, 8, 16, 24, 32, 48, 64):
                row(hq, hkv, B, ctx, baselines=False, num_splits=s, kind="sweep")
    return rows


CHECKPOINT = None  # main() sets it: rows so far -> result files (a cut-short run keeps them)
SECTIONS = {"decode": decode_rows}  # further sections: name -> fn(quick, ceiling, sweep)


def fmt(v, p=2):
    return "-" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))


def markdown(meta: dict, ceiling: float, rows: list[dict]) -> str:
    out = [f"# attention on {meta.get('gpu')}", "",
           f"commit {meta['commit']}, torch {meta['torch']}, CUDA {meta.get('cuda')}, driver "
           f"{meta.get('driver')}; `{meta['command']}`; {meta['time']}", "",
           f"HBM ceiling (device-to-device copy, read + write): {ceiling:.2f} TB/s. Decode: "
           f"head_dim {D}, bf16 q/out, CUDA graphs of {OPS} calls, caches rotated past L2; "
           "TB/s = KV bytes read / time; vs = SDPA time / fusedist time.", "",
           "| kind | q/kv heads | batch x ctx | page | KV | layout | splits | fusedist us | TB/s | "
           "% HBM | SDPA cuDNN us | SDPA flash us | vs cuDNN | vs flash | target | met |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["section"] != "decode":
            continue
        out.append(
            f"| {r['kind']} | {r['q_heads']}/{r['kv_heads']} | {r['batch']} x {r['context']} | "
            f"{r['page_size']} | {r['kv_dtype']} | {r['layout']} | {r['num_splits']} | "
            f"{fmt(r['fusedist_us'])} | {fmt(r['tbs'])} | {fmt(r['pct_hbm'], 0)} | "
            f"{fmt(r.get('sdpa_cudnn_us'))} | {fmt(r.get('sdpa_flash_us'))} | "
            f"{fmt(r.get('vs_cudnn'))} | {fmt(r.get('vs_flash'))} | {r.get('target', '')} | "
            f"{'' if 'met' not in r else ('yes' if r['met'] else 'no')} |")
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    rs = [r for r in rows if r["section"] == "decode" and r["kind"] in ("decode", "grid")]
    if not rs:
        return None
    labels = [f"{r['q_heads']}/{r['kv_heads']}\nB{r['batch']}x{r['context'] // 1024}K" for r in rs]
    x = range(len(rs))
    fig, ax = plt.subplots(figsize=(max(8, 0.45 * len(rs)), 4.5))
    w = 0.28
    ax.bar([i - w for i in x], [r["tbs"] for r in rs], w, label="fusedist paged")
    for k, (be, off) in enumerate((("cudnn", 0), ("flash", w))):
        ax.bar([i + off for i in x],
               [0 if r.get(f"sdpa_{be}_us") is None else r["kv_bytes"] / r[f"sdpa_{be}_us"] / 1e6
                for r in rs], w, label=f"SDPA {be}")
    ax.set_xticks(list(x), labels, fontsize=6)
    ax.set_ylabel("KV read TB/s")
    ax.set_title("decode attention, head_dim 128, bf16, CUDA graphs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the headline shapes only (< 60 s)")
    ap.add_argument("--what", default="decode", help="comma-separated sections: "
                    + ", ".join(SECTIONS))
    ap.add_argument("--sweep-splits", action="store_true",
                    help="also time fixed split counts at small batches (planner tuning)")
    ap.add_argument("--out", default=None, help="results root (default FUSEDIST_RESULTS_DIR or "
                    "benchmarks/results); files go to <root>/<gpu>-w1/")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/attention.py needs a GPU")
        return
    torch.manual_seed(0)
    meta = H.metadata(1)
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
        rows += SECTIONS[name](args.quick, ceiling, args.sweep_splits)
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
