"""The tuning table: every measured crossover and rule that decides which kernel runs.

One JSON table, fusedist/tuning_default.json (measured on the GPU its "measured_on" names;
each section names the benchmark that produced it), overlaid section by section by
FUSEDIST_TUNING_FILE=path.json. The ops read it and nothing else: no measured threshold lives
as a module constant (tests/test_tuning.py scans the package).

  * "allreduce": per world size, ascending byte thresholds; the first rule whose `max_bytes`
    is >= the message size names the algorithm (one_shot, two_shot, nccl). Sources, highest
    priority first: FUSEDIST_ALLREDUCE_ALGO forces one; FUSEDIST_TUNING_FILE; the cache written
    by `python benchmarks/allreduce.py --tune` (~/.cache/fusedist/allreduce-<gpu>-w<world>.json);
    the shipped default. A world size without measured rules takes those of the table's
    alpha-beta model ("allreduce_model", model_rules), with a warning. A Communicator takes
    rank 0's table at creation, so every rank makes the same choice.
  * "gemm" (fusedist.gemm's kernel="auto" rules), "gemm_comm" (the GEMM + collective engines).
  * knob sections, declared by the op that reads them (declare / knobs below): "decode"
    (the decode attention planner), "prefill" (the paged prefill's crossovers with SDPA),
    "fp8_linear" (the FP8 projections' dispatch), "moe" (the grouped GEMMs) ...

`python -m fusedist.tuning --explain "fp8_linear m=16 n=28672 k=4096"` prints which kernel a
shape takes and why; `--caps` the capability table of the build; `--table` the merged table.
"""

from __future__ import annotations

import functools
import json
import os
import re
import warnings
import weakref
from pathlib import Path
from typing import Optional

from .. import envs

ALGOS = ("one_shot", "two_shot", "nccl")
_DEFAULT = Path(__file__).parent.parent / "tuning_default.json"   # fusedist/tuning_default.json


def cache_path(gpu_name: str, world: int) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-")
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fusedist"
    return root / f"allreduce-{slug}-w{world}.json"


def _valid(table: dict) -> dict:
    for w, rules in table.get("allreduce", {}).items():
        int(w)
        for rule in rules:
            if rule["algo"] not in ALGOS:
                raise ValueError(f"fusedist: tuning table has unknown algo {rule['algo']!r}")
    model = table.get("allreduce_model")
    if model is not None:
        for key in ("alpha_us", "GBps"):
            if set(model.get(key, {})) != set(ALGOS) or \
                    not all(float(v) > 0 for v in model[key].values()):
                raise ValueError(f"fusedist: tuning table allreduce_model.{key} needs a positive "
                                 f"value for each of {ALGOS}, got {model.get(key)!r}")
    return table


# Sections whose entries (a world size, an op) are merged one by one; any other section is
# taken whole from the highest-priority file that has it.
_KEYED_SECTIONS = ("allreduce", "gemm", "gemm_comm")


def merge_tables(tables: list) -> dict:
    """Tables in ascending priority -> one table. A keyed section merges per entry (a cache
    tuned at world 2 replaces the world-2 rules only, and a file holding only the all-reduce
    section leaves the GEMM sections of the shipped default in force); other sections are
    taken from the last table that has them. "sources" maps each section to its file."""
    merged: dict = {"sources": {}}
    for t in tables:
        src = t.get("source", "?")
        for section, value in t.items():
            if section in ("source", "sources", "comment", "measured_on"):
                continue
            if section in _KEYED_SECTIONS and isinstance(value, dict):
                merged.setdefault(section, {}).update(value)
            else:
                merged[section] = value
            merged["sources"][section] = src
    return merged


def load_table(gpu_name: str, world: int) -> dict:
    """The shipped default, overlaid per section by the --tune cache, overlaid by
    FUSEDIST_TUNING_FILE (merge_tables). "source" names the highest-priority file found."""
    path = envs.get("FUSEDIST_TUNING_FILE")
    if path and not Path(path).is_file():
        raise ValueError(f"fusedist: FUSEDIST_TUNING_FILE={path!r} does not exist; point it at a "
                         "table written by benchmarks/allreduce.py --tune, or unset it")
    candidates = [_DEFAULT, cache_path(gpu_name, world)] + ([Path(path)] if path else [])
    found = []
    for p in candidates:
        if p.is_file():
            with open(p) as f:
                t = _valid(json.load(f))
            t["source"] = str(p)
            found.append(t)
    if not found:
        return {"allreduce": {}, "source": "none", "sources": {}}
    table = merge_tables(found)
    table["source"] = found[-1]["source"]
    return table


