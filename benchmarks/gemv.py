"""The decode GEMV on one GPU: fusedist.ops.gemv beside cuBLAS (torch.matmul, bf16) and
torch._scaled_mm (FP8) in the same run, on the same data.

    python3 benchmarks/gemv.py                # 16 Llama-3-8B / 70B projections (TP 1 and 2), M = 1, 4, 16
    python3 benchmarks/gemv.py --quick        # 3 shapes, M = 1 and 16 (under a minute)
    python3 benchmarks/gemv.py --ms 1,8 --models 8b --formats bf16,fp8_channel
    python3 benchmarks/gemv.py --ctas-per-sm 1,2   # + the kernel with its grid capped (diagnostic)
    python3 benchmarks/gemv.py --stages 0,2,6      # + other weight pipelines (diagnostic)
    python3 benchmarks/gemv.py --ms 32,64 --formats w8a8_channel --tps 1   # W8A8, decode batches

Shapes (K x N of the weight W [N, K], an nn.Linear): Llama-3-8B and -70B's qkv, o, gate|up
and down projections at TP 1, and at TP 2 (N halved for the column-parallel ones, K for the
row-parallel ones). Formats, each timed with its baselines:
  bf16          fusedist gemv(x, w)                        | cublas: torch.matmul(x, w.t())
  fp8_tensor    gemv(x, w8, scale=s[1])                    | scaled_mm_tensor: _scaled_mm(x8,
                                                             w8.t(), scale_a=1, scale_b=s)
  fp8_channel   gemv(x, w8, scale=s[N])                    | scaled_mm_rowwise: scale_a [M, 1],
                                                             scale_b [1, N]
  fp8_block     gemv(x, w8, scale=s[N/128, K/128])         | scaled_mm_rowwise (the nearest
                                                             form _scaled_mm has on Hopper)
  w8a8_channel  gemv(xq, w8, scale=s[N], x_scale=sx[M])    | scaled_mm_rowwise_xq: the same
                (x quantized per row, M <= 64)               xq and scales, scale_a = sx
x is bf16 [M, K] for fusedist (no activation quantization); _scaled_mm gets x8 = x in e4m3,
quantized once outside the timing (its quantization kernel is not counted), padded to 16
rows where it refuses M. Every fp8 row also shows cuBLAS bf16 at the same shape (vs_bf16).

Timing: each call reads a different weight copy (enough copies to stream at least twice the
L2 per graph replay, as a decode step's layers do), calls are captured in CUDA graphs and the
graphs of one (shape, M) replay interleaved (benchmarks/_harness.py); us = median per call.
TB/s = weight bytes (+ scale bytes) / us; "% ceil" = of --ceiling-tbs (default 4.48 TB/s,
the streaming-read rate of one H200 measured with a plain read kernel); vs_X = X's time /
fusedist's (> 1: fusedist faster). Every output is checked against a float64 reference
before it is timed (rel_err). Results: benchmarks/results/<gpu>-w1/gemv<tag>.{json,md}
(FUSEDIST_RESULTS_DIR replaces benchmarks/results).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import os
import sys
import time
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # not the checkout: fusedist stays the installed one
import _harness as H  # noqa: E402

QUICK = ("8b/tp1/o", "8b/tp1/down", "70b/tp2/qkv")
FORMATS = ("bf16", "fp8_tensor", "fp8_channel", "fp8_block")
BASELINE = {"bf16": "cublas", "fp8_tensor": "scaled_mm_tensor",
            "fp8_channel": "scaled_mm_rowwise", "fp8_block": "scaled_mm_rowwise",
            "w8a8_channel": "scaled_mm_rowwise_xq"}
TARGET_TBS = {"bf16": 4.2, "fp8": 4.0}
MS = (1, 4, 16)


def shapes(quick: bool = False, models=("8b", "70b"), tps=(1, 2)) -> list:
    """(name, K, N) of each projection: qkv, o, gate_up (column-parallel at TP > 1: N / tp),
    down (row-parallel: K / tp)."""
    out = [(f"{model}/tp{tp}/{proj}", k, n)
           for model, tp, proj, k, n in H.llama_projections(models, tps)]
    return [s for s in out if s[0] in QUICK] if quick else out


def weight_bytes(k: int, n: int, fmt: str) -> int:
    """Bytes a call must read for its weight: W, plus its fp32 scales."""
    if fmt == "bf16":
        return 2 * n * k
    scales = {"fp8_tensor": 1, "fp8_channel": n, "w8a8_channel": n,
              "fp8_block": -(-n // 128) * -(-k // 128)}[fmt]
    return n * k + 4 * scales


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    o = out.double()
    if not bool(torch.isfinite(o).all()):
        return float("inf")
    return float((o - ref).norm() / ref.norm().clamp_min(1e-30))


class Shape:
    """The weight copies of one (K, N) in every format, and the float64 reference data."""

    def __init__(self, k: int, n: int, formats, gen):
        self.k, self.n = k, n
        fp8 = [f for f in formats if f != "bf16"]
        self.ring_bf16 = max(2, H.rotation_sets(2 * n * k, most=64))
        self.ring_fp8 = max(2, H.rotation_sets(n * k, most=64)) if fp8 else 0
        self.w = [(torch.randn(n, k, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
                  for _ in range(self.ring_bf16)]
        self.w8, self.s = [], {}
        if fp8:
            nb, kb = -(-n // 128), -(-k // 128)
            ch = (torch.rand(n, device="cuda", generator=gen) + 0.5) * 4e-4
            self.s = {"fp8_tensor": torch.full((1,), 0.05 / 128, device="cuda"),
                      "fp8_channel": ch, "w8a8_channel": ch,
                      "fp8_block": (torch.rand(nb, kb, device="cuda", generator=gen) + 0.5)
                      * 4e-4}
            for _ in range(self.ring_fp8):
                self.w8.append((torch.randn(n, k, device="cuda", generator=gen) * 128)
                               .clamp(-448, 448).to(torch.float8_e4m3fn))

    def ref(self, x: torch.Tensor, fmt: str) -> torch.Tensor:
        """float64 x @ W.t() for copy 0 of the format's weights."""
        if fmt == "bf16":
            return x.double() @ self.w[0].double().t()
        G = importlib.import_module("fusedist.ops.gemv")
        return x.double() @ G.dequantize(self.w8[0], self.s[fmt]).double().t()


