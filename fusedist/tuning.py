"""All-reduce algorithm choice per (bytes, world size, dtype, peer access).

The table maps a world size to ascending byte thresholds: the first rule whose `max_bytes`
is >= the message size names the algorithm. Sources, first match wins:
  1. FUSEDIST_ALLREDUCE_ALGO=one_shot|two_shot|nccl forces one algorithm (auto = the table);
  2. FUSEDIST_TUNING_FILE=path.json;
  3. the cache written by `python benchmarks/allreduce.py --tune`
     (~/.cache/fusedist/allreduce-<gpu>-w<world>.json);
  4. the shipped default, fusedist/tuning_default.json (measured on 2x H200 NVLink).
A Communicator takes rank 0's table at creation, so every rank makes the same choice.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import Optional

ALGOS = ("one_shot", "two_shot", "nccl")
_DEFAULT = Path(__file__).with_name("tuning_default.json")


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
    return table


def load_table(gpu_name: str, world: int) -> dict:
    path = os.environ.get("FUSEDIST_TUNING_FILE")
    if path and not Path(path).is_file():
        raise ValueError(f"fusedist: FUSEDIST_TUNING_FILE={path!r} does not exist; point it at a "
                         "table written by benchmarks/allreduce.py --tune, or unset it")
    candidates = [Path(path)] if path else []
    candidates += [cache_path(gpu_name, world), _DEFAULT]
    for p in candidates:
        if p.is_file():
            with open(p) as f:
                t = _valid(json.load(f))
            t["source"] = str(p)
            return t
    return {"allreduce": {}, "source": "none"}


def forced_algo() -> Optional[str]:
    a = os.environ.get("FUSEDIST_ALLREDUCE_ALGO", "auto")
    if a == "auto":
        return None
    if a not in ALGOS:
        raise ValueError(f"fusedist: FUSEDIST_ALLREDUCE_ALGO must be auto or one of {ALGOS}, "
                         f"got {a!r}")
    return a


def choose(table: dict, nbytes: int, world: int) -> str:
    """Table lookup; the world size falls back to the nearest one in the table."""
    rules_by_world = table.get("allreduce", {})
    if not rules_by_world:
        return "one_shot" if nbytes <= 256 * 1024 else "two_shot"
    key = str(world) if str(world) in rules_by_world else \
        min(rules_by_world, key=lambda w: abs(int(w) - world))
    for rule in rules_by_world[key]:
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
