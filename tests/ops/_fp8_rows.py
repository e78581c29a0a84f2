"""Checks of the layer ops' FP8 outputs (e4m3 + one float32 scale per token) shared by
tests/ops/test_add_rmsnorm.py and test_silu_mul.py.

The convention (fusedist/ops/_rows.py fp8_rows, csrc/include/fusedist/layers/fp8_rows.cuh):
scale = max(amax |y|, 1e-12) / 448 per row of the fp32 values y, q = e4m3(y / scale).

  check_fp8_64     against the float64 values y64 of the op on the rounded inputs: the scale
                   within 2e-5 of max(amax |y64|, 1e-12) / 448 (the fp32 math's error, as the
                   fp32 outputs' tolerance), |q * scale - y64| <= 2^-4 |y64| + 2^-10 scale
                   (+ the fp32 slack): half an e4m3 ulp (3 mantissa bits) and half its
                   subnormal step; the largest |q| of a row is 448 exactly where amax >= 1e-12
                   (the amax element maps onto the e4m3 limit); rows with a NaN are all NaN.
  check_within_ulp the kernel against the reference: NaN at the same places (not the same NaN
                   bytes: a NaN's sign is the platform's), inf scales alike, e4m3 bytes equal
                   or one e4m3 ulp apart (adjacent codes: the kernel's fp32 y may differ from
                   torch's in the last bits, through rsqrtf / expf and the sum's order, and
                   fall on the other side of a rounding boundary), scales within 1e-5.
"""

from __future__ import annotations

import torch

FP8 = getattr(torch, "float8_e4m3fn", None)
E4M3_MAX = 448.0


def e4m3_ordinal(q: torch.Tensor) -> torch.Tensor:
    """The e4m3 codes as signed ordinals (int64): adjacent representable values differ by 1,
    +0 and -0 are both 0. NaN codes (0x7f / 0xff) map to +-127."""
    b = q.view(torch.uint8).long()
    mag = b & 0x7F
    return torch.where(b >= 0x80, -mag, mag)


def check_fp8_64(q: torch.Tensor, scale: torch.Tensor, y64: torch.Tensor, what: str = "") -> None:
    assert q.dtype == FP8 and scale.dtype == torch.float32, (q.dtype, scale.dtype)
    assert q.shape == y64.shape and scale.shape == y64.shape[:-1], (q.shape, scale.shape)
    q64 = q.double().reshape(-1, q.shape[-1]).cpu()
    s64 = scale.double().reshape(-1).cpu()
    y = y64.reshape(-1, y64.shape[-1]).double().cpu()
    nan_rows = y.isnan().any(-1)
    assert bool(s64[nan_rows].isnan().all()) and bool(q64[nan_rows].isnan().all()), \
        f"a row with a NaN is not all NaN {what}"
    ok = ~nan_rows
    q64, s64, y = q64[ok], s64[ok], y[ok]
    amax = y.abs().amax(-1) if y.shape[-1] else y.new_zeros(y.shape[0])
    want_s = amax.clamp_min(1e-12) / E4M3_MAX
    bad_s = ~((s64 - want_s).abs() <= 2e-5 * want_s)
    assert not bool(bad_s.any()), (f"{int(bad_s.sum())} of {s64.numel()} scales wrong {what}: "
                                   f"{s64[bad_s][:4]} vs {want_s[bad_s][:4]}")
    deq = q64 * s64[:, None]
    bound = 2.0 ** -4 * y.abs() + 2.0 ** -10 * s64[:, None] + 2e-5 * y.abs()
    bad = ~((deq - y).abs() <= bound)
    assert not bool(bad.any()), f"{int(bad.sum())} of {deq.numel()} e4m3 values wrong {what}"
    assert bool((q64.abs() <= E4M3_MAX).all())
    full = amax >= 1e-12
    assert bool((q64[full].abs().amax(-1) == E4M3_MAX).all()), \
        f"a row's largest |q| is not 448 {what}"


def check_within_ulp(q: torch.Tensor, scale: torch.Tensor, q_ref: torch.Tensor,
                     scale_ref: torch.Tensor, what: str = "") -> int:
    """The kernel's (q, scale) against the reference's; returns how many bytes differ (each by
    one e4m3 ulp)."""
    q, scale = q.cpu(), scale.cpu()
    assert torch.equal(q.float().isnan(), q_ref.float().isnan()), f"NaN places differ {what}"
    assert torch.equal(scale.isnan(), scale_ref.isnan()), f"NaN scales differ {what}"
    fin = torch.isfinite(scale_ref)
    assert torch.equal(scale[~fin].nan_to_num(), scale_ref[~fin].nan_to_num()), \
        f"non-finite scales differ {what}"
    rel = (scale[fin].double() - scale_ref[fin].double()).abs() / scale_ref[fin].double()
    assert not bool((rel > 1e-5).any()), f"scales differ by up to {float(rel.max()):.2e} {what}"
    num = ~q_ref.float().isnan()
    d = (e4m3_ordinal(q) - e4m3_ordinal(q_ref)).abs()[num]
    assert not bool((d > 1).any()), f"{int((d > 1).sum())} e4m3 values > 1 ulp off {what}"
    return int((d == 1).sum())


def bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same bits (NaN included): e4m3 bytes or float32 words."""
    view = torch.uint8 if a.dtype == FP8 else torch.int32
    return a.dtype == b.dtype and torch.equal(a.view(view), b.view(view))


def check_against_reference(q, scale, q_ref, scale_ref, device: str, what: str = "") -> None:
    """The op's (q, scale) against the reference semantics': bitwise on the CPU (the CPU path
    is the reference), check_within_ulp on CUDA."""
    if device == "cpu":
        assert bitwise(q, q_ref) and bitwise(scale, scale_ref), \
            f"the CPU path is not the reference bitwise {what}"
    else:
        check_within_ulp(q, scale, q_ref, scale_ref, what)


def fp8_rows_spelled_out(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The convention spelled out in torch ops on fp32 y (independent of the library's
    helper): (q, scale)."""
    scale = y.abs().amax(-1).clamp_min(1e-12) / 448.0
    return (y / scale.unsqueeze(-1)).to(FP8), scale
