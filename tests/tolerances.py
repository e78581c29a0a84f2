"""One tolerance table for every test: |out - ref| <= atol + rtol * |ref|, NaN never passes.

The references are float64. A symmetric all-reduce of exact inputs rounds once, so its error
is half an ulp of the output dtype (fp32 2^-24, fp16 2^-11, bf16 2^-8 relative); the table
leaves headroom for fp32 accumulation of up to 8 ranks and the RMSNorm epilogue.
"""

from __future__ import annotations

import math

import torch

TOL = {
    torch.float32: (1e-5, 1e-6),
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (8e-3, 1e-5),
}
# Epilogues that round an intermediate (all-reduce output, new residual) before further math.
TOL_EPILOGUE = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}


def count_bad(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, table=TOL) -> int:
    """Number of elements outside tolerance (NaN/inf count as bad)."""
    rtol, atol = table[dtype]
    o = out.double()
    r = ref.double()
    ok = (o - r).abs() <= atol + rtol * r.abs()
    ok &= torch.isfinite(o)
    return int((~ok).sum())


def rare_count_bound(n: int, p: float, tail: float = 1e-6) -> int:
    """The most elements of n that an event of per-element probability at most p (a rounding
    flip) may hit: the smallest k with P(Binomial(n, p) > k) < tail. A fixed fraction p * n
    allows none on a small tensor, where one flip is as likely as on any other."""
    k, log_pmf = 0, n * math.log1p(-p)     # in logs: (1 - p)^n underflows for large n
    cdf = math.exp(log_pmf)
    while 1.0 - cdf >= tail and k < n:
        log_pmf += math.log((n - k) / (k + 1) * p / (1.0 - p))
        k += 1
        cdf += math.exp(log_pmf)
    return k


# GEMM outputs: ||out - ref|| / ||ref|| (elementwise tolerances do not fit sums of K products,
# whose small elements carry large relative error). bf16/fp16 operands with fp32 accumulation
# land near 2^-9 / 2^-12 relative from the final rounding alone.
GEMM_REL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def gemm_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error; inf when any element is not finite."""
    o = out.double()
    if not bool(torch.isfinite(o).all()):
        return float("inf")
    r = ref.double()
    return float((o - r).norm() / r.norm().clamp_min(1e-30))


# GEMM outputs, element by element: |out - ref| <= rtol |ref| + atol rms(ref). The rtol term
# is a few roundings of the output dtype (half an ulp: fp16 2^-11, bf16 2^-8). The atol term,
# relative to the output's RMS, covers elements near zero (sums that cancel), whose error comes
# from roundings of intermediates: a partial per rank (up to ~4x the output's RMS at 4.5
# sigma), a bias add, a first GEMM's rounded output; two worst-case such roundings at 4x RMS:
# fp16 2 x 4 x 2^-11 ~ 4e-3, bf16 2 x 4 x 2^-8 ~ 3.2e-2. A stale 16-byte
# vector (unwritten, or values of another row or call: of the output's scale) or a NaN left
# from the poison fails.
GEMM_ELEM = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 4e-3),
             torch.bfloat16: (1.6e-2, 3.2e-2)}


def count_bad_gemm(out: torch.Tensor, ref: torch.Tensor, table=GEMM_ELEM) -> int:
    """Elements of a GEMM output outside GEMM_ELEM's bound for out's dtype (NaN/inf count
    as bad)."""
    rtol, atol = table[out.dtype]
    o = out.double()
    r = ref.double()
    rms = float(r.pow(2).mean().sqrt()) if r.numel() else 0.0
    ok = (o - r).abs() <= rtol * r.abs() + atol * rms
    ok &= torch.isfinite(o)
    return int((~ok).sum())


def gemm_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The GEMM tests' check, compared against GEMM_REL: the relative Frobenius error, or inf
    when any element is outside count_bad_gemm's element-wise bound (or not finite)."""
    if count_bad_gemm(out, ref):
        return float("inf")
    return gemm_rel_err(out, ref)
