"""Low-latency dispatch / combine (decode): the symmetric-memory kernels of
csrc/include/fusedist/ep/low_latency.cuh, their buffer and their error records.

The buffer is the comm area's SymmetricMemory (the group's own class where it brings one:
ranks emulated on one GPU), sized so that each of its `world` slots per generation holds one
source rank's rows (ep/config.h has the layout): kGenerations x world x slot_bytes per rank,
slot_bytes ~ rows_per_source x hidden x 2. Every kernel advances its epoch, so a captured
dispatch / combine pair replays with new routings, and the call checks of the high-throughput
path meet the kernels on the same epoch.

Two records say what went wrong, both host-mapped, read without a CUDA call:
* the communicator's ErrorRecord (a peer that never came, or made another call): sticky, the
  buffer is unusable afterwards (CommunicatorTimeoutError, PeerLostError when the peer's
  process is gone, CollectiveMismatchError);
* the buffer's EpStatus (a slot overflow, an expert id out of range): raised once by the next
  check (EpCapacityError / EpRoutingError) and cleared; the protocol itself completed, so the
  buffer stays usable.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from .. import _ext
from ..comm import symmetric
from ..comm.symmetric import SymmetricMemory
from ..distributed.groups import Group
from ..distributed.peers import lost_peers
from ..errors import (CollectiveMismatchError, CommunicatorTimeoutError, FusedistError,
                      PeerLostError)

# OpCodes of ep/config.h (the kernels' error records and call descriptors).
OP_DISPATCH, OP_COMBINE, OP_HT_DISPATCH, OP_HT_COMBINE = 11, 12, 13, 14
_NAMES = {OP_DISPATCH: "ep dispatch (low-latency kernel)",
          OP_COMBINE: "ep combine (low-latency kernel)",
          OP_HT_DISPATCH: "ep dispatch (high-throughput)",
          OP_HT_COMBINE: "ep combine (high-throughput)"}
EP_OVERFLOW, EP_BAD_ID = 1, 2


class EpCapacityError(FusedistError, ValueError):
    """A dispatch routed more rows from one rank to another than the buffer's slot holds
    (rows_per_source). The message names the expert, its count and the capacity. The rows
    that did not fit were not sent; that call's outputs (and its combine's) are wrong."""


class EpRoutingError(FusedistError, ValueError):
    """A dispatch met an expert id outside [0, num_experts) on the device (inside a CUDA graph,
    where the host does not look at ids). The pair was not sent."""


def describe_ep_desc(d: Optional[dict]) -> str:
    """An expert-parallel call descriptor in words (ep/config.h ep_desc)."""
    if d is None or d["op"] not in _NAMES:
        return symmetric.describe_desc(d)
    experts, top_k = d["b"] & 0xFFFF, d["b"] >> 16
    return (f"{_NAMES[d['op']]} with hidden {d['a']}, {experts} experts, top-k {top_k}, "
            f"{d['c']} rows per source{', FP8 payload' if d['flags'] & 1 else ''}")


def protocol_error(symm: SymmetricMemory, group: Group, peers, timeout_s: float
                   ) -> Optional[FusedistError]:
    """The error the communicator's record holds (None when it holds none), in the buffer's
    words; a timeout whose peer's process is gone (on this host) is a PeerLostError."""
    code = symm.error_code()
    if code == 0:
        return None
    words = list((ctypes.c_uint32 * 16).from_address(symm._err_host))
    me = ctypes.c_int32(words[1]).value
    peer = ctypes.c_int32(words[2]).value
    call, op = words[3], words[4]
    name = _NAMES.get(op) or symmetric._OPS.get(op, ("kernel",))[0]
    where = f"fusedist.ep: {name} on group {group.name} at call #{call}"
    if code == symmetric.ERR_MISMATCH:
        mine, theirs = symmetric.decode_desc(words[8:12]), symmetric.decode_desc(words[12:16])
        return CollectiveMismatchError(
            f"{where}: ranks made different calls: rank {group.ranks[me]} called "
            f"{describe_ep_desc(mine)}; rank {group.ranks[peer]} called "
            f"{describe_ep_desc(theirs)}. Every rank must call dispatch and combine in the same "
            "order, in the same mode, on Buffers of the same sizes. The buffer is unusable "
            "now; outputs of that call are undefined.")
    if peer == me:
        return CommunicatorTimeoutError(
            f"{where}: rank {group.ranks[me]} waited more than {timeout_s:g} s for its own "
            "kernel's blocks to start (the GPU is held by a kernel that never yields). The "
            "buffer is unusable now; outputs of that call are undefined.")
    gpeer = group.ranks[peer]
    if peers and len(peers) > max(group.ranks):
        lost, _ = lost_peers(peers, [gpeer], group.ranks[me], wait_s=0.5)
        if lost:
            return PeerLostError(
                f"{where}: rank {gpeer} is lost: its process (pid {lost[0][2]} on this host) "
                f"has exited; rank {group.ranks[me]} waited {timeout_s:g} s for it. The group "
                "cannot continue: end every rank and start the job again.")
    return CommunicatorTimeoutError(
        f"{where}: rank {group.ranks[me]} waited more than {timeout_s:g} s for rank {gpeer}; "
        "the peer never arrived (it skipped the call, called something else, or died). The "
        "buffer is unusable now; outputs of that call are undefined.")


