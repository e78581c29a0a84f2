"""Compare benchmark results with the committed ones and report performance regressions.

    python3 benchmarks/compare.py OLD.json NEW.json [--noise 0.06] [--fusedist NAME]
    python3 benchmarks/compare.py benchmarks/results _out/results   # every result file

One schema for every result file: a list of metrics, each
    {"key": str, "value": float, "better": "higher" | "lower", "noise": float or null}
`key` names what was measured (the case's shape and, for a ratio, "<path> vs <baseline>"),
unique within a file; `value` the measurement; `better` its direction; `noise` the relative
spread of its rounds when the benchmark recorded rounds (null: none recorded). A ratio may
carry "parts": {path: time, baseline: time} (headline first), the two times it divides: a
ratio that left its band is printed with each side's move, and a regression is told apart
from a baseline that got faster (below, "Attribution").
benchmarks/_harness.py's write_results stores them in the JSON as "metrics"; `metrics(doc)`
derives them from the "rows" (and row tables) of files written before, in every form the
benchmarks write: one row per backend (allreduce, gemm_comm, model), one row per case with
every kernel's time in a dict (gemm, gemv, fp8_linear), one row per case with fusedist's time
and its ratios to the baselines in vs_* columns (add_rmsnorm, silu_mul, attention,
attention_prefill), and rows of times with no baseline (gemm_waves, scaling).

What is measured: same-run ratios wherever a baseline ran in the same run (the speedup of
fusedist's headline path, what a user gets: `fd_auto` / `auto` / `fusedist`, or `--fusedist`,
over each baseline: NCCL, torch symmetric memory, torch async-TP, the unfused GEMM +
collective, torch.matmul, cuBLAS, SDPA / cuDNN, torch.compile, ...). A new file from another
clock state or driver is then still comparable: the baselines moved with it. Rows with no
baseline are compared as raw times (lower is better), which needs the same kind of machine.

Noise: a metric regresses when it gets worse by more than its band (higher-is-better:
new / old < 1 - band; lower-is-better: old / new < 1 - band). band = max(--noise, the old and
new metrics' own noise in quadrature); a metric with no noise recorded in either file gets
--noise-unspread, one with noise in one file only the larger of that noise and --noise-unspread.
An eager ratio whose row also timed both sides in CUDA graphs (attention_prefill) records as
noise the host share of the two eager times when it exceeds --noise-unspread's default: the
part of an eager time the GPU does not set moves with the host between runs.
The defaults come from repeated runs of the same code on 2x H200 (docs/benchmarks.md): three
paced full runs of benchmarks/gemm_comm.py moved a ratio by 1.5% (median), 4.4% (95th
percentile) and 5.6% at most, hence --noise 0.06; two paced runs of benchmarks/gemm.py (no
rounds recorded per row) by 2.3%, 8.3% and 12.0%, hence --noise-unspread 0.13.

Attribution: the machine's move between the two files is the median, over the file's distinct
baseline times, of new / old (machine_move; at least MIN_PEER_TIMES of them). A ratio that
regressed while fusedist's own time, divided by the machine's move, stayed within the band
(new / old / move <= 1 + band) is a baseline that got faster on this machine, not fusedist
code that got slower: its verdict is "baseline", printed and counted, and the exit status
ignores it unless --strict. A fusedist time that did not follow a faster machine still
regresses. On three H200s running the same code, torch.compile's ~2 us kernels and cuBLAS /
torch._scaled_mm at some GEMV shapes moved 6-35% between machines while fusedist's times held
within 3%: ratio verdicts alone failed the gate on every machine.

Directories: every result file under OLD is read (a file the loader cannot read is an error,
never skipped silently) and paired with NEW's file of the same relative path; files the new
run did not produce are listed as not measured. JSON that is not a result (traces) is named
and skipped.

Exit status: 0 no regression, 1 at least one regression (or, with --strict, a baseline that
moved), 2 nothing comparable (no metric measured in both) or a result file that could not be
read.
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
HOST_NOISE_MAX = 0.35   # two files at this noise: a band of 0.49 (quadrature)
# Fewest distinct baseline times whose median move stands for the machine's (machine_move):
# below it a file's ratios keep their verdicts.
MIN_PEER_TIMES = 8
# A ratio's parts tell which side moved only when they divide to its value, within 1%: the
# 1351 ratios with parts in benchmarks/results all agree within 0.5% (stored times are
# rounded); parts that disagree (a hand-edited or synthetic file) leave the ratio's verdict.
PARTS_AGREE = 0.01
HEADLINE = ("fd_auto", "auto", "fd_fused", "fusedist")
BASELINE_PREFIXES = ("nccl", "symm_", "torch", "unfused", "sdpa", "cudnn", "flash", "cublas",
                     "flex", "compile", "bf16", "scaled_mm")
# The columns that name a case (its shape, dtype, world, variant), in the order keys show them.
KEY_FIELDS = ("section", "kind", "group", "module", "scaling", "collective", "op", "model", "proj",
              "mode", "routing", "experts", "top_k", "form", "workload", "rate", "prefix_len",
              "shape", "layout", "format", "algo", "placement", "redop", "type", "config", "ranks",
              "nodes", "bytes", "size", "tokens", "new_tokens", "prompt_len", "context_fill",
              "hidden", "inter", "in_features", "out_features", "M", "m", "N", "K", "batch",
              "context", "q_heads", "kv_heads", "head_dim", "page_size", "waves", "pieces", "dtype",
              "kv_dtype", "world", "world_size")
# Tables of rows some benchmarks write beside "rows" (benchmarks/scaling.py).
TABLES = ("rows", "linear_rows", "decode_rows")
BETTER = ("higher", "lower")


class NotAResult(ValueError):
    """JSON that is not a benchmark result (a trace, another tool's output)."""


def is_baseline(name: str) -> bool:
    return name.startswith(BASELINE_PREFIXES)


def _num(v) -> Optional[float]:
    """v as a finite positive float, else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) and v > 0 else None


def _spread(values) -> Optional[float]:
    """(max - min) / median of a list of repeated measurements (None: fewer than two)."""
    if not isinstance(values, list):
        return None
    vals = [_num(v) for v in values]
    if len(vals) < 2 or any(v is None for v in vals):
        return None
    return (max(vals) - min(vals)) / median(vals)


def _row_spread(row: dict) -> Optional[float]:
    """The relative spread of a backend row's rounds, or None when the file records none."""
    if isinstance(row.get("spread"), (int, float)) and not isinstance(row["spread"], bool):
        return float(row["spread"])
    return _spread(row.get("rounds_us"))


# Columns of a backend row that describe that backend's run, not the case (the algorithm it
# picked, the KV dtype of the model benchmark's fusedist rows): left out of backend rows' keys.
PER_BACKEND = ("algo", "kv_dtype")


def case_key(row: dict, leave_out=()) -> str:
    return " ".join(f"{k}={row[k]}" for k in KEY_FIELDS if k not in leave_out and
                    isinstance(row.get(k), (str, int, float)) and not isinstance(row[k], bool))


def metric(key: str, value: float, better: str, noise: Optional[float] = None,
           parts: Optional[dict] = None) -> dict:
    m = {"key": key, "value": float(value), "better": better,
         "noise": None if noise is None else float(noise)}
    if parts:   # the two times a ratio divides, headline first: {headline: t, baseline: t}
        m["parts"] = {str(k): float(v) for k, v in parts.items()}
    return m


def _ratio_noise(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None else a + b


# ---- the loader: rows of every form the benchmarks write -> metrics -------------------------
def _backend_rows(rows: list, fusedist: Optional[str]) -> list:
    """One row per backend ({"backend": name, "time_us": t}: allreduce, gemm_comm, model):
    fusedist's headline over each baseline of the case; the model's prefill (TTFT) as well,
    from prefill_ms."""
    cases: dict[str, dict[str, dict]] = {}
    for row in rows:
        if _num(row.get("time_us")) is None or row.get("status", "ok") != "ok":
            continue
        key, backend = case_key(row, PER_BACKEND), str(row["backend"])
        if backend in cases.setdefault(key, {}):
            raise ValueError(f"two rows of backend {backend!r} for the case {key!r}: a case "
                             "needs a column that tells them apart (KEY_FIELDS)")
        cases[key][backend] = row
    out = []
    for case, by in cases.items():
        fd = fusedist if fusedist else next((h for h in HEADLINE if h in by), None)
        if fd not in by:
            continue
        f = by[fd]
        for name, b in by.items():
            if not is_baseline(name):
                continue
            out.append(metric(f"{case}: {fd} vs {name}", b["time_us"] / f["time_us"], "higher",
                              _ratio_noise(_row_spread(f), _row_spread(b)),
                              {fd: f["time_us"], name: b["time_us"]}))
            pf, pb = _num(f.get("prefill_ms")), _num(b.get("prefill_ms"))
            if pf and pb:
                out.append(metric(f"{case}: {fd} vs {name} prefill", pb / pf, "higher",
                                  _ratio_noise(_spread(f.get("prefill_ms_reps")),
                                               _spread(b.get("prefill_ms_reps"))),
                                  {fd: pf, name: pb}))
    return out


def _dict_row(row: dict, fusedist: Optional[str]) -> list:
    """One row per case with every kernel's time in a dict (gemm, gemv, fp8_linear): the
    headline path(s) over the row's baselines."""
    times = {k: _num(v) for k, v in row["time_us"].items()}
    status = row.get("status") if isinstance(row.get("status"), dict) else {}
    times = {k: v for k, v in times.items() if v is not None and status.get(k, "ok") == "ok"}
    if isinstance(row.get("vs"), dict):                  # gemv: fusedist vs the named ones
        heads, bases = ["fusedist"], list(row["vs"])
    elif isinstance(row.get("paths"), dict):             # fp8_linear: each layout's path
        heads, bases = list(row["paths"]), ["bf16"]
    else:                                                # gemm: auto vs torch
        heads = [next((h for h in HEADLINE if h in times), None)]
        bases = [k for k in times if is_baseline(k)]
    if fusedist:
        heads = [fusedist]
    rounds = row.get("ratio_rounds") if isinstance(row.get("ratio_rounds"), dict) else {}
    case = case_key(row)
    out = []
    for fd in heads:
        if fd not in times:
            continue
        for base in bases:
            if base in times and base != fd:
                # ratio_rounds: each round's ratio, of the headline (gemm) or the baseline
                # (gemv) against the other
                noise = _spread(rounds.get(fd)) if fd in rounds else _spread(rounds.get(base))
                out.append(metric(f"{case}: {fd} vs {base}", times[base] / times[fd], "higher",
                                  noise, {fd: times[fd], base: times[base]}))
    return out


def _host_share(row: dict, name: Optional[str]) -> Optional[float]:
    """The share of `name`'s eager time (<name>_us) that is not GPU work: 1 - its CUDA-graph
    time (<name>_graph_us) over it; None when the row has not both."""
    eager, graph = _num(row.get(f"{name}_us")), _num(row.get(f"{name}_graph_us"))
    return None if eager is None or graph is None else min(1.0, max(0.0, 1 - graph / eager))


def _eager_ratio_noise(row: dict, baseline: str) -> Optional[float]:
    """An eager ratio's noise where the row timed both sides in CUDA graphs too
    (attention_prefill): the host shares of fusedist's and the baseline's eager times, summed
    (the host part of an eager time moves between processes with the host: on one H100 two
    consecutive runs timed cuDNN's eager prefill at 44 and 54 us, its graph at 31 and 31.5),
    when that sum exceeds NOISE_UNSPREAD, and at most HOST_NOISE_MAX (a mostly host-bound
    eager ratio is still caught when it halves; the row's graph ratio gates the kernels); else
    None (the ratio is GPU-bound: the plain band).
    The baseline of vs_<b> is the row's best_peer for "best", else the eager column named b
    or ending in _b with the larger host share."""
    if baseline.endswith("_graph"):
        return None
    names = [row.get("best_peer")] if baseline == "best" else \
        [k[:-3] for k in row if k.endswith("_us") and not k.endswith("_graph_us")
         and (k[:-3] == baseline or k[:-3].endswith("_" + baseline))]
    base = [h for h in (_host_share(row, n) for n in names if isinstance(n, str)) if h is not None]
    share = _ratio_noise(_host_share(row, "fusedist"), max(base) if base else None)
    return None if share is None or share <= NOISE_UNSPREAD else min(share, HOST_NOISE_MAX)


def _column_row(row: dict) -> list:
    """One row per case with fusedist's time in fusedist_us and its ratios to the baselines in
    vs_<baseline> columns (add_rmsnorm, silu_mul, attention, attention_prefill); fusedist_us
    itself where no baseline ran. An eager ratio whose row has graph times too carries its
    host share as noise (_eager_ratio_noise)."""
    case = case_key(row)

    def parts(base: str) -> Optional[dict]:   # the times, where the row has both columns
        f, b = _num(row.get("fusedist_us")), _num(row.get(f"{base}_us"))
        return {"fusedist": f, base: b} if f is not None and b is not None else None

    out = [metric(f"{case}: fusedist vs {k[3:]}", row[k], "higher",
                  _eager_ratio_noise(row, k[3:]), parts(k[3:])) for k in sorted(row)
           if k.startswith("vs_") and _num(row[k]) is not None]
    if not out and _num(row.get("fusedist_us")) is not None:
        out.append(metric(f"{case}: fusedist_us", row["fusedist_us"], "lower"))
    return out


def _time_row(row: dict) -> list:
    """A row of times with no baseline (gemm_waves, scaling): the time, lower is better."""
    for col in ("time_us", "step_us"):
        if _num(row.get(col)) is not None:
            return [metric(f"{case_key(row)}: {col}", row[col], "lower")]
    return []


def derive(doc: dict, fusedist: Optional[str] = None) -> list:
    """The metrics of a result file's rows (and row tables), in the forms above."""
    if not isinstance(doc, dict) or not any(isinstance(doc.get(t), list) for t in TABLES):
        raise NotAResult("not a benchmark result (expected a JSON object with 'rows' or "
                         "'metrics')")
    out = []
    for table in TABLES:
        rows = [r for r in doc.get(table) or [] if isinstance(r, dict)]
        got = _backend_rows([r for r in rows if "backend" in r], fusedist)
        for row in rows:
            if "backend" in row:
                continue
            if isinstance(row.get("time_us"), dict):
                got += _dict_row(row, fusedist)
            elif any(k.startswith("vs_") for k in row) or "fusedist_us" in row:
                got += _column_row(row)
            else:
                got += _time_row(row)
        if table != "rows":     # a table beside "rows": its name starts its keys
            got = [dict(m, key=f"{table}: {m['key']}") for m in got]
        out += got
    return out


def check_metrics(metrics: list, where: str = "metrics") -> list:
    """The schema, checked: ValueError naming the entry and what is wrong."""
    if not isinstance(metrics, list):
        raise ValueError(f"{where} must be a list of metrics, got {type(metrics).__name__}")
    seen = set()
    for i, m in enumerate(metrics):
        if not isinstance(m, dict) or not isinstance(m.get("key"), str) or not m["key"]:
            raise ValueError(f"{where}[{i}] must be a dict with a non-empty str 'key', got "
                             f"{m!r:.120}")
        if m["key"] in seen:
            raise ValueError(f"{where}[{i}]: key {m['key']!r} appears twice; a key names one "
                             "measurement of the file")
        seen.add(m["key"])
        if _num(m.get("value")) is None:
            raise ValueError(f"{where}[{i}] ({m['key']}): value must be a finite number > 0, "
                             f"got {m.get('value')!r}")
        if m.get("better") not in BETTER:
            raise ValueError(f"{where}[{i}] ({m['key']}): better must be 'higher' or 'lower', "
                             f"got {m.get('better')!r}")
        n = m.get("noise")
        if n is not None and (isinstance(n, bool) or not isinstance(n, (int, float))
                              or not 0 <= n < 10):
            raise ValueError(f"{where}[{i}] ({m['key']}): noise must be null or a relative "
                             f"spread >= 0, got {n!r}")
        p = m.get("parts")
        if p is not None and not (isinstance(p, dict) and len(p) == 2 and all(
                isinstance(k, str) and _num(v) is not None for k, v in p.items())):
            raise ValueError(f"{where}[{i}] ({m['key']}): parts must be null or the ratio's two "
                             f"times, {{path: time, baseline: time}}, got {p!r:.120}")
    return metrics


def metrics(doc: dict, fusedist: Optional[str] = None) -> list:
    """A result file's metrics: its "metrics" as written (benchmarks/_harness.write_results),
    or derived from its rows (files written before the schema, or `fusedist` given)."""
    if isinstance(doc, dict) and isinstance(doc.get("metrics"), list) and fusedist is None:
        return check_metrics(doc["metrics"])
    return check_metrics(derive(doc, fusedist), "derived metrics")


# ---- the comparison -----------------------------------------------------------------------
def compare(old: dict, new: dict, noise: float = NOISE, fusedist: Optional[str] = None,
            noise_unspread: float = NOISE_UNSPREAD) -> tuple[list[dict], int]:
    """Rows of the comparison ({case, better, old, new, change, band, verdict}; change > 1 is
    better, whatever the direction) and how many metrics the two files share."""
    a = {m["key"]: m for m in metrics(old, fusedist)}
    b = {m["key"]: m for m in metrics(new, fusedist)}
    pa, pb = _parts(old, a, fusedist), _parts(new, b, fusedist)
    rows = []
    for k in sorted(set(a) & set(b)):
        mo, mn = a[k], b[k]
        if mo["better"] != mn["better"]:
            raise ValueError(f"{k}: better is {mo['better']!r} in the old file and "
                             f"{mn['better']!r} in the new one")
        # Recorded noises add in quadrature; a side with none recorded puts noise_unspread
        # under the band.
        recorded = [m["noise"] for m in (mo, mn) if m["noise"] is not None]
        band = max(noise, math.hypot(*recorded) if recorded else 0.0,
                   noise_unspread if len(recorded) < 2 else 0.0)
        change = mn["value"] / mo["value"] if mo["better"] == "higher" else \
            mo["value"] / mn["value"]
        verdict = "regressed" if change < 1 - band else "improved" if change > 1 + band else "same"
        row = {"case": k, "better": mo["better"], "old": mo["value"], "new": mn["value"],
               "change": change, "band": band, "verdict": verdict}
        if k in pa and k in pb and pa[k].keys() == pb[k].keys():
            row["parts"] = {name: (pa[k][name], pb[k][name]) for name in pa[k]}
        rows.append(row)
    _attribute(rows)
    return rows, len(rows)


def machine_move(rows: list) -> tuple[Optional[float], int]:
    """The machine's move between the two files, as the baselines see it: the median over the
    file's distinct baseline times (each ratio's second part, old -> new) of new / old, and how
    many times it is the median of; None when fewer than MIN_PEER_TIMES."""
    moves = {(name, a, b) for r in rows if _parts_agree(r)
             for name, (a, b) in list(r["parts"].items())[1:]}
    if len(moves) < MIN_PEER_TIMES:
        return None, len(moves)
    return median(b / a for _, a, b in moves), len(moves)


def _attribute(rows: list) -> None:
    """A ratio that regressed because its baseline got faster, while fusedist's own time held,
    gets the verdict "baseline" instead of "regressed".

    Fusedist's own time is judged against the machine's move (machine_move): on a machine
    whose baselines are 8% faster, a fusedist time that stayed put is 8% slower than the
    machine predicts, and a uniform slowdown of fusedist on a faster machine still regresses.
    Fusedist's time held when new / old / machine move <= 1 + the ratio's band. Files with
    fewer than MIN_PEER_TIMES baseline times, and ratios whose parts do not divide to them,
    keep the ratio's verdict."""
    m, _ = machine_move(rows)
    if m is None:
        return
    for r in rows:
        if r["verdict"] != "regressed" or not _parts_agree(r):
            continue
        fa, fb = next(iter(r["parts"].values()))
        if fb / fa / m <= 1 + r["band"]:
            r["verdict"] = "baseline"


def _parts_agree(r: dict) -> bool:
    """Whether a compared ratio's parts are the times it divides (baseline / headline, within
    PARTS_AGREE) in both files: only then do they tell which side moved."""
    if r["better"] != "higher" or not r.get("parts") or len(r["parts"]) != 2:
        return False
    (fa, fb), (ba, bb) = r["parts"].values()
    return (abs(ba / fa / r["old"] - 1) <= PARTS_AGREE
            and abs(bb / fb / r["new"] - 1) <= PARTS_AGREE)


def _parts(doc: dict, ms: dict, fusedist: Optional[str] = None) -> dict:
    """{metric key: its parts} of a file whose metrics by key are `ms`: from those, else from
    its rows (a file whose metrics were written without parts)."""
    got = {k: m["parts"] for k, m in ms.items() if m.get("parts")}
    if len(got) < len(ms) and any(isinstance(doc.get(t), list) for t in TABLES):
        try:
            got.update({m["key"]: m["parts"] for m in derive(doc, fusedist)
                        if m.get("parts") and m["key"] not in got})
        except ValueError:  # rows the loader cannot read (the file wrote its own metrics):
            pass            # the report goes without times, the gate is unchanged
    return got


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e})") from None


