"""FP8 weights in the model layers (fusedist.nn.quant): the quantization error model, the FP8
GEMM against float64 on the dequantized values, its dispatch, sharding, and the TP layers that
hold FP8 weights.

Error model (docs/design/fp8.md), checked element by element:
  quantize_fp8   |dequantize(q(w)) - w| <= 2^-4 |w| + 2^-10 s  (s: the element's scale)
  fp8_linear     the CPU reference and the dequantize path multiply x by the exact dequantized
                 weight: |y - ref| <= (K + 2) 2^-24 sum|x w| + (half an ulp of y's dtype) |ref|
                 against float64 ref = x @ (data * scale)^T
  _scaled_mm     x also rounded to e4m3 with its dynamic scale s_x (per token or per tensor):
                 + sum_k |w_k| (2^-4 |x_k| + 2^-10 s_x)
CPU tier: every CPU path, and torch._scaled_mm's paths where this torch runs them on the CPU;
gpu tier: the CUDA paths (GEMV when the build has it, row-wise / per-tensor _scaled_mm, the
dequantized weight for block scales past 16 rows), eager and in a CUDA graph."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

quant = importlib.import_module("fusedist.ops.fp8_linear")  # the op behind fusedist.nn.quant
from fusedist.nn import ColumnParallelLinear, RowParallelLinear, TPAttention  # noqa: E402
from fusedist.nn.attention import AttentionMetadata  # noqa: E402
from fusedist.nn.linear import linear  # noqa: E402
from fusedist.nn.quant import (BLOCK, FP8, FP8Rows, FP8Weight, choose_path,  # noqa: E402
                               fp8_linear, quantize_fp8)
from model_fixtures import rt  # noqa: E402,F401 - the shared runtime fixture

pytestmark = pytest.mark.skipif(FP8 is None, reason="torch without float8_e4m3fn")

LAYOUTS = ("tensor", "channel", "block")
HALF_ULP = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -9, torch.float16: 2.0 ** -11}
# Half the smallest subnormal step of each output dtype (an absolute error for tiny outputs).
HALF_TINY = {torch.float32: 2.0 ** -150, torch.bfloat16: 2.0 ** -134, torch.float16: 2.0 ** -25}
SHAPES = [(1, 16), (7, 13), (200, 300), (129, 257), (256, 128)]   # [N, K]: odd, partial blocks


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def scale_map64(w: FP8Weight) -> torch.Tensor:
    """The element scales [N, K] in float64, built block by block (independent of the code's
    expansion)."""
    n, k = w.shape
    s = w.scale.double()
    if w.layout == "tensor":
        return s.reshape(1, 1).expand(n, k)
    if w.layout == "channel":
        return s.reshape(n, 1).expand(n, k)
    out = torch.empty(n, k, dtype=torch.float64)
    for bi in range(s.shape[0]):
        for bj in range(s.shape[1]):
            out[bi * BLOCK:(bi + 1) * BLOCK, bj * BLOCK:(bj + 1) * BLOCK] = s[bi, bj]
    return out


def deq64(w: FP8Weight) -> torch.Tensor:
    return w.data.double() * scale_map64(w)


def random_fp8(n: int, k: int, layout: str, seed: int, exp=(-100, 40)) -> FP8Weight:
    """Every finite e4m3 value (+-448, subnormals, +-0) from random bytes, one all-zero row,
    and scales 2^e, e uniform in exp (default [-100, 40]: 1e-30 ~ 2^-100)."""
    g = _gen(seed)
    b = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    b[(b == 0x7F) | (b == 0xFF)] = 0                # the two NaN encodings
    b[0, :k // 2] = 0x7E                            # +448
    b[n // 2] = 0                                   # a row of zeros
    data = b.view(FP8)
    shape = quant.scale_shape(layout, n, k)
    scale = torch.exp2(torch.empty(shape).uniform_(*exp, generator=g)).float()
    return FP8Weight(data, scale, layout)


def gemm_bound(x: torch.Tensor, w64: torch.Tensor, ref: torch.Tensor, out_dtype, bias=None):
    """Per-element bound of an fp32-accumulated GEMM of the exact x and w64 (float64), rounded
    once to out_dtype."""
    k = x.shape[-1]
    absum = x.double().abs() @ w64.abs().t()
    if bias is not None:
        absum = absum + bias.double().abs()
    return (k + 2) * 2.0 ** -24 * absum + 2 * HALF_ULP[out_dtype] * ref.abs() + \
        HALF_TINY[out_dtype]


def assert_within(y, ref, bound, what):
    y = y.double()
    bad = ~((y - ref).abs() <= bound)
    worst = float(((y - ref).abs() / bound)[bad].max()) if bool(bad.any()) else 0.0
    assert not bool(bad.any()), (f"{what}: {int(bad.sum())} of {y.numel()} outside the bound, "
                                 f"worst |err| / bound {worst}")


# ---- quantization ----------------------------------------------------------------------------
def special_weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = _gen(seed)
    w = torch.randn(n, k, generator=g)
    w[0] = 0                                                     # zeros
    if n > 1:
        w[1] = torch.randn(k, generator=g) * 1e-30                # tiny values
    if n > 2:                                                    # 8 decades in one row
        w[2] = torch.randn(k, generator=g) * 10 ** torch.empty(k).uniform_(-8, 0, generator=g)
    if n > 3:
        w[3] = 448.0 * torch.sign(torch.randn(k, generator=g))   # already on the e4m3 limit
    if n > 4:
        w[4] = torch.randn(k, generator=g) * 1e30                # huge values
    return w


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_quantize_error_bound(layout, n, k):
    w = special_weight(n, k, seed=n * 1000 + k)
    for src in (w, w.to(torch.bfloat16)):
        q = quantize_fp8(src, layout)
        assert q.data.dtype == FP8 and tuple(q.scale.shape) == quant.scale_shape(layout, n, k)
        s = scale_map64(q)
        exact = src.double()
        err = (deq64(q) - exact).abs()
        bound = (2.0 ** -4 * exact.abs() + 2.0 ** -10 * s) * (1 + 1e-6)
        assert bool((err <= bound).all()), f"{layout} {n}x{k}: worst {float((err / bound).max())}"
        assert torch.equal(q.dequantize(), deq64(q).float())        # one fp32 product each
        # The largest magnitude of each scale group maps to 448 (e4m3's largest finite value);
        # an all-zero group gets scale 1 and zeros.
        mag = q.data.float().abs()
        if layout == "channel":
            amax = exact.abs().amax(1)
            assert bool((mag.amax(1)[amax > 0] == 448).all())
            assert bool((q.scale[amax == 0] == 1).all()) and bool((mag[amax == 0] == 0).all())
        elif layout == "tensor":
            assert float(mag.max()) == (448 if bool(exact.any()) else 0)
    if layout == "block":   # the zero row's blocks are not all zero (other rows share them)
        z = quantize_fp8(torch.zeros(n, k), layout)
        assert bool((z.scale == 1).all()) and not bool(z.data.float().any())


def test_quantize_refuses_nonfinite_and_bad_input():
    w = torch.randn(8, 16)
    w[3, 4] = float("inf")
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_fp8(w)
    with pytest.raises(ValueError, match="2-D floating"):
        quantize_fp8(torch.ones(8, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="layout"):
        quantize_fp8(torch.randn(8, 16), "row")


def test_weight_validation():
    d = torch.zeros(8, 16, dtype=FP8)
    with pytest.raises(ValueError, match=r"channel scale .* shape \[8\]"):
        FP8Weight(d, torch.ones(8, 1), "channel")
    with pytest.raises(ValueError, match="float32"):
        FP8Weight(d, torch.ones(1, dtype=torch.float64), "tensor")
    with pytest.raises(ValueError, match=r"shape \[1, 1\]"):
        FP8Weight(d, torch.ones(2, 1), "block")
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        FP8Weight(torch.zeros(8, 16), torch.ones(1), "tensor")


# ---- the GEMM against float64 ----------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_linear_matches_float64_on_dequantized(layout, dtype):
    # fp16 outputs stay finite: scales in [2^-24, 2^-8] (448 x 4 x 300 x 2^-8 < 65504)
    exp = (-24, -8) if dtype == torch.float16 else (-100, 40)
    for i, (n, k) in enumerate(SHAPES):
        w = random_fp8(n, k, layout, seed=i, exp=exp)
        w64 = deq64(w)
        g = _gen(100 + i)
        for lead in ((0,), (1,), (5,), (17,), (2, 3)):
            x = torch.randn(*lead, k, generator=g).to(dtype)
            bias = (torch.randn(n, generator=g) * 4).to(dtype)
            for b in (None, bias):
                y = linear(x, w, b)          # the dispatch: CPU -> fp8_linear_reference
                assert y.dtype == dtype and y.shape == (*lead, n)
                x2 = x.reshape(-1, k)
                ref = x2.double() @ w64.t() + (0 if b is None else b.double())
                bound = gemm_bound(x2, w64, ref, dtype, b)
                assert_within(y.reshape(-1, n), ref, bound, f"{layout} {dtype} {n}x{k} {lead}")
                # The CUDA fallback's form (weight dequantized to x's dtype, F.linear) on fp32.
                if dtype == torch.float32:
                    yd = fp8_linear(x, w, b, path="dequantize")
                    assert_within(yd.reshape(-1, n), ref, bound, f"dequantize {layout}")


@pytest.mark.parametrize("path", ["reference", "dequantize"])
def test_nan_input_stays_nan(path):
    w = quantize_fp8(torch.randn(40, 48), "channel")
    x = torch.randn(4, 48)
    x[2, 5] = float("nan")
    y = fp8_linear(x, w, path=path)
    assert bool(y[2].isnan().all())
    rows = [0, 1, 3]
    ref = x[rows].double() @ deq64(w).t()
    assert_within(y[rows], ref, gemm_bound(x[rows], deq64(w), ref, torch.float32), path)


def _scaled_mm_on_cpu() -> bool:
    try:
        a = torch.zeros(16, 16, dtype=FP8)
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.bfloat16)
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(()), scale_b=torch.ones(()),
                         out_dtype=torch.bfloat16)
        return True
    except (RuntimeError, NotImplementedError):
        return False


# The W8A8 error model. y = sum_k xq_k w_k against ref = sum_k x_k w_k, w the dequantized weight
# (exact in both: its own e4m3 rounding is test_quantize_error_bound's), so the error is
# e = sum_k d_k w_k plus the accumulation's and the output's rounding, d_k = xq_k - x_k the e4m3
# rounding of x_k / s_x (times s_x, s_x = amax / 448 per token, per tensor or per 128 k):
#   |d_k| <= D_k = 2^-4 |x_k| + 2^-10 s_x
# (3 mantissa bits: half an ulp is at most 2^-4 of the value; below the smallest normal,
# 2^-6 s_x, the step is the subnormal 2^-9 s_x, half of it 2^-10 s_x). Round to nearest of
# inputs that are not on e4m3's grid: the d_k are independent, zero-mean, bounded by D_k, and
# their variance is at most D_k^2 / 3 (uniform within half an ulp).
#  - each element (Hoeffding's inequality): P(|sum_k d_k w_k| > z sqrt(sum_k D_k^2 w_k^2)) <=
#    2 exp(-z^2 / 2); W8A8_Z = 6: 3e-8 per element. The bound grows as 2^-4 sqrt(K) rms(x w),
#    not as the worst case sum_k D_k |w_k| ~ 2^-4 K mean|x w| (all K errors of one sign; the
#    smaller of the two is taken, the worst case below K ~ 36), which at K = 400 accepted a
#    28% error of the largest outputs.
#  - the whole output (Frobenius): ||e_x||^2 = sum_ij (sum_k d_ik w_jk)^2 has mean <=
#    sum_ijk D_ik^2 w_jk^2 / 3 and concentrates there: a quadratic form in M x K independent
#    d's, of which the largest-magnitude row alone holds K >= 16; W8A8_FRO = 3 times the mean
#    bound (a chi-square of 16 degrees of freedom passes 3x its mean with probability ~5e-5,
#    and the d's measured variance is ~2/3 of D^2 / 3, putting the bound at ~4.5x the mean).
#    It catches a systematic error (every output 6% off, a row of another token) that stays
#    inside each element's bound.
#  - accumulation: fp32 sums (CPU, the GEMV's CUDA cores, cuBLAS and the CUTLASS mainloop
#    between promotions) at most (K + 2) 2^-24 sum_k |xq_k w_k|, |xq_k| <= 1.07 |x_k| + ...;
#    and with `wgmma`, Hopper's FP8 tensor-core accumulation: each wgmma adds 32 products to
#    the accumulator aligned to the largest exponent among them and truncated to ~13 fraction
#    bits (an error below 2^-12 of the largest of the 33 addends, of either sign), promoted to
#    fp32 every 512 products (4 k-blocks of 128, csrc/include/fusedist/gemm/fp8_gemm_sm90.cuh;
#    cuBLAS promotes at least as often): per 512-term group g, 528 such errors, each below
#    2^-12 S_g (S_g = sum over the group of |xq_k w_k|, which bounds every addend), independent
#    and zero-mean: Hoeffding again, z 2^-12 sqrt(528 sum_g S_g^2).
#  - the output: rounded once to out_dtype (2 half-ulps of |ref| + the error, covering the
#    epilogue's scale multiply), plus half the smallest subnormal step.
W8A8_Z = 6.0
W8A8_FRO = 3.0
WGMMA_GROUP, WGMMA_ADDENDS = 512, 528


def _w8a8_terms(x, w64, sx, wgmma=False):
    """(the x-rounding error's scale per element, sqrt(sum_k D_k^2 w_k^2); its bound per
    element, min(z scale, sum_k D_k |w_k|); the accumulation's bound per element)."""
    xa = x.double().abs()
    d = 2.0 ** -4 * xa + 2.0 ** -10 * sx.double()
    k = x.shape[-1]
    scale = (d.pow(2) @ w64.pow(2).t()).sqrt()
    stat = torch.minimum(W8A8_Z * scale, d @ w64.abs().t())
    acc = (k + 2) * 2.0 ** -24 * 1.07 * (xa @ w64.abs().t())
    if wgmma:
        xq = 1.07 * xa + 2.0 ** -10 * sx.double()
        groups = torch.zeros_like(scale)
        for g0 in range(0, k, WGMMA_GROUP):
            s_g = xq[:, g0:g0 + WGMMA_GROUP] @ w64[:, g0:g0 + WGMMA_GROUP].abs().t()
            groups += s_g.pow(2)
        acc = acc + W8A8_Z * 2.0 ** -12 * (WGMMA_ADDENDS * groups).sqrt()
    return scale, stat, acc


def w8a8_bound(x, w64, ref, sx, out_dtype, bias=None, wgmma=False):
    """Per-element bound of the W8A8 error model above (sx: [M, 1], [] or [M, K] dynamic
    scales); with bias (in out_dtype) its rounding too."""
    _, stat, acc = _w8a8_terms(x, w64, sx, wgmma)
    stat = stat + acc
    bound = stat + 2 * HALF_ULP[out_dtype] * (ref.abs() + stat) + HALF_TINY[out_dtype]
    if bias is not None:
        bound = bound + 2 * HALF_ULP[out_dtype] * (ref.abs() + bias.double().abs())
    return bound


def w8a8_check(y, x, w64, ref, sx, out_dtype, what, bias=None, wgmma=False):
    """y within the W8A8 error model, element by element and over the whole output."""
    assert_within(y, ref, w8a8_bound(x, w64, ref, sx, out_dtype, bias, wgmma), what)
    scale, stat, acc = _w8a8_terms(x, w64, sx, wgmma)
    det = acc + 2 * HALF_ULP[out_dtype] * (ref.abs() + stat + acc) + \
        HALF_TINY[out_dtype]
    if bias is not None:
        det = det + 2 * HALF_ULP[out_dtype] * (ref.abs() + bias.double().abs())
    fro = float((W8A8_FRO * scale.pow(2).sum() / 3).sqrt() + det.norm())
    err = float((y.double() - ref).norm())
    assert err <= fro, f"{what}: ||y - ref|| = {err:.4g} over the model's {fro:.4g}"


@pytest.mark.skipif(not _scaled_mm_on_cpu(), reason="this torch has no CPU torch._scaled_mm")
@pytest.mark.parametrize("path,layout,dtype", [("scaled_mm_rowwise", "channel", torch.bfloat16),
                                               ("scaled_mm_rowwise", "tensor", torch.bfloat16),
                                               ("scaled_mm_tensor", "tensor", torch.bfloat16),
                                               ("scaled_mm_tensor", "tensor", torch.float16)])
def test_scaled_mm_paths_w8a8_bound(path, layout, dtype):
    """The _scaled_mm paths' arithmetic (dynamic activation quantization, scale shapes), run by
    this torch's CPU _scaled_mm: within the W8A8 bound of float64 on dequantized values."""
    _w8a8_case(path, layout, dtype)


@pytest.mark.parametrize("layout", ["channel", "tensor"])
def test_fp8_gemm_path_w8a8_bound(layout):
    """path "fp8_gemm" (fusedist.ops.fp8_gemm; on the CPU its fp32 reference): x quantized per
    token, within the same W8A8 bound as row-wise _scaled_mm."""
    _w8a8_case("fp8_gemm", layout, torch.bfloat16)


def test_fp8_gemm_path_block_weights():
    """path "fp8_gemm" with 128 x 128 block weights: x quantized per token and 128 k
    (quantize_groups), fusedist.ops.fp8_gemm(block=True) (on the CPU its fp32 reference):
    within the W8A8 bound taken with each row's amax (a group's scale is at most its row's)."""
    for i, (n, k) in enumerate([(136, 256), (256, 384)]):
        w = quantize_fp8(torch.randn(n, k, generator=_gen(i)) * 0.05, "block")
        w64 = deq64(w)
        x = (torch.randn(7, k, generator=_gen(20 + i)) *
             torch.logspace(-3, 1, 7)[:, None]).to(torch.bfloat16)
        b = torch.randn(n, generator=_gen(40 + i)).to(torch.bfloat16)
        y = fp8_linear(x, w, b, path="fp8_gemm")
        ref = x.double() @ w64.t() + b.double()
        sx = x.float().abs().amax(1, keepdim=True) / 448
        w8a8_check(y, x, w64, ref, sx, torch.bfloat16, f"fp8_gemm block n={n} k={k}", b)
    xq, sx8 = quant.quantize_rows(x)
    with pytest.raises(ValueError, match="block weights take a bf16 x"):
        fp8_linear(xq, w, x_scale=sx8, path="fp8_gemm")


@pytest.mark.parametrize("mutation", ["scale_7pct", "rows_of_one_magnitude_swapped",
                                      "one_element", "scales_of_the_wrong_token"])
def test_w8a8_check_catches_broken_outputs(mutation):
    """The W8A8 check fails on outputs a broken GEMM would give while the correct one passes
    (K = 400, where the worst-case bound accepted 28% errors): every output 7% too large, two
    rows of the same magnitude swapped, one element off by half its row's RMS (the element
    bound is ~z 2^-4 = 0.375 RMS), each token dequantized with another token's scale."""
    n, k = 144, 400
    w = quantize_fp8(torch.randn(n, k, generator=_gen(3)) * 0.05, "channel")
    w64 = deq64(w)
    x = (torch.randn(9, k, generator=_gen(53)) *
         torch.logspace(-3, 1, 9)[:, None]).to(torch.bfloat16)
    x[5:7] = (torch.randn(2, k, generator=_gen(54)) * 2).to(torch.bfloat16)
    ref = x.double() @ w64.t()
    sx = x.float().abs().amax(1, keepdim=True) / 448
    y = fp8_linear(x, w, path="fp8_gemm")
    w8a8_check(y, x, w64, ref, sx, torch.bfloat16, "intact")
    if mutation == "scale_7pct":
        bad = y * 1.07
    elif mutation == "rows_of_one_magnitude_swapped":
        bad = y[[0, 1, 2, 3, 4, 6, 5, 7, 8]]
    elif mutation == "one_element":
        bad = y.clone()
        bad[8, 17] += 0.5 * ref[8].pow(2).mean().sqrt()
    else:   # x rounded per token, each row dequantized with its neighbour's scale
        xq = (x.float() / sx).to(FP8).double()
        bad = ((xq * sx.double().roll(1, 0)) @ w64.t()).to(torch.bfloat16)
    with pytest.raises(AssertionError):
        w8a8_check(bad, x, w64, ref, sx, torch.bfloat16, mutation)


def _rel_fro(y, ref) -> float:
    return float((y.double() - ref).norm() / ref.norm())


@pytest.mark.skipif(not _scaled_mm_on_cpu(), reason="this torch has no CPU torch._scaled_mm")
def test_error_flat_in_k_and_under_outliers():
    """The error model's growth (docs/design/fp8.md, "How the error grows"): the relative
    (Frobenius) error of the output against float64 on the unquantized operands does not grow
    with K (the sums are fp32; the quantization errors are independent per element), per-token
    e4m3 activations keep it with a few input channels 1e5 x the others (e4m3 is floating
    point: the ordinary elements stay normal numbers up to a ~2^15 ratio), and per-channel
    weight scales keep the ordinary rows' error with a few rows 1e6 x the others."""
    n = 256
    errs = {}
    for k in (256, 4096, 16384):
        g = _gen(k)
        x = torch.randn(64, k, generator=g).to(torch.bfloat16)
        w = torch.randn(n, k, generator=g) * 0.02
        ref = x.double() @ w.double().t()
        wq = quantize_fp8(w, "channel")
        errs[k] = {p: _rel_fro(fp8_linear(x, wq, path=p), ref)
                   for p in ("reference", "scaled_mm_rowwise")}
    for p in ("reference", "scaled_mm_rowwise"):
        assert errs[16384][p] <= 1.1 * errs[256][p], (p, errs)
        assert errs[16384][p] < (0.03 if p == "reference" else 0.045), (p, errs)
    base = None
    for f in (1.0, 1e3, 1e5):
        g = _gen(7)
        x = torch.randn(64, 4096, generator=g)
        x[:, :8] *= f
        x = x.to(torch.bfloat16)
        w = torch.randn(n, 4096, generator=g) * 0.02
        e = _rel_fro(fp8_linear(x, quantize_fp8(w, "channel"), path="scaled_mm_rowwise"),
                     x.double() @ w.double().t())
        base = e if base is None else base
        assert e <= 1.1 * base, (f, e, base)
    for f in (1.0, 1e6):
        g = _gen(9)
        x = torch.randn(64, 4096, generator=g).to(torch.bfloat16)
        w = torch.randn(n, 4096, generator=g) * 0.02
        w[:4] *= f
        ref = x.double() @ w.double().t()
        y = fp8_linear(x, quantize_fp8(w, "channel"), path="reference")
        e = _rel_fro(y[:, 4:], ref[:, 4:])
        base = e if f == 1.0 else base
        assert e <= 1.05 * base, (f, e, base)


def _w8a8_case(path, layout, dtype):
    rowwise = path.endswith("rowwise") or path == "fp8_gemm"
    for i, (n, k) in enumerate([(16, 16), (48, 32), (256, 128), (144, 400)]):
        w = quantize_fp8(torch.randn(n, k, generator=_gen(i)) * 0.05, layout)
        w64 = deq64(w)
        x = (torch.randn(9, k, generator=_gen(50 + i)) *
             torch.logspace(-3, 1, 9)[:, None]).to(dtype)       # rows of different magnitude
        x[4] = 0                                                 # a row of zeros
        bias = torch.randn(n, generator=_gen(70 + i)).to(dtype)
        for b in (None, bias):
            y = fp8_linear(x, w, b, path=path)
            assert y.dtype == dtype
            ref = x.double() @ w64.t() + (0 if b is None else b.double())
            xa = x.float().abs()
            sx = (xa.amax(1, keepdim=True) if rowwise else xa.amax()) / 448
            w8a8_check(y, x, w64, ref, sx, dtype, f"{path} {n}x{k}", b)
            assert bool((y[4] == (0 if b is None else b)).all())
    x = torch.randn(3, 32).to(dtype)
    x[1, 0] = float("nan")
    y = fp8_linear(x, quantize_fp8(torch.randn(16, 32), layout), path=path)
    if rowwise:                     # per-token scales: the NaN stays in its token's row
        assert bool(y[1].isnan().all()) and not bool(y[[0, 2]].isnan().any())
    else:                           # one scale for all of x: every output is NaN
        assert bool(y.isnan().all())


# ---- dispatch ----------------------------------------------------------------------------------
BF, HF = torch.bfloat16, torch.float16


@pytest.mark.parametrize("args,want", [
    ((1, 4096, 4096, "block", BF, None, (9, 0), True), "gemv"),
    ((16, 4096, 4096, "channel", BF, BF, (9, 0), True), "gemv"),
    ((16, 28672, 4096, "channel", BF, None, (9, 0), True), "scaled_mm_rowwise"),  # measured
    ((8, 28672, 4096, "channel", BF, None, (9, 0), True), "gemv"),
    ((16, 28672, 4096, "block", BF, None, (9, 0), True), "gemv"),           # no row-wise form
    ((16, 28672, 8192, "channel", BF, None, (9, 0), True), "gemv"),
    ((17, 4096, 4096, "channel", BF, None, (9, 0), True), "gemv_w8a8"),         # measured
    ((32, 4096, 14336, "channel", BF, None, (9, 0), True), "gemv_w8a8"),
    ((33, 4096, 4096, "channel", BF, None, (9, 0), True), "scaled_mm_rowwise"),
    ((17, 6144, 4096, "channel", BF, None, (9, 0), True), "scaled_mm_rowwise"),   # N > 4096
    ((17, 4096, 4096, "block", BF, None, (9, 0), True, False, True), "fp8_gemm"),
    ((4096, 4096, 4096, "block", BF, BF, (9, 0), True, True, True), "fp8_gemm"),
    ((64, 4096, 4160, "block", BF, None, (9, 0), True, True, True), "dequantize"),  # K % 128
    ((64, 4100, 4096, "block", BF, None, (9, 0), True, False, True), "dequantize"),  # N % 8
    ((64, 4096, 4096, "block", BF, None, (9, 0), True, True, False), "scaled_mm_block"),
    ((1, 4096, 4096, "channel", BF, None, (9, 0), False), "scaled_mm_rowwise"),   # no GEMV
    ((64, 4096, 4096, "tensor", BF, None, (9, 0), True), "scaled_mm_rowwise"),   # per token
    ((64, 4096, 4096, "tensor", BF, None, (8, 9), True), "scaled_mm_tensor"),
    ((64, 4096, 4096, "tensor", HF, None, (9, 0), True), "scaled_mm_tensor"),
    ((64, 4096, 4096, "tensor", HF, None, (8, 9), True), "scaled_mm_tensor"),
    ((64, 4096, 4096, "channel", HF, None, (9, 0), True), "dequantize"),    # row-wise: bf16
    ((64, 4096, 4096, "channel", BF, None, (8, 9), True), "dequantize"),    # row-wise: sm_90
    ((64, 4096, 4096, "block", BF, None, (9, 0), True), "dequantize"),
    ((64, 4096, 4104, "channel", BF, None, (9, 0), True), "dequantize"),    # K % 16
    ((1, 4096, 4104, "channel", BF, None, (9, 0), True), "dequantize"),     # GEMV: K % 16
    ((64, 4104, 4096, "tensor", BF, None, (9, 0), True), "dequantize"),     # N % 16
    ((64, 4096, 4096, "tensor", BF, None, (8, 0), True), "dequantize"),     # no FP8 MMA
    ((4, 4096, 4096, "channel", torch.float32, None, (9, 0), True), "dequantize"),
    ((4, 4096, 4096, "channel", BF, torch.float32, (9, 0), True), "scaled_mm_rowwise"),
])
def test_choose_path(args, want):
    assert choose_path(*args) == want


@pytest.mark.parametrize("args,want", [
    ((17, 4096, 4096, "block", BF, None, (9, 0), True), "scaled_mm_block"),
    ((4096, 28672, 4096, "block", BF, BF, (9, 0), True), "scaled_mm_block"),
    ((1, 4096, 4096, "block", BF, None, (9, 0), True), "gemv"),              # the GEMV first
    ((1, 4096, 4096, "block", BF, None, (9, 0), False), "scaled_mm_block"),  # no GEMV
    ((64, 4096, 4224, "block", BF, None, (9, 0), True), "dequantize"),       # K % 512
    ((64, 4160, 4096, "block", BF, None, (9, 0), True), "dequantize"),       # N % 128
    ((64, 4096, 4096, "block", HF, None, (9, 0), True), "dequantize"),       # bf16 x only
    ((64, 4096, 4096, "block", BF, torch.float32, (9, 0), True), "dequantize"),
    ((64, 4096, 4096, "channel", BF, None, (9, 0), True), "scaled_mm_rowwise"),
])
def test_choose_path_blockwise(args, want):
    """With torch's block-scaled scaled_mm on the device (the last argument of choose_path)."""
    assert choose_path(*args, blockwise=True) == want
    assert choose_path(*args, blockwise=False) != "scaled_mm_block"


def _fake_block_scaled_mm(calls):
    """A stand-in for torch.nn.functional.scaled_mm's 1 x 128 / 128 x 128 recipe on the CPU:
    the layout checks of torch's _scaled_block1x128_block128x128 (ScaledBlas.cpp) and of
    cuBLASLt's scaling-factor layouts (M and N multiples of 4, 16-byte aligned scale starts),
    then the block-scaled product in float64, rounded once to bf16."""
    def fn(a, b, sa, ra, sb, rb, output_dtype=None):
        calls.append((tuple(a.shape), tuple(sa.shape), sa.stride(), tuple(sb.shape), sb.stride()))
        m, k = a.shape
        n = b.shape[1]
        kb, l4 = -(-k // 128), -(-k // 512) * 4
        if (ra, rb) != ("1x128", "128x128") or output_dtype != torch.bfloat16:
            raise ValueError("recipes")
        if a.dtype != FP8 or not a.is_contiguous() or b.dtype != FP8 or b.stride() != (1, k):
            raise ValueError("mat_a row-major e4m3, mat_b column-major e4m3")
        if tuple(sa.shape) != (m, kb) or sa.stride(0) != 1 or (kb > 1 and sa.stride(1) != m):
            raise ValueError(f"scale_a must have shape ({m}, {kb}), strides (1, {m})")
        if tuple(sb.shape) != (l4, -(-n // 128)) or sb.stride(0) != 1 or sb.stride(1) != l4:
            raise ValueError(f"scale_b must have shape ({l4}, {n // 128}), strides (1, {l4})")
        if m % 4 or n % 4:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED: M and N must be multiples of 4")
        if sa.storage_offset() % 4 or sb.storage_offset() % 4:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED: scales must start 16B aligned")
        sa64 = sa.double().repeat_interleave(128, 1)[:, :k]
        sb64 = sb.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:k, :n]
        return ((a.double() * sa64) @ (b.double() * sb64)).to(torch.bfloat16)
    return fn


@pytest.mark.parametrize("m", [1, 3, 4, 17, 64])
def test_blockwise_operands_on_the_cpu(monkeypatch, m):
    """scaled_mm_blockwise hands torch's block-scaled scaled_mm the layouts it and cuBLASLt take
    for any M (rows padded to a multiple of 4, scales M-major with that column stride, the
    weight's scales [K / 128, N / 128] K-major) and returns x's M rows: the block-scaled
    product of quantize_groups(x) and the dequantized weight, plus the bias."""
    calls = []
    types = type("Types", (), {"BlockWise1x128": "1x128", "BlockWise128x128": "128x128"})
    monkeypatch.setattr(quant, "_blockwise_api", lambda: (_fake_block_scaled_mm(calls), types))
    n, k = 256, 1024
    w = quantize_fp8(torch.randn(n, k, generator=_gen(m)) * 0.05, "block")
    x = (torch.randn(m, k, generator=_gen(m + 1)) * 2).to(torch.bfloat16)
    b = torch.randn(n, generator=_gen(m + 2)).to(torch.bfloat16)
    y = quant.scaled_mm_blockwise(x, w, b)
    mp = -(-m // 4) * 4
    assert calls == [((mp, k), (mp, k // 128), (1, mp), (k // 128, n // 128), (1, k // 128))]
    xq, sx = quant.quantize_groups(x)
    xd = (xq.double().view(m, -1, 128) * sx.double()[..., None]).view(m, k)
    want = (xd @ deq64(w).t()).to(torch.bfloat16) + b
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y, want, rtol=2.0 ** -7, atol=2.0 ** -7)


def test_blockwise_probe_keeps_the_reason(monkeypatch):
    """_blockwise_check answers (ok, why): the exception torch raised, a wrong result, or no
    block-scaled scaled_mm in this torch; _probe_blockwise files the reason per device."""
    types = type("Types", (), {"BlockWise1x128": "1x128", "BlockWise128x128": "128x128"})
    cpu = torch.device("cpu")
    monkeypatch.setattr(quant, "_blockwise_api", lambda: (_fake_block_scaled_mm([]), types))
    assert quant._blockwise_check(cpu) == (True, "")

    def raises(*a, **kw):
        raise NotImplementedError("DeepSeek style (1x128, 128x128) scaling requires "
                                  "cublasLt >= 12.9")
    monkeypatch.setattr(quant, "_blockwise_api", lambda: (raises, types))
    ok, why = quant._blockwise_check(cpu)
    assert not ok and "NotImplementedError: DeepSeek style" in why and torch.__version__ in why

    def wrong(*a, **kw):
        return _fake_block_scaled_mm([])(*a, **kw) * 1.5
    monkeypatch.setattr(quant, "_blockwise_api", lambda: (wrong, types))
    ok, why = quant._blockwise_check(cpu)
    assert not ok and "wrong result" in why

    monkeypatch.setattr(quant, "_blockwise_api", lambda: None)
    ok, why = quant._blockwise_check(cpu)
    assert not ok and "no torch.nn.functional.scaled_mm" in why

    monkeypatch.setattr(quant, "_blockwise_check", lambda dev: (False, f"why {dev.index}"))
    monkeypatch.setattr(quant, "BLOCKWISE_PROBE", {})
    assert not quant._probe_blockwise(3) and quant.BLOCKWISE_PROBE == {3: "why 3"}
    monkeypatch.setattr(quant, "_blockwise_check", lambda dev: (True, ""))
    assert quant._probe_blockwise(3) and quant.BLOCKWISE_PROBE == {}


def test_quantize_groups_float64():
    """Per token and 128 k: each group's amax maps to 448, every value within e4m3's
    rounding of x / scale, zeros and NaN stay in their group, K must be whole groups."""
    g = _gen(3)
    x = torch.randn(5, 384, generator=g) * torch.logspace(-4, 2, 5)[:, None]
    x[1, 128:256] = 0
    x[3, 300] = float("nan")
    q, s = quant.quantize_groups(x.to(torch.bfloat16))
    assert q.dtype == FP8 and q.shape == (5, 384) and s.shape == (5, 3)
    xd = x.to(torch.bfloat16).double().view(5, 3, 128)
    amax = xd.abs().amax(-1)
    ok = ~torch.isnan(amax)
    assert torch.allclose(s.double()[ok & (amax > 0)], (amax / 448)[ok & (amax > 0)],
                          rtol=1e-6)
    assert float(s[1, 1]) == 1.0 and bool((q.view(5, 3, 128)[1, 1].float() == 0).all())
    back = q.double().view(5, 3, 128) * s.double()[..., None]
    err = (back - xd).abs()
    bound = 2.0 ** -4 * xd.abs() + 2.0 ** -10 * s.double()[..., None]
    assert bool((err[ok] <= bound[ok]).all())
    assert bool(torch.isnan(back[3, 2]).any()) and not bool(torch.isnan(back[3, :2]).any())
    with pytest.raises(ValueError, match="multiple of the group size 128"):
        quant.quantize_groups(torch.zeros(2, 200))


def test_cpu_path_is_reference():
    x, w = torch.randn(3, 16), quantize_fp8(torch.randn(8, 16))
    assert quant.fp8_path(x, w) == "reference"


def test_gemv_call_through_the_guard(monkeypatch):
    """The GEMV op is imported under a guard (None without fusedist/ops/gemv.py); when present,
    fp8_linear hands it x [M, K], the e4m3 data, the scale as stored and the bias."""
    try:   # by name: the package attribute fusedist.ops.gemv is the function
        op = importlib.import_module("fusedist.ops.gemv")
        assert quant._gemv is op.gemv
    except ImportError:
        assert quant._gemv is None
    calls = []

    def fake_gemv(x, w, *, scale=None, bias=None, out=None):
        calls.append((x, w, scale, bias))
        return quant.fp8_linear_reference(x, FP8Weight(w, scale, layout), bias)

    monkeypatch.setattr(quant, "_gemv", fake_gemv)
    for layout in LAYOUTS:
        w = quantize_fp8(torch.randn(144, 160), layout)
        x = torch.randn(2, 3, 160).to(torch.bfloat16)
        b = torch.randn(144).to(torch.bfloat16)
        y = fp8_linear(x, w, b, path="gemv")
        assert y.shape == (2, 3, 144)
        gx, gw, gs, gb = calls[-1]
        assert gx.shape == (6, 160) and gx.is_contiguous()
        assert gw is w.data and gs is w.scale and gb is b


# ---- sharding ----------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_narrow_and_shard_take_their_scales(layout):
    w = quantize_fp8(torch.randn(512, 300, generator=_gen(1)), layout)
    full = w.dequantize()
    for dim, (a, b) in ((0, (128, 384)), (1, (256, 300)), (0, (0, 512)), (1, (0, 128))):
        part = w.narrow(dim, a, b)
        assert torch.equal(part.dequantize(), full.narrow(dim, a, b - a))
        assert part.data.is_contiguous()
    shards = [w.shard(0, r, 4) for r in range(4)]
    assert torch.equal(torch.cat([s.dequantize() for s in shards]), full)
    w = quantize_fp8(torch.randn(100, 512, generator=_gen(2)), layout)
    shards = [w.shard(1, r, 2) for r in range(2)]
    assert torch.equal(torch.cat([s.dequantize() for s in shards], 1), w.dequantize())


@pytest.mark.parametrize("layout", ["channel", "tensor"])
def test_quantize_a_shard_with_the_whole_amax(layout):
    """reduce_amax gives a column shard the whole weight's amax (what a MAX all-reduce over the
    ranks does at load): the shards are then exactly the columns of the whole weight's
    quantization."""
    w = torch.randn(64, 96, generator=_gen(9))
    w[:, 50] *= 30                                    # the row maxima sit in one shard
    full = quantize_fp8(w, layout).dequantize()
    halves = [w[:, :48], w[:, 48:]]
    red = (lambda t: t.abs().amax(1)) if layout == "channel" else (lambda t: t.abs().amax())
    whole = torch.stack([red(h) for h in halves]).amax(0)
    for i, h in enumerate(halves):
        q = quantize_fp8(h, layout, reduce_amax=lambda a: torch.maximum(a, whole))
        assert torch.equal(q.dequantize(), full[:, 48 * i:48 * (i + 1)])
    assert not torch.equal(quantize_fp8(halves[0], layout).dequantize(), full[:, :48])


def test_block_cut_off_a_block_boundary():
    w = quantize_fp8(torch.randn(300, 200), "block")
    w.narrow(0, 128, 300)                 # the partial last block: fine
    w.narrow(1, 0, 200)
    with pytest.raises(ValueError, match=r"rows \[0, 150\) of 300 cut a 128 x 128 scale block"):
        w.narrow(0, 0, 150)
    with pytest.raises(ValueError, match=r"columns \[64, 200\)"):
        w.narrow(1, 64, 200)
    with pytest.raises(ValueError, match="cut a 128 x 128"):
        w.shard(0, 0, 2)                  # 150-row shards
    # per-channel and per-tensor weights split anywhere
    quantize_fp8(torch.randn(300, 200), "channel").narrow(0, 7, 150)
    quantize_fp8(torch.randn(300, 200), "tensor").narrow(1, 3, 11)


def test_cat_rows():
    a, b = torch.randn(64, 32), torch.randn(32, 32) * 10
    ta, tb = quantize_fp8(a, "tensor"), quantize_fp8(b, "tensor")
    cat = FP8Weight.cat_rows([ta, tb])
    assert cat.layout == "channel"                       # different scales: one per row, exact
    assert torch.equal(cat.dequantize(), torch.cat([ta.dequantize(), tb.dequantize()]))
    same = FP8Weight.cat_rows([ta, FP8Weight(tb.data, ta.scale.clone(), "tensor")])
    assert same.layout == "tensor"
    ca, cb = quantize_fp8(a, "channel"), quantize_fp8(b, "channel")
    assert torch.equal(FP8Weight.cat_rows([ca, cb]).dequantize(),
                       torch.cat([ca.dequantize(), cb.dequantize()]))
    ba, bb = quantize_fp8(torch.randn(256, 200), "block"), quantize_fp8(torch.randn(40, 200),
                                                                        "block")
    blk = FP8Weight.cat_rows([ba, bb])
    assert torch.equal(blk.dequantize(), torch.cat([ba.dequantize(), bb.dequantize()]))
    with pytest.raises(ValueError, match="part 0 has 40 rows, not a multiple of 128"):
        FP8Weight.cat_rows([bb, ba])
    with pytest.raises(ValueError, match="different scale layouts"):
        FP8Weight.cat_rows([ta, ca])


# ---- TP layers holding FP8 weights -----------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_tp_linears_take_fp8(rt, layout):
    w8 = quantize_fp8(torch.randn(256, 384, generator=_gen(3)), layout)
    bias = torch.randn(256, generator=_gen(4))
    x = torch.randn(5, 384, generator=_gen(5))
    ref = x.double() @ deq64(w8).t() + bias.double()
    bound = gemm_bound(x, deq64(w8), ref, torch.float32, bias)
    for cls in (ColumnParallelLinear, RowParallelLinear):
        m = cls.from_full(w8, bias, dtype=torch.float32, device="cpu")
        assert isinstance(m.weight, FP8Weight) and "weight" not in dict(m.named_parameters())
        assert_within(m(x), ref, bound, cls.__name__)
    with pytest.raises(ValueError, match="sequence_parallel=True takes bf16"):
        ColumnParallelLinear.from_full(w8, None, dtype=torch.float32, device="cpu",
                                       sequence_parallel=True)


def _attention_inputs(attn, T, seed):
    g = _gen(seed)
    x = torch.randn(T, attn.hidden_size, generator=g)
    pos = torch.arange(T) + 3
    meta = AttentionMetadata("decode", block_table=torch.arange(T * 2, dtype=torch.int32)
                             .view(T, 2), seq_lens=(pos + 1).to(torch.int32),
                             slot_mapping=torch.arange(T) * 32 + pos)
    return x, pos, meta


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bias", [False, True])
def test_tpattention_fp8_equals_dequantized(layout, bias):
    """TPAttention with FP8 qkv / o (load_full shards FP8Weights) against the same module with
    the dequantized weights as fp32 parameters."""
    H, KV, D, hid = 4, 2, 64, 192                 # q 256 rows, k / v 128: whole blocks
    g = _gen(7)
    full = [torch.randn(n, k, generator=g) * 0.2 for n, k in
            ((H * D, hid), (KV * D, hid), (KV * D, hid), (hid, H * D))]
    b = [torch.randn(n, generator=g) * 0.1 for n in (H * D, KV * D, KV * D)] if bias else []
    q8 = [quantize_fp8(w, layout) for w in full]
    fp8 = TPAttention(hid, H, KV, D, qkv_bias=bias, max_position=64, dtype=torch.float32,
                      fp8_layout=layout).load_full(*q8, *b)
    ref = TPAttention(hid, H, KV, D, qkv_bias=bias, max_position=64,
                      dtype=torch.float32).load_full(*[w.dequantize() for w in q8], *b)
    assert isinstance(fp8.qkv_weight, FP8Weight) and isinstance(fp8.o_weight, FP8Weight)
    x, pos, meta = _attention_inputs(fp8, 3, 8)
    got = fp8(x, pos, fp8.make_cache(1, num_pages=8, page_size=16), 0, meta)
    want = ref(x, pos, ref.make_cache(1, num_pages=8, page_size=16), 0, meta)
    err = float((got - want).norm() / want.norm())
    assert err <= 1e-5, f"{layout}: rel err {err:.2e}"
    with pytest.raises(ValueError, match="FP8Weights exactly when fp8_layout is set"):
        ref.load_full(*q8, *b)
    other = "channel" if layout != "channel" else "tensor"
    with pytest.raises(ValueError, match=f"has {other} scales"):
        fp8.load_full(*[quantize_fp8(w, other) for w in full], *b)


# ---- gpu tier ----------------------------------------------------------------------------------
CUDA = torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("m", [1, 5, 16, 17, 64, 300])
def test_gpu_paths_against_float64(layout, m):
    """Each CUDA path (fp8_path's choice at this M and layout, and the dequantize fallback)
    within its bound: the GEMV and the dequantized weight multiply bf16 x by the dequantized
    weight (the latter after rounding it to bf16), the _scaled_mm paths and fusedist.ops.fp8_gemm
    (per-tensor and per-channel weights) also round x to e4m3.
    Outputs poisoned with NaN first: eager, then replayed in a CUDA graph."""
    dev = torch.device("cuda")
    n, k = 4096 + 128, 2048 + 64
    w = quantize_fp8(torch.randn(n, k, generator=_gen(m)) * 0.02, layout).to(dev)
    w64 = deq64(w.to("cpu"))
    x = (torch.randn(m, k, generator=_gen(m + 1)) * 2).to(torch.bfloat16)
    b = torch.randn(n, generator=_gen(m + 2)).to(torch.bfloat16)
    ref = x.double() @ w64.t() + b.double()
    path = quant.fp8_path(x.to(dev), w, b.to(dev))
    paths = {path, "dequantize"} | ({"fp8_gemm"} if layout != "block" else set()) | \
        ({"gemv_w8a8"} if layout != "block" and 16 < m <= 64 and quant._gemv else set())
    for p in sorted(paths):
        xd, bd = x.to(dev), b.to(dev)
        y = fp8_linear(xd, w, bd, path=p)
        out = torch.full_like(y, float("nan"))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out.copy_(fp8_linear(xd, w, bd, path=p))
        graph.replay()
        torch.cuda.synchronize()
        if p.startswith("scaled_mm") or p in ("fp8_gemm", "gemv_w8a8"):
            xa = x.float().abs()
            sx = (xa.amax() if p == "scaled_mm_tensor" else xa.amax(1, keepdim=True)) / 448
            for got in (y, out):   # tensor cores (all but the GEMV): Hopper's FP8 accumulation
                w8a8_check(got.cpu(), x, w64, ref, sx, torch.bfloat16, f"{p} m={m} {layout}",
                           b, wgmma=p != "gemv_w8a8")
            continue
        if p == "dequantize":   # the weight rounded to bf16 first: 2^-9 relative more
            bound = gemm_bound(x, w64, ref, torch.bfloat16, b) + \
                2.0 ** -9 * (x.double().abs() @ w64.abs().t())
        else:
            bound = gemm_bound(x, w64, ref, torch.bfloat16, b)
        for got in (y, out):
            assert_within(got.cpu(), ref, bound, f"{p} m={m} {layout}")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("m", [1, 17, 300])
def test_gpu_blockwise_scaled_mm_against_float64(m):
    """torch's block-scaled scaled_mm (1 x 128 activations x 128 x 128 weights) within the
    W8A8 bound of float64 on the dequantized weight, eager and in a CUDA graph; fp8_path takes
    it for block weights past the GEMV's rows when the device probe found it and
    fusedist.ops.fp8_gemm's kernel does not run there (it takes them where it does)."""
    dev = torch.device("cuda")
    if not quant._device_facts(dev)[2]:
        why = quant.BLOCKWISE_PROBE.get(torch.cuda.current_device(), "")
        pytest.skip("torch's block-scaled scaled_mm does not run on this GPU / torch "
                    f"(capability {torch.cuda.get_device_capability()}, torch {torch.__version__})"
                    f": {why}")
    n, k = 4096 + 128, 2048 + 512
    w = quantize_fp8(torch.randn(n, k, generator=_gen(m)) * 0.02, "block").to(dev)
    w64 = deq64(w.to("cpu"))
    x = (torch.randn(m, k, generator=_gen(m + 1)) * 2).to(torch.bfloat16)
    b = torch.randn(n, generator=_gen(m + 2)).to(torch.bfloat16)
    ref = x.double() @ w64.t() + b.double()
    if m > quant.GEMV_MAX_M:
        assert quant.fp8_path(x.to(dev), w, b.to(dev)) == \
            ("fp8_gemm" if quant._device_facts(dev)[3] else "scaled_mm_block")
    xd, bd = x.to(dev), b.to(dev)
    y = fp8_linear(xd, w, bd, path="scaled_mm_block")
    out = torch.full_like(y, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(fp8_linear(xd, w, bd, path="scaled_mm_block"))
    graph.replay()
    torch.cuda.synchronize()
    sx = x.float().abs().view(m, -1, 128).amax(-1).repeat_interleave(128, 1) / 448
    for got in (y, out):
        w8a8_check(got.cpu(), x, w64, ref, sx, torch.bfloat16, f"scaled_mm_block m={m}", b,
                   wgmma=True)


def test_benchmark_shapes():
    """benchmarks/fp8_linear.py: the Llama-3-8B / 70B TP-1 projections as (name, K, N)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "fp8_linear.py"
    spec = importlib.util.spec_from_file_location("bench_fp8_linear", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    got = {name: (k, n) for name, k, n in mod.shapes()}
    assert got == {"8b/qkv": (4096, 6144), "8b/o": (4096, 4096), "8b/gate_up": (4096, 28672),
                   "8b/down": (14336, 4096), "70b/qkv": (8192, 10240), "70b/o": (8192, 8192),
                   "70b/gate_up": (8192, 57344), "70b/down": (28672, 8192)}
    assert all(quant.blockwise_shape_ok(n, k) for k, n in got.values())
    tp8 = {name: (k, n) for name, k, n in mod.shapes(("70b",), (8,))}   # one rank's share
    assert tp8 == {"70b/tp8/qkv": (8192, 1280), "70b/tp8/o": (1024, 8192),
                   "70b/tp8/gate_up": (8192, 7168), "70b/tp8/down": (3584, 8192)}
    with pytest.raises(ValueError, match="unknown model '13b'"):
        mod.shapes(("13b",))


# ---- a pre-quantized activation (e4m3 + per-token scales) ------------------------------------
def _prequantized(m: int, k: int, seed: int):
    """x_q, x_scale from fusedist.rmsnorm's FP8 output (the form the layer ops write), one row
    of zeros; and x_q * x_scale in float64 (the exact activation the GEMM multiplies)."""
    import fusedist

    x = (torch.randn(m, k, generator=_gen(seed)) * 3).to(torch.bfloat16)
    x[m // 2] = 0
    xq, sx = fusedist.rmsnorm(x, torch.ones(k, dtype=torch.bfloat16), 1e-5,
                              out_dtype=torch.float8_e4m3fn)
    return xq, sx, xq.double() * sx.double()[:, None]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prequantized_x_on_the_cpu(layout):
    """fp8_linear(x_q, w, x_scale=s) on the CPU: bf16, fp8_linear_reference on x_q * s in fp32
    rounded once (bitwise), within the GEMM bound of float64 on the dequantized operands; s as
    [M] or [M, 1], x as [B, M, K]; a bias; linear() passes x_scale through."""
    for i, (n, k) in enumerate([(7, 16), (200, 136), (129, 264)]):
        w = quantize_fp8(torch.randn(n, k, generator=_gen(10 + i)) * 0.05, layout)
        xq, sx, x64 = _prequantized(9, k, 20 + i)
        b = torch.randn(n, generator=_gen(30 + i)).to(torch.bfloat16)
        for bias in (None, b):
            y = fp8_linear(xq, w, bias, x_scale=sx)
            assert y.dtype == torch.bfloat16 and y.shape == (9, n)
            want = quant.fp8_linear_reference(xq.float() * sx[:, None], w, bias).to(torch.bfloat16)
            assert torch.equal(y, want)
            ref = x64 @ deq64(w).t() + (0 if bias is None else bias.double())
            assert_within(y, ref, gemm_bound(x64, deq64(w), ref, torch.bfloat16, bias),
                          f"{layout} {n}x{k}")
            assert bool((y[4] == (0 if bias is None else bias)).all())
            assert torch.equal(fp8_linear(xq, w, bias, x_scale=sx[:, None]), y)
            assert torch.equal(fp8_linear(xq.view(1, 9, k), w, bias, x_scale=sx.view(1, 9)),
                               y.view(1, 9, n))
            assert torch.equal(linear(xq, w, bias, x_scale=sx), y)
    y = fp8_linear(xq[:0], w, x_scale=sx[:0])
    assert y.shape == (0, w.shape[0]) and y.dtype == torch.bfloat16


def test_prequantized_x_nan_row_stays_in_its_row():
    """A token whose FP8 rows are NaN (the layer ops' NaN convention) gives a NaN output row;
    the other rows are untouched."""
    import fusedist

    x = torch.randn(4, 48).to(torch.bfloat16)
    x[2, 5] = float("nan")
    xq, sx = fusedist.rmsnorm(x, torch.ones(48, dtype=torch.bfloat16), 1e-5,
                              out_dtype=torch.float8_e4m3fn)
    w = quantize_fp8(torch.randn(40, 48), "channel")
    for path in ("reference", "dequantize"):
        y = fp8_linear(xq, w, x_scale=sx, path=path)
        assert bool(y[2].isnan().all()) and not bool(y[[0, 1, 3]].isnan().any())


def test_prequantized_x_errors():
    w = quantize_fp8(torch.randn(16, 32), "channel")
    xq, sx, _ = _prequantized(3, 32, 1)

    def bad(match, *a, **k):
        with pytest.raises(ValueError, match=match):
            fp8_linear(*a, **k)

    bad("x is e4m3; pass its per-token scales as x_scale=", xq, w)
    bad("x_scale goes with an e4m3 x", xq.float(), w, x_scale=sx)
    bad("x_scale must be float32 \\[3\\]", xq, w, x_scale=sx.double())
    bad("x_scale must be float32 \\[3\\]", xq, w, x_scale=sx[:2])
    bad("x_scale must be float32 \\[3\\]", xq, w, x_scale=torch.ones(()))
    bad("does not take a pre-quantized", xq, w, x_scale=sx, path="scaled_mm_tensor")
    bad("path 'gemv' with a pre-quantized x takes per-tensor or per-channel", xq,
        quantize_fp8(torch.randn(16, 32), "block"), x_scale=sx, path="gemv")
    y = fp8_linear(xq, w, x_scale=sx, path="gemv")     # the W8A8 GEMV (CPU: its reference)
    assert torch.equal(y, fp8_linear(xq, w, x_scale=sx, path="reference"))
    x = xq.float() * sx.reshape(-1, 1)     # a bf16 x: quantize_rows, then the same GEMV
    xb = x.to(torch.bfloat16)
    q2, s2 = quant.quantize_rows(xb)
    assert torch.equal(fp8_linear(xb, w, path="gemv_w8a8"),
                       fp8_linear(q2, w, x_scale=s2, path="gemv").to(torch.bfloat16))
    bad("not block scales", xq, quantize_fp8(torch.randn(16, 32), "block"), x_scale=sx,
        path="scaled_mm_rowwise")
    with pytest.raises(ValueError, match="needs an FP8Weight"):
        linear(xq.float(), torch.randn(16, 32), x_scale=sx)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_linear_takes_fp8_rows(layout):
    """linear(FP8Rows(x_q, s), w) is linear(x_q, w, x_scale=s), bitwise; the carrier with
    x_scale= too, or with a tensor weight, is refused."""
    w = quantize_fp8(torch.randn(40, 48, generator=_gen(11)) * 0.05, layout)
    b = torch.randn(40, generator=_gen(12)).to(torch.bfloat16)
    xq, sx, _ = _prequantized(6, 48, 13)
    for bias in (None, b):
        assert torch.equal(linear(FP8Rows(xq, sx), w, bias), linear(xq, w, bias, x_scale=sx))
    with pytest.raises(ValueError, match="FP8Rows, which carries its scales"):
        linear(FP8Rows(xq, sx), w, x_scale=sx)
    with pytest.raises(ValueError, match="needs an FP8Weight"):
        linear(FP8Rows(xq, sx), torch.randn(40, 48))


@pytest.mark.parametrize("args,want", [
    ((1, 4096, 4096, "channel", FP8, None, (9, 0), True), "scaled_mm_rowwise"),  # GEMV's rows
    ((17, 4096, 4096, "channel", FP8, None, (9, 0), True), "gemv"),     # the W8A8 GEMV
    ((32, 4096, 4096, "tensor", FP8, BF, (9, 0), True), "gemv"),
    ((33, 4096, 4096, "channel", FP8, None, (9, 0), True), "scaled_mm_rowwise"),
    ((17, 6144, 4096, "channel", FP8, None, (9, 0), True), "scaled_mm_rowwise"),
    ((17, 4096, 4096, "channel", FP8, None, (9, 0), False), "scaled_mm_rowwise"),  # no GEMV
    ((64, 4096, 4096, "tensor", FP8, BF, (9, 0), True), "scaled_mm_rowwise"),
    ((64, 4096, 4096, "block", FP8, None, (9, 0), True), "dequantize"),
    ((64, 4096, 4104, "channel", FP8, None, (9, 0), True), "dequantize"),   # K % 16
    ((64, 4104, 4096, "channel", FP8, None, (9, 0), True), "dequantize"),   # N % 16
    ((64, 4096, 4096, "tensor", FP8, None, (8, 9), True), "dequantize"),    # row-wise: sm_90
])
def test_choose_path_prequantized(args, want):
    assert choose_path(*args) == want


def test_choose_path_w8a8_gemv(monkeypatch, tmp_path):
    """The "fp8_linear" knobs w8a8_gemv_max_m / _n bound where the W8A8 GEMV is taken (a
    pre-quantized x as it is, a bf16 x after quantize_rows); w8a8_gemv_max_m = 0 turns it off.
    The knobs come from the tuning table (a FUSEDIST_TUNING_FILE section overrides them)."""
    from fusedist import tuning
    kn = dict(tuning.section_values({}, "fp8_linear"), w8a8_gemv_max_m=64, w8a8_gemv_max_n=8192)

    def path(m, *a):
        return quant.plan_shape(m, *a, knobs=kn).path
    ok = (8192, 4096, "channel", FP8, None, (9, 0), True)
    assert path(64, *ok) == "gemv" and path(17, *ok) == "gemv"
    assert path(65, *ok) == "scaled_mm_rowwise"
    assert path(64, 4096, 4096, "block", FP8, None, (9, 0), True) == "dequantize"
    bf = (8192, 4096, "channel", BF, None, (9, 0), True)
    assert path(17, *bf) == "gemv_w8a8" and path(64, *bf) == "gemv_w8a8"
    assert path(16, *bf) == "gemv" and path(65, *bf) == "scaled_mm_rowwise"
    kn["w8a8_gemv_max_m"] = 0
    assert path(17, *ok) == "scaled_mm_rowwise"
    assert path(17, *bf) == "scaled_mm_rowwise"
    # Through the table: a tuning file's section reaches the device plans.
    f = tmp_path / "t.json"
    f.write_text('{"fp8_linear": {"w8a8_gemv_max_m": 0}}')
    monkeypatch.setenv("FUSEDIST_TUNING_FILE", str(f))
    tuning.clear_cache()
    monkeypatch.setattr(quant, "_PLANS", {})
    try:
        monkeypatch.setitem(quant._DEVICE, 0, ((9, 0), True, False, False))
        ch = FP8Weight.empty(4096, 4096, "channel")
        monkeypatch.setattr(tuning, "gpu_table", lambda device=None: tuning._table_for_gpu(""))
        assert quant.takes_fp8_rows(32, ch, torch.device("cuda", 0))   # row-wise, not W8A8
        assert quant._device_plan(torch.device("cuda", 0), 32, 4096, 4096, "channel", BF,
                                  None).path == "scaled_mm_rowwise"
    finally:
        tuning.clear_cache()


def test_takes_fp8_rows(monkeypatch):
    """Where a producer's FP8 output pays: the bf16 x would go through row-wise _scaled_mm
    (device facts stood in for a CUDA device: sm_90 with the GEMV)."""
    monkeypatch.setitem(quant._DEVICE, 0, ((9, 0), True, False, False))
    dev = torch.device("cuda", 0)
    ch = FP8Weight.empty(4096, 4096, "channel")
    assert quant.takes_fp8_rows(17, ch, dev) and quant.takes_fp8_rows(300, ch, dev)
    assert not quant.takes_fp8_rows(16, ch, dev)                        # the GEMV: bf16 x
    assert not quant.takes_fp8_rows(300, FP8Weight.empty(4096, 4096, "block"), dev)
    assert not quant.takes_fp8_rows(300, ch, dev, torch.float16)
    assert not quant.takes_fp8_rows(300, ch, torch.device("cpu"))
    assert not quant.takes_fp8_rows(300, torch.empty(4096, 4096), dev)  # a bf16 weight
    monkeypatch.setitem(quant._DEVICE, 0, ((8, 9), True, False, False))
    assert not quant.takes_fp8_rows(300, ch, dev)


@pytest.mark.skipif(not _scaled_mm_on_cpu(), reason="this torch has no CPU torch._scaled_mm")
@pytest.mark.parametrize("layout", ["channel", "tensor"])
def test_prequantized_rowwise_is_the_same_gemm(layout):
    """Row-wise _scaled_mm on (x_q, s) as given is the GEMM the bf16 path runs after its own
    quantize_rows: the same bits for the same (x_q, s)."""
    w = quantize_fp8(torch.randn(48, 64, generator=_gen(3)) * 0.05, layout)
    x = torch.randn(9, 64, generator=_gen(4)).to(torch.bfloat16)
    xq, sx = quant.quantize_rows(x)
    y_pre = fp8_linear(xq, w, x_scale=sx, path="scaled_mm_rowwise")
    assert torch.equal(y_pre, fp8_linear(x, w, path="scaled_mm_rowwise"))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("m", [17, 300])
def test_gpu_block_weights_take_fp8_gemm(m):
    """Block weights past the GEMV's rows with K % 128 == 0 on Hopper: x quantized per token
    and 128 k by the quantize_rows kernel, fusedist.ops.fp8_gemm(block=True); within the W8A8
    bound taken with each row's amax (a group's scale is at most its row's), eager and
    replayed in a CUDA graph, and the quantized x the same bits as the CPU's."""
    dev = torch.device("cuda")
    n, k = 4096 + 136, 2048
    w = quantize_fp8(torch.randn(n, k, generator=_gen(m)) * 0.02, "block").to(dev)
    w64 = deq64(w.to("cpu"))
    x = (torch.randn(m, k, generator=_gen(m + 1)) *
         torch.logspace(-2, 1, m)[:, None]).to(torch.bfloat16)
    b = torch.randn(n, generator=_gen(m + 2)).to(torch.bfloat16)
    xd, bd = x.to(dev), b.to(dev)
    from conftest import require_kernel
    require_kernel("fp8_gemm")
    assert quant._device_facts(dev)[3], "the build has fp8_gemm but fusedist.nn.quant's " \
        "device probe does not take it"
    assert quant.fp8_path(xd, w, bd) == "fp8_gemm"
    qc, sc = quant.quantize_groups(x)
    qd, sd = quant.quantize_groups(xd)
    assert torch.equal(qd.cpu().view(torch.uint8), qc.view(torch.uint8))
    assert torch.equal(sd.cpu(), sc)
    y = fp8_linear(xd, w, bd)
    out = torch.full_like(y, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(fp8_linear(xd, w, bd))
    graph.replay()
    torch.cuda.synchronize()
    ref = x.double() @ w64.t() + b.double()
    sx = x.float().abs().amax(1, keepdim=True) / 448
    for got in (y, out):
        w8a8_check(got.cpu(), x, w64, ref, sx, torch.bfloat16, f"fp8_gemm block m={m}", b,
                   wgmma=True)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("m", [17, 300])
def test_gpu_prequantized_against_float64(layout, m):
    """The layer ops' FP8 output into fp8_linear on CUDA (row-wise _scaled_mm on it as it is;
    block scales: x_q * s and the weight dequantized to bf16): within the GEMM bound of
    float64 on the dequantized operands, eager and replayed in a CUDA graph."""
    import fusedist

    dev = torch.device("cuda")
    n, k = 4096 + 128, 2048 + 64
    w = quantize_fp8(torch.randn(n, k, generator=_gen(m)) * 0.02, layout).to(dev)
    w64 = deq64(w.to("cpu"))
    gu = (torch.randn(m, 2 * k, generator=_gen(m + 1)) * 2).to(torch.bfloat16).to(dev)
    xq, sx = fusedist.silu_mul(gu, out_dtype=FP8)
    x64 = xq.cpu().double() * sx.cpu().double()[:, None]
    b = torch.randn(n, generator=_gen(m + 2)).to(torch.bfloat16)
    ref = x64 @ w64.t() + b.double()
    bd = b.to(dev)   # before the capture: no host-to-device copy inside it
    path = quant.fp8_path(xq, w, bd)
    assert path == ("dequantize" if layout == "block" else "scaled_mm_rowwise")
    y = fp8_linear(xq, w, bd, x_scale=sx)
    out = torch.full_like(y, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(fp8_linear(xq, w, bd, x_scale=sx))
    graph.replay()
    torch.cuda.synchronize()
    bound = gemm_bound(x64, w64, ref, torch.bfloat16, b) + \
        2 * HALF_ULP[torch.bfloat16] * (ref.abs() + b.double().abs())
    if path == "dequantize":   # x_q * s and the weight rounded to bf16 first
        bound = bound + 2 * 2.0 ** -9 * (x64.abs() @ w64.abs().t())
    for got in (y, out):
        assert_within(got.cpu(), ref, bound, f"{path} m={m} {layout}")


def _fp8_attention(layout: str, dtype=torch.bfloat16, bias: bool = False, fp8: bool = True):
    """A TPAttention (4 heads / 2 kv heads of 64, hidden 192) with FP8 weights in `layout`
    (fp8=False: the same values dequantized, as `dtype` parameters)."""
    H, KV, D, hid = 4, 2, 64, 192
    g = _gen(7)
    full = [quantize_fp8(torch.randn(n, k, generator=g) * 0.2, layout) for n, k in
            ((H * D, hid), (KV * D, hid), (KV * D, hid), (hid, H * D))]
    b = [torch.randn(n, generator=g) * 0.1 for n in (H * D, KV * D, KV * D)] if bias else []
    attn = TPAttention(hid, H, KV, D, qkv_bias=bias, max_position=64, dtype=dtype,
                       fp8_layout=layout if fp8 else None)
    return attn.load_full(*(full if fp8 else [w.dequantize(dtype) for w in full]), *b)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bias", [False, True])
def test_tpattention_takes_fp8_rows(monkeypatch, layout, bias):
    """TPAttention(FP8Rows(x_q, s)) hands the carrier to its qkv GEMM as it is, and its output
    is the bf16 module's on x_q * s rounded to bf16, within that rounding (2^-9 of x, bf16
    attention)."""
    import fusedist
    import fusedist.nn.attention as attention
    from tolerances import GEMM_REL, gemm_rel_err

    attn = _fp8_attention(layout, bias=bias)
    x, pos, meta = _attention_inputs(attn, 5, 8)
    xq, sx = fusedist.rmsnorm(x.to(torch.bfloat16), torch.ones(192, dtype=torch.bfloat16), 1e-6,
                              out_dtype=FP8)
    seen = []
    real = attention.linear
    monkeypatch.setattr(attention, "linear", lambda a, *r, **k: seen.append(a) or real(a, *r, **k))
    rows = FP8Rows(xq, sx)
    got = attn(rows, pos, attn.make_cache(1, num_pages=16, page_size=16), 0, meta)
    assert seen[0] is rows and got.dtype == torch.bfloat16 and got.shape == (5, 192)
    x_bf = (xq.float() * sx[:, None]).to(torch.bfloat16)
    want = attn(x_bf, pos, attn.make_cache(1, num_pages=16, page_size=16), 0, meta)
    assert gemm_rel_err(got, want) <= GEMM_REL[torch.bfloat16]


def test_tpattention_fp8_rows_errors_and_decision(monkeypatch):
    """FP8Rows into a module without FP8 weights, or of another dtype than bf16: a ValueError
    naming the fix; takes_fp8_input(rows) is takes_fp8_rows on the qkv weight (with its bias),
    False on the CPU."""
    import fusedist.nn.attention as attention

    xq, sx, _ = _prequantized(3, 192, 14)
    for attn, match in ((_fp8_attention("channel", fp8=False), "FP8 weights only"),
                        (_fp8_attention("channel", dtype=torch.float32),
                         "dtype is torch.float32")):
        _, pos, meta = _attention_inputs(attn, 3, 8)
        with pytest.raises(ValueError, match=match):
            attn(FP8Rows(xq, sx), pos, attn.make_cache(1, num_pages=8, page_size=16), 0, meta)
    with pytest.raises(ValueError, match="x must be \\[tokens, 192\\]"):
        attn(FP8Rows(xq[:, :64], sx), pos, attn.make_cache(1, 8, 16), 0, meta)
    attn = _fp8_attention("tensor", bias=True)
    assert not attn.takes_fp8_input(300)                              # the CPU
    calls = []
    monkeypatch.setattr(attention, "takes_fp8_rows", lambda *a: calls.append(a) or True)
    assert attn.takes_fp8_input(300)
    assert calls == [(300, attn.qkv_weight, attn.cos_sin.device, torch.bfloat16,
                      attn.qkv_bias)]


def _fp8_mlp(h: int, inter: int, device, layout="channel"):
    import types

    from fusedist.models.llama.model import MLP

    mlp = MLP(types.SimpleNamespace(hidden_size=h, intermediate_size=inter), 1, torch.bfloat16,
              device, layout)
    g = [torch.randn(r, c, generator=_gen(i)) * 0.05
         for i, (r, c) in enumerate([(inter, h), (inter, h), (h, inter)])]
    mlp.load_shard(*[quantize_fp8(t, layout).to(device) for t in g])
    return mlp


def test_llama_mlp_fp8_handoff_on_the_cpu(monkeypatch):
    """The MLP's branch on the CPU, with the GPU's decisions stood in (kernel rows, row-wise
    _scaled_mm for down): silu_mul's FP8 output goes to down_proj as (q, scale), bitwise the
    chain spelled out; without the stand-in the bf16 chain runs."""
    import fusedist
    import fusedist.models.llama.model as model

    mlp = _fp8_mlp(64, 96, "cpu")
    x = torch.randn(20, 64, generator=_gen(5)).to(torch.bfloat16)
    gu = linear(x, mlp.gate_up)
    plain = mlp(x)                      # CPU: F.silu(g) * u, then down on bf16
    calls = []
    monkeypatch.setattr(model, "_kernel_rows", lambda t, width: True)
    monkeypatch.setattr(model, "takes_fp8_rows",
                        lambda m, w, device, dtype: calls.append((m, w, dtype)) or True)
    y = mlp(x)
    assert calls == [(20, mlp.down, torch.bfloat16)]
    xq, sx = fusedist.silu_mul(gu, out_dtype=FP8)
    assert torch.equal(y, fp8_linear(xq, mlp.down, x_scale=sx))
    # the activations rounded to e4m3 (2^-4 relative at most) against the weight-only chain
    assert (y.double() - plain.double()).norm() <= 2.0 ** -4 * plain.double().norm()
    monkeypatch.setattr(model, "takes_fp8_rows", lambda m, w, device, dtype: False)
    assert torch.equal(mlp(x), fp8_linear(fusedist.silu_mul(gu), mlp.down))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_gpu_llama_mlp_hands_silu_mul_fp8_to_down():
    """The Llama MLP with FP8 weights past 16 rows on sm_90+: down_proj's GEMM takes
    silu_mul's e4m3 rows + scales (the same bits as that chain spelled out), and the output
    stays within the e4m3 activation error of the bf16-activation chain."""
    import fusedist
    from tolerances import gemm_rel_err

    dev = torch.device("cuda")
    h, inter, m = 512, 1024, 64
    mlp = _fp8_mlp(h, inter, dev)
    x = torch.randn(m, h, generator=_gen(9)).to(torch.bfloat16).to(dev)
    if not quant.takes_fp8_rows(m, mlp.down, dev):
        pytest.skip("this GPU takes no row-wise _scaled_mm (sm_90+ needed)")
    y = mlp(x)
    gu = linear(x, mlp.gate_up)
    xq, sx = fusedist.silu_mul(gu, out_dtype=FP8)
    assert torch.equal(y, fp8_linear(xq, mlp.down, x_scale=sx))
    # the bf16 chain quantizes silu_mul's bf16-rounded values per token itself: both round
    # the activations to e4m3 (2^-4 relative at most), from values 2^-9 apart
    bf16_chain = fp8_linear(fusedist.silu_mul(gu), mlp.down)
    assert gemm_rel_err(y, bf16_chain) <= 2.0 ** -4
