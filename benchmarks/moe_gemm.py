"""The MoE grouped GEMM on one GPU: fusedist.ops.moe.grouped_gemm (the CUTLASS grouped GEMM and
the grouped decode GEMV) beside torch in the same run, on the same data.

    python3 benchmarks/moe_gemm.py --quick        # both models, both projections, 1 / 16 / 4096 tokens
    python3 benchmarks/moe_gemm.py                # + 4 / 64 / 512 / 16384 tokens, skewed routing, every format
    python3 benchmarks/moe_gemm.py --models qwen3-30b-a3b --tokens 1,16,4096 --formats bf16,fp8_block
    python3 benchmarks/moe_gemm.py --no-compile   # without the torch.compile baselines

Cases: the expert shapes of Mixtral-8x7B (E 8, top-2, hidden 4096, intermediate 14336) and
Qwen3-30B-A3B (E 128, top-8, hidden 2048, intermediate 768): gate_up (W [E, 2 I, H]) and down
(W [E, H, I]); 1-64 tokens (decode) and 512-16384 (prefill); routing "balanced" (each token's k
experts distinct, uniformly at random) or "skewed" (distinct, drawn with probability ~
1 / (rank + 1)^1.2: a few experts take most tokens). The layout is fusedist.ops.moe's
(sort_by_expert, align 1); the activations are permuted beforehand (not timed), except the
decode form fusedist runs in a model (gather=True: the GEMV reads the token-order x).

Formats, each timed with its baselines in CUDA graphs, interleaved (benchmarks/_harness.py):
  bf16         fusedist (auto path) | loop: torch.matmul per expert over its rows (segments
               known on the host, captured once) | loop_compile: the same under torch.compile
               (Mixtral's 8 experts; --compile-loop for every model) | grouped_mm:
               torch._grouped_mm (torch >= 2.8) | grouped_mm_compile | dense: one cuBLAS GEMM
               [pairs, K] x [K, N], the same FLOPs
  fp8          x e4m3 per token, w e4m3 per output channel (W8A8): fusedist (the grouped GEMM)
               | scaled_mm_loop: row-wise torch._scaled_mm per expert | vs bf16 fusedist
  fp8_block    x per token and 128 k, w 128 x 128 blocks: fusedist (the grouped GEMM, CUTLASS
               blockwise scaling) | vs bf16 fusedist (the target: >= 1.6x)
  fp8_w        bf16 x, w e4m3 per channel (weight-only, decode): fusedist (the GEMV)
  fp8_w_block  bf16 x, w 128 x 128 blocks (weight-only, decode): fusedist (the GEMV)
At decode sizes fusedist's two kernels are also timed forced (gemv / gemm columns: where the
"moe" tuning section's gemv_max_pairs should sit). Decode inputs rotate over several routings
per graph (each call reads other experts' weights: the weights come from HBM, as in a model's
step). TFLOP/s = 2 pairs N K / time; decode TB/s = the distinct routed experts' weight (+
scale) bytes / time (the bytes a call must read; averaged over the rotation); vs_X = X's time /
fusedist's (> 1: fusedist faster). Every output is checked against an fp32 per-expert product
of the dequantized operands before it is timed (rel_err < 1e-2, else the column is left out
with the reason). Results:
benchmarks/results/<gpu>-w1/moe_gemm<tag>.{json,md}.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # not the checkout: fusedist stays the installed one
import _harness as H  # noqa: E402

MODELS = {  # experts, top-k, hidden, intermediate
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "qwen3-30b-a3b": (128, 8, 2048, 768),
}
DECODE = (1, 4, 16, 64)
PREFILL = (512, 4096, 16384)
QUICK_TOKENS = (1, 16, 4096)
FORMATS = ("bf16", "fp8", "fp8_block", "fp8_w", "fp8_w_block")
DECODE_ONLY = ("fp8_w", "fp8_w_block")   # weight-only FP8: the GEMV's form
TARGETS = {"vs_dense": 0.9, "vs_grouped_mm": 1.2, "fp8_block_vs_bf16": 1.6,
           "decode_tbs_bf16": 3.8, "decode_tbs_fp8": 3.5}


@dataclass(frozen=True)
class Case:
    model: str
    proj: str        # gate_up or down
    experts: int
    top_k: int
    n: int
    k: int
    tokens: int
    routing: str     # balanced or skewed


def cases(quick: bool = False, models=tuple(MODELS), tokens=None, routings=None) -> list:
    """Every (model, projection, tokens, routing) of the run."""
    tokens = tokens or (QUICK_TOKENS if quick else DECODE + PREFILL)
    routings = routings or (("balanced",) if quick else ("balanced", "skewed"))
    out = []
    for m in models:
        E, k, hidden, inter = MODELS[m]
        for proj, n, kk in (("gate_up", 2 * inter, hidden), ("down", hidden, inter)):
            for t in tokens:
                for r in routings:
                    out.append(Case(m, proj, E, k, n, kk, t, r))
    return out


def routing_ids(T: int, E: int, k: int, how: str, gen: torch.Generator, device) -> torch.Tensor:
    """ids [T, k] int32, k distinct experts per token: "balanced" uniform, "skewed" with
    probability ~ 1 / (rank + 1)^1.2 over a random ranking of the experts."""
    if how == "balanced":
        return torch.rand(T, E, generator=gen, device=device).topk(k, dim=1).indices.int()
    rank = torch.randperm(E, generator=gen, device=device)
    p = (rank.double() + 1.0).pow(-1.2)
    return torch.multinomial(p.expand(T, E), k, replacement=False, generator=gen).int()


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    o = out.double()
    if not bool(torch.isfinite(o).all()):
        return float("inf")
    return float((o - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


class Weights:
    """One projection's expert weights in every format the run asks for."""

    def __init__(self, c: Case, formats, gen):
        E, N, K = c.experts, c.n, c.k
        self.w = (torch.randn(E, N, K, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
        self.w8 = {}
        if any(f != "bf16" for f in formats):
            Q = importlib.import_module("fusedist.ops.quantize_rows")
            nb, kb = -(-N // 128), -(-K // 128)
            wf = self.w.float()
            q, s = Q.quantize_rows_reference(wf)                      # per output channel
            self.w8["channel"] = (q, s.squeeze(-1))
            pad = torch.zeros(E, nb * 128, kb * 128, device="cuda")
            pad[:, :N, :K] = wf
            blocks = pad.view(E, nb, 128, kb, 128)
            sb = Q.unit_scale(blocks.abs().amax(dim=(2, 4)))
            qb = Q.to_e4m3(blocks / sb[:, :, None, :, None]).view(E, nb * 128, kb * 128)
            self.w8["block"] = (qb[:, :N, :K].contiguous(), sb)
            del wf, pad, blocks

    def of(self, fmt):
        """(w, w_scale) of a format."""
        if fmt == "bf16":
            return self.w, None
        return self.w8["block" if fmt in ("fp8_block", "fp8_w_block") else "channel"]

    def bytes_per_expert(self, fmt) -> int:
        w, s = self.of(fmt)
        return w[0].numel() * w.element_size() + (0 if s is None else s[0].numel() * 4)


def _x_of(fmt, x_tok):
    """Token-order activations of a format: bf16, or e4m3 with per-token / per-128-k scales."""
    Q = importlib.import_module("fusedist.ops.quantize_rows")
    if fmt == "fp8":
        q, s = Q.quantize_rows_reference(x_tok)
        return q, s.reshape(-1)
    if fmt == "fp8_block":
        return Q.quantize_groups_reference(x_tok)
    return x_tok, None


def _dequant(w, s, e):
    we = w[e].float()
    if s is None:
        return we
    se = s[e]
    if se.dim() == 1:
        return we * se[:, None]
    N, K = we.shape
    return we * se.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]


class Inputs:
    """One routing: its layout, the permuted activations, the host-known segments."""

    def __init__(self, c: Case, fmt, gen):
        M = importlib.import_module("fusedist.ops.moe")
        self.ids = routing_ids(c.tokens, c.experts, c.top_k, c.routing, gen, "cuda")
        self.layout = M.sort_by_expert(self.ids, c.experts)
        x = (torch.randn(c.tokens, c.k, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
        self.x_tok, self.sx_tok = _x_of(fmt, x)
        src = self.layout.src_index.long().clamp_min(0) // c.top_k
        self.x = self.x_tok.index_select(0, src)
        self.sx = None if self.sx_tok is None else self.sx_tok.index_select(0, src)
        cnt = self.layout.counts.tolist()
        off = self.layout.offsets.tolist()
        self.segments = [(e, off[e], cnt[e]) for e in range(c.experts) if cnt[e]]
        self.pairs = c.tokens * c.top_k
        self.out = torch.empty(self.layout.rows, c.n, dtype=torch.bfloat16, device="cuda")

    def reference(self, w, s) -> torch.Tensor:
        """fp32 per-expert product of the dequantized operands, [pairs, N] (the valid rows)."""
        x = self.x.float()
        if self.sx is not None:
            x = x * (self.sx[:, None] if self.sx.dim() == 1 else
                     self.sx.repeat_interleave(128, 1)[:, :x.shape[1]])
        ref = torch.empty(self.layout.rows, w.shape[1], device="cuda")
        for e, o, c in self.segments:
            ref[o:o + c] = x[o:o + c] @ _dequant(w, s, e).t()
        return ref[:self.pairs]


_COMPILED: dict = {}


def _grouped_mm_compiled():
    """torch._grouped_mm under torch.compile, compiled once for every shape (dynamic)."""
    if "gmm" not in _COMPILED:
        _COMPILED["gmm"] = torch.compile(
            lambda x, w, offs: torch._grouped_mm(x, w, offs=offs), dynamic=True)
    return _COMPILED["gmm"]


def _baselines(c: Case, fmt, ins, wts, args) -> dict:
    """{name: step(i)} of torch's ways to the same product, each checked first."""
    w, s = wts.of(fmt)
    steps = {}
    if fmt == "bf16":
        def loop(i, ins=ins):
            I = ins[i % len(ins)]
            for e, o, n in I.segments:
                torch.matmul(I.x[o:o + n], w[e].t(), out=I.out[o:o + n])
        steps["loop"] = loop
        if args.compile and not args.quick and (c.experts <= 8 or args.compile_loop):
            fns = [torch.compile(lambda I=I: [torch.matmul(I.x[o:o + n], w[e].t())
                                             for e, o, n in I.segments]) for I in ins]
            steps["loop_compile"] = lambda i: fns[i % len(fns)]()
        if hasattr(torch, "_grouped_mm"):
            wt = w.transpose(1, 2)   # [E, K, N], K contiguous

            def gmm(i, ins=ins):
                I = ins[i % len(ins)]
                return torch._grouped_mm(I.x[:I.pairs], wt, offs=I.layout.offsets[1:])
            steps["grouped_mm"] = gmm
            if args.compile:
                def gmm_compiled(i, ins=ins):
                    I = ins[i % len(ins)]
                    return _grouped_mm_compiled()(I.x[:I.pairs], wt, I.layout.offsets[1:])
                steps["grouped_mm_compile"] = gmm_compiled
        xd = ins[0].x[:ins[0].pairs]
        yd = torch.empty(ins[0].pairs, c.n, dtype=torch.bfloat16, device="cuda")
        steps["dense"] = lambda i: torch.matmul(xd, w[0].t(), out=yd)
    elif fmt == "fp8":
        # cuBLASLt's row-wise (outer-vector) scales must start 16-byte aligned: a view
        # I.sx[o:o + n] at a row offset o that is not a multiple of 4 is refused
        # (CUBLAS_STATUS_NOT_SUPPORTED), so each segment's scales get their own buffer here,
        # once, outside the timing, as a user keeping per-expert scales would hold them.
        seg_sx = [[I.sx[o:o + n, None].clone() for _, o, n in I.segments] for I in ins]

        def smm(i, ins=ins):
            I, sxs = ins[i % len(ins)], seg_sx[i % len(ins)]
            for (e, o, n), sx in zip(I.segments, sxs):
                I.out[o:o + n] = torch._scaled_mm(I.x[o:o + n], w[e].t(), scale_a=sx,
                                                  scale_b=s[e][None, :],
                                                  out_dtype=torch.bfloat16)
        steps["scaled_mm_loop"] = smm
    return steps


def time_case(c: Case, fmt: str, wts: Weights, args, gen) -> dict:
    """One row: fusedist and its baselines on case c in format fmt."""
    GG = importlib.import_module("fusedist.ops.moe.grouped_gemm")
    decode = c.tokens <= max(DECODE)
    w, s = wts.of(fmt)
    # Decode: enough routings that one replay streams >= twice the L2 of distinct weights.
    per_call = min(c.experts, c.tokens * c.top_k) * wts.bytes_per_expert(fmt)
    n_in = max(2, H.rotation_sets(per_call, most=16)) if decode else 1
    ins = [Inputs(c, fmt, gen) for _ in range(n_in)]
    distinct = median([len(I.segments) for I in ins])
    gather = decode and fmt in ("bf16", "fp8_w", "fp8_w_block")
    plans, steps, errs = {}, {}, {}

    def fusedist_step(path):
        g = gather and path != "gemm"   # the GEMM reads the permuted rows
        operands = [((I.x_tok, I.sx_tok) if g else (I.x, I.sx)) for I in ins]
        ps = [GG.plan(xi, w, I.layout, g, w_scale=s, x_scale=si, path=path)
              for I, (xi, si) in zip(ins, operands)]

        def step(i):
            j = i % len(ins)
            xi, si = operands[j]
            GG.run(ps[j], xi, w, ins[j].layout, w_scale=s, x_scale=si, gather=g,
                   out=ins[j].out)
        return ps[0].path, step

    paths = [None] + (["gemv", "gemm"] if decode and args.both_paths else [])
    for path in paths:
        label = "fusedist" if path is None else f"fusedist:{path}"
        try:
            plans[label], steps[label] = fusedist_step(path)
        except ValueError as e:   # that kernel does not take this form
            plans[label] = f"n/a ({str(e).split(': ', 1)[-1][:160]})"
    for name, st in _baselines(c, fmt, ins, wts, args).items():
        steps[name] = st
    ref = ins[0].reference(w, s)
    for name in list(steps):
        try:
            ins[0].out.fill_(float("nan"))
            r = steps[name](0)
            torch.cuda.synchronize()
            y = r[:ins[0].pairs] if isinstance(r, torch.Tensor) else ins[0].out[:ins[0].pairs]
            if name == "loop_compile":
                y = torch.cat(r) if r else y
            errs[name] = _rel_err(y, ref) if name != "dense" else 0.0
        except Exception as e:  # noqa: BLE001 - a baseline this torch / GPU lacks
            errs[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
            H.sync_quietly()
        if not (isinstance(errs[name], float) and errs[name] < 1e-2):
            print(f"  {c} {fmt} {name}: rel err {errs[name]}; not timed", flush=True)
            steps.pop(name)
    flops = 2.0 * ins[0].pairs * c.n * c.k
    est_us = max(flops / 500e12, per_call / 4e12) * 1e6
    ops = max(n_in, min(64, math.ceil(200 / max(est_us, 1.0))))
    med, per_round, status = H.time_graphs_interleaved(
        steps, ops, args.rounds, args.reps, warmup=2,
        pacer="fusedist" if "fusedist" in steps else None, pace_us=min(5000.0, 20 * est_us))
    t = {nm: v for nm, v in med.items() if status.get(nm) == "ok"}
    for nm, st in status.items():
        if st != "ok":
            print(f"  {c} {fmt} {nm}: {st}", flush=True)
    row = {**asdict(c), "format": fmt, "pairs": ins[0].pairs, "routings": n_in,
           "distinct_experts": distinct, "calls_per_graph": ops,
           "path": plans.get("fusedist"), "plans": {k: v for k, v in plans.items()
                                                     if isinstance(v, str)},
           "rel_err": errs, "time_us": t, "vs": {}}
    fd = t.get("fusedist")
    if fd:
        row["tflops"] = flops / fd / 1e6
        for b, tb in t.items():
            if b != "fusedist":
                row["vs"][b] = tb / fd
        if decode:
            row["tbs"] = distinct * wts.bytes_per_expert(fmt) / fd / 1e6
    return row


def fmt_v(v, p=2):
    return "-" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))


def markdown(rows) -> str:
    base = ("loop", "loop_compile", "grouped_mm", "grouped_mm_compile", "dense",
            "scaled_mm_loop", "fusedist:gemv", "fusedist:gemm")
    out = ["fusedist.ops.moe.grouped_gemm beside torch, one GPU, CUDA graphs (decode: routings "
           "rotated, weights from HBM). TFLOP/s = 2 pairs N K / time; TB/s (decode) = distinct "
           "routed experts' weight bytes / time; vs_X = X's time / fusedist's (> 1: fusedist "
           "faster); fp8 rows' vs bf16 = the bf16 fusedist row's time / this one's.", "",
           "| model | proj | tokens | routing | format | path | experts hit | fusedist us | "
           "TFLOP/s | TB/s | " + " | ".join(f"vs {b}" for b in base) + " | vs bf16 |",
           "|" + "---|" * (11 + len(base))]
    bf = {(r["model"], r["proj"], r["tokens"], r["routing"]): r for r in rows
          if r["format"] == "bf16"}
    for r in rows:
        b = bf.get((r["model"], r["proj"], r["tokens"], r["routing"]))
        vs_bf = None
        if r["format"] != "bf16" and b and b["time_us"].get("fusedist") and \
                r["time_us"].get("fusedist"):
            vs_bf = b["time_us"]["fusedist"] / r["time_us"]["fusedist"]
            r["vs"]["bf16"] = vs_bf
        out.append(f"| {r['model']} | {r['proj']} | {r['tokens']} | {r['routing']} | "
                   f"{r['format']} | {r['path']} | {r['distinct_experts']} | "
                   f"{fmt_v(r['time_us'].get('fusedist'), 1)} | {fmt_v(r.get('tflops'), 0)} | "
                   f"{fmt_v(r.get('tbs'))} | " +
                   " | ".join(fmt_v(r["vs"].get(x)) for x in base) + f" | {fmt_v(vs_bf)} |")
    # The targets, at >= 4096 tokens (GEMM) and <= 16 tokens (decode TB/s).
    out += ["", "| target | rows | met | worst (case) |", "|---|---|---|---|"]

    def target(name, sel, val, goal):
        rs = [(val(r), r) for r in rows if sel(r) and val(r) is not None]
        if rs:
            worst = min(rs, key=lambda p: p[0])
            out.append(f"| {name} >= {goal} | {len(rs)} | {sum(v >= goal for v, _ in rs)} | "
                       f"{worst[0]:.2f} ({worst[1]['model']} {worst[1]['proj']} "
                       f"{worst[1]['tokens']} {worst[1]['routing']}) |")
    big = lambda r: r["tokens"] >= 4096  # noqa: E731
    target("bf16 vs dense cuBLAS", lambda r: big(r) and r["format"] == "bf16",
           lambda r: r["vs"].get("dense"), TARGETS["vs_dense"])
    target("bf16 vs torch._grouped_mm", lambda r: big(r) and r["format"] == "bf16",
           lambda r: r["vs"].get("grouped_mm"), TARGETS["vs_grouped_mm"])
    target("fp8_block vs bf16", lambda r: big(r) and r["format"] == "fp8_block",
           lambda r: r["vs"].get("bf16"), TARGETS["fp8_block_vs_bf16"])
    target("decode TB/s bf16", lambda r: r["tokens"] <= 16 and r["format"] == "bf16",
           lambda r: r.get("tbs"), TARGETS["decode_tbs_bf16"])
    target("decode TB/s fp8_w", lambda r: r["tokens"] <= 16 and r["format"] == "fp8_w",
           lambda r: r.get("tbs"), TARGETS["decode_tbs_fp8"])
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help=f"tokens {', '.join(map(str, QUICK_TOKENS))}, balanced routing")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tokens", default=None, help="comma-separated token counts")
    ap.add_argument("--routings", default=None, help="balanced,skewed")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--no-compile", dest="compile", action="store_false",
                    help="skip the torch.compile baselines")
    ap.add_argument("--compile-loop", action="store_true",
                    help="the compiled per-expert loop for every model (slow to compile at "
                         "128 experts)")
    ap.add_argument("--no-both-paths", dest="both_paths", action="store_false",
                    help="at decode sizes time only the auto path (not the forced gemv / gemm)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (3; quick 2)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tag", default="", help="results file stem suffix: moe_gemm<tag>")
    args = ap.parse_args()
    args.formats = [f for f in args.formats.split(",") if f]
    for f in args.formats:
        if f not in FORMATS:
            raise SystemExit(f"--formats: {f!r} is not one of {', '.join(FORMATS)}")
    models = [m for m in args.models.split(",") if m]
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"--models: {m!r} is not one of {', '.join(MODELS)}")
    tokens = tuple(int(v) for v in args.tokens.split(",")) if args.tokens else None
    routings = tuple(args.routings.split(",")) if args.routings else None
    args.rounds = args.rounds or (2 if args.quick else 3)
    if not torch.cuda.is_available():
        print("benchmarks/moe_gemm.py needs a GPU")
        return
    if not hasattr(torch, "float8_e4m3fn"):
        args.formats = [f for f in args.formats if f == "bf16"]
    from fusedist import _ext
    torch.cuda.set_device(0)
    for kern in ("moe_grouped_gemm", "moe_grouped_gemv"):
        why = _ext.why_not(kern, torch.device("cuda", 0))
        if why:
            raise SystemExit(f"benchmarks/moe_gemm.py: the {kern} kernel does not run here ({why})")
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
    gen = torch.Generator(device="cuda").manual_seed(1)
    t0 = time.time()
    rows = []
    by_weights: dict = {}
    for c in cases(args.quick, models, tokens, routings):
        key = (c.model, c.proj)
        if key not in by_weights:
            by_weights.clear()
            torch.cuda.empty_cache()
            by_weights[key] = Weights(c, args.formats, gen)
        for fmt in args.formats:
            if fmt in DECODE_ONLY and c.tokens > max(DECODE):
                continue
            r = time_case(c, fmt, by_weights[key], args, gen)
            rows.append(r)
            print(f"{c.model} {c.proj} T={c.tokens} {c.routing} {fmt} ({r['path']}): fusedist "
                  f"{fmt_v(r['time_us'].get('fusedist'), 1)} us, "
                  f"{fmt_v(r.get('tflops'), 0)} TFLOP/s"
                  + (f", {fmt_v(r.get('tbs'))} TB/s" if 'tbs' in r else "") + ", vs "
                  + (", ".join(f"{b} {v:.2f}" for b, v in r["vs"].items()) or "-"), flush=True)
    meta = H.metadata(1)
    meta["command"] = "python3 benchmarks/moe_gemm.py " + " ".join(sys.argv[1:])
    meta["quick"] = args.quick
    meta["seconds"] = round(time.time() - t0, 1)
    meta["targets"] = TARGETS
    md = markdown(rows)
    paths = H.write_results("moe_gemm" + args.tag, meta, rows, md)
    print(md + "\nresults: " + ", ".join(map(str, paths)))


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    main()
