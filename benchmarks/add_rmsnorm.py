"""Residual add + RMSNorm on one GPU: fusedist.add_rmsnorm beside the torch composite and
torch.compile of it, in the same run.

    python benchmarks/add_rmsnorm.py                 # T = 1, 8, 64, 512, 4096; hidden 4096; bf16
    python benchmarks/add_rmsnorm.py --quick         # T = 1, 64, 4096
    python benchmarks/add_rmsnorm.py --hidden 4096,8192 --dtype bfloat16,float16

Each row times, for one (form, T, hidden, dtype):
  fusedist   fusedist.add_rmsnorm(x, residual, w, eps): one kernel, the residual updated in
             place (what the model runs at TP 1); "plain" rows: fusedist.rmsnorm(x, w, eps),
             the model's first norm
  torch      h = x + residual; F.rms_norm(h, w, eps) (the torch model's code: two kernels);
             plain: F.rms_norm(x, w, eps)
  compile    that composite under torch.compile(fullgraph=True)
  vpt1..8    diagnostics: the kernel with 1, 2, 4 or 8 16-byte vectors per thread forced
             (fusedist is the launcher's choice; "-" where the row does not fit that split)
Timing: each backend's calls are captured in one CUDA graph that rotates over enough input sets
(x, residual, weight) to stream at least twice the L2 per replay, so inputs come from HBM as
in a model's step; the graphs replay interleaved (benchmarks/_harness.py) and time_us is the
median per call. GB/s: bytes read + written per call / fusedist's time; % HBM: of a
device-to-device copy in the same run. vs torch / vs compile: their time / fusedist's.
Results: benchmarks/results/<gpu>-w1/add_rmsnorm.{json,md}.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # not the checkout: fusedist stays the installed one
import _harness as H  # noqa: E402
from attention import hbm_ceiling_tbs  # noqa: E402

import fusedist  # noqa: E402

OPS = 20          # calls per graph at least (more when the rotation needs more input sets)
ROUNDS, REPS = 3, 10
EPS = 1e-5
TOKENS = (1, 8, 64, 512, 4096)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def composite(x, r, w):
    h = x + r
    return F.rms_norm(h, (h.shape[-1],), w, EPS), h


def composite_plain(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, EPS)


def row_bytes(form: str, T: int, hidden: int, dtype) -> int:
    """add: x, residual and weight read, the residual and normed written; plain: x and weight
    read, normed written."""
    es = dtype.itemsize
    return ((5 if form == "add" else 2) * T * hidden + hidden) * es


def time_row(form: str, T: int, hidden: int, dtype, hbm_tbs: float) -> dict:
    impl = importlib.import_module("fusedist.ops.add_rmsnorm")
    nbytes = row_bytes(form, T, hidden, dtype)
    sets = H.rotation_sets(nbytes)
    ops = max(OPS, sets)
    xs = [torch.randn(T, hidden, device="cuda").to(dtype) for _ in range(sets)]
    rs = [torch.randn(T, hidden, device="cuda").to(dtype) for _ in range(sets)] \
        if form == "add" else [None] * sets
    ws = [(1 + 0.1 * torch.randn(hidden, device="cuda")).to(dtype) for _ in range(sets)]
    outs = [torch.empty_like(x) for x in xs]
    torch._dynamo.reset()   # a fresh compile per shape (no recompile limit across rows)
    if form == "add":
        compiled = torch.compile(composite, fullgraph=True, dynamic=False)
        steps = {"fusedist": lambda i: fusedist.add_rmsnorm(xs[i % sets], rs[i % sets],
                                                            ws[i % sets], EPS),
                 "torch": lambda i: composite(xs[i % sets], rs[i % sets], ws[i % sets]),
                 "compile": lambda i: compiled(xs[i % sets], rs[i % sets], ws[i % sets])}
    else:
        compiled = torch.compile(composite_plain, fullgraph=True, dynamic=False)
        steps = {"fusedist": lambda i: fusedist.rmsnorm(xs[i % sets], ws[i % sets], EPS),
                 "torch": lambda i: composite_plain(xs[i % sets], ws[i % sets]),
                 "compile": lambda i: compiled(xs[i % sets], ws[i % sets])}
    for v in (1, 2, 4, 8):
        steps[f"vpt{v}"] = (lambda v: lambda i: impl._add_rmsnorm_impl(
            outs[i % sets], xs[i % sets], rs[i % sets], ws[i % sets], EPS,
            vectors_per_thread=v))(v)
    med, _, status = H.time_graphs_interleaved(steps, ops, ROUNDS, REPS, pacer="torch")
    times = {n: t for n, t in med.items() if status[n] == "ok"}
    for n, st in status.items():
        if st != "ok" and not n.startswith("vpt"):
            print(f"  {form} T={T} {n}: {st}", flush=True)
    row = dict(op="add_rmsnorm" if form == "add" else "rmsnorm", form=form, tokens=T,
               hidden=hidden, dtype=str(dtype).replace("torch.", ""), world_size=1,
               bytes=nbytes, input_sets=sets, calls_per_graph=ops)
    row.update(H.rate_columns(times, nbytes, hbm_tbs))
    del xs, rs, ws, outs, compiled
    return row


def fmt(v, p=2):
    return "-" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))


def markdown(rows, hbm_tbs) -> str:
    out = [f"HBM copy in this run: {hbm_tbs:.2f} TB/s (read + written). Inputs rotate past the L2.",
           "", "| form | T | hidden | dtype | fusedist us | GB/s | % HBM | torch us | compile us | "
           "vs torch | vs compile | vpt1 / vpt2 / vpt4 / vpt8 us |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        vpt = " / ".join(fmt(r.get(f"vpt{v}_us")) for v in (1, 2, 4, 8))
        out.append(f"| {r['form']} | {r['tokens']} | {r['hidden']} | {r['dtype']} | "
                   f"{fmt(r.get('fusedist_us'))} | {fmt(r.get('fusedist_gbs'), 0)} | "
                   f"{fmt(r.get('pct_hbm'), 1)} | {fmt(r.get('torch_us'))} | "
                   f"{fmt(r.get('compile_us'))} | {fmt(r.get('vs_torch'))} | "
                   f"{fmt(r.get('vs_compile'))} | {vpt} |")
    return "\n".join(out) + "\n"


def parser(doc: str, width: str, default: str) -> argparse.ArgumentParser:
    """The flags both single-GPU layer benchmarks take (--quick, --dtype, the row width)."""
    ap = argparse.ArgumentParser(description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="T = 1, 64, 4096 only")
    ap.add_argument(f"--{width}", default=default, help=f"comma-separated {width} sizes")
    ap.add_argument("--dtype", default="bfloat16", help="comma-separated: " + ", ".join(DTYPES))
    return ap


def sweep(args, width: str):
    """(dtype, width, T) of the run, the dtypes checked."""
    for dname in args.dtype.split(","):
        if dname not in DTYPES:
            raise SystemExit(f"--dtype: {dname!r} is not one of {', '.join(DTYPES)}")
        for n in (int(v) for v in getattr(args, width).split(",")):
            for T in (1, 64, 4096) if args.quick else TOKENS:
                yield DTYPES[dname], n, T


def run(stem: str, rows_for, markdown_for) -> None:
    """Time rows_for(hbm_tbs) (an iterable of rows, each printed as it comes) on the GPU and
    write benchmarks/results/<gpu>-w1/<stem>.{json,md}."""
    if not torch.cuda.is_available():
        print(f"benchmarks/{stem}.py needs a GPU")
        return
    torch.manual_seed(0)
    hbm = hbm_ceiling_tbs()
    rows = []
    for row in rows_for(hbm):
        rows.append(row)
        print(", ".join(f"{k} {fmt(v)}" for k, v in row.items()
                        if k in ("form", "tokens", "hidden", "inter", "fusedist_us", "torch_us",
                                 "compile_us")), flush=True)
    meta = H.metadata(1)
    meta["command"] = f"python benchmarks/{stem}.py " + " ".join(sys.argv[1:])
    meta["hbm_copy_tbs"] = hbm
    md = markdown_for(rows, hbm)
    paths = H.write_results(stem, meta, rows, md)
    print(md + "\nresults: " + ", ".join(map(str, paths)))


def main():
    ap = parser(__doc__, "hidden", "4096")
    ap.add_argument("--forms", default="add,plain", help="add (with a residual), plain")
    args = ap.parse_args()
    forms = args.forms.split(",")
    if any(f not in ("add", "plain") for f in forms):
        raise SystemExit(f"--forms: {args.forms!r}: each must be add or plain")
    run("add_rmsnorm", lambda hbm: (time_row(f, T, n, dt, hbm) for f in forms
                                    for dt, n, T in sweep(args, "hidden")), markdown)


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    main()
