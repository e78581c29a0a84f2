"""An alpha-beta cost model of fusedist's collectives, per link level, for N nodes x G ranks.

Each link level (fusedist's intra-node kernels, NCCL or gloo inside a node, NCCL or gloo
across nodes) is a :class:`Link`: one or more protocols, each a fixed cost
``alpha_us`` and a bus bandwidth ``gbps``, plus a per-step latency ``step_us`` that grows with
the number of ring steps. A protocol's time for a collective moving ``factor * S`` bytes per
rank in ``steps`` steps is::

    t = alpha_us + steps * step_us + factor * S / gbps

and the link's time is the fastest protocol's (NCCL switches protocol by size the same way:
LL for small messages, Simple for large ones). The factors are nccl-tests' bus factors:
all-reduce 2(p-1)/p with 2(p-1) steps, all-gather and reduce-scatter (p-1)/p with p-1 steps,
S the full buffer (all-gather's output, reduce-scatter's input).

The parameters of a machine live in a data file, ``fusedist/comm/links/<machine>.json``, each
level with the source of its numbers: fitted from a results file (``fit_link``, the points it
was fitted on listed) or assumed (said why). docs/scaling.md has the equations, the flat,
hierarchical and FP8 forms, and the error against every measured point.

Pure Python: no torch, no GPU; importable anywhere.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence

LINKS_DIR = Path(__file__).resolve().parent / "links"
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
# FP8 payloads: one byte per element (e3m4 or e4m3) plus one fp32 scale per block.
FP8_SCALE_BYTES = 4


@dataclass(frozen=True)
class Protocol:
    alpha_us: float
    gbps: float     # GB/s (1e9 bytes/s) of bus bandwidth


@dataclass(frozen=True)
class Link:
    protocols: tuple[Protocol, ...]
    step_us: float = 0.0
    source: str = ""
    # The transport runs a reduce-scatter as an all-reduce of the whole buffer (gloo does),
    # so it costs one.
    reduce_scatter_as_all_reduce: bool = False

    def op(self, op: str) -> str:
        return "all_reduce" if op == "reduce_scatter" and self.reduce_scatter_as_all_reduce \
            else op

    def time_us(self, factor_bytes: float, steps: int) -> float:
        return min(p.alpha_us + steps * self.step_us + factor_bytes / (p.gbps * 1e3)
                   for p in self.protocols)

    @staticmethod
    def from_dict(d: dict) -> "Link":
        return Link(tuple(Protocol(float(p["alpha_us"]), float(p["gbps"]))
                          for p in d["protocols"]), float(d.get("step_us", 0.0)),
                    str(d.get("source", "")), bool(d.get("reduce_scatter_as_all_reduce", False)))

    def to_dict(self) -> dict:
        return {"protocols": [{"alpha_us": round(p.alpha_us, 4), "gbps": round(p.gbps, 4)}
                              for p in self.protocols],
                "step_us": self.step_us, "source": self.source,
                "reduce_scatter_as_all_reduce": self.reduce_scatter_as_all_reduce}


@dataclass(frozen=True)
class Machine:
    """A machine's link levels. Levels: ``intra`` (the library collective inside a node, NCCL
    on GPUs or gloo on CPUs: per-rank bus bandwidth), ``inter`` (the same across nodes: one
    NIC per rank, its gbps one NIC's),
    and optionally ``fusedist_one_shot`` / ``fusedist_two_shot`` (fusedist's intra-node
    all-reduce kernels). ``nic_efficiency`` scales the NICs' aggregate bandwidth in a flat ring
    across nodes (see docs/scaling.md)."""
    name: str
    gpus_per_node: int
    links: dict
    nic_efficiency: float = 1.0
    codec_gbps: float = 0.0   # FP8 encode + decode throughput (0: not modelled, free)
    notes: tuple = field(default=())
    # Whether collectives on different groups run at the same time (GPUs: separate NCCL
    # streams and links). False where they share the cores that drive them: chunks then
    # add up instead of overlapping.
    overlap: bool = True

    @staticmethod
    def load(name_or_path) -> "Machine":
        p = Path(name_or_path)
        if not p.suffix:
            p = LINKS_DIR / f"{name_or_path}.json"
        if not p.exists():
            have = sorted(f.stem for f in LINKS_DIR.glob("*.json"))
            raise FileNotFoundError(f"fusedist.comm.cost_model: no link file {p}; machines: "
                                    f"{', '.join(have)} (or pass the path of a JSON file)")
        d = json.loads(p.read_text())
        return Machine(d["name"], int(d["gpus_per_node"]),
                       {k: Link.from_dict(v) for k, v in d["links"].items()},
                       float(d.get("nic_efficiency", 1.0)), float(d.get("codec_gbps", 0.0)),
                       tuple(d.get("notes", ())), bool(d.get("overlap", True)))

    def link(self, level: str) -> Link:
        if level not in self.links:
            raise KeyError(f"fusedist.comm.cost_model: machine {self.name} has no link level "
                           f"{level!r}; it has {sorted(self.links)}")
        return self.links[level]


def _check(op: str, nodes: int, gpus: int, nbytes: float) -> None:
    if op not in COLLECTIVES:
        raise ValueError(f"cost_model: op must be one of {COLLECTIVES}, got {op!r}")
    for name, v in (("nodes", nodes), ("gpus", gpus)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"cost_model: {name} must be a positive int, got {v!r}")
    if nbytes < 0:
        raise ValueError(f"cost_model: nbytes must be >= 0, got {nbytes!r}")


def bus_factor(op: str, p: int) -> tuple[float, int]:
    """(bytes factor, ring steps) of `op` on p ranks (nccl-tests' busbw factors)."""
    if p <= 1:
        return 0.0, 0
    if op == "all_reduce":
        return 2.0 * (p - 1) / p, 2 * (p - 1)
    return (p - 1) / p, p - 1


def ring(link: Link, op: str, p: int, nbytes: float, gbps_cap: Optional[float] = None) -> float:
    """A ring collective of `op` over p ranks on one link level (0 for p == 1). gbps_cap
    limits every protocol's bandwidth (a slower link the ring also crosses)."""
    factor, steps = bus_factor(link.op(op), p)
    if p <= 1:
        return 0.0
    if gbps_cap is not None:
        link = Link(tuple(Protocol(q.alpha_us, min(q.gbps, gbps_cap)) for q in link.protocols),
                    link.step_us, link.source)
    return link.time_us(factor * nbytes, steps)


def flat(m: Machine, op: str, nodes: int, gpus: int, nbytes: float) -> float:
    """NCCL over all nodes x gpus ranks as one group: a ring through every rank. Inside one
    node it is the intra level; across nodes the fixed cost is the inter level's, the steps that
    cross a node boundary pay its step latency and the others the intra level's, and the
    ring's bandwidth is the smaller of the intra-node bus and the node's NICs together (gpus
    NICs, one ring per NIC, nic_efficiency of their sum). For all-reduce NCCL's tree is
    modelled too (latency 2 (log2(nodes) network steps + gpus - 1 NVLink steps), the ring's
    bandwidth) and the faster of the two is taken, as NCCL's tuner does."""
    _check(op, nodes, gpus, nbytes)
    p = nodes * gpus
    if nodes == 1:
        return ring(m.link("intra"), op, p, nbytes)
    intra, inter = m.link("intra"), m.link("inter")
    cap = max(q.gbps for q in intra.protocols)
    op = inter.op(op)
    factor, steps = bus_factor(op, p)
    # NCCL's ring latency: the steps that cross a node boundary pay the network's latency,
    # the others NVLink's (2 (nodes - 1) of the 2 (p - 1) all-reduce steps cross).
    cross = steps * (nodes - 1) // (p - 1)
    lat = (steps - cross) * intra.step_us + cross * inter.step_us
    t = min(q.alpha_us + lat + factor * nbytes / (min(cap, gpus * m.nic_efficiency * q.gbps) * 1e3)
            for q in inter.protocols)
    if op == "all_reduce":
        lat = 2 * (math.ceil(math.log2(nodes)) * inter.step_us + (gpus - 1) * intra.step_us)
        t = min(t, min(q.alpha_us + lat + factor * nbytes /
                       (min(cap, gpus * m.nic_efficiency * q.gbps) * 1e3)
                       for q in inter.protocols))
    return t


def intra_all_reduce(m: Machine, gpus: int, nbytes: float) -> tuple[float, str]:
    """The fastest intra-node all-reduce of the machine: fusedist one-shot (each rank reads
    every peer's buffer: (g-1) S bytes, no ring steps), two-shot (ring factors) or NCCL."""
    best = (ring(m.link("intra"), "all_reduce", gpus, nbytes), "ring")
    if gpus <= 1:
        return 0.0, "none"
    if "fusedist_one_shot" in m.links:
        t = m.link("fusedist_one_shot").time_us((gpus - 1) * nbytes, 0)
        best = min(best, (t, "one_shot"))
    if "fusedist_two_shot" in m.links:
        t = m.link("fusedist_two_shot").time_us(2.0 * (gpus - 1) / gpus * nbytes, 0)
        best = min(best, (t, "two_shot"))
    return best


def hierarchical(m: Machine, op: str, nodes: int, gpus: int, nbytes: float,
                 chunks: int = 1) -> float:
    """The two-level form (fusedist.comm.hierarchical), `chunks` pipelined chunks.

    all_reduce: reduce-scatter inside each node, all-reduce of the 1/gpus shard across nodes
    (gpus inter-node groups in parallel, one NIC each), all-gather inside. all_gather: across
    (each local rank with its counterparts), then inside. reduce_scatter: inside, then
    across. A chunk of c bytes
    takes stage times s_i(c); k chunks take sum_i s_i(c) + (k - 1) max_i s_i(c) (levels
    overlap: a chunk's inter-node stage runs while the next chunk's intra-node stage does);
    on a machine without overlap (Machine.overlap False) k chunks take k sum_i s_i(c)."""
    _check(op, nodes, gpus, nbytes)
    if chunks < 1:
        raise ValueError(f"cost_model: chunks must be >= 1, got {chunks!r}")
    stages = _stages(m, op, nodes, gpus, nbytes / chunks)
    if not m.overlap:
        return chunks * sum(stages)
    return sum(stages) + (chunks - 1) * max(stages)


def _stages(m: Machine, op: str, nodes: int, gpus: int, c: float) -> list:
    """The two-level form's stage times for a chunk of c bytes (hierarchical's docstring)."""
    intra, inter = m.link("intra"), m.link("inter")
    if op == "all_reduce":
        return [ring(intra, "reduce_scatter", gpus, c),
                ring(inter, "all_reduce", nodes, c / gpus),
                ring(intra, "all_gather", gpus, c)]
    if op == "all_gather":     # c: the full output; across first (output c / gpus per rank)
        return [ring(inter, "all_gather", nodes, c / gpus),
                ring(intra, "all_gather", gpus, c)]
    return [ring(intra, "reduce_scatter", gpus, c),       # reduce_scatter, c: the full input
            ring(inter, "reduce_scatter", nodes, c / gpus)]


def fused_two_level(m: Machine, op: str, nodes: int, gpus: int, nbytes: float,
                    compute_us: float, chunks: int = 1, algo: str = "hierarchical") -> float:
    """A fused op's two-level form (fusedist.ops: gemm_comm's hierarchical engine,
    all_reduce_add_rmsnorm on a group that spans nodes): its local compute (`compute_us`: the
    whole GEMM, or the RMSNorm epilogue) pipelined with the collective `op` of `nbytes` (gemm_ar
    and all_reduce_add_rmsnorm: all_reduce of the output; gemm_rs: reduce_scatter of the
    GEMM's output; ag_gemm: all_gather of the input). all_reduce / reduce_scatter: the compute
    of a chunk is one more pipeline stage, t = sum(s) + (chunks - 1) max(s) with s = [compute /
    chunks] + the collective's stages. all_gather (ag_gemm): the own rows' GEMM beside the
    gather across nodes, the counterparts' beside the gather inside, then the rest:
    t = max(AG_across, T / p) + max(AG_inside, T (nodes - 1) / p) + T (gpus - 1) / gpus.
    algo="flat": the GEMM then the flat collective (ag_gemm: the own rows beside it). On a
    machine without overlap (Machine.overlap False) nothing overlaps: compute + chunks x the
    stages. The GEMM's time is the caller's (the model has no compute rates)."""
    _check(op, nodes, gpus, nbytes)
    if chunks < 1:
        raise ValueError(f"cost_model: chunks must be >= 1, got {chunks!r}")
    p = nodes * gpus
    if algo == "flat":
        comm = flat(m, op, nodes, gpus, nbytes)
        if op == "all_gather" and m.overlap:
            return max(comm, compute_us / p) + compute_us * (p - 1) / p
        return compute_us + comm
    if algo != "hierarchical":
        raise ValueError(f"cost_model.fused_two_level: algo must be hierarchical or flat, got "
                         f"{algo!r}")
    if op == "all_gather":
        across, inside = _stages(m, op, nodes, gpus, nbytes)
        if not m.overlap:
            return compute_us + across + inside
        return (max(across, compute_us / p) + max(inside, compute_us * (nodes - 1) / p)
                + compute_us * (gpus - 1) / gpus)
    stages = _stages(m, op, nodes, gpus, nbytes / chunks)
    if not m.overlap:
        return compute_us + chunks * sum(stages)
    stages.append(compute_us / chunks)
    return sum(stages) + (chunks - 1) * max(stages)


def best_hierarchical(m: Machine, op: str, nodes: int, gpus: int, nbytes: float,
                      chunk_choices: Sequence[int] = (1, 2, 4, 8)) -> tuple[float, int]:
    """(time, chunks) of the fastest chunk count."""
    return min((hierarchical(m, op, nodes, gpus, nbytes, k), k) for k in chunk_choices)


def fp8_payload_bytes(nbytes: float, itemsize: int, block: int) -> float:
    """Bytes an FP8 payload of a buffer of `nbytes` (elements of `itemsize`) takes."""
    n = nbytes / itemsize
    return n + FP8_SCALE_BYTES * math.ceil(n / block)


def fp8(m: Machine, op: str, nodes: int, gpus: int, nbytes: float, itemsize: int = 2,
        block: int = 128, algo: str = "two_shot") -> float:
    """FP8 all-reduce / all-gather (fusedist.comm.fp8): flat NCCL on the 8-bit payload plus
    the codec (encode the input, decode what arrives, at codec_gbps). all_reduce two_shot:
    an all-to-all of payload shards (priced as a reduce-scatter) and an all-gather of the
    re-quantized sums; one_shot: an all-gather of every rank's payload."""
    if op not in ("all_reduce", "all_gather"):
        raise ValueError(f"cost_model.fp8: op must be all_reduce or all_gather, got {op!r}")
    p = nodes * gpus
    q = fp8_payload_bytes(nbytes, itemsize, block)
    codec = 0.0 if m.codec_gbps <= 0 else (nbytes + q) / (m.codec_gbps * 1e3)
    if op == "all_gather":
        return flat(m, "all_gather", nodes, gpus, q) + codec
    if algo == "one_shot":
        return flat(m, "all_gather", nodes, gpus, q * p) + p * codec
    return (flat(m, "reduce_scatter", nodes, gpus, q) + flat(m, "all_gather", nodes, gpus, q)
            + 2 * codec)


def predict(m: Machine, op: str, nodes: int, gpus: int, nbytes: float,
            algo: str = "auto") -> tuple[float, str]:
    """(time_us, algorithm) of `op` on nodes x gpus ranks. algo: 'flat', 'hierarchical',
    'fusedist' (intra-node all-reduce kernels, one node only), 'fp8' or 'auto' (the fastest
    of flat, hierarchical and, on one node, fusedist's kernels: never slower than flat by
    the model's own prediction; FP8 is never chosen by 'auto')."""
    _check(op, nodes, gpus, nbytes)
    if algo == "flat":
        return flat(m, op, nodes, gpus, nbytes), "flat"
    if algo == "hierarchical":
        t, k = best_hierarchical(m, op, nodes, gpus, nbytes)
        return t, f"hierarchical/{k}"
    if algo == "fusedist":
        if nodes != 1 or op != "all_reduce":
            raise ValueError("cost_model: algo='fusedist' models the intra-node all-reduce "
                             "kernels (nodes=1, op='all_reduce')")
        t, how = intra_all_reduce(m, gpus, nbytes)
        return t, how
    if algo == "fp8":
        return fp8(m, op, nodes, gpus, nbytes), "fp8"
    if algo != "auto":
        raise ValueError(f"cost_model: algo must be auto, flat, hierarchical, fusedist or fp8, "
                         f"got {algo!r}")
    cands = [(flat(m, op, nodes, gpus, nbytes), "flat")]
    if nodes > 1 and gpus > 1:
        t, k = best_hierarchical(m, op, nodes, gpus, nbytes)
        cands.append((t, f"hierarchical/{k}"))
    if nodes == 1 and op == "all_reduce":
        cands.append(intra_all_reduce(m, gpus, nbytes))
    return min(cands)


def decode_step_us(m: Machine, nodes: int, gpus: int, *, step_us_tp1: float, layers: int,
                   hidden: int, batch: int, itemsize: int = 2, comm_us_tp1: float = 0.0) -> dict:
    """A tensor-parallel decode step over nodes x gpus ranks (one TP group spanning them):
    the TP-1 step's non-communication time divided by the TP size (the step is bound by
    reading weights and KV cache, both split by TP), plus two all-reduces of batch x hidden
    per layer at the model's best algorithm. Returns the parts and the total."""
    tp = nodes * gpus
    compute = (step_us_tp1 - comm_us_tp1) / tp
    ar, how = predict(m, "all_reduce", nodes, gpus, batch * hidden * itemsize) if tp > 1 \
        else (0.0, "none")
    comm = 2 * layers * ar
    return {"compute_us": compute, "comm_us": comm, "all_reduce_us": ar, "algo": how,
            "total_us": compute + comm}


# ---- fitting ---------------------------------------------------------------------------------
def _fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(alpha, inverse bandwidth) of t = alpha + x * beta minimizing the squared relative
    error sum ((pred - t) / t)^2, both clamped >= 0 (a two-variable least-squares solve)."""
    a11 = a12 = a22 = b1 = b2 = 0.0
    for x, t in points:
        w = 1.0 / (t * t)
        a11 += w
        a12 += w * x
        a22 += w * x * x
        b1 += w * t
        b2 += w * x * t
    det = a11 * a22 - a12 * a12
    if abs(det) < 1e-30 * max(a11 * a22, 1e-300):
        return sum(t for _, t in points) / len(points), 0.0
    alpha = (b1 * a22 - b2 * a12) / det
    beta = (a11 * b2 - a12 * b1) / det
    if beta <= 0:
        return min(t for _, t in points), 0.0
    if alpha < 0:  # refit beta alone
        beta = sum(x / t for x, t in points) / sum(x * x / (t * t) for x, t in points)
        alpha = 0.0
    return alpha, beta


def fit_link(points: Iterable[tuple[float, float]], *, factor: float, steps: int,
             step_us: float = 0.0, max_protocols: int = 2, source: str = "",
             latency: str = "alpha") -> Link:
    """A Link fitted to measured (bytes S, time_us) points of one collective whose per-rank
    traffic is factor * S in `steps` steps. With max_protocols=2 the sizes are split where a
    two-piece fit (small-message protocol below, large-message above; the link's time is the
    faster) has the smallest worst relative error, as NCCL's LL / Simple protocols split.

    latency="step" puts the whole fixed cost into the per-step latency (alpha 0, one
    protocol): for transports where every ring step is a round of messages with its own
    wake-up (gloo's rings), so that a collective of more ranks (more steps) costs more."""
    pts = sorted((factor * s, t) for s, t in points)
    if len(pts) < 2:
        raise ValueError("cost_model.fit_link: need at least 2 points")
    if latency == "step":
        if steps < 1:
            raise ValueError("cost_model.fit_link: latency='step' needs steps >= 1")
        a, b = _fit_line(pts)
        return Link((Protocol(0.0, 1e-3 / b if b > 0 else 1e9),), a / steps, source)
    if latency != "alpha":
        raise ValueError(f"cost_model.fit_link: latency must be 'alpha' or 'step', got "
                         f"{latency!r}")

    def proto(sub):
        a, b = _fit_line(sub)
        return Protocol(max(a - steps * step_us, 0.0), 1e-3 / b if b > 0 else 1e9)

    def worst(link):
        return max(abs(link.time_us(x, steps) - t) / t for x, t in pts)

    best = Link((proto(pts),), step_us, source)
    if max_protocols >= 2:
        for k in range(2, len(pts) - 1):
            cand = Link((proto(pts[:k]), proto(pts[k:])), step_us, source)
            if worst(cand) < worst(best):
                best = cand
    return best


def relative_error(pred: float, measured: float) -> float:
    return (pred - measured) / measured


# ---- all-to-all (expert parallelism: fusedist.ep) ---------------------------------------------
# The EP modes' host round trip: a high-throughput call waits on the host for the counts
# before it can size the payload exchange (assumed, not measured: a device-to-host copy and
# its event poll).
EP_HOST_SYNC_US = 15.0
EP_MODES = ("low_latency", "high_throughput")


def all_to_all(m: Machine, nodes: int, gpus: int, nbytes: float) -> float:
    """NCCL all-to-all(-v) over nodes x gpus ranks of `nbytes` per rank spread evenly over the
    p ranks (the rank's own share stays): (gpus - 1) / p of it crosses the intra level,
    (p - gpus) / p the rank's NIC (the inter level at nic_efficiency). Every peer's message is
    in flight at once (one step of each level's latency); the two levels run side by side, so
    the slower one decides."""
    for name, v in (("nodes", nodes), ("gpus", gpus)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"cost_model: {name} must be a positive int, got {v!r}")
    if nbytes < 0:
        raise ValueError(f"cost_model: nbytes must be >= 0, got {nbytes!r}")
    p = nodes * gpus
    if p == 1:
        return 0.0
    t = m.link("intra").time_us((gpus - 1) / p * nbytes, 1) if gpus > 1 else 0.0
    if nodes > 1:
        inter = m.link("inter")
        t = max(t, min(q.alpha_us + inter.step_us + (p - gpus) / p * nbytes /
                       (m.nic_efficiency * q.gbps * 1e3) for q in inter.protocols))
    return t


def all_to_all_two_level(m: Machine, nodes: int, gpus: int, inter_bytes: float,
                         intra_bytes: float) -> float:
    """The two-level all-to-all of fusedist.ep (route by node, then within it): stage 1 sends
    `inter_bytes` per rank to its counterparts on the other nodes ((nodes - 1) / nodes of it
    crosses its NIC), stage 2 `intra_bytes` per rank inside the node ((gpus - 1) / gpus over
    the intra level). The stages follow each other (stage 2 forwards what stage 1 brought)."""
    if nodes < 2:
        return all_to_all(m, 1, gpus, intra_bytes)
    inter = m.link("inter")
    t1 = min(q.alpha_us + inter.step_us + (nodes - 1) / nodes * inter_bytes /
             (m.nic_efficiency * q.gbps * 1e3) for q in inter.protocols)
    t2 = m.link("intra").time_us((gpus - 1) / gpus * intra_bytes, 1) if gpus > 1 else 0.0
    return t1 + t2


def ep_symmetric(m: Machine, gpus: int, nbytes: float) -> float:
    """fusedist's low-latency kernels inside one node: each rank stores `nbytes` of rows
    straight into its peers' symmetric buffers ((gpus - 1) / gpus of them over NVLink) and
    waits for theirs: one kernel, priced by the link of fusedist's one-shot all-reduce (the
    same NVLink stores into peers' slots, one launch), the intra level where it is missing."""
    if gpus <= 1:
        return m.link("fusedist_one_shot").protocols[0].alpha_us \
            if "fusedist_one_shot" in m.links else 0.0
    link = m.link("fusedist_one_shot") if "fusedist_one_shot" in m.links else m.link("intra")
    return link.time_us((gpus - 1) / gpus * nbytes, 0)


def ep_bytes(tokens: int, hidden: int, top_k: int, itemsize: int = 2, fp8: bool = False
             ) -> tuple[float, float]:
    """(dispatch, combine) payload bytes one rank sends for `tokens` tokens: a row per
    (token, slot) pair; dispatch rows are FP8 (a byte per element and a 4-byte scale per 128)
    with fp8, else `itemsize` bytes per element; combine rows are bf16 / the dtype."""
    rows = tokens * top_k
    d = rows * (hidden + FP8_SCALE_BYTES * math.ceil(hidden / 128) if fp8 else hidden * itemsize)
    return float(d), float(rows * hidden * itemsize)


def ep_predict(m: Machine, mode: str, nodes: int, gpus: int, tokens: int, hidden: int,
               top_k: int, itemsize: int = 2, fp8: bool = False, num_experts: int = 0,
               two_level: Optional[bool] = None) -> dict:
    """Predicted dispatch and combine times (us) of fusedist.ep for `tokens` tokens per rank.
    low_latency: one symmetric-memory kernel each way (one node only; FP8 dispatch rows with
    fp8). high_throughput: a small all-to-all of counts, the host round trip, and the payload
    all-to-all, flat or (several nodes of several ranks) two-level, where stage 1 carries each
    token once per node it reaches (the expected number of distinct nodes of k experts drawn
    uniformly from num_experts, when given; else min(k, nodes)) and stage 2 a row per pair.
    two_level: force one form (None: the faster by the model). Returns dispatch_us,
    combine_us, the bytes each direction moves per rank, and "how" (low_latency, flat or
    two_level)."""
    if mode not in EP_MODES:
        raise ValueError(f"cost_model.ep_predict: mode must be one of {EP_MODES}, got {mode!r}")
    d_bytes, c_bytes = ep_bytes(tokens, hidden, top_k, itemsize, fp8 and
                                mode == "low_latency")
    if mode == "low_latency":
        if nodes != 1:
            raise ValueError("cost_model.ep_predict: the low-latency kernels run inside one "
                             "node (nodes=1)")
        return {"dispatch_us": ep_symmetric(m, gpus, d_bytes),
                "combine_us": ep_symmetric(m, gpus, c_bytes),
                "dispatch_bytes": d_bytes, "combine_bytes": c_bytes, "how": "low_latency"}
    p = nodes * gpus
    counts = all_to_all(m, nodes, gpus, 8.0 * p * 16) + EP_HOST_SYNC_US
    flat_t = (counts + all_to_all(m, nodes, gpus, d_bytes),
              counts + all_to_all(m, nodes, gpus, c_bytes), "flat")
    cands = [flat_t] if two_level is not True else []
    if nodes > 1 and gpus > 1 and two_level is not False:
        reach = float(min(top_k, nodes))
        if num_experts:
            per_node = num_experts / nodes
            # expected distinct nodes among k experts without replacement
            miss = math.prod((num_experts - per_node - i) / (num_experts - i)
                             for i in range(top_k)) if num_experts - per_node >= top_k else 0.0
            reach = nodes * (1.0 - miss)
        tok = tokens * hidden * itemsize
        cands.append((counts + all_to_all_two_level(m, nodes, gpus, tok * reach, d_bytes),
                      counts + all_to_all_two_level(m, nodes, gpus, c_bytes, c_bytes),
                      "two_level"))
    if not cands:
        raise ValueError("cost_model.ep_predict: two_level=True needs several nodes of several "
                         "ranks")
    d, c, how = min(cands, key=lambda x: x[0] + x[1])
    return {"dispatch_us": d, "combine_us": c, "dispatch_bytes": d_bytes,
            "combine_bytes": c_bytes, "how": how}
