"""A host stand-in for the slice of fusedist._C and torch.cuda that SymmetricMemory's
constructor uses, so its cross-rank checks (sizes, layout) run on CPU ranks over a real gloo
group (tests/dist/worker_protocol.py) and in one process (tests/test_protocol.py)."""

from __future__ import annotations

import contextlib
import ctypes
from types import SimpleNamespace

EMPTY_WORD = 0x80008000


class FakeC:
    """The slice of fusedist._C that SymmetricMemory's constructor uses, on the host; allocs
    lists the device allocations it was asked for, comm_args SymmComm's arguments."""
    MAX_RANKS, GENERATIONS, EMPTY_WORD, MAX_SIGNAL_PIECES = 8, 3, EMPTY_WORD, 64
    ERROR_RECORD_BYTES, CONTROL_BYTES, DESC_BYTES = 64, 16, 128

    def __init__(self):
        self.allocs, self.comm_args, self._keep = [], None, []

    def device_info(self, dev):
        return SimpleNamespace(pci_bus_id="0000:01:00.0", sm_count=132, major=9, minor=0)

    def can_access_peer_by_bus_id(self, bus):
        return 1

    def device_alloc(self, nbytes):
        self.allocs.append(nbytes)
        return 1 << (20 + len(self.allocs))

    def host_mapped_alloc(self, nbytes):
        buf = (ctypes.c_uint8 * nbytes)()
        self._keep.append(buf)
        return ctypes.addressof(buf)

    def host_mapped_device_ptr(self, p):
        return p

    def ipc_get_handle(self, p):
        return b"handle"

    def ipc_open_handle(self, h):
        return 1 << 40

    def SymmComm(self, *args):
        self.comm_args = args
        return SimpleNamespace(max_blocks=args[-1])

    def fill_u32(self, *a):
        pass

    def stream_synchronize(self, *a):
        pass

    device_free = host_mapped_free = ipc_close_handle = fill_u32


@contextlib.contextmanager
def fake_device(setattr_=None):
    """FakeC as fusedist.comm.symmetric's _C, and torch.cuda's current device / stream /
    capture state answered on the host, for the block (restored after). setattr_: a
    (target, name, value) setter that restores itself (pytest's monkeypatch.setattr), else
    one here."""
    import torch

    from fusedist.comm import symmetric

    C = FakeC()
    patches = [(symmetric._ext, "load", lambda: C),
               (torch.cuda, "is_current_stream_capturing", lambda: False),
               (torch.cuda, "current_device", lambda: 0),
               (torch.cuda, "current_stream", lambda *a: SimpleNamespace(cuda_stream=0))]
    if setattr_ is not None:
        for target, name, value in patches:
            setattr_(target, name, value)
        yield C
        return
    saved = [(t, n, getattr(t, n)) for t, n, _ in patches]
    try:
        for target, name, value in patches:
            setattr(target, name, value)
        yield C
    finally:
        for target, name, value in saved:
            setattr(target, name, value)
