"""FP8 projections at prefill sizes on one GPU: fusedist.nn.quant.fp8_linear (what the model
runs for FP8 weights past the GEMV's 16 rows) beside cuBLAS bf16 on the same shapes, in the
same run.

    python3 benchmarks/fp8_linear.py              # Llama-3-8B / 70B (TP 1) projections, M = 128 .. 16384
    python3 benchmarks/fp8_linear.py --quick      # 8B projections, M = 4096
    python3 benchmarks/fp8_linear.py --ms 1024,8192 --models 70b
    python3 benchmarks/fp8_linear.py --tps 1,2,4,8 --ms 1024,4096 --tag=-tps   # one rank's shapes

Per shape (K x N of W [N, K], an nn.Linear weight) and M, each timed in CUDA graphs,
interleaved (benchmarks/_harness.py), x [M, K] bf16:
  bf16         torch.matmul(x, w.t())                       (cuBLAS, the reference speed)
  channel      fp8_linear with per-channel scales: x quantized per token (its own kernels,
               counted) + row-wise torch._scaled_mm
  block        fp8_linear with 128 x 128 block scales: x quantized per token and 128 k
               (counted) + torch's block-scaled scaled_mm where the device runs it, else the
               weight dequantized at every call (the "path" column says which)
  channel_gemm row-wise torch._scaled_mm alone, x already quantized (the GEMM's own speed)
  fusedist_gemm fusedist.ops.fp8_gemm (CUTLASS, fp32 promotion every 512 k) on the same xq,
               the same product as channel_gemm (where the build has it)
  fusedist_block fusedist.ops.fp8_gemm(block=True) (CUTLASS blockwise scaling) with the
               block weight, x already quantized per token and 128 k (K % 128 == 0)
TFLOP/s = 2 M N K / time; "vs bf16" = bf16 time / this time (> 1: FP8 faster). Every output
is checked against float64 on the dequantized weight (rel_err, the largest error over the
largest reference value) before it is timed. Results: benchmarks/results/<gpu>-w1/
fp8_linear<tag>.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # not the checkout: fusedist stays the installed one
import _harness as H  # noqa: E402

MS = (128, 1024, 4096, 16384)
TARGET = 1.5   # FP8 at M >= 4096: >= 1.5x bf16 cuBLAS


def shapes(models=("8b", "70b"), tps=(1,)) -> list:
    """(name, K, N) of each projection: qkv, o, gate_up, down; one rank's share at TP > 1
    (named model/tp<N>/projection; model/projection at TP 1)."""
    return [(f"{model}/{proj}" if tp == 1 else f"{model}/tp{tp}/{proj}", k, n)
            for model, tp, proj, k, n in H.llama_projections(models, tps)]


def run_shape(name, k, n, m, args, Q):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(k * 7 + n + m)
    x = (torch.randn(m, k, device=dev, generator=g) * 0.5).to(torch.bfloat16)
    w = (torch.randn(n, k, device=dev, generator=g) * 0.02).to(torch.bfloat16)
    weights = {lay: Q.quantize_fp8(w, lay) for lay in ("channel", "block")}
    out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    xq, sx = Q.quantize_rows(x)
    cw = weights["channel"]
    steps = {
        "bf16": lambda i: torch.matmul(x, w.t(), out=out),
        "channel": lambda i: Q.fp8_linear(x, cw),
        "block": lambda i: Q.fp8_linear(x, weights["block"]),
        "channel_gemm": lambda i: torch._scaled_mm(xq, cw.data.t(), scale_a=sx,
                                                   scale_b=cw.channel_scale.view(1, -1),
                                                   out_dtype=torch.bfloat16),
    }
    from fusedist.ops import fp8_gemm as FG
    if not FG.kernel_why_not(xq, cw.data, out, sx, cw.channel_scale):
        steps["fusedist_gemm"] = lambda i: FG.fp8_gemm(xq, sx, cw.data, cw.channel_scale,
                                                       out=out)
    bw = weights["block"]
    if k % 128 == 0:
        xg, sg = Q.quantize_groups(x)
        if not FG.kernel_why_not(xg, bw.data, out, sg, bw.scale, block=True):
            steps["fusedist_block"] = lambda i: FG.fp8_gemm(xg, sg, bw.data, bw.scale, out=out,
                                                            block=True)
    errs = {}
    x64 = x.double()
    for nm, step in steps.items():
        lay = "block" if nm in ("block", "fusedist_block") else "channel"
        ref = x64 @ (w.double() if nm == "bf16" else
                     weights[lay].dequantize(torch.float64)).t()
        got = step(0).double()
        errs[nm] = float((got - ref).abs().max() / ref.abs().max())
    paths = {lay: Q.fp8_path(x, weights[lay]) for lay in weights}
    med, _, status = H.time_graphs_interleaved(steps, args.ops, args.rounds, args.reps,
                                               pacer="bf16")
    flops = 2.0 * m * n * k
    row = {"shape": name, "K": k, "N": n, "M": m, "paths": paths, "rel_err": errs,
           "time_us": {nm: med.get(nm) for nm in steps}, "status": status,
           "tflops": {nm: flops / med[nm] / 1e6 for nm in med},
           "vs_bf16": {nm: med["bf16"] / med[nm] for nm in med if "bf16" in med}}
    return row


def markdown(rows) -> str:
    cols = ("bf16", "channel", "block", "channel_gemm", "fusedist_gemm", "fusedist_block")
    out = ["fusedist.nn.quant.fp8_linear at prefill sizes beside cuBLAS bf16, one GPU, CUDA "
           "graphs, same run. us per call (TFLOP/s); vs bf16 = bf16 time / this time. channel "
           "and block include the activation quantization; channel_gemm is row-wise "
           "torch._scaled_mm alone, fusedist_gemm fusedist.ops.fp8_gemm on the same quantized x, "
           "fusedist_block its block-scaled form on x quantized per token and 128 k. "
           f"Target at M >= 4096: >= {TARGET}x bf16.", "",
           "| shape | M | " + " | ".join(f"{c} us (TFLOP/s)" for c in cols) +
           " | channel vs bf16 | block vs bf16 | block path | max rel_err |",
           "|---|---|" + "---|" * (len(cols) + 4)]
    for r in rows:
        cells = []
        for c in cols:
            t = r["time_us"].get(c)
            cells.append("-" if t is None else f"{t:.1f} ({r['tflops'][c]:.0f})")
        vs = r["vs_bf16"]
        out.append(f"| {r['shape']} | {r['M']} | " + " | ".join(cells) +
                   f" | **{vs.get('channel', float('nan')):.2f}** | "
                   f"**{vs.get('block', float('nan')):.2f}** | {r['paths']['block']} | "
                   f"{max(r['rel_err'].values()):.1e} |")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8B projections at M = 4096")
    ap.add_argument("--ms", default=None, help="comma-separated M (default 128,1024,4096,16384)")
    ap.add_argument("--models", default="8b,70b")
    ap.add_argument("--tps", default="1", help="comma-separated TP degrees: one rank's shapes")
    ap.add_argument("--ops", type=int, default=3, help="calls per graph")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tag", default="", help="results file stem suffix: fp8_linear<tag>")
    args = ap.parse_args()
    ms = [int(v) for v in (args.ms or ("4096" if args.quick else ",".join(map(str, MS)))).split(",")]
    models = ("8b",) if args.quick else tuple(args.models.split(","))
    tps = (1,) if args.quick else tuple(int(v) for v in args.tps.split(","))
    if not torch.cuda.is_available():
        print("benchmarks/fp8_linear.py needs a GPU")
        return
    if not hasattr(torch, "float8_e4m3fn"):
        print("benchmarks/fp8_linear.py needs a torch with float8_e4m3fn")
        return
    import fusedist.nn.quant as Q
    torch.cuda.set_device(0)
    rows = []
    for name, k, n in shapes(models, tps):
        for m in ms:
            rows.append(run_shape(name, k, n, m, args, Q))
            r = rows[-1]
            print(f"{name} M={m}: " + ", ".join(f"{c} {t:.1f} us" for c, t in r["time_us"].items()
                                               if t is not None), flush=True)
    meta = H.metadata(1)
    meta.update(quick=args.quick, ms=ms, models=list(models), tps=list(tps))
    md = markdown(rows)
    why = getattr(Q, "BLOCKWISE_PROBE", {}).get(0)   # why the block-scaled scaled_mm is not used
    if why:
        meta["blockwise_probe"] = why
        md += f"\nBlock-scaled scaled_mm not used on this GPU: {why}\n"
    print(md)
    paths = H.write_results("fp8_linear" + args.tag, meta, rows, md)
    print("results:", ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
