"""The 16-byte rule: fusedist's kernels move 16-byte vectors (and TMA needs 16-byte aligned
addresses and row strides), so every pointer a kernel reads or writes must be 16-byte aligned.
Views that are not (a slice at an odd offset) go through an aligned copy: alignment may differ
between ranks, and it must never change which path a collective takes."""

from __future__ import annotations

import torch

VECTOR_BYTES = 16


def round_up(n: int, a: int) -> int:
    """n rounded up to a multiple of a (buffer sizes and offsets)."""
    return (n + a - 1) // a * a


def is_aligned(t: torch.Tensor) -> bool:
    """t's first element is 16-byte aligned."""
    return t.data_ptr() % VECTOR_BYTES == 0


def whole_vectors(nbytes: int) -> bool:
    """nbytes is a whole number of 16-byte vectors (a row a vector kernel can store)."""
    return nbytes % VECTOR_BYTES == 0


def aligned_input(t: torch.Tensor) -> torch.Tensor:
    """t itself when aligned, else an aligned copy (for tensors a kernel only reads)."""
    return t if is_aligned(t) else t.clone()


def aligned_output(out: torch.Tensor) -> torch.Tensor:
    """out itself when aligned, else a fresh aligned buffer of its shape; the caller copies it
    into out after the kernel (for tensors a kernel writes)."""
    return out if is_aligned(out) else torch.empty_like(out)
