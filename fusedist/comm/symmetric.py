"""Symmetric memory: one equally sized buffer per rank of a single-node group, mapped into
every peer through CUDA IPC, plus this rank's control block and host-mapped error record.

Layout and protocol: csrc/include/fusedist/common/layout.h and docs/design/allreduce.md. In short,
the buffer holds kGenerations generations of `world` receive slots, one gather region and one
call descriptor per rank; every free 32-bit word holds EMPTY_WORD; writers push into their own
slot of a peer's buffer and the owner clears what it reads. The kernels (and the call checks,
device barriers that carry a descriptor: before NCCL calls and between the steps of the GEMM +
collective pipelines) compare the peers' call descriptors with their own and record a
mismatch like a timeout: the communicator fails for good and check() raises, naming both
calls. This module builds the descriptors the host passes and decodes them for the message.
Created collectively, before any CUDA-graph capture, after checking that every rank asked for
the same sizes; freed by close() after a group barrier so no peer still writes into freed
memory.
"""

from __future__ import annotations

import ctypes
import socket
from typing import Optional, Sequence

import torch

from .. import _dtypes, _ext, envs
from .._align import round_up
from ..distributed.groups import Group
from ..errors import (CollectiveMismatchError, CommunicatorClosedError, CommunicatorTimeoutError,
                     PeerAccessError)

# OpCode (layout.h) values: kernels (1-7, in error records) and what a rank called (call
# descriptors: 1-6, and 8-10 for the NCCL call a call check guards).
OP_ONE_SHOT, OP_TWO_SHOT, OP_RMSNORM, OP_GEMM_AR, OP_AG_GEMM, OP_GEMM_RS = 1, 2, 3, 4, 5, 6
OP_CALL_CHECK, OP_NCCL_ALL_REDUCE, OP_NCCL_ALL_GATHER, OP_NCCL_REDUCE_SCATTER = 7, 8, 9, 10
GEMM_OPS = {"gemm_ar": OP_GEMM_AR, "ag_gemm": OP_AG_GEMM, "gemm_rs": OP_GEMM_RS}
NCCL_OPS = {"all_reduce": OP_NCCL_ALL_REDUCE, "all_gather": OP_NCCL_ALL_GATHER,
            "reduce_scatter": OP_NCCL_REDUCE_SCATTER}

# Kernel OpCode (error record) -> the kernel's name and what a failed call leaves in its outputs.
_NAN_WHERE_MISSING = "outputs of that call are NaN where a peer's data did not arrive"
_OPS = {
    OP_ONE_SHOT: ("one_shot all_reduce", _NAN_WHERE_MISSING),
    OP_TWO_SHOT: ("two_shot all_reduce", _NAN_WHERE_MISSING),
    OP_RMSNORM: ("all_reduce_add_rmsnorm", "rows of that call's outputs that miss a peer's data "
                 "are NaN"),
    OP_GEMM_AR: ("gemm_ar (fused)", _NAN_WHERE_MISSING),
    OP_AG_GEMM: ("ag_gemm (fused: waiting for a peer's rows)",
                 "outputs of that call are undefined"),
    OP_GEMM_RS: ("gemm_rs (fused: waiting for a peer's partial rows)",
                 "outputs of that call are undefined"),
    # Communicator.device_barrier(): before an NCCL call, and between the steps of the GEMM +
    # collective ops' copy-engine pipelines and fused Hopper engines (call_check.cuh).
    OP_CALL_CHECK: ("call check (the device barrier before an NCCL call or between the steps of "
                    "a GEMM + collective op)", "outputs of that call are undefined"),
}
# Call descriptor OpCode -> what the rank called, in the user's words.
_CALLS = {OP_ONE_SHOT: "one_shot all_reduce", OP_TWO_SHOT: "two_shot all_reduce",
          OP_RMSNORM: "all_reduce_add_rmsnorm", OP_GEMM_AR: "gemm_ar", OP_AG_GEMM: "ag_gemm",
          OP_GEMM_RS: "gemm_rs", OP_NCCL_ALL_REDUCE: "all_reduce through NCCL",
          OP_NCCL_ALL_GATHER: "all_gather through NCCL",
          OP_NCCL_REDUCE_SCATTER: "reduce_scatter through NCCL"}
