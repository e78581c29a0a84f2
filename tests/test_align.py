"""fusedist/_align.py: the one 16-byte rule the kernels' launchers share."""

from __future__ import annotations

import torch

from fusedist import _align


def test_aligned_views_pass_through_and_misaligned_ones_are_copied():
    buf = torch.arange(64, dtype=torch.bfloat16)
    assert _align.is_aligned(buf) and _align.aligned_input(buf) is buf
    view = buf[1:9]  # 2 bytes past an aligned start
    assert not _align.is_aligned(view)
    got = _align.aligned_input(view)
    assert got is not view and _align.is_aligned(got) and torch.equal(got, view)
    out = _align.aligned_output(view)
    assert out is not view and _align.is_aligned(out) and out.shape == view.shape
    assert _align.aligned_output(buf) is buf
    assert _align.is_aligned(buf[8:])  # 16 bytes in


def test_whole_vectors():
    assert _align.whole_vectors(48) and _align.whole_vectors(0)
    assert not _align.whole_vectors(40)