def _fmt(r: dict) -> str:
    if r["better"] == "higher":      # ratios
        old, new = f"{r['old']:.3f}x", f"{r['new']:.3f}x"
    else:                            # times
        old, new = f"{r['old']:.4g}", f"{r['new']:.4g}"
    line = (f"  {r['verdict']:9s} {r['case']}: {old} -> {new} "
            f"({r['change'] - 1:+.1%} {'better' if r['change'] >= 1 else 'worse'}, band "
            f"{r['band']:.1%})")
    if r.get("parts"):  # which side of the ratio moved: each time, old -> new
        line += "; times " + ", ".join(f"{name} {a:.4g} -> {b:.4g} ({b / a - 1:+.1%})"
                                       for name, (a, b) in r["parts"].items())
    return line


def pairs(old: Path, new: Path) -> list[tuple[Path, Path]]:
    """(old file, new file of the same relative path; it may not exist) for every JSON under
    a directory OLD, or the one pair of two files."""
    if old.is_dir():
        return [(o, new / o.relative_to(old)) for o in sorted(old.rglob("*.json"))]
    return [(old, new)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", type=Path, help="a result JSON (or a results directory)")
    ap.add_argument("new", type=Path, help="the result JSON to check (or a directory)")
    ap.add_argument("--noise", type=float, default=NOISE,
                    help=f"smallest relative change counted (default {NOISE})")
    ap.add_argument("--noise-unspread", type=float, default=NOISE_UNSPREAD,
                    help="band of metrics with no recorded noise (default "
                    f"{NOISE_UNSPREAD})")
    ap.add_argument("--fusedist", default=None,
                    help="the fusedist path compared (default: fd_auto / auto / fusedist)")
    ap.add_argument("--all", action="store_true", help="print every metric, not only changes")
    ap.add_argument("--strict", action="store_true",
                    help="a ratio that regressed because its baseline got faster (verdict "
                    "'baseline') fails too: fusedist's standing, not only its code")
    args = ap.parse_args(argv)
    for name in ("noise", "noise_unspread"):
        if not 0 <= getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(args, name)}")
    for p in (args.old, args.new):
        if not p.exists():
            ap.error(f"{p} does not exist")
    if args.old.is_dir() != args.new.is_dir():
        ap.error("OLD and NEW must both be files or both be directories")
    compared = errors = 0
    regressed = False
    for old, new in pairs(args.old, args.new):
        try:
            old_doc = _load(old)
            old_metrics = metrics(old_doc, args.fusedist)
        except NotAResult as e:
            print(f"{old}: skipped, {e}")
            continue
        except (OSError, ValueError) as e:
            print(f"ERROR {old}: {e}")
            errors += 1
            continue
        if not old_metrics:
            print(f"ERROR {old}: no metric read from its rows (a row form compare.py does not "
                  "know: teach benchmarks/compare.py's loader, or write metrics)")
            errors += 1
            continue
        if not new.is_file():
            print(f"{old}: {len(old_metrics)} metrics, not measured in this run")
            continue
        try:
            rows, n = compare(old_doc, _load(new), args.noise, args.fusedist,
                              args.noise_unspread)
        except (OSError, ValueError) as e:
            print(f"ERROR {old} -> {new}: {e}")
            errors += 1
            continue
        if n == 0:
            print(f"{old} -> {new}: no metric measured in both ({len(old_metrics)} in the old "
                  "file)")
            continue
        bad = [r for r in rows if r["verdict"] == "regressed"]
        good = [r for r in rows if r["verdict"] == "improved"]
        peer = [r for r in rows if r["verdict"] == "baseline"]
        m, k = machine_move(rows)
        print(f"{old} -> {new}: {n} of {len(old_metrics)} metrics compared, {len(bad)} "
              f"regressed, {len(peer)} baseline moved, {len(good)} improved (noise band >= "
              f"{args.noise:.0%}; " + (f"machine move {m - 1:+.1%}, the median of {k} "
                                       "baseline times)" if m is not None else
                                       f"{k} baseline times: too few for a machine move)"))
        for r in rows:
            if args.all or r["verdict"] != "same":
                print(_fmt(r))
        compared += 1
        regressed = regressed or bool(bad) or (args.strict and bool(peer))
    if args.new.is_dir():
        for p in sorted(args.new.rglob("*.json")):
            if not (args.old / p.relative_to(args.new)).exists():
                print(f"{p}: new, no committed result to compare with")
    if regressed:
        return 1
    if errors or not compared:
        print("nothing comparable" if not compared else f"{errors} result file(s) unreadable")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
