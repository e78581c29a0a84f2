"""fusedist.ops.fp8_gemm: the W8A8 GEMM (per-token x per-channel scales) against float64 on the
dequantized operands.

Error model, element by element, ref = float64 (xq sx) @ (wq sw)^T + bias, mag = sum_k |x_k w_k|:
  |y - ref| <= 2^-8 |ref|           y's bf16 rounding (half an ulp of 8 significant bits)
             + 2^-13 mag            Hopper's FP8 wgmma: products are added inside an instruction
                                    and into its accumulator keeping ~14 significant bits, not
                                    fp32's 24 (DeepSeek-V3 technical report, 2024); the kernel
                                    adds those partial sums into fp32 every 512 k, so each
                                    512-k interval errs by at most 2^-13 of its own mag
             + (K + 2) 2^-24 mag    the fp32 sums and the epilogue's two scale products.
On H200 (K = 16 and 256, random signs) the kernel's excess over the fp32-only bound stayed
within 2^-14 mag, and on every shape torch._scaled_mm also takes (K = 4096) the two gave the
same largest error; an fp32 GEMM on the same values never left the fp32-only bound. Without the
promotion, K = 32768 of positive products would drift by a few percent (the long-K test).
CPU tier: the reference path and every argument error; gpu tier: the CUTLASS kernel on Hopper,
odd M, N and K, long K, the scales at e4m3's limits, NaN, bias, strided out, a CUDA graph."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fusedist import _dtypes  # noqa: E402
from fusedist.nn.quant import quantize_rows  # noqa: E402
from fusedist.ops import fp8_gemm as F  # noqa: E402

FP8 = _dtypes.FP8
pytestmark = pytest.mark.skipif(FP8 is None, reason="torch without float8_e4m3fn")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _operands(m, n, k, seed, device="cpu", spread=1.0):
    g = _gen(seed)
    x = torch.randn(m, k, generator=g) * spread
    w = torch.randn(n, k, generator=g) * 0.02
    xq, sx = quantize_rows(x)
    wq, sw = quantize_rows(w)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    return [t.to(device) for t in (xq, sx, wq, sw, bias)]


def _f64(t):
    """t in float64 on its own device (e4m3 through float32: both widenings are exact). The
    float64 reference GEMMs run where the operands are: a 4096^3 pair takes ~10 s on the
    host's cores and milliseconds in the GPU's float64 units, with the same rounding model."""
    return t.float().double() if t.dtype == FP8 else t.double()


def _ref(xq, sx, wq, sw, bias=None):
    x = _f64(xq) * _f64(sx).reshape(-1, 1)
    w = _f64(wq) * _f64(sw).reshape(-1, 1)
    ref = x @ w.t()
    mag = x.abs() @ w.abs().t()
    if bias is not None:
        ref = ref + _f64(bias)
    return ref, mag


def _bad(y, xq, sx, wq, sw, bias=None, wgmma=True) -> int:
    """Elements of y outside the bound (module docstring); wgmma=False: the fp32-only bound
    (the reference path's fp32 matmul)."""
    ref, mag = _ref(xq, sx, wq, sw, bias)
    k = xq.shape[1]
    tol = 2.0 ** -8 * ref.abs() + ((2.0 ** -13 if wgmma else 0.0) + (k + 2) * 2.0 ** -24) * mag
    y = _f64(y.to(ref.device))
    return int((~((y - ref).abs() <= tol)).sum())   # NaN counts as bad


@pytest.mark.parametrize("m,n,k", [(1, 8, 16), (5, 24, 48), (33, 40, 160)])
def test_reference_path_against_float64(m, n, k):
    xq, sx, wq, sw, bias = _operands(m, n, k, m + n + k)
    for b in (None, bias):
        y = F.fp8_gemm(xq, sx, wq, sw, bias=b)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        assert _bad(y, xq, sx, wq, sw, b, wgmma=False) == 0


def test_bad_arguments_name_the_fix():
    xq, sx, wq, sw, bias = _operands(4, 16, 32, 3)
    with pytest.raises(TypeError, match="xq must be a 2-d float8_e4m3fn"):
        F.fp8_gemm(xq.float(), sx, wq, sw)
    with pytest.raises(ValueError, match="wq must be .N, K=32."):
        F.fp8_gemm(xq, sx, wq.t().contiguous(), sw)
    with pytest.raises(ValueError, match="sx must be float32 .4."):
        F.fp8_gemm(xq, sx[:3], wq, sw)
    with pytest.raises(ValueError, match="sw must be float32 .16."):
        F.fp8_gemm(xq, sx, wq, sw.double())
    with pytest.raises(ValueError, match="bias must be bfloat16 .16."):
        F.fp8_gemm(xq, sx, wq, sw, bias=bias.float())
    with pytest.raises(ValueError, match="out must be bfloat16 .4, 16."):
        F.fp8_gemm(xq, sx, wq, sw, out=torch.empty(4, 15, dtype=torch.bfloat16))
    assert F.kernel_why_not(xq, wq).startswith("tensors on cpu")


def test_binding_carries_every_argument_to_the_host_check():
    """The host-side check behind the kernel runs without a GPU: every field _args sets
    reaches it (a field missing from the binding fails here, not first on a GPU)."""
    from conftest import require_kernel
    from fusedist import _ext
    require_kernel("fp8_gemm", "cpu")
    xq, sx, wq, sw, bias = _operands(4, 128, 256, 7)
    for block in (False, True):
        a = F._args(xq, sx, wq, sw, bias, None, block=block)
        assert a.block == int(block) and (a.m, a.n, a.k) == (4, 128, 256)
    a.block = 2
    assert "block must be 0" in _ext.load().fp8_gemm_why_not(a)


def test_out_overlapping_an_input_is_refused():
    xq, sx, wq, sw, _ = _operands(4, 16, 32, 6)
    buf = torch.zeros(4 * 16 * 2, dtype=torch.uint8)            # out's bytes
    sx_alias = buf[:16].view(torch.float32).view(4, 1)          # sx in out's first 16 bytes
    sx_alias.copy_(sx)
    with pytest.raises(ValueError, match="out overlaps sx"):
        F.fp8_gemm(xq, sx_alias, wq, sw, out=buf.view(torch.bfloat16).view(4, 16))


def test_under_torch_compile():
    """fp8_gemm inside torch.compile(fullgraph=True) reaches torch.ops.fusedist.fp8_gemm and
    gives the eager result; out= is written and returned."""
    torch._dynamo.reset()
    xq, sx, wq, sw, bias = _operands(5, 24, 48, 8)
    want = F.fp8_gemm(xq, sx, wq, sw, bias=bias)
    run = torch.compile(lambda o: F.fp8_gemm(xq, sx, wq, sw, bias=bias, out=o), fullgraph=True,
                        backend="aot_eager")
    out = torch.full((5, 24), float("nan"), dtype=torch.bfloat16)
    assert torch.equal(run(out), want) and torch.equal(out, want)
    torch._dynamo.reset()


def test_empty_rows():
    xq, sx, wq, sw, _ = _operands(0, 16, 32, 4)
    assert F.fp8_gemm(xq, sx, wq, sw).shape == (0, 16)


# ---- the kernel (Hopper) -----------------------------------------------------------------
def _kernel(dev="cuda"):
    """The kernel must run on this GPU (tests/conftest.py's rule: a build without it fails),
    and take the plainest call."""
    from conftest import require_kernel
    require_kernel("fp8_gemm", dev)
    why = F.kernel_why_not(torch.empty(1, 16, dtype=FP8, device=dev),
                           torch.empty(8, 16, dtype=FP8, device=dev))
    assert not why, f"fp8_gemm's kernel refuses the plainest call: {why}"


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (17, 1000, 2064), (300, 6144, 4096),
                                   (4096, 4096, 4096), (129, 128, 14336), (5, 8, 16)])
