"""fusedist.silu_mul against a float64 reference (silu(g) * u of the rounded inputs) and the
torch composite F.silu(g) * u; NaN-poisoned outputs, fresh inputs, odd shapes. CPU cases run
the reference path everywhere; the cuda cases (gpu marker) require the kernel."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tolerances import TOL, count_bad  # noqa: E402

import fusedist  # noqa: E402
from fusedist import _ext  # noqa: E402
from fusedist.ops.silu_mul import silu_mul_reference  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
TOKENS = (1, 3, 17, 64, 257)
INTER = (8, 136, 4096, 5120, 8200, 14336)


def _gen(device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(int(torch.randint(1 << 30, ())))
    return g


def _need_kernel(device):
    """On CUDA the kernel must run (a missing one would pass through the reference path)."""
    if device == "cuda":
        from conftest import require_kernel
        require_kernel("silu_mul")


def _gate_up(T, inter, dtype, device, gen, scale=3.0):
    return (torch.randn((T, 2 * inter), generator=gen, device=device) * scale).to(dtype)


def _ref64(gu):
    i = gu.shape[-1] // 2
    g, u = gu[..., :i].double(), gu[..., i:].double()
    return g / (1 + torch.exp(-g)) * u


def _bad(out, gu, dtype) -> int:
    return count_bad(out, _ref64(gu), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter", INTER)
def test_silu_mul_odd_shapes(device, dtype, inter):
    _need_kernel(device)
    gen = _gen(device)
    for T in TOKENS:
        gu = _gate_up(T, inter, dtype, device, gen)
        gu0 = gu.clone()
        out = torch.full((T, inter), float("nan"), dtype=dtype, device=device)
        y = fusedist.silu_mul(gu, out=out)
        assert y is out and torch.equal(gu, gu0), "gate_up was written"
        bad = _bad(out, gu, dtype)
        assert bad == 0, f"{bad} of {out.numel()} wrong at T={T}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_matches_torch_composite(device, dtype):
    """The model's torch code F.silu(g) * u (which rounds silu(g) first) agrees within the
    tolerance; very negative and very positive gates (exp overflow) give 0 and g * u."""
    _need_kernel(device)
    gen = _gen(device)
    gu = _gate_up(64, 4096, dtype, device, gen)
    gu[0, :8] = torch.tensor([-1e4, -100.0, -88.0, -20.0, 20.0, 88.0, 100.0, 0.0]).to(dtype)
    want = F.silu(gu[:, :4096]) * gu[:, 4096:]
    got = fusedist.silu_mul(gu)
    assert count_bad(got, want, dtype) == 0
    assert _bad(got, gu, dtype) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_silu_mul_layouts(device):
    """[B, S, 2I] inputs; gate_up with a row stride (a slice of a wider buffer) and off the
    16-byte grid (copied); a strided and an unaligned out (written through a copy)."""
    _need_kernel(device)
    gen = _gen(device)
    dt, T, i = torch.bfloat16, 17, 136
    gu = _gate_up(T, i, dt, device, gen)
    y = fusedist.silu_mul(gu.view(1, T, 2 * i))
    assert y.shape == (1, T, i) and _bad(y.view(T, i), gu, dt) == 0
    wide = torch.full((T, 2 * i + 8), float("nan"), dtype=dt, device=device)
    wide[:, :2 * i] = gu
    out_wide = torch.full((T, i + 8), float("nan"), dtype=dt, device=device)
    y = fusedist.silu_mul(wide[:, :2 * i], out=out_wide[:, :i])
    assert y.data_ptr() == out_wide.data_ptr() and _bad(y, gu, dt) == 0
    assert torch.isnan(out_wide[:, i:]).all(), "wrote outside out"
    flat = torch.zeros(T * 2 * i + 1, dtype=dt, device=device)
    odd = flat[1:].view(T, 2 * i)
    odd.copy_(gu)
    flat_o = torch.full((T * i + 1,), float("nan"), dtype=dt, device=device)
    y = fusedist.silu_mul(odd, out=flat_o[1:].view(T, i))
    assert _bad(y, gu, dt) == 0 and torch.isnan(flat_o[0])


@pytest.mark.parametrize("device", DEVICES)
def test_silu_mul_empty_batch(device):
    _need_kernel(device)
    for shape in ((0, 64), (2, 0, 32)):
        y = fusedist.silu_mul(torch.randn(shape, device=device).to(torch.bfloat16))
        assert y.shape == (*shape[:-1], shape[-1] // 2)


@pytest.mark.gpu
def test_silu_mul_more_rows_than_one_grid():
    """More rows than the grid's 65535 row blocks: each block walks several rows."""
    _need_kernel("cuda")
    gen = _gen("cuda")
    gu = _gate_up(65535 * 2 + 3, 8, torch.bfloat16, "cuda", gen)
    out = torch.full((gu.shape[0], 8), float("nan"), dtype=torch.bfloat16, device="cuda")
    assert _bad(fusedist.silu_mul(gu, out=out), gu, torch.bfloat16) == 0


