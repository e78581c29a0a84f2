"""fusedist.comm.fp8's codec and its error model (one process: the collectives' arithmetic
replayed on p inputs, as tests/dist/worker_fp8_comm.py checks the ranks do): the relative
error against the bf16 result as a function of world size and block size, on Gaussian
inputs and on inputs with a few channels 100x larger."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from fusedist.comm import fp8

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "dist"))
from worker_fp8_comm import replay_all_reduce  # noqa: E402

N = 1 << 15
# Bounds of ||y - ref|| / ||ref|| (ref: the exact sum rounded to bf16), measured at p = 2..8
# and blocks 32..4096 with headroom (docs/scaling.md has the table): e4m3's 3 mantissa bits
# give ~2.4-2.7% per quantization of Gaussian data; two_shot quantizes twice.
BOUND = {("gaussian", "one_shot"): 2.8e-2, ("gaussian", "two_shot"): 4.0e-2,
         ("outlier", "one_shot"): 2.8e-2, ("outlier", "two_shot"): 4.0e-2}
# The error of the ordinary channels of outlier inputs, where one channel in 512 is 100x:
# blocks that hold an outlier quantize their other values at the same relative precision
# (e4m3 is a floating format: 100x is well inside its 2^17 range of normal values).
BOUND_ORDINARY = {"one_shot": 3.0e-2, "two_shot": 4.5e-2}


def inputs(p, kind, seed):
    g = torch.Generator().manual_seed(seed)
    xs = []
    for _ in range(p):
        x = torch.randn(N, generator=g)
        if kind == "outlier":
            x.view(-1, 4096)[:, ::512] *= 100
        xs.append(x.to(torch.bfloat16))
    return xs


def rel(y, ref, mask=None):
    d, r = y.double() - ref, ref
    if mask is not None:
        d, r = d[mask], r[mask]
    return float(d.norm() / r.norm())


@pytest.mark.parametrize("kind", ["gaussian", "outlier"])
@pytest.mark.parametrize("algo", fp8.ALGOS)
@pytest.mark.parametrize("block", [32, 128, 512, 4096])
@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_error_model(kind, algo, block, p):
    xs = inputs(p, kind, seed=1000 * p + block)
    ref = sum(x.double() for x in xs).to(torch.bfloat16).double()
    y = replay_all_reduce(xs, block, algo)
    assert torch.isfinite(y).all()
    assert rel(y, ref) <= BOUND[(kind, algo)], rel(y, ref)
    if kind == "outlier":
        ordinary = torch.ones(N, dtype=torch.bool)
        ordinary.view(-1, 4096)[:, ::512] = False
        assert rel(y, ref, ordinary) <= BOUND_ORDINARY[algo], rel(y, ref, ordinary)


def test_one_scale_per_tensor_loses_small_values_that_blocks_keep():
    """Why per-block scales: values 2^20 below the tensor's largest flush to zero with one
    scale, and keep their 3 mantissa bits with a scale per block."""
    x = torch.full((256,), 1e-4)
    x[0] = 2.0e2
    whole = fp8.dequantize(*fp8.quantize(x, 256), 256, 256)
    blocks = fp8.dequantize(*fp8.quantize(x, 32), 256, 32)
    assert float(whole[100]) == 0.0
    assert abs(float(blocks[100]) - 1e-4) <= 1e-4 * 2 ** -4


def test_codec_round_trip():
    g = torch.Generator().manual_seed(3)
    for n, block in ((1, 128), (127, 32), (1000, 100), (4099, 128)):
        x = torch.randn(n, generator=g) * torch.logspace(-3, 3, n)
        q, s = fp8.quantize(x, block)
        assert q.dtype == torch.uint8 and q.numel() == -(-n // block) * block
        assert s.dtype == torch.float32 and s.numel() == -(-n // block)
        y = fp8.dequantize(q, s, n, block)
        # round to nearest with 3 mantissa bits: at most 2^-4 relative, above the subnormals
        big = x.abs() >= s.repeat_interleave(block)[:n] * 2 ** -6
        assert bool(((y - x).abs() <= x.abs() * 2 ** -4 + 1e-30)[big].all())
        # the largest of each block is exact (it maps to 448)
        amax_idx = x.new_zeros(q.numel()).index_copy(0, torch.arange(n), x.abs()) \
            .view(-1, block).argmax(dim=1) + torch.arange(0, q.numel(), block)
        amax_idx = amax_idx[amax_idx < n]
        assert torch.allclose(y[amax_idx], x[amax_idx], rtol=1e-6, atol=0)
    zeros = fp8.dequantize(*fp8.quantize(torch.zeros(70), 32), 70, 32)
    assert torch.equal(zeros, torch.zeros(70))


def test_bad_block_size():
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        fp8.quantize(torch.ones(4), 0)


# ---- the CUDA codec kernels against the torch path (one GPU) ---------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,block", [(1, 128), (127, 32), (1000, 100), (4099, 128),
                                     (70001, 4096), (33, 1)])
def test_codec_kernels_are_the_torch_path_bitwise(dtype, n, block):
    from fusedist import _ext

    if not hasattr(_ext.load(), "fp8_encode"):
        pytest.fail("fusedist._C lacks fp8_encode: rebuild the extension")
    g = torch.Generator(device="cuda").manual_seed(n * 7 + block)
    x = (torch.randn(n, generator=g, device="cuda") *
         torch.logspace(-4, 4, n, device="cuda")).to(dtype)
    x[:: max(1, n // 5)] = 0.0
    q_k, s_k = fp8.quantize(x, block, use_kernel=True)
    q_t, s_t = fp8.quantize(x, block, use_kernel=False)
    assert torch.equal(s_k, s_t) and torch.equal(q_k, q_t)
    # decode_sum of 3 payloads in order, and of one (its values, signed zeros kept)
    ys = [(torch.randn(n, generator=g, device="cuda") * 3).to(dtype) for _ in range(3)]
    enc = [fp8.quantize(y, block, use_kernel=False) for y in ys]
    qs = torch.stack([e[0] for e in enc])
    ss = torch.stack([e[1] for e in enc])
    for rows in (3, 1):
        k = fp8.decode_sum(qs[:rows], ss[:rows], n, block, use_kernel=True)
        t = fp8.decode_sum(qs[:rows], ss[:rows], n, block, use_kernel=False)
        assert torch.equal(k.view(torch.int32), t.view(torch.int32))


@pytest.mark.gpu
def test_codec_kernel_nan_and_inf_follow_the_torch_path():
    x = torch.randn(300, device="cuda")
    x[5], x[200] = float("nan"), float("inf")
    q_k, s_k = fp8.quantize(x, 128, use_kernel=True)
    q_t, s_t = fp8.quantize(x, 128, use_kernel=False)
    assert torch.equal(s_k.isnan(), s_t.isnan()) and torch.equal(s_k[~s_k.isnan()],
                                                                  s_t[~s_t.isnan()])
    d_k = fp8.dequantize(q_k, s_k, 300, 128)
    d_t = fp8.dequantize(q_t, s_t, 300, 128)
    assert torch.equal(d_k.isnan(), d_t.isnan())
    assert torch.equal(d_k[~d_k.isnan()], d_t[~d_t.isnan()])