_DTYPE_NAMES = {_dtypes.FLOAT32: "float32", _dtypes.FLOAT16: "float16",
                _dtypes.BFLOAT16: "bfloat16", _dtypes.FLOAT8_E4M3: "float8_e4m3fn"}
ERR_TIMEOUT, ERR_MISMATCH = 1, 2
DESC_FP8_OUT = 1
# flags of a GEMM + collective op's descriptor: engine | chunks << 2 (layout.h kDescEngine*).
DESC_ENGINE_COPY_ENGINE, DESC_ENGINE_FUSED = 1, 2
_ENGINES = {DESC_ENGINE_COPY_ENGINE: "the copy-engine overlap",
            DESC_ENGINE_FUSED: "the fused kernel"}

# Mirrors of layout.h (tests/test_protocol.py checks them against _C where it is built).
GENERATIONS = 3
EPOCH_PERIOD = 0xFFFFFFFF // GENERATIONS * GENERATIONS


def next_epoch(epoch: int) -> int:
    """The epoch after `epoch` (layout.h next_epoch): it counts modulo EPOCH_PERIOD, a multiple
    of GENERATIONS, so consecutive calls never share a generation, across the wrap too."""
    return 0 if epoch + 1 >= EPOCH_PERIOD else epoch + 1


def generation_of(epoch: int) -> int:
    return epoch % GENERATIONS


# ---- call descriptors (layout.h CallDesc, desc_word) --------------------------------------
# A descriptor is (op, dtype, flags, a, b, c); the kernels send it as four words with the low
# byte of the epoch. These build the fields the host passes to a call check (and to the copy-
# engine gemm_ar's closing kernel); the kernels that build their own mirror the same rules.

def collective_desc(op: int, dtype: int, numel: int, flags: int = 0, c: int = 0) -> tuple:
    """An all-reduce's or an NCCL call's descriptor: op, dtype, element count (a, b = its bits
    0..30 and 31..61), c = the fused RMSNorm's row width or the NCCL calls it covers."""
    return (op, dtype, flags, numel & 0x7FFFFFFF, (numel >> 31) & 0x7FFFFFFF, c)


def nccl_desc(collective: str, dtype: int, numel: int, calls: int = 1) -> tuple:
    """The descriptor a call check carries before NCCL `collective` ("all_reduce",
    "all_gather", "reduce_scatter") of `numel` input elements in `calls` NCCL calls (the
    overlap engine's chunks): what NCCL needs every rank to agree on."""
    return collective_desc(NCCL_OPS[collective], dtype, numel, c=calls if calls > 1 else 0)


def gemm_desc(op: str, dtype: int, engine: int, chunks: int, m: int, n: int, k: int) -> tuple:
    """A GEMM + collective op's descriptor on a symmetric path: what every rank must agree on.
    m: the GEMM's rows (ag_gemm: world x the shard's). gemm_ar and gemm_rs sum [M, N] partials,
    so M and N; their K is each rank's own shard (uneven shards compute correctly), so it is not
    compared. ag_gemm gathers [m, K] shards, so M and K; its N is each rank's column shard.
    engine: DESC_ENGINE_*; chunks: the pipeline's chunks or pieces (compared modulo 64)."""
    if op == "ag_gemm":
        n = 0
    else:
        k = 0
    return (GEMM_OPS[op], dtype, (engine & 3) | (chunks & 63) << 2, m & 0x7FFFFFFF,
            n & 0x7FFFFFFF, k & 0x7FFFFF)


def desc_words(desc: Sequence[int], epoch: int) -> list:
    """The four words the kernels send for `desc` at `epoch` (layout.h desc_word)."""
    op, dtype, flags, a, b, c = (int(x) for x in desc)
    return [0xFD000000 | (flags & 0xFF) << 16 | (op & 0xFF) << 8 | (dtype & 0xFF),
            a & 0x7FFFFFFF, b & 0x7FFFFFFF, (c & 0x7FFFFF) << 8 | (epoch & 0xFF)]


