"""Mixture-of-experts ops on one GPU beside torch, in the same run, one part at a time.

    python benchmarks/moe.py --quick --what gating,permute
    python benchmarks/moe.py --what gating --models qwen3-30b-a3b,deepseek-v3
    python benchmarks/moe.py --what permute --tokens 1,16,4096 --routing balanced,skewed

Parts (--what; each writes benchmarks/results/<gpu>-w1/moe-<part>.{json,md}):
  gating   router logits [T, E] -> ids, weights and the layout by expert:
             fusedist   fusedist.ops.moe.route_and_sort (the planner's choice)
             fused      the one-launch route + sort kernel (where T * k fits one CTA)
             one_cta    the routing kernel, then the one-CTA sort
             chunked    the routing kernel, then the chunked sort (chunks of 1024 pairs)
             torch      the Hugging Face models' torch code (softmax / sigmoid, torch.topk,
                        DeepSeek-V3's group mask) and the layout by argsort / bincount
                        (fusedist.ops.moe.sort_by_expert_reference)
             compile    that torch code under torch.compile(fullgraph=True)
           fused / one_cta / chunked measure the tuning table's moe_gating knobs
           (fusedist/tuning_default.json).
  permute  the tokens into the layout and back (bf16 rows of the model's hidden size):
             permute        fusedist permute vs torch index_select + where
             permute_fp8    quant="token" (e4m3 + a scale a row) vs torch's index_select and
                            per-row quantization
             permute_fp8g   quant="group" (a scale per 128 columns)
             unpermute      fusedist unpermute with the residual vs torch index_add_ of the
                            weighted rows (fp32) + residual
           each beside torch.compile of the torch code; GB/s = bytes read + written / time,
           % HBM of a device-to-device copy in the same run.
  (gemm and layer: the grouped GEMMs and the MoE layer, parts of their own.)
Timing as benchmarks/add_rmsnorm.py: each backend's calls captured in one CUDA graph rotating
over input sets that stream at least twice the L2 per replay, the graphs replayed interleaved
(benchmarks/_harness.py); *_us = median per call; vs_torch / vs_compile = their time /
fusedist's. Routings: balanced (random logits) or skewed (a quarter of the experts get +4 on
every logit: most pairs go to them).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # not the checkout: fusedist stays the installed one
import _harness as H  # noqa: E402
from add_rmsnorm import fmt  # noqa: E402
from attention import hbm_ceiling_tbs  # noqa: E402

import fusedist  # noqa: E402,F401
from fusedist.ops import moe  # noqa: E402
from fusedist.ops.moe import gating as G  # noqa: E402

OPS = 20          # calls per graph at least (more when the rotation needs more input sets)
ROUNDS, REPS = 3, 10
# name: (experts, top_k, hidden, RouterSpec keywords, bias)
MODELS = {
    "qwen3-30b-a3b": (128, 8, 2048, dict(scoring="softmax", renormalize=True), False),
    "mixtral-8x7b": (8, 2, 4096, dict(scoring="softmax", renormalize=True), False),
    "deepseek-v3": (256, 8, 7168, dict(scoring="sigmoid", renormalize=True, num_groups=8,
                                       topk_groups=4, routed_scaling=2.5), True),
}
TOKENS = (1, 4, 16, 64, 512, 4096, 16384)
QUICK_TOKENS = (1, 16, 4096)
QUICK_MODELS = ("qwen3-30b-a3b", "deepseek-v3")   # the two routing schemes
ROUTINGS = ("balanced", "skewed")


def torch_route(logits, spec, bias):
    """The HF models' routing in torch: scores in fp32, torch.topk (DeepSeek-V3: the group
    mask from the two best biased scores a group, the weights gathered unbiased)."""
    x = logits.float()
    s = torch.softmax(x, -1) if spec.scoring == "softmax" else torch.sigmoid(x)
    choice = s if bias is None else s + bias
    if spec.num_groups > 1:
        T, E = x.shape
        g = spec.num_groups
        gs = choice.view(T, g, E // g).topk(2, -1)[0].sum(-1)
        keep = gs.topk(spec.topk_groups, -1)[1]
        mask = torch.zeros(T, g, device=x.device, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~mask.repeat_interleave(E // g, 1), float("-inf"))
    ids = choice.topk(spec.top_k, -1)[1]
    w = s.gather(1, ids)
    if spec.renormalize:
        w = w / w.sum(-1, keepdim=True)
    return ids, w * spec.routed_scaling


def torch_route_sort(logits, spec, bias, align):
    ids, w = torch_route(logits, spec, bias)
    lay = G.sort_by_expert_reference(ids, logits.shape[1], align)
    return ids, w, lay.src_index, lay.dest_index


def _logits(T, E, routing):
    x = torch.randn(T, E, device="cuda")
    if routing == "skewed":
        x[:, : max(1, E // 4)] += 4.0
    return x.to(torch.bfloat16)


def _report(status, what):
    for n, st in status.items():
        if st != "ok":
            print(f"  {what} {n}: {st}", flush=True)


# ---- gating ----------------------------------------------------------------------------------

def gating_row(model: str, T: int, routing: str, align: int) -> dict:
    E, k, _, kw, has_bias = MODELS[model]
    spec = moe.RouterSpec(k, **kw)
    bias = (0.1 * torch.randn(E, device="cuda")) if has_bias else None
    sets = H.rotation_sets(T * E * 2, most=256)
    ops = max(OPS, sets)
    xs = [_logits(T, E, routing) for _ in range(sets)]
    rows = moe.capacity(T, E, k, align)
    C = G._ext.load()

    def split(chunk):
        def step(i):
            ids, _ = G._route_kernel(xs[i % sets], spec, bias)
            G._sort_impl(ids, E, align, rows, G.SortPlan("kernel", chunk))
        return step

    def torch_code(x):
        return torch_route_sort(x, spec, bias, align)

    torch._dynamo.reset()
    compiled = torch.compile(torch_code, fullgraph=True, dynamic=False)
    steps = {"fusedist": lambda i: moe.route_and_sort(xs[i % sets], spec, bias, align=align),
             "torch": lambda i: torch_code(xs[i % sets]),
             "compile": lambda i: compiled(xs[i % sets])}
    if T * k <= C.MOE_SORT_SMALL_MAX_PAIRS:
        steps["fused"] = lambda i: G._route_sort_impl(xs[i % sets], spec, bias, align, rows,
                                                      fused=True)
        steps["one_cta"] = split(0)
    steps["chunked"] = split(1024)
    med, _, status = H.time_graphs_interleaved(steps, ops, ROUNDS, REPS, pacer="torch")
    _report(status, f"{model} T={T}")
    row = dict(op="moe_gating", model=model, tokens=T, experts=E, top_k=k, routing=routing,
               align=align, world_size=1, input_sets=sets, calls_per_graph=ops)
    times = {n: t for n, t in med.items() if status[n] == "ok"}
    row.update({f"{n}_us": t for n, t in times.items()})
    if times.get("fusedist"):
        for b in ("torch", "compile"):
            if times.get(b):
                row[f"vs_{b}"] = times[b] / times["fusedist"]
    row["path"] = "fused" if G.fused_ok(xs[0], spec) else \
        ("one_cta" if G.sort_plan(torch.empty(T, k, dtype=torch.int32, device="cuda"), E)
         .chunk_pairs == 0 else "chunked")
    del xs, compiled
    return row


def gating_markdown(rows, hbm_tbs) -> str:
    out = ["Router logits bf16 [T, E] -> ids, weights and the layout by expert. fusedist: "
           "route_and_sort (the planner's path); fused / one_cta / chunked: its variants.", "",
           "| model | T | routing | path | fusedist us | fused us | one_cta us | chunked us | "
           "torch us | compile us | vs torch | vs compile |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['tokens']} | {r['routing']} | {r.get('path', '-')} | "
                   f"{fmt(r.get('fusedist_us'))} | {fmt(r.get('fused_us'))} | "
                   f"{fmt(r.get('one_cta_us'))} | {fmt(r.get('chunked_us'))} | "
                   f"{fmt(r.get('torch_us'))} | {fmt(r.get('compile_us'))} | "
                   f"{fmt(r.get('vs_torch'))} | {fmt(r.get('vs_compile'))} |")
    return "\n".join(out) + "\n"


# ---- permute / unpermute ---------------------------------------------------------------------

def torch_permute(x, src, k):
    return torch.where((src >= 0)[:, None], x.index_select(0, src.clamp_min(0) // k),
                       torch.zeros((), dtype=x.dtype, device=x.device))


def torch_permute_fp8(x, src, k, group):
    xp = torch_permute(x, src, k).float()
    if group:
        xp = xp.unflatten(-1, (xp.shape[-1] // 128, 128))
    amax = xp.abs().amax(-1, keepdim=True)
    s = torch.where(amax == 0, torch.ones_like(amax), amax.clamp_min(1e-30) / 448.0)
    q = (xp / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return (q.flatten(-2), s.squeeze(-1)) if group else (q, s.squeeze(-1))


def torch_unpermute(y, dest, w, r):
    T, k = w.shape
    tok = torch.arange(T, device=y.device).repeat_interleave(k)
    acc = r.to(torch.float32, copy=True).index_add_(0, tok, y.index_select(0, dest).float() *
                                                    w.reshape(-1, 1))
    return acc.to(y.dtype)


def permute_rows(model: str, T: int, routing: str, align: int, hbm: float) -> list:
    E, k, Hd, kw, has_bias = MODELS[model]
    spec = moe.RouterSpec(k, **kw)
    bias = (0.1 * torch.randn(E, device="cuda")) if has_bias else None
    dt = torch.bfloat16
    es = dt.itemsize
    _, w, lay = moe.route_and_sort(_logits(T, E, routing), spec, bias, align=align)
    rows = lay.rows
    pairs = T * k
    src, dest = lay.src_index, lay.dest_index
    forms = {  # name: (bytes read + written, fusedist, torch, per-set inputs)
        "permute": (pairs * Hd * es + rows * Hd * es,),
        "permute_fp8": (pairs * Hd * es + rows * (Hd + 4),),
        "permute_fp8g": (pairs * Hd * es + rows * (Hd + 4 * Hd // 128),),
        "unpermute": (pairs * Hd * es + 2 * T * Hd * es + pairs * 8,),
    }
    out = []
    for form, (nbytes,) in forms.items():
        sets = H.rotation_sets(nbytes, most=64)
        ops = max(OPS, sets)
        if form == "unpermute":
            ys = [torch.randn(rows, Hd, device="cuda").to(dt) for _ in range(sets)]
            rs = [torch.randn(T, Hd, device="cuda").to(dt) for _ in range(sets)]
            fus = lambda i: moe.unpermute(ys[i % sets], lay, w, residual=rs[i % sets])  # noqa: E731
            ref = torch_unpermute
            args = lambda i: (ys[i % sets], dest, w, rs[i % sets])  # noqa: E731
        else:
            xs = [torch.randn(T, Hd, device="cuda").to(dt) for _ in range(sets)]
            quant = {"permute": None, "permute_fp8": "token", "permute_fp8g": "group"}[form]
            fus = (lambda q: lambda i: moe.permute(xs[i % sets], lay, quant=q))(quant)
            if quant is None:
                ref = torch_permute
                args = lambda i: (xs[i % sets], src, k)  # noqa: E731
            else:
                ref = torch_permute_fp8
                args = (lambda g: lambda i: (xs[i % sets], src, k, g))(quant == "group")
        torch._dynamo.reset()
        compiled = torch.compile(ref, fullgraph=True, dynamic=False)
        steps = {"fusedist": fus, "torch": lambda i: ref(*args(i)),
                 "compile": lambda i: compiled(*args(i))}
        med, _, status = H.time_graphs_interleaved(steps, ops, ROUNDS, REPS, pacer="torch")
        _report(status, f"{model} T={T} {form}")
        row = dict(op=f"moe_{form}", model=model, tokens=T, hidden=Hd, top_k=k, experts=E,
                   routing=routing, align=align, rows=rows, dtype="bfloat16", world_size=1,
                   bytes=nbytes, input_sets=sets, calls_per_graph=ops)
        row.update(H.rate_columns({n: t for n, t in med.items() if status[n] == "ok"}, nbytes,
                                  hbm))
        out.append(row)
        del compiled
    return out


def permute_markdown(rows, hbm_tbs) -> str:
    out = [f"HBM copy in this run: {hbm_tbs:.2f} TB/s (read + written). bf16 rows of the "
           "model's hidden size; inputs rotate past the L2.", "",
           "| op | model | T | routing | rows | fusedist us | GB/s | % HBM | torch us | "
           "compile us | vs torch | vs compile |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['op']} | {r['model']} | {r['tokens']} | {r['routing']} | {r['rows']} "
                   f"| {fmt(r.get('fusedist_us'))} | {fmt(r.get('fusedist_gbs'), 0)} | "
                   f"{fmt(r.get('pct_hbm'), 1)} | {fmt(r.get('torch_us'))} | "
                   f"{fmt(r.get('compile_us'))} | {fmt(r.get('vs_torch'))} | "
                   f"{fmt(r.get('vs_compile'))} |")
    return "\n".join(out) + "\n"


# ---- driver ----------------------------------------------------------------------------------

def _gating_part(args, hbm):
    for model in args.models:
        for T in args.tokens:
            for routing in args.routing:
                yield gating_row(model, T, routing, args.align)


def _permute_part(args, hbm):
    for model in args.models:
        for T in args.tokens:
            for routing in args.routing:
                yield from permute_rows(model, T, routing, args.align, hbm)


# part: (rows(args, hbm_tbs), markdown(rows, hbm_tbs))
PARTS = {"gating": (_gating_part, gating_markdown),
         "permute": (_permute_part, permute_markdown)}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--what", default="gating,permute",
                    help=f"comma-separated parts: {', '.join(PARTS)}")
    ap.add_argument("--quick", action="store_true",
                    help=f"T = {', '.join(map(str, QUICK_TOKENS))}, balanced routing, "
                         f"{' and '.join(QUICK_MODELS)} (unless given)")
    ap.add_argument("--models", default=None, help="comma-separated: " + ", ".join(MODELS))
    ap.add_argument("--tokens", default=None, help="comma-separated token counts")
    ap.add_argument("--routing", default=None, help="comma-separated: balanced, skewed")
    ap.add_argument("--align", type=int, default=1,
                    help="the layout's row alignment (the grouped GEMM's tile; default 1)")
    args = ap.parse_args(argv)
    args.what = [p for p in args.what.split(",") if p]
    for p in args.what:
        if p not in PARTS:
            raise SystemExit(f"--what: {p!r} is not a part of benchmarks/moe.py; parts: "
                             f"{', '.join(PARTS)}")
    args.models = [m for m in args.models.split(",") if m] if args.models else \
        list(QUICK_MODELS if args.quick else MODELS)
    for m in args.models:
        if m not in MODELS:
            raise SystemExit(f"--models: {m!r} is not one of {', '.join(MODELS)}")
    args.tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else \
        list(QUICK_TOKENS if args.quick else TOKENS)
    if any(t < 1 for t in args.tokens):
        raise SystemExit("--tokens: token counts must be >= 1")
    args.routing = args.routing.split(",") if args.routing else \
        (["balanced"] if args.quick else list(ROUTINGS))
    for r in args.routing:
        if r not in ROUTINGS:
            raise SystemExit(f"--routing: {r!r} is not one of {', '.join(ROUTINGS)}")
    if args.align < 1:
        raise SystemExit("--align must be >= 1")
    return args


def main(argv=None):
    args = parse(argv)
    if not torch.cuda.is_available():
        print("benchmarks/moe.py needs a GPU")
        return
    torch.manual_seed(0)
    hbm = hbm_ceiling_tbs()
    for part in args.what:
        rows_for, markdown = PARTS[part]
        rows = []
        for row in rows_for(args, hbm):
            rows.append(row)
            print(", ".join(f"{k} {fmt(v)}" for k, v in row.items()
                            if k in ("op", "model", "tokens", "routing", "fusedist_us",
                                     "torch_us", "compile_us")), flush=True)
        meta = H.metadata(1)
        meta["command"] = "python benchmarks/moe.py " + " ".join(sys.argv[1:] if argv is None
                                                                 else argv)
        meta["hbm_copy_tbs"] = hbm
        md = markdown(rows, hbm)
        paths = H.write_results(f"moe-{part}", meta, rows, md)
        print(md + "\nresults: " + ", ".join(map(str, paths)))


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    main()
