"""fusedist's GEMMs without communication against torch.matmul (cuBLAS), at decode and small
prefill row counts: the shapes where the choice of kernel and tile decides the speed.

One GPU. For N = 8192, K in {4096, 14336} (gemm_ar's per-rank weights), w [K, N] row-major
("kn") and the .t() of an nn.Linear [N, K] weight ("nk"), and M from 1 to 512 rows: the time
of torch.matmul, of the decode kernel (M <= 128), of every Hopper tile configuration this build
has (fusedist._C.GEMM_SM90_TILES) in every tile order (GEMM_SM90_RASTERS: sm90_<tile>_<raster>)
and of fusedist.gemm(kernel="auto"); and the kernels cuBLAS runs (kn). Each call reads a
different weight (a ring of copies larger than L2), as a decode step's layers do, so weights
stream from HBM for every kernel alike. CUDA graphs; every fusedist output is checked against
torch.matmul's before it is timed. Timing (--timing): "paced" (default) replays every kernel's
graph in interleaved rounds, each burst after ~30 ms of torch.matmul, so all see the clock of
a GPU under sustained load, as in a serving loop and in benchmarks/gemm_comm.py (the median of
all timed replays); "blocks" times each kernel alone, one after another: the
GPU runs cooler and faster there, and tiles do not gain alike from it (benchmarks/NOTES.md). x[:M] is a slice of a buffer of
max(--ms) rows, so below that the sm90 GEMMs read whole tiles of rows
(fusedist.ops.gemm.launch_sm90). Diagnoses, not kernels: sm90_<narrow|mid|swap>_exact, the
tile on a copy of x[:M] (its last tile's loads run past the end); sm90_narrow_pad, x copied
into zero rows to a whole tile, both copies included.

    python3 benchmarks/gemm.py            # results: benchmarks/results/<gpu>-w1/gemm.*
    python3 benchmarks/gemm.py --shapes llama --write-rules   # the Llama sweep -> rule data

--shapes llama sweeps the projections of Llama-3-8B and -70B at tensor-parallel sizes 1, 2, 4
and 8 (QKV, O, gate-up, down, LM head; the nn.Linear weight passed as w.t(), "nk") over M = 1,
2, 4 .. 16384 (up to LLAMA_MAX_FLOP per GEMM), timing torch.matmul, the decode kernel, the
sm90 GEMM (its launcher's tile) and auto, interleaved, in CUDA graphs. --write-rules derives
kernel="auto"'s rules from that run (tuning.derive_gemm_rules: a fusedist kernel only where it
beat torch.matmul in every round) and writes them into fusedist/tuning_default.json's "gemm"
section (or --rules-file); `--rules-from RESULT.json ...` derives them from saved sweeps
without a GPU. The headline column is auto / torch: what a user gets.
"""

from __future__ import annotations

import argparse
import sys
from statistics import median
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (kernels, llama_projections, metadata, time_graph,  # noqa: E402
                      time_graphs_interleaved, write_results)

import fusedist  # noqa: E402
from fusedist import _ext  # noqa: E402
from fusedist import tuning  # noqa: E402
from fusedist.ops.gemm import launch_sm90  # noqa: E402

MS = (1, 16, 32, 64, 96, 112, 128, 160, 192, 256, 320, 384, 512)
L2_RING_BYTES = 3 << 27  # 384 MB of weights per shape: more than any Hopper L2 many times over


# Llama-3 8B / 70B projections (with the LM head) at these TP degrees: the sweep's shapes.
LLAMA_TP = (1, 2, 4, 8)
LLAMA_MS = tuple(1 << i for i in range(15))  # 1 .. 16384
LLAMA_MAX_FLOP = 1 << 41  # ~3 ms per GEMM on an H200: keeps the sweep to a few minutes
ROOF_TFLOPS, ROOF_TBPS = 600.0, 4.0  # for the sweep's time estimate and graph sizes only


def llama_shapes() -> list:
    """(model, tp, projection, K, N) of every column- and row-parallel projection."""
    return [(f"llama3-{model}", tp, proj, k, n) for model, tp, proj, k, n in
            llama_projections(("8b", "70b"), LLAMA_TP, lm_head=True)]


