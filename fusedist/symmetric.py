"""Symmetric memory: one equally sized buffer per rank of a single-node group, mapped into
every peer through CUDA IPC, plus this rank's control block and host-mapped error record.

Layout and protocol: csrc/include/fusedist/layout.h and docs/design/allreduce.md. In short,
the buffer holds kGenerations generations of `world` receive slots and one gather region; every
free 32-bit word holds EMPTY_WORD; writers push into their own slot of a peer's buffer and the
owner clears what it reads. Created collectively, before any CUDA-graph capture; freed by
close() after a group barrier so no peer still writes into freed memory.
"""

from __future__ import annotations

import ctypes
import os
import socket
from typing import Optional

import torch

from . import _ext
from .errors import CommunicatorClosedError, CommunicatorTimeoutError, PeerAccessError
from .groups import Group

_OP_NAMES = {1: "one_shot all_reduce", 2: "two_shot all_reduce", 3: "all_reduce_add_rmsnorm",
             4: "gemm_ar (fused)", 5: "ag_gemm (fused: waiting for a peer's rows)",
             6: "gemm_rs (fused: waiting for a peer's partial rows)"}


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def default_timeout_s() -> float:
    return float(os.environ.get("FUSEDIST_TIMEOUT_S", "30"))


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
        me = {"node": group.topology.node_ids[group.ranks[r]] if group.topology else
              socket.gethostname(), "host": socket.gethostname(), "bus": info.pci_bus_id,
              "sms": info.sm_count, "cc": (info.major, info.minor)}
        peers = group.all_gather_object(me)
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

        self.timeout_s = default_timeout_s() if timeout_s is None else float(timeout_s)
        self.one_shot_max_bytes = _align(max(16, one_shot_max_bytes), 16)
        self.max_bytes = _align(max(16, max_bytes), 16)
        chunk_bytes = _align(-(-self.max_bytes // W), 16)
        self.slot_bytes = max(self.one_shot_max_bytes, chunk_bytes)
        self.gen_bytes = W * self.slot_bytes + self.max_bytes
        self.staging_offset = C.GENERATIONS * self.gen_bytes
        self.staging_bytes = _align(max(0, staging_bytes), 256)
        self.signal_offset = self.staging_offset + self.staging_bytes
        self.signal_bytes = _align(W * C.MAX_SIGNAL_PIECES * 4, 256)
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
            handles = group.all_gather_object(C.ipc_get_handle(self._base))
            bases, err = [], None
            for i, h in enumerate(handles):
                if i == r:
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
            self.max_blocks = min(p["sms"] for p in peers)
            self.bases = list(bases)  # rank p's allocation, mapped into this process
            self.handle = C.SymmComm(r, W, bases, self.gen_bytes, self.slot_bytes, self._control,
                                     C.host_mapped_device_ptr(self._err_host), self.timeout_s,
                                     self.max_blocks)
        except BaseException:
            self._free()
            raise
        self._closed = False
        self.total_bytes = total
        self._staging_u8: Optional[torch.Tensor] = None
        if self.staging_bytes:
            self.staging(torch.uint8, (0,))  # wrap it now, not during a CUDA-graph capture

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
        words = (ctypes.c_int32 * 5).from_address(self._err_host)
        if words[0] == 0:
            return None
        op = _OP_NAMES.get(words[4], "kernel")
        me, peer = self.group.ranks[words[1]], self.group.ranks[words[2]]
        if peer == me:  # finish_epoch: a block of this rank's own launch never started
            what = (f"rank {me} waited more than {self.timeout_s:g} s for its own kernel's "
                    "blocks to start (the GPU is held by a kernel that never yields)")
        else:
            what = (f"rank {me} waited more than {self.timeout_s:g} s for rank {peer}; the peer "
                    "never arrived (it skipped the collective, called a different op, or died)")
        return (f"{op} on group {self.group.name} at call #{words[3] & 0xffffffff}: {what}. The "
                "communicator is unusable now; outputs of that call are NaN.")

    def check(self) -> None:
        if self._closed:
            raise CommunicatorClosedError(f"fusedist: communicator of group {self.group.name} "
                                          "is closed")
        msg = self.error()
        if msg is not None:
            raise CommunicatorTimeoutError("fusedist: " + msg)

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
        torch.cuda.synchronize()
        self.group.barrier()
        self._free()
