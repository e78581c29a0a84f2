"""The engines of the GEMM + collective ops, one unit each (why_not(call): why it cannot take
the call, None when it can; run(call)), in the manner of vLLM's communicator backends:
  unfused      the collective and one cuBLAS GEMM, back to back (CPU: the reference path)
  overlap      chunked GEMMs on the caller's stream, the chunks' collectives on a comm stream
  copy_engine  the overlap engine with copy-engine transfers between symmetric staging
  fused_sm90   ag_gemm / gemm_rs: one persistent Hopper GEMM with per-piece flags
  fused_ar     gemm_ar at decode sizes: one kernel, GEMM + one-shot exchange
  hierarchical groups that span nodes: the GEMM's chunks pipelined with the two-level
               collectives (fusedist.comm.hierarchical)
(engine="fused" names fused_ar for gemm_ar and fused_sm90 for ag_gemm / gemm_rs.)
choose() is the dispatcher: engine="auto" takes the tuning table's pick (tuning.choose_gemm,
FUSEDIST_GEMM_ENGINE overrides), given the gates of the fused unit and of the copy engine; on
a group that spans nodes (call.hier) the hierarchical unit, unless every rank is an NVLink
peer (symmetric memory over the group: nodes emulated on one host), where the table decides.
Every input of the choice is identical on every rank, so is the choice."""

from __future__ import annotations

from typing import Optional

from ... import envs, tuning
from ...comm.communicator import Communicator
from . import copy_engine, fused_ar, fused_sm90, hierarchical, overlap, unfused
from .base import Call, Engine

ENGINES = ("unfused", "overlap", "fused", "hierarchical")  # what engine= names
UNITS = {e.name: e for e in (unfused.ENGINE, overlap.ENGINE, copy_engine.ENGINE, fused_sm90.ENGINE,
                             fused_ar.ENGINE, hierarchical.ENGINE)}


def fused_unit(op: str) -> Engine:
    """The unit behind engine="fused" for op."""
    return fused_ar.ENGINE if op == "gemm_ar" else fused_sm90.ENGINE


def choose(call: Call, engine: str) -> Engine:
    """The unit that runs `call` for engine= `engine` (call.transport already resolved)."""
    comm = call.comm
    # FUSEDIST_GEMM_ENGINE=unfused|overlap forces a one-level engine on every group.
    two_level = engine == "hierarchical" or (
        engine == "auto" and call.hier is not None and (comm.device.type == "cpu" or
                                                        comm.symm is None)
        and envs.get("FUSEDIST_GEMM_ENGINE") not in ("unfused", "overlap"))
    if two_level:
        why = hierarchical.ENGINE.why_not(call)
        if why is not None and engine == "hierarchical":
            raise ValueError(f"fusedist.{call.op}: engine='hierarchical' does not take this "
                             f"call: {why}; use engine='auto'")
        if why is not None:
            raise ValueError(f"fusedist.{call.op}: group {comm.group.name} spans nodes, so "
                             f"engine='auto' takes the hierarchical engine, which does not take "
                             f"this call: {why}; pass engine='unfused' or 'overlap' for a "
                             "one-level engine")
        return hierarchical.ENGINE
    if comm.device.type == "cpu" or comm.group.size == 1:
        return unfused.ENGINE
    fused_why_not = fused_unit(call.op).why_not(call)
    name = pick(call.op, engine, call.rows, call.n, call.k, comm, fused_why_not,
                copy_engine_ok=call.transport == "copy_engine")
    if name == "fused":
        return fused_unit(call.op)
    if name == "overlap":
        return copy_engine.ENGINE if call.transport == "copy_engine" else overlap.ENGINE
    return unfused.ENGINE


def pick(op: str, engine: str, m: int, n: int, k: int, comm: Communicator,
            fused_why_not: Optional[str], copy_engine_ok: bool = False) -> str:
    """The engine for this call. `fused_why_not` is None when the fused kernel takes the call,
    else the reason it does not (it depends only on shapes, dtypes and strides, which SPMD code
    keeps identical on every rank, so every rank picks the same engine)."""
    if engine not in ("auto",) + ENGINES:
        raise ValueError(f"fusedist.{op}: engine must be 'auto' or one of {ENGINES}, got "
                         f"{engine!r}")
    if comm.device.type == "cpu" or comm.group.size == 1:
        return "unfused"
    if engine == "hierarchical":
        return engine
    if engine == "fused" and fused_why_not is not None:
        raise ValueError(f"fusedist.{op}: engine='fused' does not take this call: "
                         f"{fused_why_not}; use engine='auto', 'overlap' or 'unfused'")
    if engine == "auto":
        forced = envs.get("FUSEDIST_GEMM_ENGINE")  # validated against its choices there
        if forced == "fused" and fused_why_not is None:
            return "fused"
        if forced in ("unfused", "overlap"):
            return forced
        measured = comm.table.get("gemm_comm", {}).get("measured_worlds")
        if measured and comm.group.size not in measured:
            tuning.warn_once(comm, "gemm_comm_untuned_world",
                             f"the GEMM + collective engine rules were measured at world size"
                             f" {', '.join(map(str, measured))}, not {comm.group.size}; "
                             "engine='auto' applies them as they are (the engines may cross over "
                             "elsewhere at this size): measure with benchmarks/gemm_comm.py")
        return tuning.choose_gemm(comm.table, op, m, n, k, comm.group.size,
                                  fused_ok=fused_why_not is None, copy_engine_ok=copy_engine_ok)
    return engine
