"""The input-error record of the single-GPU ops on CUDA (csrc/include/fusedist/common/op_error.h).

A kernel that meets bad paged metadata (a page id outside the cache, a length longer than its
block-table row, a slot or position out of range) or a bad MoE layout (an expert id outside
[0, num_experts), a permuted-row index out of range) touches no memory outside its tensors,
poisons the affected outputs with NaN and records the first such event in a host-mapped
record, one per device. The host reads it without a copy or a synchronization:

    fusedist.check_device_errors()      # raises MetadataError if a kernel recorded one
    fusedist.clear_device_errors()      # after handling it

The attention ops check it before each eager launch on the device (an error of an earlier
call raises there), and the model runner after the prefill and after the decode loop, where it
synchronizes anyway. The record is allocated outside
CUDA graphs (decode_plan, the first eager call); a graph captured before it exists runs
without recording (still safe, still poisoned).
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from .. import _ext
from ..errors import MetadataError

OPS = {1: "decode", 2: "rope_append", 3: "prefill", 4: "ops.moe.sort_by_expert",
       5: "ops.moe.permute", 6: "ops.moe.unpermute"}
_MOE_OPS = (4, 5, 6)


class _Record(ctypes.Structure):
    _fields_ = [("state", ctypes.c_uint32), ("op", ctypes.c_uint32), ("what", ctypes.c_uint32),
                ("row", ctypes.c_int32), ("value", ctypes.c_int64), ("limit", ctypes.c_int64),
                ("index", ctypes.c_int32), ("pad", ctypes.c_uint32)]


_records: dict[int, tuple[int, int]] = {}   # device index -> (host pointer, device pointer)
_views: dict[int, _Record] = {}              # device index -> the record, read in place


def _index(device) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):   # a device index (the records are kept by index)
        return device
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def record_ptr(device, allocate: bool = True) -> int:
    """The record's device pointer for `device` (0 when it does not exist and cannot be made
    here: allocate=False, or inside a CUDA-graph capture)."""
    idx = _index(device)
    rec = _records.get(idx)
    if rec is None:
        if not allocate or torch.cuda.is_current_stream_capturing() or not _ext.available():
            return 0
        C = _ext.load()
        with torch.cuda.device(idx):
            host = C.host_mapped_alloc(ctypes.sizeof(_Record))
            ctypes.memset(host, 0, ctypes.sizeof(_Record))
            rec = (host, C.host_mapped_device_ptr(host))
        _records[idx] = rec
        _views[idx] = _Record.from_address(host)
    return rec[1]


def _describe(r: _Record) -> str:
    op = OPS.get(r.op, f"op {r.op}")
    if r.what == 1:
        return (f"fusedist.{op}: sequence {r.row} reads block_table[{r.row}, {r.index}] = "
                f"{r.value}, outside the cache's {r.limit} pages (ids 0..{r.limit - 1})")
    if r.what == 2:
        return (f"fusedist.{op}: seq_lens[{r.row}] = {r.value} is outside [0, {r.limit}], the "
                "tokens its block-table row can hold (columns x page_size)")
    if r.what == 3:
        return (f"fusedist.{op}: slot_mapping[{r.row}] = {r.value} is outside the cache's "
                f"{r.limit} slots (num_pages x page_size)")
    if r.what == 4:
        return (f"fusedist.{op}: positions[{r.row}] = {r.value} is outside the RoPE table's "
                f"[0, {r.limit}) positions")
    if r.what == 5:
        return (f"fusedist.{op}: sequence {r.row} has {r.value} new tokens (cu_seqlens_q) "
                f"outside [0, {r.limit}] (its seq_lens, the q tokens and max_q_len bound it)")
    if r.what == 6:
        return (f"fusedist.{op}: ids[{r.row}, {r.index}] = {r.value} is outside the "
                f"{r.limit} experts (ids 0..{r.limit - 1})")
    if r.what == 7 and r.op == 5:
        return (f"fusedist.{op}: layout.src_index[{r.row}] = {r.value} is outside [-1, "
                f"{r.limit}) (-1 or a (token, slot) pair t * top_k + j)")
    if r.what == 7:
        return (f"fusedist.{op}: layout.dest_index[{r.row} * top_k + {r.index}] = {r.value} is "
                f"outside the {r.limit} rows of y_perm")
    return f"fusedist.{op}: bad metadata (code {r.what}) at row {r.row}: {r.value}"


def check_device_errors(device=None) -> None:
    """Raise MetadataError if a kernel on `device` (default: the current one; "all": every
    device with a record) recorded bad metadata. Reads host memory; never synchronizes, so
    call it after the step whose kernels you want covered has finished (the runner does)."""
    if device == "all":
        for idx in list(_records):
            check_device_errors(idx)
        return
    if not _records:   # no record exists before a kernel got one (nor without CUDA)
        return
    r = _views.get(_index(device))
    if r is None or r.state != 1:
        return
    fix = ("the routing (the ids passed to sort_by_expert, or the MoeLayout passed on)"
           if r.op in _MOE_OPS else
           "the metadata (block tables, seq_lens, slot_mapping, positions) the engine passes")
    raise MetadataError(
        _describe(r) + ". The kernel read and wrote nothing outside its tensors and set that "
        f"row's outputs to NaN. Fix {fix}; fusedist.clear_device_errors() resets the record.")


def clear_device_errors(device=None) -> None:
    """Reset the record of `device` (default: the current one; "all": every device) after
    the kernels that wrote it have finished."""
    if not _records:
        return
    idxs = list(_records) if device == "all" else [_index(device)]
    for idx in idxs:
        rec = _records.get(idx)
        if rec is not None:
            ctypes.memset(rec[0], 0, ctypes.sizeof(_Record))


def check_before_launch(t: torch.Tensor) -> None:
    """The ops' pre-launch check: eager CUDA calls raise an error an earlier kernel recorded
    (never during capture or tracing, where nothing should synchronize the host)."""
    if t.device.type == "cuda" and _records and not torch.cuda.is_current_stream_capturing() \
            and not torch.compiler.is_compiling():
        check_device_errors(t.device)
