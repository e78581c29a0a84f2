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
                 "ce_min_mnk": None,
                 "ce_chunks": 2, "ce_min_piece_rows": 256}


def _gemm_rule(table: dict, op: str) -> dict:
    return {**_GEMM_DEFAULT, **table.get("gemm_comm", {}).get(op, {})}


def choose_gemm(table: dict, op: str, m: int, n: int, k: int, world: int,
                fused_ok: bool = False, copy_engine_ok: bool = False) -> str:
    """Engine for a GEMM + collective: "fused" when the fused kernel takes the call
    (`fused_ok`) and M <= the rule's fused_max_m (decode kernels) or M*N*K >= its
    fused_min_mnk (prefill kernels); else "overlap" from min_mnk up, or from
    ce_min_mnk up when the overlap engine would move data with the copy engine
    (`copy_engine_ok`: the communicator has staging for the call); else "unfused". Inputs are
    identical on every rank, so is the choice."""
    rule = _gemm_rule(table, op)
    if world < 2:
        return "unfused"
    if fused_ok and m <= int(rule.get("fused_max_m") or 0):
        return "fused"
    if fused_ok and rule.get("fused_min_mnk") is not None and m * n * k >= rule["fused_min_mnk"]:
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