class StatusRecord:
    """The buffer's host-mapped EpStatus (ep/config.h): data errors of its dispatches."""

    def __init__(self, group: Group):
        C = _ext.load()
        self._C = C
        self.group = group
        self.host = C.host_mapped_alloc(C.EP_STATUS_BYTES)
        self.device = C.host_mapped_device_ptr(self.host)

    def words(self) -> list:
        return list((ctypes.c_uint32 * 16).from_address(self.host))

    def take(self, local_experts: int) -> Optional[FusedistError]:
        """The recorded error (None when none), cleared so the next one can be recorded."""
        if self.host is None:
            return None
        w = self.words()
        if w[0] == 0:
            return None
        i = [ctypes.c_int32(v).value for v in w]
        ranks = self.group.ranks
        ctypes.memset(self.host, 0, 64)
        if w[0] == EP_OVERFLOW:
            src, dst, expert = ranks[i[2]], ranks[i[3]], i[4]
            return EpCapacityError(
                f"fusedist.ep.Buffer.dispatch: slot overflow at call #{w[8]} (seen by rank "
                f"{ranks[i[1]]}): rank {src} routed {w[7]} rows to rank {dst}'s experts, "
                f"{w[6]} fit a slot (rows_per_source); expert {expert} (local expert "
                f"{expert % local_experts} of rank {dst}) got {w[5]} of them and was the first "
                "that did not fit. The rows past the slot were not sent: that call's outputs "
                "and its combine's are wrong. Create the Buffer with rows_per_source >= "
                f"{w[7]} (the default, max_tokens_per_rank x min(top_k, local experts), never "
                "overflows with distinct ids per token)")
        return EpRoutingError(
            f"fusedist.ep.Buffer.dispatch: expert id {i[4]} of token {i[9]}, slot {i[10]} on "
            f"rank {ranks[i[1]]} (call #{w[8]}) is outside [0, num_experts); the pair was not "
            "sent and adds nothing to its combine")

    def free(self) -> None:
        if self.host is None:
            return
        host, self.host = self.host, None
        # Ranks emulated on one GPU free device memory only when every rank is done (a free
        # waits for the whole GPU, where a peer's kernel may wait for this rank): their group
        # collects it with the symmetric buffers.
        world = getattr(self.group, "_world", None)
        if world is not None and hasattr(world, "free_later"):
            world.free_later(0, 0, host)
        else:
            self._C.host_mapped_free(host)