def decode_desc(words: Sequence[int]) -> Optional[dict]:
    """A call descriptor's four words as a dict, or None if the words are not one."""
    w = [int(x) & 0xFFFFFFFF for x in words]
    if len(w) != 4 or w[0] >> 24 != 0xFD or any(x >> 31 for x in w[1:]):
        return None
    d = {"op": (w[0] >> 8) & 0xFF, "dtype": w[0] & 0xFF, "flags": (w[0] >> 16) & 0xFF,
         "a": w[1], "b": w[2], "c": w[3] >> 8, "epoch8": w[3] & 0xFF}
    d["numel"] = d["a"] | d["b"] << 31
    return d


def describe_desc(d: Optional[dict]) -> str:
    """A call descriptor in words: 'one_shot all_reduce of 4096 float32 elements', 'gemm_ar
    (the fused kernel) with M = 4, N = 512, bfloat16'."""
    if d is None:
        return "an unreadable call"
    op = d["op"]
    name = _CALLS.get(op, f"op {op}")
    dtype = _DTYPE_NAMES.get(d["dtype"], f"dtype {d['dtype']}")
    if op in GEMM_OPS.values():
        dims = [f"M = {d['a']}"] + ([f"K = {d['c']}"] if op == OP_AG_GEMM else
                                    [f"N = {d['b']}"])
        engine, chunks = d["flags"] & 3, d["flags"] >> 2
        how = _ENGINES.get(engine, f"engine {engine}")
        if chunks:
            how += f", {chunks} {'piece' if engine == DESC_ENGINE_FUSED else 'chunk'}" + \
                ("s" if chunks > 1 else "")
        return f"{name} ({how}) with {', '.join(dims)}, {dtype}"
    text = f"{name} of {d['numel']} {dtype} elements"
    if op in NCCL_OPS.values():
        return text + (f" in {d['c']} NCCL calls" if d["c"] > 1 else "")
    if d["c"]:
        text += f" (rows of {d['c']})"
    if d["flags"] & DESC_FP8_OUT:
        text += " with float8_e4m3fn output"
    return text


def check_same_config(group_name: str, ranks: Sequence[int], configs: Sequence[dict]) -> None:
    """Raise CollectiveMismatchError if the ranks of a group asked for differently sized
    symmetric memory: the kernels address peers' buffers with this rank's offsets, and the
    transport chosen from these sizes must be the same everywhere. `configs[i]` is what global
    rank `ranks[i]` asked for (a dict of the same keys on every rank)."""
    bad = [k for k in configs[0] if any(c.get(k) != configs[0][k] for c in configs)]
    if not bad:
        return
    parts = []
    for k in bad:
        vals = ", ".join(f"rank {r}: {c.get(k)!r}" for r, c in zip(ranks, configs))
        parts.append(f"{k} ({vals})")
    raise CollectiveMismatchError(
        f"fusedist.Communicator: the ranks of group {group_name} asked for different symmetric "
        f"memory: {'; '.join(parts)}. Create the communicator with the same max_bytes, "
        "one_shot_max_bytes, staging_bytes and timeout_s (and the same FUSEDIST_TIMEOUT_S) on "
        "every rank")


