"""Compare two benchmark result files row by row and report performance regressions.

    python3 benchmarks/compare.py OLD.json NEW.json [--noise 0.06] [--fusedist NAME]
    python3 benchmarks/compare.py benchmarks/results _out/results   # every file both hold

What is compared: same-run ratios, never raw times. For every case (op and shape) of a file,
the speedup of fusedist's headline path (what a user gets: `fd_auto` / `auto`, or
`--fusedist`) over each baseline measured in the same run (NCCL, torch symmetric memory,
torch async-TP, the unfused GEMM + collective, torch.matmul, SDPA, ...). A new file from
another machine, clock state or driver is then still comparable: the baselines moved with it.

Noise: a ratio regresses when new / old < 1 - band (improves above 1 + band). band =
max(--noise, the row's own spread), the row's spread being the relative spread of its rounds'
medians (`spread` or `rounds_us` in the file: fusedist's and the baseline's added, old and new
combined in quadrature); rows of files that record no rounds get --noise-unspread instead.
The defaults come from repeated runs of the same code on 2x H200 (docs/benchmarks.md): three
paced full runs of benchmarks/gemm_comm.py moved a ratio by 1.5% (median), 4.4% (95th
percentile) and 5.6% at most, hence --noise 0.06; two paced runs of benchmarks/gemm.py (no
rounds recorded per row) by 2.3%, 8.3% and 12.0%, hence --noise-unspread 0.13.

Exit status: 0 no regression, 1 at least one regression, 2 nothing comparable (no common
case, or a file that is not a benchmark result).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from statistics import median
from typing import Optional

NOISE = 0.06
NOISE_UNSPREAD = 0.13
HEADLINE = ("fd_auto", "auto", "fd_fused")
BASELINE_PREFIXES = ("nccl", "symm_", "torch", "unfused", "sdpa", "cudnn", "flash", "cublas",
                     "flex")
SHAPE_KEYS = ("op", "layout", "bytes", "tokens", "hidden", "M", "N", "K", "batch", "context",
              "q_heads", "kv_heads", "head_dim", "page_size", "dtype", "kv_dtype", "world")


def is_baseline(name: str) -> bool:
    return name.startswith(BASELINE_PREFIXES)


def _spread(row: dict) -> Optional[float]:
    """The relative spread of a row's rounds, or None when the file records none."""
    if isinstance(row.get("spread"), (int, float)):
        return float(row["spread"])
    rounds = row.get("rounds_us")
    if isinstance(rounds, list) and len(rounds) > 1 and min(rounds) > 0:
        return (max(rounds) - min(rounds)) / median(rounds)
    return None