class LowLatency:
    """The low-latency path of one Buffer: its symmetric memory, layout and status record."""

    def __init__(self, buf, group: Group):
        C = _ext.load()
        self._C = C
        self.buf = buf
        W, r = group.size, group.rank
        probe = C.ep_config(W, r, buf.hidden, buf.num_experts, buf.top_k,
                            buf.max_tokens_per_rank, buf.rows_per_source, bool(buf.fp8), 1)
        # The record first: a host allocation may wait for the GPU, and the symmetric memory's
        # exchanges after it keep every rank from launching until all have allocated.
        self.status = StatusRecord(group)
        symm_class = group.symmetric_memory_class or SymmetricMemory
        try:
            self.symm: SymmetricMemory = symm_class(group, 16, int(probe.slot_bytes),
                                                    buf.timeout_s, 0)
        except BaseException:
            self.status.free()
            raise
        try:
            self.cfg = C.ep_config(W, r, buf.hidden, buf.num_experts, buf.top_k,
                                   buf.max_tokens_per_rank, buf.rows_per_source, bool(buf.fp8),
                                   int(self.symm.max_blocks))
        except BaseException:
            self.close()
            raise
        self.rows = W * buf.rows_per_source       # recv_x's rows

    def desc(self, op: int) -> tuple:
        return tuple(self._C.ep_desc(op, self.cfg))

    def dispatch(self, x: torch.Tensor, ids32: torch.Tensor, stream: torch.cuda.Stream):
        """Launch on `stream` (the tensors were allocated on the caller's stream and are
        record_stream-ed by the caller). Returns (recv_x, recv_counts, recv_offsets, recv_src,
        send_pos)."""
        C, b = self._C, self.buf
        T, H, L = x.shape[0], b.hidden, b.placement.local_experts
        dev = x.device
        recv_x = torch.empty(self.rows, H, dtype=torch.bfloat16, device=dev)
        recv_counts = torch.empty(L, dtype=torch.int32, device=dev)
        recv_offsets = torch.empty(L + 1, dtype=torch.int32, device=dev)
        recv_src = torch.empty(self.rows, dtype=torch.int32, device=dev)
        send_pos = torch.empty(max(1, T * b.top_k), dtype=torch.int32, device=dev)
        a = C.EpDispatchArgs()
        a.x, a.ids, a.tokens = x.data_ptr(), ids32.data_ptr(), T
        a.recv_x, a.recv_counts, a.recv_offsets = (recv_x.data_ptr(), recv_counts.data_ptr(),
                                                   recv_offsets.data_ptr())
        a.recv_src, a.send_pos, a.status = recv_src.data_ptr(), send_pos.data_ptr(), \
            self.status.device
        outs = (recv_x, recv_counts, recv_offsets, recv_src, send_pos)
        for t in outs:
            t.record_stream(stream)
        self.symm.before_launch()
        C.ep_dispatch(self.symm.handle, self.cfg, a, stream.cuda_stream)
        self.symm.after_launch()
        return outs

    def combine(self, y: torch.Tensor, handle, out: torch.Tensor,
                stream: torch.cuda.Stream) -> torch.Tensor:
        C = self._C
        a = C.EpCombineArgs()
        a.y, a.ids, a.weights = y.data_ptr(), handle.ids.data_ptr(), handle.weights.data_ptr()
        a.send_pos, a.recv_src = handle.send_pos.data_ptr(), handle.recv_src.data_ptr()
        a.recv_offsets, a.tokens, a.out = handle.recv_offsets.data_ptr(), handle.tokens, \
            out.data_ptr()
        self.symm.before_launch()
        C.ep_combine(self.symm.handle, self.cfg, a, stream.cuda_stream)
        self.symm.after_launch()
        return out

    def call_check(self, op: int, stream: torch.cuda.Stream) -> None:
        """The call check (comm/call_check.cuh) carrying this call's descriptor: it meets a
        peer's kernel or call check on the same epoch."""
        self.symm.before_launch()
        self._C.call_check(self.symm.handle, self.desc(op), stream.cuda_stream)
        self.symm.after_launch()

    def close(self) -> None:
        try:
            self.symm.close()
        finally:
            self.status.free()


__all__ = ["LowLatency", "StatusRecord", "EpCapacityError", "EpRoutingError",
           "protocol_error", "describe_ep_desc"]