def error_message(words: Sequence[int], group_name: str, ranks: Sequence[int],
                  timeout_s: float) -> Optional[str]:
    """The host's message for an error record (layout.h ErrorRecord, as 16 uint32 words);
    None when it records nothing."""
    code = int(words[0])
    if code == 0:
        return None
    me, peer = ranks[int(words[1])], ranks[int(words[2])]
    call = int(words[3]) & 0xFFFFFFFF
    op, outputs = _OPS.get(int(words[4]), ("kernel", "outputs of that call are undefined"))
    if code == ERR_MISMATCH:
        mine, theirs = decode_desc(words[8:12]), decode_desc(words[12:16])
        return (f"{op} on group {group_name} at call #{call}: ranks called different "
                f"collectives: rank {me} called {describe_desc(mine)}; rank {peer} called "
                f"{describe_desc(theirs)}. Every rank must make the same call (same op, dtype "
                "and size). The communicator is unusable now; outputs of that call are "
                "undefined (NaN where a wait gave up).")
    if peer == me:  # finish_epoch: a block of this rank's own launch never started
        what = (f"rank {me} waited more than {timeout_s:g} s for its own kernel's "
                "blocks to start (the GPU is held by a kernel that never yields)")
    else:
        what = (f"rank {me} waited more than {timeout_s:g} s for rank {peer}; the peer "
                "never arrived (it skipped the collective, called a different op, or died)")
    return (f"{op} on group {group_name} at call #{call}: {what}. The communicator is "
            f"unusable now; {outputs}.")


def default_timeout_s() -> float:
    return envs.get("FUSEDIST_TIMEOUT_S")