def forced_algo() -> Optional[str]:
    a = envs.get("FUSEDIST_ALLREDUCE_ALGO")  # validated against its choices there
    return None if a == "auto" else a


# ---- warnings, once per communicator ------------------------------------------------------
_warned: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_warned_by_id: dict = {}


def warn_once(comm, key: str, msg: str) -> bool:
    """Warn `msg` (RuntimeWarning) the first time `key` comes up for `comm`; True when it
    warned. The text names the communicator, so Python's own once-per-line filter does not
    swallow the warning of a second communicator."""
    try:
        seen = _warned.setdefault(comm, set())
    except TypeError:  # not weak-referenceable
        seen = _warned_by_id.setdefault(id(comm), set())
    if key in seen:
        return False
    seen.add(key)
    name = getattr(comm, "name", None)
    warnings.warn(f"fusedist{f' ({name})' if name else ''}: {msg}", RuntimeWarning, stacklevel=3)
    return True


# ---- untuned world sizes: the alpha-beta model --------------------------------------------
# Per algorithm a, the time for n bytes at world size W: alpha_us[a] + f_a(W) n / GBps[a], with
# f_a(W) the bytes each rank moves per byte of the message: one_shot reads every peer's whole
# input (W - 1); two_shot and NCCL's ring reduce-scatter then all-gather (2 (W - 1) / W).
_VOLUME = {"one_shot": lambda w: w - 1, "two_shot": lambda w: 2 * (w - 1) / w,
           "nccl": lambda w: 2 * (w - 1) / w}


def model_time_us(model: dict, algo: str, nbytes: int, world: int) -> float:
    return float(model["alpha_us"][algo]) + \
        _VOLUME[algo](world) * nbytes / (float(model["GBps"][algo]) * 1e3)


def model_rules(model: dict, world: int, max_bytes: int = 1 << 31) -> list:
    """Ascending byte thresholds in the table's rule format, from the model: the fastest
    algorithm per power-of-two size (and the sizes between, as the crossovers are found by
    bisection), up to max_bytes, the last rule unbounded."""
    def best(n):
        return min(ALGOS, key=lambda a: (model_time_us(model, a, n, world), ALGOS.index(a)))

    rules = []
    algo = best(1)
    n = 1
    while n < max_bytes:
        nxt = n * 2
        if best(nxt) != algo:
            a, b = n, nxt  # best(a) == algo != best(b): bisect the crossover
            while b - a > 1:
                mid = (a + b) // 2
                a, b = (mid, b) if best(mid) == algo else (a, mid)
            rules.append({"max_bytes": a, "algo": algo})
            algo = best(b)
        n = nxt
    rules.append({"max_bytes": None, "algo": algo})
    return rules


@functools.lru_cache(maxsize=64)
def _model_rules_cached(frozen: tuple, world: int) -> tuple:
    model = {"alpha_us": dict(frozen[0]), "GBps": dict(frozen[1])}
    return tuple((r["max_bytes"], r["algo"]) for r in model_rules(model, world))


def _rules_for_world(table: dict, world: int) -> Optional[list]:
    rules_by_world = table.get("allreduce", {})
    if str(world) in rules_by_world:
        return rules_by_world[str(world)]
    model = table.get("allreduce_model")
    if model is None:
        return None
    frozen = (tuple(sorted(model["alpha_us"].items())), tuple(sorted(model["GBps"].items())))
    rules = [{"max_bytes": b, "algo": a} for b, a in _model_rules_cached(frozen, world)]
    if not table.get("_warned_untuned"):
        # Once per table, i.e. once per communicator (each holds its own copy of rank 0's).
        table["_warned_untuned"] = True
        tuned = ", ".join(sorted(rules_by_world, key=int)) or "none"
        said = ", ".join(f"{r['algo']} up to {r['max_bytes']} bytes" if r["max_bytes"] else
                         r["algo"] for r in rules)
        warnings.warn(
            f"fusedist: no measured all-reduce table for world size {world} (measured: {tuned}); "
            "the algorithm thresholds come from the alpha-beta model of "
            f"{table.get('sources', {}).get('allreduce_model', 'the tuning table')} "
            f"({said}); "
            "run `torchrun --nproc-per-node <world> benchmarks/allreduce.py --tune` to measure",
            RuntimeWarning, stacklevel=3)
    return rules