def test_gpu_kernel_against_float64(m, n, k):
    _kernel()
    xq, sx, wq, sw, bias = _operands(m, n, k, m * 7 + n + k, "cuda")
    assert not F.kernel_why_not(xq, wq, None, sx, sw, bias)
    for b in (None, bias):
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        F.fp8_gemm(xq, sx, wq, sw, bias=b, out=out)
        assert _bad(out, xq, sx, wq, sw, b) == 0, f"bias={b is not None}"
        assert torch.equal(out, F.fp8_gemm(xq, sx, wq, sw, bias=b)), "not reproducible"


@pytest.mark.gpu
def test_gpu_long_k_all_positive_keeps_fp32_sums():
    """K = 32768 of positive products (|ref| = mag): a sum kept in wgmma's ~14-bit
    accumulator over all of K would lose a few percent to truncation as it grows (1024
    instructions, each addend ~2^-10 of the sum); the promoted sums stay within the 0.6% bound
    (2^-8 + 2^-13 + 32770 2^-24)."""
    _kernel()
    m, n, k = 64, 256, 32768
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.rand(m, k, generator=g, device="cuda") + 0.5
    w = torch.rand(n, k, generator=g, device="cuda") + 0.5
    xq, sx = quantize_rows(x)
    wq, sw = quantize_rows(w)
    assert _bad(F.fp8_gemm(xq, sx, wq, sw), xq, sx, wq, sw) == 0