def test_silu_mul_reference_rounds_once():
    gen = _gen("cpu")
    gu = _gate_up(7, 64, torch.bfloat16, "cpu", gen)
    want = (F.silu(gu[:, :64].float()) * gu[:, 64:].float()).to(torch.bfloat16)
    assert torch.equal(silu_mul_reference(gu), want)


def test_silu_mul_bad_inputs():
    bf = torch.bfloat16

    def bad(match, *a, **k):
        with pytest.raises(ValueError, match=match):
            fusedist.silu_mul(*a, **k)

    bad("multiple of 8", torch.randn(3, 24).to(bf))          # I = 12
    bad("multiple of 8", torch.randn(3, 7).to(bf))
    bad("multiple of 8", torch.randn(3, 0).to(bf))
    bad("float32, float16 or bfloat16", torch.randn(3, 32).double())
    bad("gate_up must be a tensor", torch.tensor(1.0))
    gu = torch.randn(3, 32).to(bf)
    bad("out must be", gu, out=torch.empty(3, 32, dtype=bf))
    bad("out must be", gu, out=torch.empty(3, 16))
    bad("out overlaps gate_up", gu, out=gu[:, :16])


# ------------------------------------------------------------------------------------------------
# torch.compile, torch.ops, CUDA graphs
# ------------------------------------------------------------------------------------------------

def _mlp_tail(gu):
    return fusedist.silu_mul(gu) * 2


@pytest.mark.parametrize("device,backend", [("cpu", "eager"), ("cpu", "aot_eager"),
                                            pytest.param("cuda", "inductor",
                                                         marks=pytest.mark.gpu)])
def test_silu_mul_under_torch_compile(device, backend):
    _need_kernel(device)
    torch._dynamo.reset()
    gu = _gate_up(9, 136, torch.bfloat16, device, _gen(device))
    got = torch.compile(_mlp_tail, fullgraph=True, backend=backend)(gu)
    assert torch.equal(got, _mlp_tail(gu))
    torch._dynamo.reset()


def test_silu_mul_registered():
    assert hasattr(torch.ops.fusedist, "silu_mul")
    gu = _gate_up(3, 16, torch.float32, "cpu", _gen("cpu"))
    out = torch.full((3, 16), float("nan"))
    torch.ops.fusedist.silu_mul(out, gu)
    assert _bad(out, gu, torch.float32) == 0


@pytest.mark.gpu
def test_silu_mul_cuda_graph():
    """One capture on static buffers; replays with new inputs equal eager calls bitwise."""
    _need_kernel("cuda")
    gen = _gen("cuda")
    dt = torch.bfloat16
    gu = _gate_up(64, 14336, dt, "cuda", gen)
    out = fusedist.silu_mul(gu)                      # warm-up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fusedist.silu_mul(gu, out=out)
    for _ in range(3):
        gu0 = _gate_up(64, 14336, dt, "cuda", gen)
        gu.copy_(gu0)
        out.fill_(float("nan"))
        g.replay()
        assert torch.equal(out, fusedist.silu_mul(gu0))
        assert _bad(out, gu0, dt) == 0