def choose(table: dict, nbytes: int, world: int) -> str:
    """Table lookup. A world size the table has no rules for takes the rules of the table's
    alpha-beta model ("allreduce_model"), with a warning once per table; without a model,
    one-shot up to 256 KiB, else two-shot."""
    rules = _rules_for_world(table, world)
    if rules is None:
        return "one_shot" if nbytes <= 256 * 1024 else "two_shot"
    for rule in rules:
        if rule.get("max_bytes") is None or nbytes <= rule["max_bytes"]:
            return rule["algo"]
    return "nccl"


# ---- GEMM + collective ------------------------------------------------------------------
# Default when the table has no "gemm_comm" section: overlap once M*N*K reaches 2^33 (about
# 17 GFLOP: large enough that a chunk's GEMM outlasts its collective's launch costs), and no
# fused kernel (fused_max_m 0). gemm_ar's fused decode kernel is used for M <= fused_max_m
# where it applies (ops/gemm_comm.py: dtype, layout, capacity).
_GEMM_DEFAULT = {"min_mnk": 1 << 33, "chunks": 4, "fused_max_m": 0, "fused_min_mnk": None,
                 "fused_max_n": None,
                 "ce_min_mnk": None,
                 "ce_chunks": 2, "ce_min_piece_rows": 256}


def _gemm_rule(table: dict, op: str) -> dict:
    return {**_GEMM_DEFAULT, **table.get("gemm_comm", {}).get(op, {})}


def choose_gemm(table: dict, op: str, m: int, n: int, k: int, world: int,
                fused_ok: bool = False, copy_engine_ok: bool = False) -> str:
    """Engine for a GEMM + collective: "fused" when the fused kernel takes the call
    (`fused_ok`) and M <= the rule's fused_max_m (decode kernels) or M*N*K >= its
    fused_min_mnk with N <= its fused_max_n when set (prefill kernels); else "overlap" from
    min_mnk up, or from ce_min_mnk up when the overlap engine would move data with the copy engine
    (`copy_engine_ok`: the communicator has staging for the call); else "unfused". Inputs are
    identical on every rank, so is the choice."""
    rule = _gemm_rule(table, op)
    if world < 2:
        return "unfused"
    if fused_ok and m <= int(rule.get("fused_max_m") or 0):
        return "fused"
    if fused_ok and rule.get("fused_min_mnk") is not None and m * n * k >= rule["fused_min_mnk"] \
            and (rule.get("fused_max_n") is None or n <= rule["fused_max_n"]):
        return "fused"
    threshold = rule.get("ce_min_mnk") if copy_engine_ok and rule.get("ce_min_mnk") is not None \
        else rule["min_mnk"]
    if threshold is None:
        return "unfused"
    return "overlap" if m * n * k >= threshold else "unfused"


def gemm_chunks(table: dict, op: str, m: int, n: int, k: int, world: int,
                copy_engine: bool = False) -> int:
    """Pipeline depth of the overlap engine: the rule's "chunks", or "ce_chunks" when the data
    moves with the copy engine (whose pipelines hide all but one chunk from 2 chunks up)."""
    rule = _gemm_rule(table, op)
    if not copy_engine:
        return int(rule["chunks"])
    # Each copy-engine chunk is multiplied as `world` row pieces, and every piece streams the
    # whole weight: below ~256 rows a piece is weight-bandwidth bound (a 32-row piece of an
    # 8192 x 8192 weight took as long as a 256-row one), so fewer chunks for small M.
    pieces = m // (world * max(1, int(rule["ce_min_piece_rows"])))
    return max(1, min(int(rule["ce_chunks"]), pieces))


# ---- wave-aware GEMM pieces ---------------------------------------------------------------
# A tiled GEMM runs its output tiles in waves of one tile per SM, so a piece of ceil(t / sms)
# waves costs as much as a full one. gemm_rs's copy-engine overlap cuts each rank block's
# rows into chunks and multiplies every chunk as its own GEMMs; cut evenly, the pieces can
# need more waves than the whole GEMM (2 x 1024 rows x 14336 columns in 128 x 256 tiles:
# 2 x 4 waves against 7 for 2048 rows). The table's "gemm_comm" "waves" entry, {"tile_m":
# rows, "tile_n": columns, "sms": n}, describes the GEMM that the pieces run (cuBLAS's, as
# traced on the table's GPU); without it pieces are cut evenly. Taken from rank 0's table, so
# every rank cuts the same pieces. Optional "min_gain" (default 0): the least fraction of the
# even cut's waves that another cut must save to be taken.