@pytest.mark.gpu
def test_gpu_scale_limits_nan_and_strided_out():
    _kernel()
    m, n, k = 40, 136, 256
    xq, sx, wq, sw, bias = _operands(m, n, k, 11, "cuda")
    sx[0], sx[1] = 2.0 ** -20, 448.0          # tiny and large row scales
    sw[5] = 0.0                               # a zero channel
    xq[2, 7] = float("nan")                   # a NaN input poisons its row
    big = torch.full((m, n + 24), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = big[:, 8:8 + n]                     # row stride n + 24, 16-byte aligned
    F.fp8_gemm(xq, sx, wq, sw, bias=bias, out=out)
    assert out[2].isnan().all() and not out[[0, 1, 3]].isnan().any()
    keep = torch.ones(m, dtype=torch.bool)
    keep[2] = False
    assert _bad(out[keep], xq[keep], sx[keep], wq, sw, bias) == 0
    assert (out[keep.cuda(), 5] == bias[5]).all()           # 0 x a finite sum, plus the bias
    assert big[:, :8].isnan().all() and big[:, 8 + n:].isnan().all()   # nothing else written


@pytest.mark.gpu
def test_gpu_cuda_graph_and_fallback():
    _kernel()
    xq, sx, wq, sw, bias = _operands(77, 512, 1024, 13, "cuda")
    out = torch.full((77, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    g = torch.cuda.CUDAGraph()
    F.fp8_gemm(xq, sx, wq, sw, bias=bias, out=out)
    with torch.cuda.graph(g):
        F.fp8_gemm(xq, sx, wq, sw, bias=bias, out=out)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert _bad(out, xq, sx, wq, sw, bias) == 0
    # K not a multiple of 16: the reference path, same bound
    xq2, sx2, wq2, sw2, _ = _operands(9, 64, 40, 17, "cuda")
    assert "multiple of 16" in F.kernel_why_not(xq2, wq2)
    assert _bad(F.fp8_gemm(xq2, sx2, wq2, sw2), xq2, sx2, wq2, sw2, wgmma=False) == 0


# ---- the 128 x 128 block-scaled form (block=True) -----------------------------------------
def _groups(t: torch.Tensor, rows_per: int):
    """t [R, K] quantized per (rows_per rows x 128 k) block (partial last blocks included):
    (e4m3 [R, K], float32 scales [ceil(R / rows_per), ceil(K / 128)])."""
    r, k = t.shape
    rb, kb = -(-r // rows_per), -(-k // 128)
    pad = torch.zeros(rb * rows_per, kb * 128, dtype=torch.float32)
    pad[:r, :k] = t.float()
    amax = pad.abs().view(rb, rows_per, kb, 128).amax(dim=(1, 3))
    s = torch.where(amax == 0, torch.ones_like(amax), amax.clamp_min(1e-30) / 448.0)
    q = (t.float() / _dtypes.expand_block_scales(s, r, k, rows_per)).clamp(-448, 448).to(FP8)
    return q, s


def _operands_block(m, n, k, seed, device="cpu"):
    g = _gen(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m).reshape(-1, 1)
    w = torch.randn(n, k, generator=g) * 0.02
    xq, sx = _groups(x, 1)
    wq, sw = _groups(w, 128)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    return [t.to(device) for t in (xq, sx, wq, sw, bias)]


def _bad_block(y, xq, sx, wq, sw, bias=None, wgmma=True) -> int:
    """The module's bound on the block-dequantized operands (each 128-k block's sum is promoted
    to fp32 after its two scales multiply it: at most 2^-13 of its magnitude lost)."""
    (m, k), n = xq.shape, wq.shape[0]
    x = _f64(xq) * _dtypes.expand_block_scales(_f64(sx), m, k, 1)
    w = _f64(wq) * _dtypes.expand_block_scales(_f64(sw), n, k)
    ref, mag = x @ w.t(), x.abs() @ w.abs().t()
    if bias is not None:
        ref = ref + _f64(bias)
    tol = 2.0 ** -8 * ref.abs() + ((2.0 ** -13 if wgmma else 0.0) + (k + 2) * 2.0 ** -24) * mag
    return int((~((_f64(y.to(ref.device)) - ref).abs() <= tol)).sum())


@pytest.mark.parametrize("m,n,k", [(1, 8, 16), (5, 136, 272), (33, 256, 1024)])
def test_block_reference_path_against_float64(m, n, k):
    xq, sx, wq, sw, bias = _operands_block(m, n, k, m + n + k)
    for b in (None, bias):
        y = F.fp8_gemm(xq, sx, wq, sw, bias=b, block=True)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        assert _bad_block(y, xq, sx, wq, sw, b, wgmma=False) == 0


def test_block_bad_scales_name_the_fix():
    xq, sx, wq, sw, _ = _operands_block(4, 136, 272, 1)
    with pytest.raises(ValueError, match=r"sx must be float32 \[4, 3\] \(block=True"):
        F.fp8_gemm(xq, sx[:, :2], wq, sw, block=True)
    with pytest.raises(ValueError, match=r"sw must be float32 \[2, 3\]"):
        F.fp8_gemm(xq, sx, wq, sw.t().contiguous(), block=True)
    with pytest.raises(ValueError, match=r"sx must be float32 \[4\]"):
        F.fp8_gemm(xq, sx, wq, sw)                      # block scales without block=True


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (17, 1000, 2064), (300, 6144, 4096),
                                   (4096, 4096, 4096), (129, 128, 14336), (5, 136, 272)])
def test_gpu_block_against_float64(m, n, k):
    """The CUTLASS blockwise-scaling kernel: odd M, partial 128-blocks along N and K, bias,
    poisoned out, reproducible, in a CUDA graph."""
    _kernel()
    xq, sx, wq, sw, bias = _operands_block(m, n, k, m * 3 + n + k, "cuda")
    assert not F.kernel_why_not(xq, wq, None, sx, sw, bias, block=True)
    for b in (None, bias):
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        F.fp8_gemm(xq, sx, wq, sw, bias=b, out=out, block=True)
        assert _bad_block(out, xq, sx, wq, sw, b) == 0, f"bias={b is not None}"
        assert torch.equal(out, F.fp8_gemm(xq, sx, wq, sw, bias=b, block=True))
    g = torch.cuda.CUDAGraph()
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    with torch.cuda.graph(g):
        F.fp8_gemm(xq, sx, wq, sw, bias=bias, out=out, block=True)
    g.replay()
    torch.cuda.synchronize()
    assert _bad_block(out, xq, sx, wq, sw, bias) == 0