def test_launch_path_on_a_host_fake(monkeypatch):
    """The CUDA launch path on CPU tensors through a host stand-in for the kernel
    (tests/ops/_fake_layers.py): pointers, row strides in elements, and the copies around an
    unaligned gate_up and out."""
    from _fake_layers import install

    fake = install(monkeypatch, importlib.import_module("fusedist.ops.silu_mul"))
    gen = _gen("cpu")
    dt, T, i = torch.float16, 5, 136
    gu = _gate_up(T, i, dt, "cpu", gen)
    y = fusedist.silu_mul(gu.view(1, T, 2 * i))
    _, a = fake.calls[-1]
    assert (a["tokens"], a["inter"], a["in_stride"], a["out_stride"]) == (T, i, 2 * i, i)
    assert a["gate_up"] == gu.data_ptr() and _bad(y.view(T, i), gu, dt) == 0
    wide = torch.zeros(T, 2 * i + 8, dtype=dt)
    wide[:, :2 * i] = gu
    out_wide = torch.full((T, i + 8), float("nan"), dtype=dt)
    fusedist.silu_mul(wide[:, :2 * i], out=out_wide[:, :i])
    _, a = fake.calls[-1]
    assert (a["in_stride"], a["out_stride"]) == (2 * i + 8, i + 8)
    assert _bad(out_wide[:, :i], gu, dt) == 0 and torch.isnan(out_wide[:, i:]).all()
    flat = torch.zeros(T * 2 * i + 1, dtype=dt)
    odd = flat[1:].view(T, 2 * i)
    odd.copy_(gu)
    flat_o = torch.full((T * i + 1,), float("nan"), dtype=dt)
    out = flat_o[1:].view(T, i)
    assert fusedist.silu_mul(odd, out=out) is out
    _, a = fake.calls[-1]
    assert a["gate_up"] != odd.data_ptr() and a["out"] != out.data_ptr()
    assert _bad(out, gu, dt) == 0 and torch.isnan(flat_o[0])


# ------------------------------------------------------------------------------------------------
# FP8 output: e4m3 + one float32 scale per token (tests/ops/_fp8_rows.py states the checks)
# ------------------------------------------------------------------------------------------------

from _fp8_rows import (FP8, bitwise, check_against_reference, check_fp8_64,  # noqa: E402
                       fp8_rows_spelled_out)

needs_fp8 = pytest.mark.skipif(FP8 is None, reason="torch without float8_e4m3fn")


def _need_fp8_kernel(device):
    """On CUDA the kernel must run, with its FP8 output: a fusedist._C built before it fails."""
    _need_kernel(device)
    if device == "cuda" and not hasattr(_ext.load().SiluMulArgs(), "fp8_out"):
        pytest.fail("fusedist._C predates silu_mul's FP8 output: rebuild fusedist",
                    pytrace=False)


def _check_fp8(q, scale, gu, device, what):
    """(q, scale) against float64, and on CUDA within one e4m3 ulp of the reference semantics
    (bitwise on the CPU)."""
    check_fp8_64(q, scale, _ref64(gu), what)
    check_against_reference(q, scale, *silu_mul_reference(gu.cpu(), FP8), device, what)


@needs_fp8
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter", INTER)
def test_silu_mul_fp8_odd_shapes(device, dtype, inter):
    _need_fp8_kernel(device)
    gen = _gen(device)
    for T in TOKENS:
        gu = _gate_up(T, inter, dtype, device, gen)
        gu0 = gu.clone()
        q, scale = fusedist.silu_mul(gu, out_dtype=FP8)
        assert q.dtype == FP8 and q.shape == (T, inter) and q.device == gu.device
        assert scale.dtype == torch.float32 and scale.shape == (T,)
        assert torch.equal(gu, gu0), "gate_up was written"
        _check_fp8(q, scale, gu, device, f"T={T}")