def cases(doc: dict) -> dict[tuple, dict[str, tuple[float, Optional[float]]]]:
    """{case key: {backend: (time_us, spread)}} of a result file's rows. Two row forms: one row
    per backend ({"backend": name, "time_us": t}), or one row per case holding every backend
    ({"time_us": {name: t}}, benchmarks/gemm.py)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
        raise ValueError("not a benchmark result (expected a JSON object with 'rows')")
    out: dict[tuple, dict[str, tuple[float, Optional[float]]]] = {}
    for row in doc["rows"]:
        key = tuple((k, row[k]) for k in SHAPE_KEYS if k in row)
        t = row.get("time_us")
        if isinstance(t, dict):
            for name, v in t.items():
                if isinstance(v, (int, float)) and v > 0 and math.isfinite(v):
                    out.setdefault(key, {})[name] = (float(v), None)
        elif "backend" in row and isinstance(t, (int, float)) and t > 0 and math.isfinite(t) \
                and row.get("status", "ok") == "ok":
            out.setdefault(key, {})[row["backend"]] = (float(t), _spread(row))
    return out


def ratios(doc: dict, fusedist: Optional[str] = None
           ) -> dict[tuple, tuple[float, Optional[float]]]:
    """{(case key, fusedist path, baseline): (speedup = baseline time / fusedist time, spread
    of the two rows, None when unrecorded)}."""
    out = {}
    for key, times in cases(doc).items():
        fd = fusedist if fusedist else next((h for h in HEADLINE if h in times), None)
        if fd not in times:
            continue
        t_fd, s_fd = times[fd]
        for name, (t, s) in times.items():
            if is_baseline(name):
                out[(key, fd, name)] = (t / t_fd, None if s_fd is None or s is None
                                        else s_fd + s)
    return out


def label(key: tuple, fd: str, base: str) -> str:
    shape = " ".join(f"{k}={v}" for k, v in key if k not in ("dtype", "world"))
    return f"{shape}: {fd} vs {base}"


def compare(old: dict, new: dict, noise: float = NOISE, fusedist: Optional[str] = None,
            noise_unspread: float = NOISE_UNSPREAD) -> tuple[list[dict], int]:
    """Rows of the comparison ({case, old, new, change, band, verdict}) and how many ratios
    the two files share."""
    a, b = ratios(old, fusedist), ratios(new, fusedist)
    rows = []
    for k in sorted(set(a) & set(b), key=str):
        (r_old, s_old), (r_new, s_new) = a[k], b[k]
        if s_old is None or s_new is None:
            band = max(noise, noise_unspread)
        else:
            band = max(noise, math.hypot(s_old, s_new))
        change = r_new / r_old
        verdict = "regressed" if change < 1 - band else "improved" if change > 1 + band else "same"
        rows.append({"case": label(*k), "old": r_old, "new": r_new, "change": change,
                     "band": band, "verdict": verdict})
    return rows, len(rows)


def pairs(old: Path, new: Path) -> list[tuple[Path, Path]]:
    if old.is_dir() and new.is_dir():
        return [(o, new / o.relative_to(old)) for o in sorted(old.rglob("*.json"))
                if (new / o.relative_to(old)).is_file()]
    return [(old, new)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", type=Path, help="a result JSON (or a results directory)")
    ap.add_argument("new", type=Path, help="the result JSON to check (or a directory)")
    ap.add_argument("--noise", type=float, default=NOISE,
                    help=f"smallest relative change counted (default {NOISE})")
    ap.add_argument("--noise-unspread", type=float, default=NOISE_UNSPREAD,
                    help="band of rows whose files record no rounds (default "
                    f"{NOISE_UNSPREAD})")
    ap.add_argument("--fusedist", default=None,
                    help="the fusedist path compared (default: fd_auto / auto / fd_fused)")
    ap.add_argument("--all", action="store_true", help="print every ratio, not only changes")
    args = ap.parse_args(argv)
    for name in ("noise", "noise_unspread"):
        if not 0 <= getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(args, name)}")
    compared = regressed = False
    many = args.old.is_dir()
    for old, new in pairs(args.old, args.new):
        try:
            rows, n = compare(json.loads(old.read_text()), json.loads(new.read_text()),
                              args.noise, args.fusedist, args.noise_unspread)
        except (OSError, ValueError) as e:
            if not many:  # a directory also holds traces and other non-result JSON
                print(f"{old} -> {new}: {e}")
            continue
        if n == 0:
            if not many:
                print(f"{old} -> {new}: no case measured in both")
            continue
        bad = [r for r in rows if r["verdict"] == "regressed"]
        good = [r for r in rows if r["verdict"] == "improved"]
        print(f"{old} -> {new}: {n} ratios, {len(bad)} regressed, {len(good)} improved "
              f"(noise band >= {args.noise:.0%})")
        for r in rows:
            if args.all or r["verdict"] != "same":
                print(f"  {r['verdict']:9s} {r['case']}: {r['old']:.3f}x -> {r['new']:.3f}x "
                      f"({r['change'] - 1:+.1%}, band {r['band']:.1%})")
        compared, regressed = True, regressed or bool(bad)
    if not compared:
        print("nothing comparable")
        return 2
    return 1 if regressed else 0


if __name__ == "__main__":
    sys.exit(main())