def est_us(m: int, k: int, n: int) -> float:
    """A roofline estimate of one bf16 GEMM (for graph sizes and the sweep's budget)."""
    return max(2 * m * n * k / (ROOF_TFLOPS * 1e6), 2 * (m * k + k * n + m * n) / (ROOF_TBPS * 1e6),
               5.0)


def sweep_points() -> list:
    """(shape, m) of the Llama sweep: each distinct (K, N) once, M up to LLAMA_MAX_FLOP."""
    seen, pts = {}, []
    for model, tp, proj, k, n in llama_shapes():
        seen.setdefault((k, n), []).append(f"{model}/tp{tp}/{proj}")
    for (k, n), names in seen.items():
        for m in LLAMA_MS:
            if 2 * m * n * k <= LLAMA_MAX_FLOP:
                pts.append(((k, n, names), m))
    return pts


def graph_ops(m: int, k: int, n: int) -> int:
    """GEMMs per CUDA graph: >= ~100 us of work per replay, 2 to 20."""
    return max(2, min(20, -(-100 // int(est_us(m, k, n)))))


def sweep_seconds(pts: list) -> float:
    """The sweep's expected wall time: per kernel ~14 graph replays (capture, warm-up, 2 timed
    rounds), the pacer's bursts and ~30 ms of capture and host work."""
    tot = 0.0
    for (k, n, _), m in pts:
        e = est_us(m, k, n)
        tot += (4 if m <= 128 else 3) * (14 * graph_ops(m, k, n) * e + 3 * min(5000, 20 * e)
                                         + 30000)
    return tot / 1e6


def points_from_results(data: dict) -> list:
    """Measurements for tuning.derive_gemm_rules from a result file of this benchmark: the
    --shapes llama sweep ("ratio_rounds": torch / kernel per round) or the default sweep
    (time_us of "decode", and of "auto" where it ran the decode kernel or an sm90 tile)."""
    pts = []
    for r in data.get("rows", []):
        if "layout" not in r:
            continue
        base = {"layout": r["layout"], "dtype": r.get("dtype", "bfloat16"), "k": r["K"],
                "n": r["N"], "m": r["M"]}
        if "ratio_rounds" in r:
            for kern, ratios in r["ratio_rounds"].items():
                if kern in tuning.GEMM_KERNELS:
                    pts += [{**base, "kernel": kern, "ratio": q} for q in ratios]
            continue
        t = r.get("time_us", {})
        if "torch" in t and "decode" in t:
            pts.append({**base, "kernel": "decode", "ratio": t["torch"] / t["decode"]})
    return pts


def write_rules(rules: list, path: Path, measured: str = "") -> None:
    """rules -> the "gemm" section of the table at path (other sections kept); `measured`
    names the measurement they come from."""
    import json
    table = json.loads(path.read_text()) if path.is_file() else {}
    table["gemm"] = {
        "comment": "fusedist.gemm(kernel='auto'): a fusedist kernel only in these measured "
                   "regions (every same-run ratio torch.matmul / kernel >= 0.99, median >= 1.0: "
                   "tuning.derive_gemm_rules), torch.matmul elsewhere. "
                   + (f"From {measured}. " if measured else "")
                   + "Regenerate: benchmarks/gemm.py --shapes llama --write-rules.",
        "rules": rules}
    path.write_text(json.dumps(table, indent=1) + "\n")
    print(f"{len(rules)} gemm rules -> {path}")


def sweep_llama(args) -> None:
    dev, dt = torch.device("cuda", 0), torch.bfloat16
    torch.cuda.set_device(dev)
    C = _ext.load()
    hopper = torch.cuda.get_device_capability(dev)[0] == 9
    g = torch.Generator(device=dev).manual_seed(1)

    def rnd(*sh):
        return (torch.randn(*sh, generator=g, device=dev) * 0.1).to(dt)

    pts = sweep_points()
    print(f"{len(pts)} (shape, M) points; about {sweep_seconds(pts):.0f} s", flush=True)
    rows, md = [], ["| K | N | M | shapes | torch us | auto us | **auto / torch** | decode / torch "
                    "| sm90 / torch | best fusedist / torch (diagnostic) |", "|" + "---|" * 10]
    by_shape = {}
    for (k, n, names), m in pts:
        by_shape.setdefault((k, n, tuple(names)), []).append(m)
    for (k, n, names), ms in by_shape.items():
        ring = max(2, -(-L2_RING_BYTES // (k * n * 2)))
        ws = [rnd(n, k).t() for _ in range(ring)]  # the nn.Linear weight, passed as w.t()
        x = rnd(max(ms), k)
        for m in ms:
            xm = x[:m]
            ops = graph_ops(m, k, n)
            outs = [torch.empty(m, n, dtype=dt, device=dev) for _ in range(min(ring, ops))]
            calls = {"torch": lambda w, o: torch.matmul(xm, w, out=o),
                     "auto": lambda w, o: fusedist.gemm(xm, w, out=o)}
            if hopper and m <= C.GEMM_AR_FUSED_MAX_M:
                calls["decode"] = lambda w, o: fusedist.gemm(xm, w, out=o, kernel="decode")
            if hopper:
                calls["sm90"] = lambda w, o: fusedist.gemm(xm, w, out=o, kernel="sm90")
            ref = torch.matmul(xm.float(), ws[0].float())
            steps, errs = {}, {}
            for name, call in calls.items():
                try:
                    outs[0].fill_(float("nan"))
                    call(ws[0], outs[0])
                    torch.cuda.synchronize()
                    errs[name] = ((outs[0].float() - ref).norm() / ref.norm()).item()
                    if not errs[name] < 1e-2:
                        raise RuntimeError(f"rel err {errs[name]:.3g}")
                except (RuntimeError, ValueError) as e:
                    print(f"K={k} N={n} M={m} {name}: {e}")
                    continue
                steps[name] = (lambda call: lambda i: call(ws[i % ring], outs[i % len(outs)]))(call)
            med, per_round, status = time_graphs_interleaved(
                steps, ops, args.rounds, 3, warmup=1, pacer="torch",
                pace_us=min(5000.0, 20 * est_us(m, k, n)))
            times = {nm: t for nm, t in med.items() if status[nm] == "ok"}
            ratio_rounds = {nm: [a / b for a, b in zip(per_round["torch"], per_round[nm])]
                            for nm in times if nm != "torch" and "torch" in times}
            ratio = {nm: times["torch"] / t for nm, t in times.items() if "torch" in times}
            fd = [ratio[nm] for nm in ("decode", "sm90") if nm in ratio]
            rows.append({"layout": "nk", "dtype": "bfloat16", "M": m, "K": k, "N": n,
                         "shapes": list(names), "time_us": times, "rel_err": errs,
                         "ratio": ratio, "ratio_rounds": ratio_rounds,
                         "tflops": {nm: 2 * m * n * k / t / 1e6 for nm, t in times.items()}})

            def f(nm):
                return f"{ratio[nm]:.2f}" if nm in ratio else "-"
            md.append(f"| {k} | {n} | {m} | {', '.join(names)} | "
                      f"{times.get('torch', float('nan')):.1f} | "
                      f"{times.get('auto', float('nan')):.1f} | **{f('auto')}** | {f('decode')} | "
                      f"{f('sm90')} | {max(fd) if fd else float('nan'):.2f} |")
        ws = None
    text = "\n".join(["Time of torch.matmul / time of fusedist (> 1: fusedist faster); bf16, "
                      "w = nn.Linear weight .t(), CUDA graphs, weights rotated past L2. "
                      "Headline: auto.", ""] + md)
    paths = write_results("gemm_llama" + args.tag, metadata(1), rows, text)
    print(text + "\n\nresults: " + ", ".join(map(str, paths)))
    if args.write_rules:
        meta = metadata(1)
        write_rules(tuning.derive_gemm_rules(points_from_results({"rows": rows})),
                    Path(args.rules_file), f"{paths[0].name} ({meta.get('gpu')}, commit "
                    f"{meta.get('commit')})")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="default", choices=["default", "llama"],
                    help="llama: the Llama-3-8B/70B projections at TP 1/2/4/8, M = 1 .. 16384")
    ap.add_argument("--write-rules", action="store_true",
                    help="derive kernel='auto''s rules from the sweep and write them")
    ap.add_argument("--rules-file", default=str(Path(tuning.__file__).with_name(
        "tuning_default.json")), help="the table --write-rules writes (default: the shipped one)")
    ap.add_argument("--rules-from", nargs="*", default=None, metavar="RESULT.json",
                    help="derive and write the rules from saved result files (no GPU needed)")
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--ks", default="4096,14336")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--tag", default="")
    ap.add_argument("--timing", default="paced", choices=["paced", "blocks"],
                    help="paced (default): every kernel timed in interleaved rounds, each burst "
                    "after ~30 ms of torch.matmul (the loaded GPU's clock); blocks: each kernel "
                    "alone, one graph after another (the GPU runs cooler)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="interleaved rounds (paced; default 4, the llama sweep 2)")
    args = ap.parse_args()
    if args.rules_from is not None:
        import json
        pts = []
        for f in args.rules_from:
            pts += points_from_results(json.loads(Path(f).read_text()))
        write_rules(tuning.derive_gemm_rules(pts), Path(args.rules_file),
                    ", ".join(Path(f).name for f in args.rules_from))
        return
    if not torch.cuda.is_available():
        print("benchmarks/gemm.py needs a GPU")
        return
    if args.shapes == "llama":
        args.rounds = args.rounds or 2
        sweep_llama(args)
        return
    args.rounds = args.rounds or 4
    dev, dt, N = torch.device("cuda", 0), torch.bfloat16, args.n
    torch.cuda.set_device(dev)
    C = _ext.load()
    hopper = torch.cuda.get_device_capability(dev)[0] == 9
    tiles = dict(C.GEMM_SM90_TILES) if hopper else {}
    rasters = dict(C.GEMM_SM90_RASTERS) if hopper else {}
    g = torch.Generator(device=dev).manual_seed(1)

    def rnd(*s):
        return (torch.randn(*s, generator=g, device=dev) * 0.1).to(dt)

    ms = [int(m) for m in args.ms.split(",")]
    rows = []
    names = ["torch", "decode"] + [f"sm90_{t}_{r}" for t in tiles for r in rasters] + \
        [f"sm90_{t}_exact" for t in ("narrow", "mid", "swap") if t in tiles] + \
        (["sm90_narrow_pad"] if "narrow" in tiles else []) + ["auto"]
    md = ["| layout | K | M | " + " | ".join(f"{n} us" for n in names) +
          " | **auto / torch** | best fusedist / torch (diagnostic) |",
          "|" + "---|" * (len(names) + 5)]
    kmd = []
    cmd = ["| layout | K | M | " + " | ".join(f"{n} MHz" for n in names) + " |",
           "|" + "---|" * (len(names) + 3)]
    for K in map(int, args.ks.split(",")):
        ring = max(2, -(-L2_RING_BYTES // (K * N * 2)))
        for layout in ("kn", "nk"):
            ws = [rnd(K, N) if layout == "kn" else rnd(N, K).t() for _ in range(ring)]
            x = rnd(max(ms), K)
            for M in ms:
                xm = x[:M]
                outs = [torch.empty(M, N, dtype=dt, device=dev) for _ in range(ring)]
                calls = {"torch": lambda i, w, o: torch.matmul(xm, w, out=o)}
                if M <= C.GEMM_AR_FUSED_MAX_M:
                    calls["decode"] = lambda i, w, o: fusedist.gemm(xm, w, out=o, kernel="decode")
                for t, code in tiles.items():
                    for r, order in rasters.items():
                        calls[f"sm90_{t}_{r}"] = (lambda code, order: lambda i, w, o: launch_sm90(
                            xm, w, None, o, torch.cuda.current_stream(), tile=code,
                            raster=order))(code, order)
                if "narrow" in tiles and M % C.GEMM_SM90_BLOCK_M:
                    # Diagnosis: x in a buffer of exactly M rows, so the last tile's loads run
                    # past its end (the sm90 columns read the rows after x[:M], as a slice of
                    # a larger activation buffer lets them).
                    xe = xm.clone()
                    for t in ("narrow", "mid", "swap"):
                        if t in tiles:
                            calls[f"sm90_{t}_exact"] = (lambda code: lambda i, w, o: launch_sm90(
                                xe, w, None, o, torch.cuda.current_stream(), tile=code))(tiles[t])
                    # Diagnosis: the narrow tile with x padded by zero rows to whole tiles and
                    # the rows copied out, copies included (partial tiles measured slow).
                    mp = -(-M // C.GEMM_SM90_BLOCK_M) * C.GEMM_SM90_BLOCK_M
                    xp = torch.zeros(mp, K, dtype=dt, device=dev)
                    op = torch.empty(mp, N, dtype=dt, device=dev)

                    def padded(i, w, o, xp=xp, op=op, M=M, xm=xm):
                        xp[:M].copy_(xm)
                        launch_sm90(xp, w, None, op, torch.cuda.current_stream(),
                                    tile=tiles["narrow"])
                        o.copy_(op[:M])
                    calls["sm90_narrow_pad"] = padded
                calls["auto"] = lambda i, w, o: fusedist.gemm(xm, w, out=o)
                ref = torch.matmul(xm.float(), ws[0].float())
                times, errs, steps = {}, {}, {}
                for name, call in calls.items():
                    try:
                        outs[0].fill_(float("nan"))
                        call(0, ws[0], outs[0])
                        torch.cuda.synchronize()
                        errs[name] = ((outs[0].float() - ref).norm() / ref.norm()).item()
                        if not errs[name] < 1e-2:
                            raise RuntimeError(f"rel err {errs[name]:.3g}")
                    except (RuntimeError, ValueError) as e:
                        print(f"K={K} {layout} M={M} {name}: {e}")
                        continue
                    steps[name] = (lambda call: lambda i: call(i, ws[i % ring],
                                                               outs[i % ring]))(call)
                clocks = {}
                if args.timing == "blocks":
                    times = {name: time_graph(step, 2 * ring, 20) for name, step in steps.items()}
                else:
                    med, _, status = time_graphs_interleaved(steps, 2 * ring, args.rounds, 5,
                                                             pacer="torch", clocks=clocks)
                    times = {n: t for n, t in med.items() if status[n] == "ok"}
                mhz = {n: median(c) for n, c in clocks.items() if c}
                fd = [times[n] for n in times
                      if n != "torch" and not n.endswith(("_pad", "_exact"))]
                best = times["torch"] / min(fd) if fd and "torch" in times else float("nan")
                cublas = [(n[:90], round(t, 1)) for n, t in
                          kernels(lambda: torch.matmul(xm, ws[0], out=outs[0]))] \
                    if layout == "kn" else []
                if cublas:
                    kmd.append(f"| {K} | {M} | " + "<br>".join(f"{n} ({t} us)" for n, t in cublas)
                               + " |")
                if mhz:
                    cmd.append(f"| {layout} | {K} | {M} | " + " | ".join(
                        f"{mhz[n]:.0f}" if n in mhz else "-" for n in names) + " |")
                rows.append({"layout": layout, "M": M, "N": N, "K": K, "time_us": times,
                             "sm_clock_mhz": mhz,
                             "rel_err": errs, "best_ratio": best, "cublas_kernels": cublas,
                             "auto_ratio": times["torch"] / times["auto"]
                             if "torch" in times and "auto" in times else None,
                             "weight_GBps": {n: K * N * 2 / t / 1e3 for n, t in times.items()}})
                auto = times["torch"] / times["auto"] if "torch" in times and "auto" in times \
                    else float("nan")
                md.append(f"| {layout} | {K} | {M} | " + " | ".join(
                    f"{times[n]:.1f}" if n in times else "-" for n in names) +
                    f" | **{auto:.2f}** | {best:.2f} |")
            ws = None  # the ring is freed before the next layout allocates its own
    clock_md = ["", "SM clock while each kernel ran (NVML, MHz, the median of its rounds; "
                "paced timing only):", ""] + cmd if len(cmd) > 2 else []
    text = "\n".join(md + clock_md + ["", "cuBLAS kernels (kn; profiled once, device us):", "",
                                       "| K | M | kernels |", "|---|---|---|"] + kmd)
    paths = write_results("gemm" + args.tag, metadata(1), rows, text)
    print(text + "\n\nresults: " + ", ".join(map(str, paths)))


if __name__ == "__main__":
    main()