class SymmetricMemory:
    """Symmetric buffers for `group` able to all-reduce up to `max_bytes` with two-shot and
    `one_shot_max_bytes` with one-shot, plus `staging_bytes` of plain staging space that peers
    read with the copy engine (the overlap engine's copy-engine transport, ops/gemm_comm.py).

    Layout of each rank's allocation (identical on every rank):
      [0, GENERATIONS * gen_bytes)   sentinel-protocol slots (layout.h)
      [staging_offset, + staging_bytes)   staging: written by its owner (a shard, partial
                                     products, reduced rows), read by peers between device
                                     barriers (ops/gemm_comm.py)
      [signal_offset, + signal_bytes)    counters of the fused gemm_rs: uint32 [world,
                                     MAX_SIGNAL_PIECES], slot [s, p] added to by rank s's GEMM,
                                     waited on and cleared by this rank; zero between calls"""

    def __init__(self, group: Group, max_bytes: int, one_shot_max_bytes: int,
                 timeout_s: Optional[float] = None, staging_bytes: int = 0):
        C = _ext.load()
        self.group = group
        self._C = C
        self._closed = True
        W, r = group.size, group.rank
        if W > C.MAX_RANKS:
            raise PeerAccessError(f"fusedist: symmetric memory supports at most {C.MAX_RANKS} "
                                  f"ranks per group, this group has {W}")
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("fusedist: symmetric memory must be created before CUDA-graph "
                               "capture; create the Communicator first, then capture")
        dev = torch.cuda.current_device()
        self._device = torch.device("cuda", dev)
        info = C.device_info(dev)
        if timeout_s is None:
            timeout_s = default_timeout_s()
        elif isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or \
                not timeout_s > 0 or timeout_s == float("inf"):
            raise ValueError(f"fusedist: SymmetricMemory timeout_s must be a finite number of "
                             f"seconds > 0, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self.one_shot_max_bytes = round_up(max(16, one_shot_max_bytes), 16)
        self.max_bytes = round_up(max(16, max_bytes), 16)
        self.staging_bytes = round_up(max(0, staging_bytes), 256)
        config = {"max_bytes": self.max_bytes, "one_shot_max_bytes": self.one_shot_max_bytes,
                  "staging_bytes": self.staging_bytes, "timeout_s": self.timeout_s}
        me = {"node": group.topology.node_ids[group.ranks[r]] if group.topology else
              socket.gethostname(), "host": socket.gethostname(), "bus": info.pci_bus_id,
              "sms": info.sm_count, "cc": (info.major, info.minor), "config": config}
        peers = group.all_gather_object(me)
        # Before anything is allocated: every rank raises alike.
        check_same_config(group.name, group.ranks, [p["config"] for p in peers])
        if len({(p["node"], p["host"]) for p in peers}) != 1:
            raise PeerAccessError(
                "fusedist: symmetric memory needs every rank of the group on one node; group "
                f"{group.name} spans {sorted({p['node'] for p in peers})}")
        # P2P check where the peer's GPU is visible here; IPC open decides otherwise.
        ok = all(C.can_access_peer_by_bus_id(p["bus"]) != 0 for p in peers)
        if not all(group.all_gather_object(ok)):
            raise PeerAccessError(
                f"fusedist: GPUs {[p['bus'] for p in peers]} of group {group.name} cannot "
                "access each other (no P2P); ops fall back to NCCL")

        chunk_bytes = round_up(-(-self.max_bytes // W), 16)
        self.slot_bytes = max(self.one_shot_max_bytes, chunk_bytes)
        # world slots, the two-shot gather region, the call descriptors (layout.h)
        self.gen_bytes = W * self.slot_bytes + self.max_bytes + C.DESC_BYTES
        self.staging_offset = C.GENERATIONS * self.gen_bytes
        self.signal_offset = self.staging_offset + self.staging_bytes
        self.signal_bytes = round_up(W * C.MAX_SIGNAL_PIECES * 4, 256)
        total = self.signal_offset + self.signal_bytes
        stream = torch.cuda.current_stream().cuda_stream

        self._base = C.device_alloc(total)
        self._control = C.device_alloc(C.CONTROL_BYTES)
        self._err_host = C.host_mapped_alloc(C.ERROR_RECORD_BYTES)
        self._opened: list[int] = []
        try:
            C.fill_u32(self._base, C.EMPTY_WORD, self.signal_offset // 4, stream)
            C.fill_u32(self._base + self.signal_offset, 0, self.signal_bytes // 4, stream)
            C.fill_u32(self._control, 0, C.CONTROL_BYTES // 4, stream)
            C.stream_synchronize(stream)  # slots are empty before any peer learns our handle
            self.bases = self._map_peers()  # rank p's allocation, mapped into this process
            self.max_blocks = self._max_blocks(min(p["sms"] for p in peers))
            self.handle = C.SymmComm(r, W, self.bases, self.gen_bytes, self.slot_bytes,
                                     self._control, C.host_mapped_device_ptr(self._err_host),
                                     self.timeout_s, self.max_blocks)
        except BaseException:
            self._free()
            raise
        self._closed = False
        self.total_bytes = total
        self._staging_u8: Optional[torch.Tensor] = None
        if self.staging_bytes:
            self.staging(torch.uint8, (0,))  # wrap it now, not during a CUDA-graph capture

    # ---- how the ranks reach each other (a subclass for ranks that are not one process per
    # GPU: fusedist.testing's emulated ranks) ------------------------------------------------
    def _map_peers(self) -> list:
        """Collective: every rank's allocation as a device pointer in this process, in rank
        order: the peers' opened through CUDA IPC (kept in self._opened for _free)."""
        C, group = self._C, self.group
        handles = group.all_gather_object(C.ipc_get_handle(self._base))
        bases, err = [], None
        for i, h in enumerate(handles):
            if i == group.rank:
                bases.append(self._base)
                continue
            try:
                p = C.ipc_open_handle(h)
                self._opened.append(p)
                bases.append(p)
            except RuntimeError as e:
                err = f"rank {group.ranks[i]}: {e}"
                break
        errs = [e for e in group.all_gather_object(err) if e]
        if errs:
            raise PeerAccessError(f"fusedist: cannot map peers' symmetric buffers through "
                                  f"CUDA IPC ({errs[0]}); ops fall back to NCCL")
        return bases

    def _max_blocks(self, sms: int) -> int:
        """SMs the kernels of one call may fill (their grids, and so the residency every wait
        relies on: docs/design/allreduce.md, Co-residency), given the group's smallest SM
        count: all of them, each rank having a GPU of its own."""
        return sms

    def _synchronize(self) -> None:
        """Wait until this rank's work on the device is done (before the epoch is read or set,
        and before the buffers are freed)."""
        torch.cuda.synchronize(self._device)

    def before_launch(self) -> None:
        """Called on this rank before each launch of a kernel that waits for its peers
        (Communicator.launch_stream). Nothing to do between GPUs; emulated ranks, which share
        one, launch in step (fusedist.testing)."""

    def after_launch(self) -> None:
        """Called on this rank right after such a launch (the other half of launching in
        step, for emulated ranks)."""

    def staging(self, dtype: torch.dtype, shape: tuple, offset: int = 0) -> torch.Tensor:
        """This rank's staging as a tensor: `shape` of `dtype` from byte `offset` (a view that
        owns nothing; valid until close()). Peers read the same bytes at
        bases[rank] + staging_offset + offset."""
        numel = 1
        for d in shape:
            numel *= int(d)
        nbytes = numel * dtype.itemsize
        if offset < 0 or offset + nbytes > self.staging_bytes:
            raise ValueError(f"fusedist: staging view of {nbytes} bytes at offset {offset} "
                             f"exceeds the {self.staging_bytes} staging bytes")
        if self._staging_u8 is None:
            # __cuda_array_interface__: torch wraps the raw allocation without copying.
            iface = {"shape": (self.staging_bytes,), "typestr": "|u1", "version": 3,
                     "data": (self._base + self.staging_offset, False), "strides": None}
            holder = type("_Staging", (), {"__cuda_array_interface__": iface})()
            self._staging_u8 = torch.as_tensor(holder, device=self._device)
        return self._staging_u8[offset:offset + nbytes].view(dtype).view(shape)

    # ---- errors ------------------------------------------------------------------------
    def error(self) -> Optional[str]:
        """The recorded device-side failure, read from host-mapped memory (no CUDA call)."""
        if self._err_host is None:
            return None
        words = list((ctypes.c_uint32 * 16).from_address(self._err_host))
        if words[0] == 0:
            return None
        words[1], words[2] = ctypes.c_int32(words[1]).value, ctypes.c_int32(words[2]).value
        return error_message(words, self.group.name, self.group.ranks, self.timeout_s)

    def error_code(self) -> int:
        """The error record's code: 0 (none), ERR_TIMEOUT or ERR_MISMATCH (no CUDA call)."""
        if self._err_host is None:
            return 0
        return int((ctypes.c_uint32 * 1).from_address(self._err_host)[0])

    def check(self) -> None:
        if self._closed:
            raise CommunicatorClosedError(f"fusedist: communicator of group {self.group.name} "
                                          "is closed")
        msg = self.error()
        if msg is not None:
            cls = CollectiveMismatchError if self.error_code() == ERR_MISMATCH else \
                CommunicatorTimeoutError
            raise cls("fusedist: " + msg)

    # ---- tests -------------------------------------------------------------------------
    def epoch(self) -> int:
        """This rank's epoch (calls completed modulo EPOCH_PERIOD). Waits for this rank's work."""
        self._synchronize()
        return int.from_bytes(self._C.copy_to_host(self._control, 4), "little")

    def set_epoch(self, epoch: int) -> None:
        """Test hook: start counting calls at `epoch` (e.g. just below the wrap). Collective:
        call it on every rank with the same value, between calls (slots are empty then)."""
        if not 0 <= epoch < EPOCH_PERIOD:
            raise ValueError(f"fusedist: epoch must be in [0, {EPOCH_PERIOD}), got {epoch}")
        self._synchronize()
        self.group.barrier()  # no peer still runs a call that reads the old epoch
        stream = torch.cuda.current_stream(self._device).cuda_stream
        self._C.fill_u32(self._control, epoch, 1, stream)
        self._C.stream_synchronize(stream)
        self.group.barrier()

    # ---- teardown ----------------------------------------------------------------------
    def _free(self) -> None:
        C = self._C
        self._staging_u8 = None
        for p in self._opened:
            try:
                C.ipc_close_handle(p)
            except RuntimeError:
                pass
        self._opened = []
        if getattr(self, "_base", None):
            C.device_free(self._base)
            self._base = None
        if getattr(self, "_control", None):
            C.device_free(self._control)
            self._control = None
        if getattr(self, "_err_host", None):
            C.host_mapped_free(self._err_host)
            self._err_host = None

    def close(self) -> None:
        """Collective: wait for local work, barrier so no peer still writes here, unmap, free."""
        if self._closed:
            return
        self._closed = True
        self._synchronize()
        self.group.barrier()
        self._free()