@needs_fp8
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_silu_mul_fp8_special_rows(device, dtype):
    """A row of zeros (scale = 1e-12 / 448, q = 0); one NaN gate makes its whole row NaN (the
    scale too: the kernel's amax keeps NaN) and no other; values far above 448 and below the
    1e-12 floor; a gate|up product that overflows fp32 (inf): its scale is inf, that element
    NaN (inf / inf) and the row's others 0, as torch gives."""
    _need_fp8_kernel(device)
    gen = _gen(device)
    T, i = 7, 136
    gu = _gate_up(T, i, dtype, device, gen)
    gu[0] = 0
    gu[1, 5] = float("nan")                 # a gate
    gu[2, i + 3] = float("nan")             # an up
    gu[3, i:] *= 1e4                        # |y| up to ~1e5
    gu[4, i:] = (gu[4, i:].float() * 1e-15).to(dtype)    # |y| ~1e-14, under the floor
    q, scale = fusedist.silu_mul(gu, out_dtype=FP8)
    _check_fp8(q, scale, gu, device, "special")
    assert float(scale[0]) == float(torch.tensor(1e-12) / 448) and bool((q[0].float() == 0).all())
    for row in (1, 2):
        assert bool(q[row].float().isnan().all()) and bool(scale[row].isnan())
    assert not bool(q[[0, 3, 4, 5, 6]].float().isnan().any())
    assert float(scale[4]) == float(scale[0]) and float(q[4].float().abs().max()) < 448
    big = torch.zeros(2, 2 * i, dtype=dtype, device=device)
    big[:, :i] = 1.0
    big[0, 2], big[0, i + 2] = 1e38, 1e38   # silu(1e38) * 1e38 = inf in fp32
    big[0, i + 4] = 2.0
    q, scale = fusedist.silu_mul(big, out_dtype=FP8)
    assert float(scale[0]) == float("inf") and bool(q[0, 2].float().isnan())
    rest = torch.ones(i, dtype=torch.bool)
    rest[2] = False
    assert bool((q[0, rest].float() == 0).all())
    assert float(scale[1]) == float(torch.tensor(1e-12) / 448) and \
        bool((q[1].float() == 0).all())     # u = 0: a row of zeros
    # (NaN places, not NaN bytes, on CUDA: the CPU's inf / inf is a negative NaN, 0xff in e4m3)
    check_against_reference(q, scale, *silu_mul_reference(big.cpu(), FP8), device, "overflow")


@needs_fp8
def test_silu_mul_fp8_cpu_is_the_conventionbitwise():
    """The CPU path is the convention spelled out in torch ops on fp32 F.silu(g) * u (the same
    as fusedist.add_rmsnorm's and the fused all-reduce + RMSNorm's), bitwise."""
    gen = _gen("cpu")
    for dtype in DTYPES:
        gu = _gate_up(17, 136, dtype, "cpu", gen)
        q, scale = fusedist.silu_mul(gu.view(1, 17, 272), out_dtype=FP8)
        assert q.shape == (1, 17, 136) and scale.shape == (1, 17)
        y = F.silu(gu[:, :136].float()) * gu[:, 136:].float()
        q_sp, s_sp = fp8_rows_spelled_out(y)
        assert bitwise(q.view(17, 136), q_sp) and bitwise(scale.view(17), s_sp)
        assert torch.equal(fusedist.silu_mul(gu, out_dtype=dtype), fusedist.silu_mul(gu))


@needs_fp8
def test_silu_mul_fp8_bad_out_dtype_and_empty():
    gu = torch.randn(3, 32).to(torch.bfloat16)
    for od in (torch.float16, torch.float32, torch.int8):
        with pytest.raises(ValueError, match="out_dtype must be None, torch.bfloat16 "
                                             ".gate_up's dtype. or torch.float8_e4m3fn"):
            fusedist.silu_mul(gu, out_dtype=od)
    with pytest.raises(ValueError, match="pass out=None"):
        fusedist.silu_mul(gu, out=torch.empty(3, 16, dtype=FP8), out_dtype=FP8)
    q, scale = fusedist.silu_mul(torch.zeros(2, 0, 32), out_dtype=FP8)
    assert q.shape == (2, 0, 16) and q.dtype == FP8 and scale.shape == (2, 0)