def gemm_waves(table: dict) -> Optional[dict]:
    """The table's wave model, or None."""
    w = table.get("gemm_comm", {}).get("waves")
    if not w:
        return None
    if not all(key in w for key in ("tile_m", "tile_n", "sms")):
        raise ValueError(f"fusedist: tuning table gemm_comm.waves needs tile_m, tile_n and sms, "
                         f"got {w!r}")
    model = {key: int(w[key]) for key in ("tile_m", "tile_n", "sms")}
    model["min_gain"] = float(w.get("min_gain", 0.0))
    if min(model["tile_m"], model["tile_n"], model["sms"]) < 1 or \
            not 0 <= model["min_gain"] < 1:
        raise ValueError(f"fusedist: tuning table gemm_comm.waves needs positive tile_m, tile_n "
                         f"and sms and 0 <= min_gain < 1, got {w!r}")
    return model


def _gains(cut: int, even: int, model: dict) -> bool:
    """A cut of `cut` waves replaces the even one of `even` waves: fewer waves, by at least
    the model's min_gain (a fraction of `even`; the model is coarse, as cuBLAS changes its
    kernel with the shape, so a gain of one wave in fifty is not trusted)."""
    return cut < even and even - cut >= model.get("min_gain", 0.0) * even


def _waves(rows: int, cols: int, model: dict) -> int:
    """Waves of a rows x cols GEMM output under `model` (0 for an empty one)."""
    tiles = -(-rows // model["tile_m"]) * -(-cols // model["tile_n"])
    return -(-tiles // model["sms"])


def even_bounds(n: int, parts: int) -> list:
    """Bounds of `parts` near-equal consecutive ranges of range(n) (some empty when n < parts)."""
    return [n * i // parts for i in range(parts + 1)]


def wave_row_bounds(rows: int, cols: int, parts: int, model: Optional[dict]) -> list:
    """Bounds of `parts` consecutive row ranges of a rows x cols GEMM output, each range run
    as its own GEMM (or as several of that shape: the argmin is the same). The even split,
    unless a split whose ranges are whole numbers of tile rows takes fewer waves in total, by
    at least the model's min_gain; then the most even such split (least sum of squared
    rows)."""
    even = even_bounds(rows, parts)
    if model is None or parts < 2 or rows < parts:
        return even
    cut = list(_wave_row_bounds(rows, cols, parts, model["tile_m"], model["tile_n"],
                                model["sms"]))
    return cut if _gains(_cost(cut, cols, model), _cost(even, cols, model), model) else even


def _cost(bounds: list, cols: int, model: dict) -> int:
    return sum(_waves(b - a, cols, model) for a, b in zip(bounds, bounds[1:]))


@functools.lru_cache(maxsize=None)
def _wave_row_bounds(rows: int, cols: int, parts: int, tm: int, tn: int, sms: int) -> tuple:
    model = {"tile_m": tm, "tile_n": tn, "sms": sms}
    even = even_bounds(rows, parts)
    T = -(-rows // tm)  # tile rows; the last one may be partial
    best = (_cost(even, cols, model), sum((b - a) ** 2 for a, b in zip(even, even[1:])),
            tuple(even))
    if T >= parts:
        # dp[p][t]: (waves, sum of squared rows, bounds) of the best split of the first t tile
        # rows into p ranges of at least one tile row each.
        def rows_of(t):
            return min(rows, t * tm)

        dp = [{0: (0, 0, (0,))}] + [dict() for _ in range(parts)]
        for p in range(1, parts + 1):
            for t in range(p, T - (parts - p) + 1):
                cand = None
                for s, (wv, sq, bd) in dp[p - 1].items():
                    if s >= t:
                        continue
                    h = rows_of(t) - rows_of(s)
                    c = (wv + _waves(h, cols, model), sq + h * h, bd + (rows_of(t),))
                    if cand is None or c[:2] < cand[:2]:
                        cand = c
                if cand is not None:
                    dp[p][t] = cand
        got = dp[parts].get(T)
        if got is not None and got[0] < best[0]:
            best = got
    return best[2]


# ---- fusedist.gemm(kernel="auto") ---------------------------------------------------------
# The table's "gemm" section lists the regions where one of fusedist's GEMM kernels beat
# torch.matmul in a same-run measurement (benchmarks/gemm.py --write-rules derives them):
#   {"rules": [{"kernel": "decode" | "sm90", "layout": "kn" | "nk", "dtype": "bfloat16",
#               "k": K, "n": N, "m": [lo, hi]}, ...]}
# Every other call takes torch.matmul.
GEMM_KERNELS = ("decode", "sm90")
GEMM_LAYOUTS = ("kn", "nk")


def gemm_rules(table: dict) -> list:
    """The table's GEMM rules, checked."""
    rules = table.get("gemm", {}).get("rules", [])
    for r in rules:
        if r.get("kernel") not in GEMM_KERNELS or r.get("layout") not in GEMM_LAYOUTS or \
                not isinstance(r.get("m"), list) or len(r["m"]) != 2 or r["m"][0] > r["m"][1] \
                or not all(isinstance(r.get(key), int) for key in ("k", "n")) or \
                not isinstance(r.get("dtype"), str):
            raise ValueError(f"fusedist: tuning table gemm rule {r!r} needs kernel in "
                             f"{GEMM_KERNELS}, layout in {GEMM_LAYOUTS}, dtype, int k and n, "
                             "and m = [lo, hi]")
    return rules


_gemm_index: dict = {}   # id(rules list) -> (rules list, {(k, n, layout, dtype): [(lo, hi, kernel)]})


def _gemm_rule_index(table: dict) -> dict:
    """The table's GEMM rules checked once and indexed by shape (a per-call lookup: eager
    decode asks for every GEMM of every layer)."""
    rules = table.get("gemm", {}).get("rules", [])
    hit = _gemm_index.get(id(rules))
    if hit is not None and hit[0] is rules:
        return hit[1]
    index: dict = {}
    for r in gemm_rules(table):
        index.setdefault((r["k"], r["n"], r["layout"], r["dtype"]), []).append(
            (r["m"][0], r["m"][1], r["kernel"]))
    _gemm_index[id(rules)] = (rules, index)
    return index


def choose_gemm_kernel(table: dict, m: int, k: int, n: int, layout: str, dtype: str) -> str:
    """The kernel of the first rule covering (m, k, n, layout, dtype), else "torch"."""
    for lo, hi, kernel in _gemm_rule_index(table).get((k, n, layout, dtype), ()):
        if lo <= m <= hi:
            return kernel
    return "torch"


def derive_gemm_rules(points: list, min_ratio: float = 0.99, min_median: float = 1.0) -> list:
    """GEMM rules from measurements. points: dicts with kernel, layout, dtype, k, n, m and
    ratio (torch.matmul time / the kernel's time, same run). A measured m qualifies for a
    kernel when every ratio there is >= min_ratio and their median >= min_median; runs of
    consecutive qualifying m (in the measured m of that shape) become one rule [first, last].
    Where two kernels qualify at one m, the one with the larger median wins."""
    from statistics import median
    by: dict = {}
    for p in points:
        shape = (p["layout"], p["dtype"], int(p["k"]), int(p["n"]))
        by.setdefault(shape, {}).setdefault(int(p["m"]), {}).setdefault(
            p["kernel"], []).append(float(p["ratio"]))
    rules = []
    for (layout, dtype, k, n), per_m in sorted(by.items()):
        best = {}
        for m, kernels in per_m.items():
            ok = {kn: median(rs) for kn, rs in kernels.items()
                  if min(rs) >= min_ratio and median(rs) >= min_median}
            best[m] = max(ok, key=ok.get) if ok else "torch"
        run = None
        for m in sorted(best) + [None]:
            kern = best.get(m) if m is not None else None
            if run is not None and kern == run["kernel"]:
                run["m"][1] = m
                continue
            if run is not None and run["kernel"] != "torch":
                rules.append(run)
            run = None if m is None else {"kernel": kern, "layout": layout, "dtype": dtype,
                                          "k": k, "n": n, "m": [m, m]}
    return rules


# ---- knob sections: every op's measured crossovers and rules -------------------------------
# A knob section is a flat {key: number} object of the table (plus "comment" and "benchmark":
# the benchmark and result file that measured it). KNOBS declares each section's keys with the
# shipped default (the value the CPU path and an unmeasured GPU use), its type and its range;
# an op reads its section with knobs(name, device) and never keeps a measured threshold as a
# module constant (tests/test_tuning.py scans fusedist/ops for them). A section of
# FUSEDIST_TUNING_FILE replaces the shipped one key by key.

class Knob:
    """One tunable: default, type (int / float / bool) and inclusive range [lo, hi]
    (None: unbounded); nullable: null in the table means "never" (a disabled crossover)."""

    __slots__ = ("default", "type", "lo", "hi", "nullable", "doc")

    def __init__(self, default, type_=int, lo=None, hi=None, nullable=False, doc=""):
        self.default, self.type, self.lo, self.hi = default, type_, lo, hi
        self.nullable, self.doc = nullable, doc

    def check(self, section: str, key: str, value):
        if value is None and self.nullable:
            return None
        ok = isinstance(value, self.type) and not (self.type is not bool and
                                                   isinstance(value, bool))
        if self.type is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if ok and self.type is not bool:
            ok = (self.lo is None or value >= self.lo) and (self.hi is None or value <= self.hi)
        if not ok:
            rng = f" in [{self.lo}, {self.hi}]" if self.type is not bool else ""
            null = " or null" if self.nullable else ""
            kind = {int: "an int", float: "a float", bool: "a bool"}[self.type]
            raise ValueError(f"fusedist: tuning table {section}.{key} must be {kind}{rng}{null}, "
                             f"got {value!r}")
        return value


KNOBS: dict = {}


def declare(section: str, **knobs: Knob) -> None:
    """Declare (or extend) a knob section; ops call this at import with their defaults."""
    KNOBS.setdefault(section, {}).update(knobs)


def section_values(table: dict, section: str) -> dict:
    """The section's knobs: the table's values over the declared defaults, each checked (a
    ValueError names the key and its range; an undeclared key is an error too)."""
    declared = KNOBS.get(section)
    if declared is None:
        raise KeyError(f"fusedist.tuning: no knob section {section!r}; declared: "
                       f"{sorted(KNOBS)}")
    values = {k: v.default for k, v in declared.items()}
    for key, value in table.get(section, {}).items():
        if key in ("comment", "benchmark"):
            continue
        if key not in declared:
            raise ValueError(f"fusedist: tuning table {section} section has unknown key {key!r}; "
                             f"known: {sorted(declared)}")
        values[key] = declared[key].check(section, key, value)
    return values


@functools.lru_cache(maxsize=None)
def _table_for_gpu(gpu_name: str) -> dict:
    return load_table(gpu_name, 1)


# gpu_table's answers by CUDA device index (the ops ask on every call): cleared with the
# tables by clear_cache().
_by_index: dict = {}


def gpu_table(device=None) -> dict:
    """The single-GPU table (shipped default, overlaid by FUSEDIST_TUNING_FILE) for a CUDA
    device's model, read once per model and process; for None or a CPU device (or a machine
    without CUDA: tests that stand in for a device) the table of no particular GPU."""
    if device is not None:
        import torch
        device = torch.device(device)
        if device.type == "cuda":
            hit = _by_index.get(device.index)
            if hit is not None:
                return hit
            if torch.cuda.is_available():
                table = _table_for_gpu(_gpu_name(device.index if device.index is not None
                                                 else torch.cuda.current_device()))
                if device.index is not None:
                    _by_index[device.index] = table
                return table
    return _table_for_gpu("")


@functools.lru_cache(maxsize=16)
def _gpu_name(index: int) -> str:
    import torch
    return torch.cuda.get_device_name(index)


def knobs(section: str, device=None) -> dict:
    """The knob section `section` for `device` (gpu_table; section_values)."""
    table = gpu_table(device)
    cache = table.setdefault("_knobs", {})
    hit = cache.get(section)
    if hit is None:
        hit = cache[section] = section_values(table, section)
    return hit


def clear_cache() -> None:
    """Forget the tables read so far (tests change FUSEDIST_TUNING_FILE)."""
    _table_for_gpu.cache_clear()
    _by_index.clear()


# ---- the decode attention planner (fusedist.ops.attention._decode) ---------------------------
# Section "decode": {"min_slabs_per_split": int >= 1, "max_merge_splits": 1..128,
# "long_split_slabs": int >= 1, "cluster_merge_max_splits": 0..16}.
declare("decode",
        min_slabs_per_split=Knob(8, int, 1, 1 << 20),
        max_merge_splits=Knob(32, int, 1, 128),
        long_split_slabs=Knob(32, int, 1, 1 << 20),
        cluster_merge_max_splits=Knob(2, int, 0, 16))
DECODE_DEFAULT = {k: v.default for k, v in KNOBS["decode"].items()}


def decode_rule(table: dict) -> dict:
    """The decode planner's knobs: the table's "decode" section over the declared defaults,
    checked (a ValueError names the key and its range)."""
    return section_values(table, "decode")
