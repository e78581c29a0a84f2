"""fusedist.ep.Buffer: expert-parallel dispatch and combine over a group (docs/design/ep.md).

    buf = fusedist.ep.Buffer(group, hidden=7168, max_tokens_per_rank=128, num_experts=256,
                             top_k=8, dtype=torch.bfloat16, fp8=True)
    recv_x, recv_counts, handle = buf.dispatch(x, topk_ids, topk_weights)
    y = experts(recv_x, recv_counts)            # rows grouped by local expert
    out = buf.combine(y, handle)                # [T, H]: sum_j w[t, j] * expert_j(x[t])

    # overlapped (DeepEP style): the exchange runs on the buffer's stream
    recv_x, recv_counts, handle, event = buf.dispatch_async(x, topk_ids, topk_weights)
    ...                                         # other work on the current stream
    event.current_stream_wait()                 # then use recv_x

Sized once in model terms; expert e lives on rank e // (num_experts / world) (layout.Placement).
dispatch returns recv_x [R, H]: the tokens this rank's experts receive, grouped by local
expert (contiguous segments, sources in rank order, each source's rows in pair order
t * k + j), recv_counts int32 [L] on the device and a handle; rows past sum(recv_counts) are
unspecified (the low-latency mode's R is its fixed capacity, world x rows_per_source; the
high-throughput mode's R is exactly the rows received). combine(y, handle) takes the experts'
outputs in recv_x's row order and returns [T, H]: each token's sum over its k slots of
weight x output in float32, in slot order, rounded once: bitwise
fusedist.ops.moe.unpermute_reference on the same expert outputs, in every mode.

Modes (mode=, per Buffer and per call):
* "low_latency" (decode): the symmetric-memory kernels (low_latency.py), bf16 rows or FP8
  (e4m3 + a fp32 scale per 128, quantized on the way out, dequantized on receive: fp8=True),
  no host synchronization, CUDA-graph replayable with new routings; one node, up to
  max_tokens_per_rank tokens.
* "high_throughput" (prefill): all-to-all-v over NCCL (gloo on CPUs), two-level across nodes
  (high_throughput.py). The host waits for the counts: not capturable.
* "auto": the mode fusedist.comm.cost_model predicts faster at max_tokens_per_rank tokens
  among those this group and build can run. The choice is made once, from values every rank
  shares, so ranks with different token counts still agree.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from .. import _align, _dtypes, _ext
from ..comm import cost_model
from ..comm.communicator import resolve_group
from ..comm.hierarchical import layout as two_level_layout
from ..comm.streams import nvtx_range
from ..comm.symmetric import default_timeout_s
from ..distributed.groups import Group, describe_differences
from ..distributed.runtime import check_timeout_s, get_runtime
from ..errors import (CollectiveMismatchError, CommunicatorClosedError, NcclUnavailableError,
                      PeerAccessError)
from . import high_throughput as ht
from . import low_latency as ll
from .layout import Placement, max_rows_per_source

MODES = ("auto", "low_latency", "high_throughput")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _fail(msg: str, exc=ValueError):
    raise exc(f"fusedist.ep.Buffer: {msg}")


def _positive_int(name: str, v) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        _fail(f"{name} must be a positive int, got {v!r}")
    return v


class EventOverlap:
    """Completion of an async dispatch / combine (DeepEP's EventOverlap):
    current_stream_wait() makes the caller's current stream wait for it (no host
    synchronization); synchronize() blocks the host; query() polls. CPU calls complete before
    they return (event None)."""

    def __init__(self, event: Optional[torch.cuda.Event] = None):
        self.event = event

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def synchronize(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def query(self) -> bool:
        return self.event is None or self.event.query()


@dataclass
class DispatchHandle:
    """What combine needs from a dispatch (opaque to the caller)."""
    buffer: "Buffer"
    mode: str
    tokens: int
    rows: int                       # recv_x's rows (and y's)
    ids: torch.Tensor               # int32 [T, k]
    weights: torch.Tensor           # float32 [T, k]
    recv_counts: torch.Tensor       # int32 [L]
    recv_offsets: Optional[torch.Tensor] = None   # int32 [L + 1] (low-latency)
    send_pos: Optional[torch.Tensor] = None       # int32 [T k] (low-latency)
    recv_src: Optional[torch.Tensor] = None       # int32 [R] (low-latency)
    ht: Optional[ht.HtHandle] = None


class Buffer:
    """Expert-parallel dispatch / combine over `group` (module docstring).

    group: a fusedist Group, torch ProcessGroup or None (the world). hidden: elements per
    token. max_tokens_per_rank: tokens one rank may dispatch per call. num_experts: a multiple
    of the group's size. top_k: experts per token. dtype: of x and the expert outputs
    (bfloat16 for the low-latency kernels; any float on the high-throughput path). fp8: the
    low-latency dispatch moves e4m3 + scales. rows_per_source: rows of a low-latency slot (one
    source rank's rows for one destination rank; default max_tokens_per_rank x min(top_k,
    local experts), which never overflows with distinct ids per token; smaller saves memory,
    and a dispatch that overflows it raises EpCapacityError naming the expert and the count).
    chunk_rows: rows per peer and NCCL group call of the high-throughput exchange. two_level:
    the high-throughput exchange in two levels (route by node, then within it) where the
    group spans several nodes of several ranks each (None: where the cost model predicts it
    faster at max_tokens_per_rank; True where it cannot is an error naming why). timeout_s:
    bounded waits (default FUSEDIST_TIMEOUT_S). machine: the cost model's link file.

    Collective: every rank of the group creates it with the same arguments
    (CollectiveMismatchError names the ones that differ, before anything is allocated), and
    makes the same dispatch / combine calls in the same order."""

    def __init__(self, group=None, hidden: int = 0, max_tokens_per_rank: int = 0,
                 num_experts: int = 0, top_k: int = 0, dtype: torch.dtype = torch.bfloat16, *,
                 fp8: bool = False, mode: str = "auto", rows_per_source: Optional[int] = None,
                 chunk_rows: int = 4096, two_level: Optional[bool] = None,
                 timeout_s: Optional[float] = None, machine: Optional[str] = None):
        rt = get_runtime()
        g: Group = rt.world if group is None else resolve_group(group)
        if not g.is_member:
            _fail(f"this rank is not in group {g.name} {list(g.ranks)}")
        self.hidden = _positive_int("hidden", hidden)
        self.max_tokens_per_rank = _positive_int("max_tokens_per_rank", max_tokens_per_rank)
        self.num_experts = _positive_int("num_experts", num_experts)
        self.top_k = _positive_int("top_k", top_k)
        if self.top_k > self.num_experts:
            _fail(f"top_k={top_k} exceeds num_experts={num_experts}")
        if dtype not in DTYPES:
            _fail(f"dtype must be one of {DTYPES}, got {dtype!r}", TypeError)
        if not isinstance(fp8, bool):
            _fail(f"fp8 must be a bool, got {fp8!r}", TypeError)
        if mode not in MODES:
            _fail(f"mode must be one of {MODES}, got {mode!r}")
        if two_level not in (None, True, False):
            _fail(f"two_level must be None, True or False, got {two_level!r}", TypeError)
        self.chunk_rows = _positive_int("chunk_rows", chunk_rows)
        self.placement = Placement(self.num_experts, g.size)
        L = self.placement.local_experts
        self.rows_per_source = max_rows_per_source(self.max_tokens_per_rank, self.top_k, L) \
            if rows_per_source is None else _positive_int("rows_per_source", rows_per_source)
        self.timeout_s = check_timeout_s("fusedist.ep.Buffer", timeout_s) \
            if timeout_s is not None else float(default_timeout_s())
        self.group, self.dtype, self.fp8, self.device = g, dtype, fp8, g.device
        self.dtype_code = _dtypes.code(dtype)
        self.machine_name = machine or ("h200" if self.device.type == "cuda" else "cpu")
        self.machine = cost_model.Machine.load(self.machine_name)
        self.closed = True
        self._aborted = False
        # Before anything is allocated: every rank raises alike.
        fields = {"hidden": str(self.hidden), "max_tokens_per_rank": str(max_tokens_per_rank),
                  "num_experts": str(num_experts), "top_k": str(top_k), "dtype": str(dtype),
                  "fp8": str(fp8), "mode": mode, "rows_per_source": str(self.rows_per_source),
                  "chunk_rows": str(chunk_rows), "two_level": str(two_level),
                  "timeout_s": f"{self.timeout_s:g}",
                  "machine": self.machine_name, "device": self.device.type}
        every = g.all_gather_object(fields)
        if any(f != fields for f in every):
            raise CollectiveMismatchError(
                f"fusedist.ep.Buffer: ranks of group {g.name} were given different sizes: "
                f"{describe_differences(g.ranks, every)}. Create the Buffer with the same "
                "arguments on every rank")

        # ---- where the ranks are: nodes for the two-level path ----
        rank_at, why_flat = two_level_layout(g)
        if two_level and not rank_at:
            _fail(f"two_level=True, but the exchange has one level here: {why_flat}")
        self.rank_at = rank_at
        self.nodes = len(rank_at) if rank_at else 1
        self.gpus = g.size // self.nodes
        node_of, local_of = [0] * g.size, list(range(g.size))
        if rank_at:
            for n, node in enumerate(rank_at):
                for i, r in enumerate(node):
                    node_of[r], local_of[r] = n, i
        self.node_of_rank = torch.tensor(node_of, dtype=torch.long)
        self.local_of_rank = torch.tensor(local_of, dtype=torch.long)
        self.node, self.local = node_of[g.rank], local_of[g.rank]

        # ---- the low-latency path ----
        self.ll: Optional[ll.LowLatency] = None
        why_ll = self._why_not_low_latency(mode)
        # Every rank must take the same path: the verdict of the worst rank for all.
        why_ll = next((w for w in g.all_gather_object(why_ll) if w), "")
        if not why_ll:
            try:
                self.ll = ll.LowLatency(self, g)
            except PeerAccessError as e:
                why_ll = str(e)
                warnings.warn(f"fusedist.ep.Buffer: no low-latency path: {e}", RuntimeWarning,
                              stacklevel=2)
        self.why_not = {"low_latency": why_ll}

        # ---- the high-throughput path ----
        self._nccl: list = []
        self.ht: Optional[ht.HighThroughput] = None
        try:
            self.why_not["high_throughput"] = self._build_high_throughput(rt, g, two_level)
        except BaseException:
            if self.ll is not None:
                self.ll.close()
            raise

        self.stream = None
        if self.device.type == "cuda":
            lo, hi = torch.cuda.Stream.priority_range()
            self.stream = torch.cuda.Stream(device=self.device, priority=min(lo, hi))
        try:
            self.mode = self._resolve_mode(mode)
        except BaseException:
            self.closed = False
            self.close()
            raise
        self.closed = False
        self._calls = 0
        # Every rank is done creating (allocations that may wait for the GPU included) before
        # any launches a kernel that waits for its peers.
        g.barrier()

    # ---- construction -----------------------------------------------------------------------
    def _why_not_low_latency(self, mode: str) -> str:
        g = self.group
        if mode == "high_throughput":
            return "the Buffer was created with mode='high_throughput'"
        if self.device.type != "cuda":
            return "CPU groups run the high-throughput path over gloo"
        why = _ext.why_not("ep_low_latency", self.device)
        if why:
            return why
        if self.dtype != torch.bfloat16:
            return f"the low-latency kernels move bfloat16 rows, the Buffer's dtype is {self.dtype}"
        if not g.single_node:
            return f"group {g.name} spans nodes (symmetric memory is one NVLink domain)"
        return _ext.load().ep_why_not(self.hidden, self.num_experts, g.size, self.top_k,
                                      self.max_tokens_per_rank, self.fp8)

    def _build_high_throughput(self, rt, g: Group, two_level: Optional[bool]) -> str:
        """Create the all-to-all transports (collective); returns why there is none ("")."""
        if self.device.type == "cpu":
            if g.size > 1 and g.pg is None:
                return f"group {g.name} has no torch.distributed process group (gloo)"
        elif g.nccl_class is not None:
            return (f"group {g.name} brings its own transports, which have no all-to-all "
                    "(ranks emulated on one GPU: NCCL runs one rank per GPU and process)")

        def level(grp: Group) -> ht.Level:
            nc = None
            if self.device.type == "cuda" and grp.size > 1:
                nc = ht.EpNccl(grp)
                self._nccl.append(nc)
            return ht.Level(grp, self.chunk_rows, nc)

        if two_level is None and self.rank_at:
            two_level = self.predict("high_throughput")["how"] == "two_level"
        try:
            levels = {"flat": level(g)}
            intra, inter = rt.intra_node, rt.inter_node
            if two_level:
                # The runtime's node groups are the levels: the group is the world.
                if not (g.ranks == tuple(range(rt.world_size)) and inter is not None and
                        intra.ranks == tuple(g.ranks[r] for r in self.rank_at[self.node]) and
                        inter.ranks == tuple(g.ranks[n[self.local]] for n in self.rank_at)):
                    _fail(f"two_level=True needs the group to be the world (the runtime's "
                          f"intra- and inter-node groups are its levels); group {g.name} is not")
                levels.update(intra=level(intra), inter=level(inter), rank_at=self.rank_at)
        except NcclUnavailableError as e:
            return str(e)
        self.ht = ht.HighThroughput(self, levels)
        return ""

    def _resolve_mode(self, mode: str) -> str:
        ok = [m for m in MODES[1:] if not self.why_not[m]]
        if mode != "auto":
            if mode not in ok:
                _fail(f"mode={mode!r} cannot run here: {self.why_not[mode]}")
            return mode
        if not ok:
            _fail("no mode can run here: " + "; ".join(f"{m}: {w}" for m, w in
                                                     self.why_not.items()))
        return min(ok, key=lambda m: self.predict(m)["dispatch_us"] +
                   self.predict(m)["combine_us"])

    # ---- facts ------------------------------------------------------------------------------
    @property
    def local_experts(self) -> int:
        return self.placement.local_experts

    @property
    def experts(self) -> range:
        """The global ids of this rank's experts (local expert l at index l)."""
        return self.placement.experts_of(self.group.rank)

    def predict(self, mode: str, tokens: Optional[int] = None) -> dict:
        """The cost model's dispatch_us / combine_us (and bytes) for `mode` at `tokens` tokens
        per rank (default max_tokens_per_rank)."""
        t = self.max_tokens_per_rank if tokens is None else tokens
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        nodes = 1 if mode == "low_latency" else self.nodes
        gpus = self.group.size if mode == "low_latency" else self.gpus
        two_level = None
        if mode == "high_throughput" and getattr(self, "ht", None) is not None and \
                self.nodes > 1 and self.gpus > 1:
            two_level = self.ht.two_level      # the form the buffer runs
        return cost_model.ep_predict(self.machine, mode, nodes, gpus, t, self.hidden,
                                     self.top_k, itemsize, self.fp8, self.num_experts,
                                     two_level)

    def footprint_bytes(self) -> int:
        """Symmetric memory this rank holds for the low-latency path (0 without it)."""
        return 0 if self.ll is None else int(self.ll.symm.total_bytes)

    # ---- errors -----------------------------------------------------------------------------
    def check(self) -> None:
        """Raise what the last calls recorded on the device: a lost or mismatched peer (sticky:
        the buffer is unusable afterwards), a slot overflow or an expert id out of range
        (raised once). A host read, no CUDA call; call it after a synchronize or between
        graph replays."""
        if self.closed:
            raise CommunicatorClosedError(f"fusedist.ep.Buffer of group {self.group.name} is "
                                          "closed")
        self.check_protocol()
        if self.ll is not None:
            err = self.ll.status.take(self.local_experts)
            if err is not None:
                raise err

    def check_protocol(self, abort: bool = False) -> None:
        if self.ll is None:
            return
        rt = get_runtime()
        err = ll.protocol_error(self.ll.symm, self.group, rt.peers, self.timeout_s)
        if err is not None:
            if abort or isinstance(err, CollectiveMismatchError):
                self.abort_nccl()
            raise err

    def abort_nccl(self) -> None:
        """Abort the buffer's NCCL communicators (once): an NCCL call queued behind a failed
        call check may wait for a peer that never comes."""
        if self._aborted:
            return
        self._aborted = True
        for nc in self._nccl:
            try:
                nc.abort()
            except Exception as e:  # noqa: BLE001 - the first error is the one to report
                warnings.warn(f"fusedist.ep.Buffer: aborting NCCL failed: {e}", RuntimeWarning,
                              stacklevel=2)

    def call_check(self, op: int) -> None:
        """Before a high-throughput call on GPUs with symmetric memory: the device call check
        carrying its descriptor (it meets a peer's low-latency kernel or call check)."""
        if self.ll is not None and self.group.size > 1:
            code = ll.OP_HT_DISPATCH if op == ht.OP_DISPATCH else ll.OP_HT_COMBINE
            self.ll.call_check(code, torch.cuda.current_stream(self.device))

    # ---- validation -------------------------------------------------------------------------
    def _mode(self, mode: Optional[str]) -> str:
        if mode is None or mode == "auto":
            mode = self.mode
        if mode not in MODES[1:]:
            _fail(f"mode must be one of {MODES}, got {mode!r}")
        if self.why_not[mode]:
            _fail(f"mode={mode!r} cannot run here: {self.why_not[mode]}")
        if mode == "high_throughput" and self.device.type == "cuda" and \
                torch.cuda.is_current_stream_capturing():
            _fail("the high-throughput mode waits on the host for the counts and cannot be "
                  "captured in a CUDA graph; capture mode='low_latency' calls")
        return mode

    def _tensor(self, op: str, name: str, t, shape: tuple, dtypes: tuple):
        if not isinstance(t, torch.Tensor):
            _fail(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
        if t.device.type != self.device.type or (self.device.type == "cuda" and
                                                 t.device.index != self.device.index):
            _fail(f"{op}: {name} is on {t.device}, the buffer's group runs on {self.device}; "
                  f"move it with {name}.to('{self.device}')")
        if t.dim() != len(shape) or any(s is not None and t.shape[i] != s
                                        for i, s in enumerate(shape)):
            want = ", ".join("?" if s is None else str(s) for s in shape)
            _fail(f"{op}: {name} has shape {tuple(t.shape)}, expected [{want}]")
        if t.dtype not in dtypes:
            _fail(f"{op}: {name} has dtype {t.dtype}; expected "
                  f"{' or '.join(str(d) for d in dtypes)}", TypeError)

    def _check_dispatch(self, x, ids, weights, mode: str):
        op = "dispatch"
        self._tensor(op, "x", x, (None, self.hidden), (self.dtype,))
        T = x.shape[0]
        if T > self.max_tokens_per_rank:
            _fail(f"dispatch: x has {T} tokens, more than max_tokens_per_rank="
                  f"{self.max_tokens_per_rank}; create the Buffer with a larger "
                  "max_tokens_per_rank or dispatch in pieces")
        self._tensor(op, "topk_ids", ids, (T, self.top_k), (torch.int32, torch.int64))
        self._tensor(op, "topk_weights", weights, (T, self.top_k), (torch.float32,))
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if ids.numel() and not capturing:
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.num_experts:
                _fail(f"dispatch: topk_ids must be expert ids in [0, {self.num_experts}), got "
                      f"values in [{lo}, {hi}]")
        return x, ids, weights

    @staticmethod
    def _prepare(x, ids, weights):
        """The kernels' forms of the inputs (copies only where needed), made on the current
        stream: the one the exchange runs after (_dispatch)."""
        x = _align.aligned_input(x.contiguous())
        return x, ids.to(torch.int32).contiguous(), weights.contiguous()

    def _check_open(self) -> None:
        if self.closed:
            raise CommunicatorClosedError(f"fusedist.ep.Buffer of group {self.group.name} is "
                                          "closed")
        self.check_protocol()

    # ---- dispatch ---------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                 mode: Optional[str] = None):
        """(recv_x, recv_counts, handle) (module docstring); ordered on the current stream."""
        recv_x, counts, handle, _ = self._dispatch(x, topk_ids, topk_weights, mode, None, False)
        return recv_x, counts, handle

    def dispatch_async(self, x: torch.Tensor, topk_ids: torch.Tensor,
                       topk_weights: torch.Tensor, *, mode: Optional[str] = None,
                       previous_event: Optional[EventOverlap] = None):
        """dispatch on the buffer's stream, after the current stream (or after
        `previous_event` alone, which must then follow the inputs' production):
        (recv_x, recv_counts, handle, event). Call event.current_stream_wait() before using
        recv_x (and before a CUDA-graph capture ends)."""
        return self._dispatch(x, topk_ids, topk_weights, mode, previous_event, True)

    def _dispatch(self, x, ids, weights, mode, previous_event, async_finish):
        self._check_open()
        mode = self._mode(mode)
        x, ids, weights = self._check_dispatch(x, ids, weights, mode)
        T = x.shape[0]
        self._calls += 1
        with nvtx_range(f"fusedist.ep.dispatch.{mode}"):
            if self.device.type == "cpu":
                x, ids32, weights = self._prepare(x, ids, weights)
                recv_x, counts, h = self.ht.dispatch(x, ids32)
                return recv_x, counts, DispatchHandle(self, mode, T, recv_x.shape[0], ids32,
                                                      weights, counts, ht=h), EventOverlap()
            own = self._own_allocations(previous_event)
            if not own:          # the copies on the caller's stream, before the fork
                x, ids, weights = self._prepare(x, ids, weights)
            caller, comm = self._fork(previous_event)
            for t in (x, ids, weights):
                t.record_stream(comm)
            with torch.cuda.stream(comm if own else caller):
                x, ids32, weights = self._prepare(x, ids, weights) if own else (x, ids, weights)
                if mode == "low_latency":
                    recv_x, counts, offsets, src, pos = self.ll.dispatch(x, ids32, comm)
            if mode == "low_latency":
                handle = DispatchHandle(self, mode, T, recv_x.shape[0], ids32, weights, counts,
                                        offsets, pos, src)
            else:
                with torch.cuda.stream(comm):
                    recv_x, counts, h = self.ht.dispatch(x, ids32)
                handle = DispatchHandle(self, mode, T, recv_x.shape[0], ids32, weights, counts,
                                        ht=h)
            for t in (recv_x, counts):
                t.record_stream(caller)
            event = self._join(caller, comm, async_finish)
        return recv_x, counts, handle, event

    # ---- combine ----------------------------------------------------------------------------
    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """[T, H]: each token's weighted sum of its experts' outputs (module docstring)."""
        return self._combine(y, handle, None, False)[0]

    def combine_async(self, y: torch.Tensor, handle: DispatchHandle, *,
                      previous_event: Optional[EventOverlap] = None):
        """combine on the buffer's stream: (out, event); event.current_stream_wait() before
        using out."""
        return self._combine(y, handle, previous_event, True)

    def _combine(self, y, handle, previous_event, async_finish):
        self._check_open()
        if not isinstance(handle, DispatchHandle) or handle.buffer is not self:
            _fail("combine: handle must be the DispatchHandle a dispatch of this Buffer returned",
                  TypeError)
        mode = self._mode(handle.mode)
        self._tensor("combine", "y", y, (handle.rows, self.hidden), (self.dtype,))
        with nvtx_range(f"fusedist.ep.combine.{mode}"):
            if self.device.type == "cpu":
                y = _align.aligned_input(y.contiguous())
                return self.ht.combine(y, handle, handle.weights), EventOverlap()
            own = self._own_allocations(previous_event)
            if not own:          # the copy on the caller's stream, before the fork
                y = _align.aligned_input(y.contiguous())
            caller, comm = self._fork(previous_event)
            y.record_stream(comm)
            with torch.cuda.stream(comm if own else caller):
                if own:
                    y = _align.aligned_input(y.contiguous())
                if mode == "low_latency":
                    out = torch.empty(handle.tokens, self.hidden, dtype=self.dtype,
                                      device=self.device)
            if mode == "low_latency":
                for t in (y, out, handle.ids, handle.weights, handle.send_pos, handle.recv_src,
                          handle.recv_offsets):
                    t.record_stream(comm)
                self.ll.combine(y, handle, out, comm)
            else:
                y.record_stream(comm)
                with torch.cuda.stream(comm):
                    out = self.ht.combine(y, handle, handle.weights)
            out.record_stream(caller)
            event = self._join(caller, comm, async_finish)
        return out, event

    # ---- streams ----------------------------------------------------------------------------
    def _fork(self, previous_event: Optional[EventOverlap]):
        """The buffer's stream, after the caller's stream (or previous_event). Every call of
        the buffer runs there, one after another: the kernels' epochs need them in the same
        order on every rank, one at a time."""
        caller = torch.cuda.current_stream(self.device)
        if previous_event is not None and previous_event.event is not None:
            self.stream.wait_event(previous_event.event)
        else:
            self.stream.wait_stream(caller)
        return caller, self.stream

    @staticmethod
    def _own_allocations(previous_event: Optional[EventOverlap]) -> bool:
        """Whether a call's input copies and outputs come from the buffer's stream. The
        caching allocator hands a stream the blocks freed on it, whose last users on that
        stream may still be queued. Without previous_event the buffer's stream waits for the
        caller's, so the copies are made on the caller's stream before that wait and the
        outputs taken from its blocks are safe to write; with previous_event it does not wait
        for the caller's stream (the event stands for the inputs), so the copies and outputs
        are made on the buffer's stream, after the event, and handed to the caller's stream
        with record_stream."""
        return previous_event is not None and previous_event.event is not None

    def _join(self, caller, comm, async_finish: bool) -> EventOverlap:
        done = torch.cuda.Event()
        done.record(comm)
        if not async_finish:
            caller.wait_event(done)
        return EventOverlap(done)

    # ---- teardown ---------------------------------------------------------------------------
    def close(self) -> None:
        """Collective: release the symmetric memory and the NCCL communicators."""
        if self.closed:
            return
        self.closed = True
        if self.stream is not None:
            self.stream.synchronize()
        try:
            if self.ll is not None:
                self.ll.close()
        finally:
            for nc in self._nccl:
                if not nc.aborted:
                    nc.close()
            self._nccl = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


__all__ = ["Buffer", "DispatchHandle", "EventOverlap", "MODES"]