def _mlp_tail_fp8(gu):
    q, s = fusedist.silu_mul(gu, out_dtype=FP8)
    return q.float() * s[:, None]


@needs_fp8
@pytest.mark.parametrize("device,backend", [("cpu", "eager"), ("cpu", "aot_eager"),
                                            pytest.param("cuda", "inductor",
                                                         marks=pytest.mark.gpu)])
def test_silu_mul_fp8_under_torch_compile(device, backend):
    _need_fp8_kernel(device)
    torch._dynamo.reset()
    gu = _gate_up(9, 136, torch.bfloat16, device, _gen(device))
    got = torch.compile(_mlp_tail_fp8, fullgraph=True, backend=backend)(gu)
    assert torch.equal(got, _mlp_tail_fp8(gu))
    q, s = torch.ops.fusedist.silu_mul_fp8(gu)
    assert torch.equal(q.float() * s[:, None], got)
    torch._dynamo.reset()


@needs_fp8
def test_launch_path_fp8_on_a_host_fake(monkeypatch):
    """The FP8 launch path through the host stand-in: fp8_out and the scale pointer, out a
    fresh e4m3 [T, I] with its row stride in e4m3 elements (I: not always whole 16-byte
    vectors), an unaligned gate_up copied first; bitwise the reference."""
    from _fake_layers import install

    fake = install(monkeypatch, importlib.import_module("fusedist.ops.silu_mul"))
    gen = _gen("cpu")
    for dt, T, i in ((torch.bfloat16, 5, 136), (torch.float32, 3, 8200)):
        gu = _gate_up(T, i, dt, "cpu", gen)
        q, scale = fusedist.silu_mul(gu.view(1, T, 2 * i), out_dtype=FP8)
        _, a = fake.calls[-1]
        assert a["fp8_out"] and a["scale"] == scale.data_ptr() and a["out"] == q.data_ptr()
        assert (a["tokens"], a["inter"], a["in_stride"], a["out_stride"]) == (T, i, 2 * i, i)
        _check_fp8(q.view(T, i), scale.view(T), gu, "cpu", "fake")
    flat = torch.zeros(T * 2 * i + 1, dtype=dt)
    odd = flat[1:].view(T, 2 * i)
    odd.copy_(gu)
    q, scale = fusedist.silu_mul(odd, out_dtype=FP8)
    assert fake.calls[-1][1]["gate_up"] != odd.data_ptr()
    _check_fp8(q, scale, gu, "cpu", "unaligned gate_up")
    fusedist.silu_mul(gu)
    assert not fake.calls[-1][1]["fp8_out"] and fake.calls[-1][1]["scale"] == 0


@needs_fp8
@pytest.mark.gpu
def test_silu_mul_fp8_cuda_graph_and_many_rows():
    """One capture of the FP8 output; replays with new inputs equal eager calls bitwise and
    the reference within one e4m3 ulp. Also more rows than the bf16 kernel's 65535 row
    blocks (the FP8 kernel: one block a row)."""
    _need_fp8_kernel("cuda")
    gen = _gen("cuda")
    dt = torch.bfloat16
    gu = _gate_up(64, 14336, dt, "cuda", gen)
    fusedist.silu_mul(gu, out_dtype=FP8)                 # warm-up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        q, scale = fusedist.silu_mul(gu, out_dtype=FP8)
    for _ in range(3):
        gu0 = _gate_up(64, 14336, dt, "cuda", gen)
        gu.copy_(gu0)
        q.view(torch.uint8).fill_(0x7F)
        scale.fill_(float("nan"))
        g.replay()
        qe, se = fusedist.silu_mul(gu0, out_dtype=FP8)
        assert bitwise(q, qe) and bitwise(scale, se)
        _check_fp8(q, scale, gu0, "cuda", "graph replay")
    many = _gate_up(65535 * 2 + 3, 8, dt, "cuda", gen)
    q, scale = fusedist.silu_mul(many, out_dtype=FP8)
    _check_fp8(q, scale, many, "cuda", "many rows")