def _scaled_mm_calls(x: torch.Tensor, sh: Shape, fast_accum: bool) -> dict:
    """{name: (call(i) or None, notes)} of the _scaled_mm baselines (per-tensor, row-wise):
    each with x8 padded to 16 rows where M is refused, checked against float64 first; None
    with the reason where this torch / GPU does not run it."""
    m, k = x.shape
    n = sh.n
    calls = {}

    def padded(rows):  # x in e4m3, zero rows below M
        xp = torch.zeros(rows, k, device="cuda", dtype=torch.bfloat16)
        xp[:m] = x.clamp(-448, 448)
        return xp.to(torch.float8_e4m3fn)

    s_ch = sh.s["fp8_channel"].view(1, n)
    one = torch.ones((), device="cuda")
    forms = {
        "scaled_mm_tensor": lambda x8: (one, sh.s["fp8_tensor"].reshape(())),
        "scaled_mm_rowwise": lambda x8: (torch.ones(x8.shape[0], 1, device="cuda"), s_ch),
    }
    refs = {"scaled_mm_tensor": "fp8_tensor", "scaled_mm_rowwise": "fp8_channel"}
    for name, scales in forms.items():
        for rows in (m, 16 * -(-m // 16)):
            x8 = padded(rows)
            sa, sb = scales(x8)
            try:
                y = torch._scaled_mm(x8, sh.w8[0].t(), scale_a=sa, scale_b=sb,
                                     out_dtype=torch.bfloat16, use_fast_accum=fast_accum)
                torch.cuda.synchronize()
            except (RuntimeError, ValueError, TypeError, NotImplementedError) as e:
                why = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
                continue
            ref = x8[:m].float().double() @ importlib.import_module("fusedist.ops.gemv") \
                .dequantize(sh.w8[0], sh.s[refs[name]]).double().t()
            err = _rel_err(y[:m], ref)  # x in e4m3: a few % (a wrong scaling: ~100%)
            if not err < 0.1:
                why = f"rel err {err:.3g} (not this scaling)"
                continue
            calls[name] = ((lambda x8, sa, sb: lambda i: torch._scaled_mm(
                x8, sh.w8[i % sh.ring_fp8].t(), scale_a=sa, scale_b=sb,
                out_dtype=torch.bfloat16, use_fast_accum=fast_accum))(x8, sa, sb),
                {"rows": rows, "rel_err": err})
            break
        else:
            calls[name] = (None, {"status": why})
    return calls


def time_shape(name: str, k: int, n: int, m: int, sh: Shape, args, gen) -> list:
    """The rows of one (shape, M): every format, its fusedist time and its baselines'."""
    from fusedist.ops import gemv
    G = importlib.import_module("fusedist.ops.gemv")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = (torch.randn(m, k, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
    outs = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    steps, errs, info = {}, {}, {}
    fmts = [f for f in args.formats if f == "bf16" or sh.w8]

    def check(label, call, ref, fmt_of=None):
        o = call(0)
        torch.cuda.synchronize()
        errs[label] = _rel_err(o, ref)
        if not errs[label] < 1e-2:
            print(f"  {name} M={m} {label}: rel err {errs[label]:.3g}; not timed", flush=True)
            return False
        return True

    # cuBLAS bf16 (the pacer: every burst starts after ~20 calls' worth of it)
    def cublas(i):
        return torch.matmul(x, sh.w[i % sh.ring_bf16].t(), out=outs[i % 2])
    if check("cublas", cublas, sh.ref(x, "bf16")):
        steps["cublas"] = cublas
    for fmt in fmts:
        ref = sh.ref(x, fmt)
        if fmt == "bf16":
            def call(i, c=None):
                return gemv(x, sh.w[i % sh.ring_bf16], out=outs[i % 2])
            capped = lambda c, st=-1: lambda i: G.launch(  # noqa: E731
                outs[i % 2], x, sh.w[i % sh.ring_bf16], None, None, max_ctas=c, stages=st)
            info[fmt] = dataclasses.asdict(G.plan(x, sh.w[0]))
        elif fmt == "w8a8_channel":
            s = sh.s[fmt]
            QR = importlib.import_module("fusedist.ops.quantize_rows")
            xq, sx = QR.quantize_rows_reference(x)
            ref = (xq.double() * sx.double()) @ G.dequantize(sh.w8[0], s).double().t()

            def call(i, s=s, xq=xq, sx=sx):
                return gemv(xq, sh.w8[i % sh.ring_fp8], scale=s, out=outs[i % 2], x_scale=sx)
            capped = (lambda s, xq, sx: lambda c, st=-1: lambda i: G.launch(  # noqa: E731
                outs[i % 2], xq, sh.w8[i % sh.ring_fp8], s, None, max_ctas=c, stages=st,
                x_scale=sx))(s, xq, sx)
            info[fmt] = dataclasses.asdict(G.plan(xq, sh.w8[0], s, x_scale=sx))

            def smm(i, xq=xq, sx=sx, s=s):   # the same product by row-wise _scaled_mm
                return torch._scaled_mm(xq, sh.w8[i % sh.ring_fp8].t(), scale_a=sx,
                                        scale_b=s.view(1, -1), out_dtype=torch.bfloat16)
            if args.scaled_mm and check("scaled_mm_rowwise_xq", smm, ref):
                steps["scaled_mm_rowwise_xq"] = smm
        else:
            s = sh.s[fmt]

            def call(i, s=s):
                return gemv(x, sh.w8[i % sh.ring_fp8], scale=s, out=outs[i % 2])
            capped = (lambda s: lambda c, st=-1: lambda i: G.launch(  # noqa: E731
                outs[i % 2], x, sh.w8[i % sh.ring_fp8], s, None, max_ctas=c, stages=st))(s)
            info[fmt] = dataclasses.asdict(G.plan(x, sh.w8[0], s))
        if check(f"fusedist:{fmt}", call, ref):
            steps[f"fusedist:{fmt}"] = call
        for cps in args.ctas_per_sm:
            label = f"fusedist:{fmt}:cps{cps}"
            if check(label, capped(sms * cps), ref):
                steps[label] = capped(sms * cps)
        for st in args.stages:
            label = f"fusedist:{fmt}:st{st}"
            if check(label, capped(0, st), ref):
                steps[label] = capped(0, st)
    baselines = {}
    if sh.w8 and args.scaled_mm:
        for bname, (call, meta) in _scaled_mm_calls(x, sh, args.fast_accum).items():
            baselines[bname] = meta
            if call is not None:
                steps[bname] = call
    ops = max(sh.ring_bf16, sh.ring_fp8, 2)
    est_us = 2 * n * k / 4e6
    ops = max(ops, min(64, math.ceil(150 / max(est_us, 1.0))))
    clocks = {}
    med, per_round, status = H.time_graphs_interleaved(
        steps, ops, args.rounds, args.reps, warmup=2, pacer="cublas" if "cublas" in steps else None,
        pace_us=min(5000.0, 20 * est_us), clocks=clocks)
    t = {nm: v for nm, v in med.items() if status.get(nm) == "ok"}
    for nm, st in status.items():
        if st != "ok":
            print(f"  {name} M={m} {nm}: {st}", flush=True)
    rows = []
    for fmt in fmts:
        fd = t.get(f"fusedist:{fmt}")
        nbytes = weight_bytes(k, n, fmt)
        row = {"shape": name, "K": k, "N": n, "M": m, "format": fmt, "bytes": nbytes,
               "calls_per_graph": ops, "ring": sh.ring_bf16 if fmt == "bf16" else sh.ring_fp8,
               "plan": info.get(fmt), "rel_err": {lb: e for lb, e in errs.items()
                                                  if lb.startswith(f"fusedist:{fmt}")},
               "time_us": {}, "vs": {}}
        row["time_us"]["fusedist"] = fd
        for cps in args.ctas_per_sm:
            row["time_us"][f"cps{cps}"] = t.get(f"fusedist:{fmt}:cps{cps}")
        for st in args.stages:
            row["time_us"][f"st{st}"] = t.get(f"fusedist:{fmt}:st{st}")
        base = [BASELINE[fmt]]
        for b in base + (["cublas"] if fmt != "bf16" else []):
            key = "bf16" if (fmt != "bf16" and b == "cublas") else b
            row["time_us"][key] = t.get(b)
            if fd and t.get(b):
                row["vs"][key] = t[b] / fd
            if b in baselines:
                row.setdefault("baseline_meta", {})[b] = baselines[b]
        if fd:
            row["tbs"] = nbytes / fd / 1e6
            row["pct_ceiling"] = 100.0 * row["tbs"] / args.ceiling_tbs
            row["meets_target"] = row["tbs"] >= TARGET_TBS["bf16" if fmt == "bf16" else "fp8"]
            row["base_tbs"] = {b: nbytes / t[b] / 1e6 for b in base if t.get(b)}
        mhz = clocks.get(f"fusedist:{fmt}")
        row["sm_clock_mhz"] = median(mhz) if mhz else None
        row["ratio_rounds"] = {
            b: [a / f for a, f in zip(per_round.get(b, []), per_round.get(f"fusedist:{fmt}", []))]
            for b in base if b in per_round and f"fusedist:{fmt}" in per_round}
        rows.append(row)
    return rows


def fmt_v(v, p=2):
    return "-" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))


def markdown(rows, args) -> str:
    out = [f"fusedist.ops.gemv beside cuBLAS bf16 (torch.matmul) and torch._scaled_mm FP8, one "
           f"GPU, CUDA graphs, weights rotated past L2. TB/s: weight (+ scale) bytes / time; "
           f"% ceil: of {args.ceiling_tbs} TB/s; vs: baseline time / fusedist time (> 1: "
           f"fusedist faster); targets {TARGET_TBS['bf16']} TB/s bf16, {TARGET_TBS['fp8']} "
           "TB/s fp8.", "",
           "| shape | K | N | M | format | fusedist us | TB/s | % ceil | baseline | baseline us "
           "| baseline TB/s | **vs baseline** | vs bf16 cuBLAS |" +
           "".join(f" cps{c} us |" for c in args.ctas_per_sm) +
           "".join(f" stages {st} us |" for st in args.stages),
           "|" + "---|" * (13 + len(args.ctas_per_sm) + len(args.stages))]
    for r in rows:
        base = BASELINE[r["format"]]
        bt = r["time_us"].get(base)
        out.append(
            f"| {r['shape']} | {r['K']} | {r['N']} | {r['M']} | {r['format']} | "
            f"{fmt_v(r['time_us'].get('fusedist'))} | {fmt_v(r.get('tbs'))} | "
            f"{fmt_v(r.get('pct_ceiling'), 1)} | {base} | {fmt_v(bt)} | "
            f"{fmt_v(r.get('base_tbs', {}).get(base))} | **{fmt_v(r['vs'].get(base))}** | "
            f"{fmt_v(r['vs'].get('bf16'))} |" +
            "".join(f" {fmt_v(r['time_us'].get(f'cps{c}'))} |" for c in args.ctas_per_sm) +
            "".join(f" {fmt_v(r['time_us'].get(f'st{st}'))} |" for st in args.stages))
    # Summary: the worst row of each (format, M), and how many rows met the target.
    out += ["", "| format | M | rows | min TB/s (shape) | rows >= target | min vs baseline "
            "(shape) |", "|---|---|---|---|---|---|"]
    for f in args.formats:
        for m in args.ms:
            rs = [r for r in rows if r["format"] == f and r["M"] == m and r.get("tbs")]
            if not rs:
                continue
            lo = min(rs, key=lambda r: r["tbs"])
            vs = [(min(v for b, v in r["vs"].items() if b != "bf16"), r["shape"])
                  for r in rs if any(b != "bf16" for b in r["vs"])]
            worst = min(vs) if vs else (None, "-")
            out.append(f"| {f} | {m} | {len(rs)} | {lo['tbs']:.2f} ({lo['shape']}) | "
                       f"{sum(r['meets_target'] for r in rs)} | {fmt_v(worst[0])} "
                       f"({worst[1]}) |")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help=f"shapes {', '.join(QUICK)} at M = 1 and 16")
    ap.add_argument("--ms", default=None, help="comma-separated M (default 1,4,16)")
    ap.add_argument("--models", default="8b,70b")
    ap.add_argument("--tps", default="1,2")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--ctas-per-sm", default="",
                    help="also time the kernel with its grid capped at SMs x c (diagnostic)")
    ap.add_argument("--stages", default="",
                    help="also time these weight pipelines: 0 (registers) or 1-6 ring stages "
                         "(diagnostic; the headline is the default)")
    ap.add_argument("--no-scaled-mm", dest="scaled_mm", action="store_false")
    ap.add_argument("--fast-accum", action="store_true",
                    help="_scaled_mm with use_fast_accum=True (default False)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (3; quick 2)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ceiling-tbs", type=float, default=4.48)
    ap.add_argument("--tag", default="", help="results file stem suffix: gemv<tag>")
    args = ap.parse_args()
    args.formats = [f for f in args.formats.split(",") if f]
    for f in args.formats:
        if f not in BASELINE:
            raise SystemExit(f"--formats: {f!r} is not one of {', '.join(BASELINE)}")
    if "w8a8_channel" in args.formats and args.ms and max(int(v) for v in args.ms.split(",")) > 64:
        raise SystemExit("--formats w8a8_channel: the kernel takes M <= 64")
    args.ms = [int(v) for v in (args.ms or ("1,16" if args.quick else "1,4,16")).split(",")]
    args.ctas_per_sm = [int(v) for v in args.ctas_per_sm.split(",") if v]
    args.stages = [int(v) for v in args.stages.split(",") if v]
    args.rounds = args.rounds or (2 if args.quick else 3)
    if not torch.cuda.is_available():
        print("benchmarks/gemv.py needs a GPU")
        return
    if not hasattr(torch, "float8_e4m3fn"):
        args.formats = [f for f in args.formats if f == "bf16"]
    G = importlib.import_module("fusedist.ops.gemv")
    torch.cuda.set_device(0)
    if not G.kernel_available(torch.device("cuda", 0)):
        raise SystemExit("benchmarks/gemv.py: the gemv kernel does not run here (fusedist._C "
                         "without it, or not a Hopper GPU)")
    gen = torch.Generator(device="cuda").manual_seed(1)
    t0 = time.time()
    rows = []
    for name, k, n in shapes(args.quick, args.models.split(","),
                             tuple(int(v) for v in args.tps.split(","))):
        sh = Shape(k, n, args.formats, gen)
        for m in args.ms:
            for r in time_shape(name, k, n, m, sh, args, gen):
                rows.append(r)
                print(f"{name} K={k} N={n} M={m} {r['format']}: fusedist "
                      f"{fmt_v(r['time_us'].get('fusedist'))} us, {fmt_v(r.get('tbs'))} TB/s, "
                      f"vs {', '.join(f'{b} {v:.2f}' for b, v in r['vs'].items()) or '-'}",
                      flush=True)
        del sh
        torch.cuda.empty_cache()
    meta = H.metadata(1)
    meta["command"] = "python3 benchmarks/gemv.py " + " ".join(sys.argv[1:])
    meta["ceiling_tbs"] = args.ceiling_tbs
    meta["quick"] = args.quick
    meta["seconds"] = round(time.time() - t0, 1)
    md = markdown(rows, args)
    paths = H.write_results("gemv" + args.tag, meta, rows, md)
    print(md + "\nresults: " + ", ".join(map(str, paths)))


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    main()
