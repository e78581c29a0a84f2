"""fusedist.add_rmsnorm / fusedist.rmsnorm against float64 references: the new residual
against x + residual in float64 (and bitwise against torch's x + residual: the add happens in
the input dtype), normed against the float64 RMSNorm of that residual. Outputs are
NaN-poisoned, inputs fresh every run, shapes odd (T 1 ... 257, hidden 8 ... 8200). CPU cases
run the reference path everywhere; the cuda cases (gpu marker) require the kernel."""

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
from fusedist.ops.add_rmsnorm import (MAX_HIDDEN, MAX_VECTORS, _add_rmsnorm_impl,  # noqa: E402
                                      add_rmsnorm_reference)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
TOKENS = (1, 3, 17, 64, 257)
HIDDEN = (8, 136, 4096, 5120, 8200)
EPS = 1e-5


def _gen(device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(int(torch.randint(1 << 30, ())))
    return g


def _randn(shape, dtype, device, gen, scale=1.0, shift=0.0):
    return (torch.randn(shape, generator=gen, device=device) * scale + shift).to(dtype)


def _need_kernel(device):
    """On CUDA the kernel must run (a missing one would pass through the reference path)."""
    if device == "cuda":
        from conftest import require_kernel
        require_kernel("add_rmsnorm")


def _inputs(T, hidden, dtype, device, gen):
    x = _randn((T, hidden), dtype, device, gen)
    r = _randn((T, hidden), dtype, device, gen, scale=2.0)
    w = _randn((hidden,), dtype, device, gen, scale=0.5, shift=1.0)
    return x, r, w


def _rms64(h, w, eps=EPS):
    hd = h.double()
    return hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def _check(normed, h, x, r, w, dtype, what=""):
    """h (the new residual, or x) against float64 x + r, and bitwise against torch's add in
    dtype; normed against the float64 RMSNorm of h."""
    if r is not None:
        assert count_bad(h, x.double() + r.double(), dtype) == 0, f"residual wrong {what}"
        assert torch.equal(h, x + r), f"residual is not x + residual in {dtype} {what}"
    bad = count_bad(normed, _rms64(h, w), dtype)
    assert bad == 0, f"{bad} of {normed.numel()} normed elements wrong {what}"


# ------------------------------------------------------------------------------------------------
# values
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "plain"])
def test_add_rmsnorm_odd_shapes(device, dtype, hidden, with_residual):
    _need_kernel(device)
    gen = _gen(device)
    for T in TOKENS:
        x, r, w = _inputs(T, hidden, dtype, device, gen)
        x0, r0, w0 = x.clone(), r.clone(), w.clone()
        out = torch.full_like(x, float("nan"))
        res = r if with_residual else None
        normed, h = fusedist.add_rmsnorm(x, res, w, EPS, out=out)
        assert normed is out
        assert torch.equal(x, x0) and torch.equal(w, w0), "x or weight was written"
        if with_residual:
            assert h is r, "the new residual must be the residual argument, updated in place"
            _check(normed, h, x0, r0, w, dtype, f"T={T}")
        else:
            assert h is x
            _check(normed, x, x, None, w, dtype, f"T={T}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rmsnorm_matches_torch_composite(device, dtype):
    """The model's torch code: h = x + residual; F.rms_norm(h, weight)."""
    _need_kernel(device)
    gen = _gen(device)
    x, r, w = _inputs(64, 4096, dtype, device, gen)
    h_want = x + r
    want = F.rms_norm(h_want, (4096,), w, EPS)
    normed, h = fusedist.add_rmsnorm(x, r.clone(), w, EPS)
    assert torch.equal(h, h_want)
    assert count_bad(normed, want, dtype) == 0
    assert count_bad(fusedist.rmsnorm(x, w, EPS), F.rms_norm(x, (4096,), w, EPS), dtype) == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rmsnorm_widest_rows(device, dtype):
    """16384 and the widest row (MAX_HIDDEN: 8 vectors a thread, 512 threads)."""
    _need_kernel(device)
    gen = _gen(device)
    for hidden in sorted({16384, MAX_HIDDEN[dtype]}):
        x, r, w = _inputs(5, hidden, dtype, device, gen)
        x0, r0 = x.clone(), r.clone()
        normed, h = fusedist.add_rmsnorm(x, r, w, EPS, out=torch.full_like(x, float("nan")))
        _check(normed, h, x0, r0, w, dtype, f"hidden={hidden}")
        _check(fusedist.rmsnorm(x, w, EPS), x, x, None, w, dtype, f"plain hidden={hidden}")
    assert MAX_HIDDEN[dtype] * dtype.itemsize == MAX_VECTORS * 16


@pytest.mark.parametrize("device", DEVICES)
def test_add_rmsnorm_layouts(device):
    """[B, S, hidden] inputs; x with a row stride (a slice of a wider buffer); a residual and an
    out that are strided or not 16-byte aligned (written through a copy); out = x."""
    _need_kernel(device)
    gen = _gen(device)
    dt, T, n = torch.bfloat16, 17, 136
    x, r, w = _inputs(T, n, dt, device, gen)
    # 3-D
    normed, h = fusedist.add_rmsnorm(x.view(1, T, n), r.clone().view(1, T, n), w, EPS)
    assert normed.shape == (1, T, n) and h.shape == (1, T, n)
    _check(normed.view(T, n), h.view(T, n), x, r, w, dt, "3-D")
    # strided x and residual (row stride n + 8), a residual and out off the 16-byte grid
    wide_x = torch.full((T, n + 8), float("nan"), dtype=dt, device=device)
    wide_x[:, :n] = x
    wide_r = torch.full((T, n + 8), float("nan"), dtype=dt, device=device)
    wide_r[:, :n] = r
    flat = torch.full((T * n + 1,), float("nan"), dtype=dt, device=device)
    out_odd = flat[1:].view(T, n)                        # 2 bytes past an aligned start
    normed, h = fusedist.add_rmsnorm(wide_x[:, :n], wide_r[:, :n], w, EPS, out=out_odd)
    assert normed is out_odd and h.data_ptr() == wide_r.data_ptr()
    _check(normed, wide_r[:, :n], x, r, w, dt, "strided")
    assert torch.isnan(wide_r[:, n:]).all() and torch.isnan(flat[0]), "wrote outside the views"
    res_flat = torch.full((T * n + 1,), float("nan"), dtype=dt, device=device)
    res_odd = res_flat[1:].view(T, n)
    res_odd.copy_(r)
    normed, h = fusedist.add_rmsnorm(x, res_odd, w, EPS)
    assert h is res_odd
    _check(normed, res_odd, x, r, w, dt, "unaligned residual")
    # out = x: normed overwrites x (allowed with a residual)
    xx, rr = x.clone(), r.clone()
    normed, h = fusedist.add_rmsnorm(xx, rr, w, EPS, out=xx)
    assert normed is xx
    _check(xx, rr, x, r, w, dt, "out=x")


@pytest.mark.parametrize("device", DEVICES)
def test_add_rmsnorm_empty_batch(device):
    _need_kernel(device)
    for shape in ((0, 4096), (2, 0, 64)):
        x = torch.randn(shape, device=device).to(torch.bfloat16)
        r = torch.randn(shape, device=device).to(torch.bfloat16)
        w = torch.ones(shape[-1], device=device, dtype=torch.bfloat16)
        normed, h = fusedist.add_rmsnorm(x, r, w, EPS)
        assert normed.shape == shape and h is r
        assert fusedist.rmsnorm(x, w, EPS).shape == shape


def test_reference_is_the_torch_composite_on_cpu():
    """The CPU path is today's torch code: h = x + residual, then rmsnorm of h (bitwise h)."""
    gen = _gen("cpu")
    x, r, w = _inputs(7, 64, torch.bfloat16, "cpu", gen)
    normed, h = add_rmsnorm_reference(x, r, w, EPS)
    assert torch.equal(h, x + r)
    assert count_bad(normed, F.rms_norm(x + r, (64,), w, EPS), torch.bfloat16) == 0
    n2, h2 = add_rmsnorm_reference(x, None, w, EPS)
    assert h2 is x and count_bad(n2, _rms64(x, w), torch.bfloat16) == 0


# ------------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------------

def test_add_rmsnorm_bad_inputs():
    bf = torch.bfloat16
    x = torch.randn(3, 64).to(bf)
    r = torch.randn(3, 64).to(bf)
    w = torch.ones(64, dtype=bf)

    def bad(match, *a, **k):
        with pytest.raises(ValueError, match=match):
            fusedist.add_rmsnorm(*a, **k)

    bad("positive multiple of 8", torch.randn(3, 12).to(bf), None, torch.ones(12, dtype=bf))
    bad("positive multiple of 8", torch.randn(3, 0).to(bf), None, torch.ones(0, dtype=bf))
    wide = MAX_HIDDEN[torch.float32] + 8
    bad("exceeds", torch.randn(1, wide), None, torch.ones(wide))
    bad("float32, float16 or bfloat16", x.double(), None, w.double())
    bad("x must be a tensor", torch.tensor(1.0), None, w)
    bad("residual is", x, r.float(), w)
    bad("residual is", x, r[:2], w)
    bad("weight must be", x, r, w.float())
    bad("weight must be", x, r, torch.ones(32, dtype=bf))
    bad("eps must be", x, r, w, -1e-6)
    bad("eps must be", x, r, w, 1)
    bad("eps must be", x, r, w, float("nan"))
    bad("out must be", x, r, w, EPS, out=torch.empty(3, 32, dtype=bf))
    bad("out must be", x, r, w, EPS, out=torch.empty(3, 64))
    bad("out overlaps residual", x, r, w, EPS, out=r)
    bad("out may be x itself only when", x, None, w, EPS, out=x)
    big = torch.randn(4, 64).to(bf)
    bad("out overlaps x", big[:3], r, w, EPS, out=big[1:])
    bad("residual partially overlaps x", big[:3], big[1:], w)
    with pytest.raises(ValueError, match="positive multiple of 8"):
        fusedist.rmsnorm(torch.randn(2, 20), torch.ones(20))


# ------------------------------------------------------------------------------------------------
# torch.compile, torch.ops, CUDA graphs, the kernel's instantiations
# ------------------------------------------------------------------------------------------------

def _block(x, r, w):
    normed, h = fusedist.add_rmsnorm(x, r, w, EPS)
    return normed * 2, h + 1, fusedist.rmsnorm(h, w, EPS)


def _block_fp8(x, r, w):
    fp8 = torch.float8_e4m3fn
    q, h, s = fusedist.add_rmsnorm(x, r, w, EPS, out_dtype=fp8)
    q2, s2 = fusedist.rmsnorm(h, w, EPS, out_dtype=fp8)
    return q.float() * s[:, None], h + 1, q2.float() * s2[:, None]


@pytest.mark.parametrize("device,backend", [("cpu", "eager"), ("cpu", "aot_eager"),
                                            pytest.param("cuda", "inductor",
                                                         marks=pytest.mark.gpu)])
@pytest.mark.parametrize("fp8", [False, True], ids=["default", "fp8"])
def test_add_rmsnorm_under_torch_compile(device, backend, fp8):
    """fullgraph=True through torch.ops.fusedist.add_rmsnorm (and add_rmsnorm_fp8 for the FP8
    output): the eager results, and the residual updated in place as in eager."""
    if fp8 and not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("torch without float8_e4m3fn")
    (_need_fp8_kernel if fp8 else _need_kernel)(device)
    torch._dynamo.reset()
    gen = _gen(device)
    x, r, w = _inputs(9, 136, torch.bfloat16, device, gen)
    r_eager, r_compiled = r.clone(), r.clone()
    block = _block_fp8 if fp8 else _block
    want = block(x, r_eager, w)
    got = torch.compile(block, fullgraph=True, backend=backend)(x, r_compiled, w)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert torch.equal(r_compiled, r_eager) and not torch.equal(r_compiled, r)
    torch._dynamo.reset()


def test_add_rmsnorm_registered():
    assert hasattr(torch.ops.fusedist, "add_rmsnorm")
    gen = _gen("cpu")
    x, r, w = _inputs(3, 64, torch.float32, "cpu", gen)
    r0, out = r.clone(), torch.full_like(x, float("nan"))
    torch.ops.fusedist.add_rmsnorm(out, x, r, w, EPS)
    _check(out, r, x, r0, w, torch.float32)


@pytest.mark.gpu
def test_add_rmsnorm_cuda_graph():
    """One capture on static buffers; replays with new inputs equal eager calls bitwise."""
    _need_kernel("cuda")
    gen = _gen("cuda")
    dt = torch.bfloat16
    x, r, w = _inputs(64, 4096, dt, "cuda", gen)
    out = torch.empty_like(x)
    fusedist.add_rmsnorm(x, r.clone(), w, EPS, out=out)      # warm-up outside the capture
    plain = torch.empty_like(x)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fusedist.add_rmsnorm(x, r, w, EPS, out=out)
        fusedist.rmsnorm(x, w, EPS, out=plain)
    for _ in range(3):
        x0, r0, _ = _inputs(64, 4096, dt, "cuda", gen)
        x.copy_(x0)
        r.copy_(r0)
        out.fill_(float("nan"))
        plain.fill_(float("nan"))
        g.replay()
        want, h = fusedist.add_rmsnorm(x0, r0.clone(), w, EPS)
        assert torch.equal(out, want) and torch.equal(r, h)
        assert torch.equal(plain, fusedist.rmsnorm(x0, w, EPS))
        _check(out, r, x0, r0, w, dt, "graph replay")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rmsnorm_every_instantiation(dtype):
    """Each vectors-per-thread instantiation (the launcher's choice depends on hidden) on rows
    whose vectors do not fill the last warp, with and without a residual; a split too small
    for the row (more than 512 threads) is refused."""
    _need_kernel("cuda")
    gen = _gen("cuda")
    per = 16 // dtype.itemsize
    for hidden in (8 * 257, 8 * 513):
        hv = hidden // per
        x, r, w = _inputs(17, hidden, dtype, "cuda", gen)
        for vpt in (1, 2, 4, 8):
            out = torch.full_like(x, float("nan"))
            if -(-hv // vpt) > 512:
                with pytest.raises(ValueError, match="too few"):
                    _add_rmsnorm_impl(out, x, None, w, EPS, vectors_per_thread=vpt)
                continue
            for with_residual in (True, False):
                res = r.clone() if with_residual else None
                out.fill_(float("nan"))
                _add_rmsnorm_impl(out, x, res, w, EPS, vectors_per_thread=vpt)
                _check(out, x if res is None else res, x, r if with_residual else None, w,
                       dtype, f"hidden={hidden} vpt={vpt}")


@pytest.mark.gpu
def test_add_rmsnorm_extension_constant():
    _need_kernel("cuda")
    assert _ext.load().ADD_RMSNORM_MAX_VECTORS == MAX_VECTORS


def test_launch_path_on_a_host_fake(monkeypatch):
    """The CUDA launch path on CPU tensors through a host stand-in for the kernel
    (tests/ops/_fake_layers.py): pointers, row strides in elements, 3-D rows, and the copies
    around a strided x, an unaligned residual (written back in place) and an unaligned out."""
    from _fake_layers import install

    fake = install(monkeypatch, importlib.import_module("fusedist.ops.add_rmsnorm"))
    gen = _gen("cpu")
    dt, T, n = torch.bfloat16, 5, 136
    x, r, w = _inputs(T, n, dt, "cpu", gen)
    r0 = r.clone()
    normed, h = fusedist.add_rmsnorm(x.view(1, T, n), r.view(1, T, n), w, EPS)
    _check(normed.view(T, n), r, x, r0, w, dt, "3-D")
    kind, a = fake.calls[-1]
    assert (a["tokens"], a["hidden"], a["x_stride"], a["out_stride"]) == (T, n, n, n)
    assert a["residual"] == r.data_ptr() and a["x"] == x.data_ptr()
    # a row-strided x and residual go in as they are
    wide_x = torch.zeros(T, n + 8, dtype=dt)
    wide_x[:, :n] = x
    wide_r = torch.full((T, n + 8), float("nan"), dtype=dt)
    wide_r[:, :n] = r0
    normed, h = fusedist.add_rmsnorm(wide_x[:, :n], wide_r[:, :n], w, EPS)
    _, a = fake.calls[-1]
    assert a["x_stride"] == n + 8 and a["residual_stride"] == n + 8
    _check(normed, wide_r[:, :n], x, r0, w, dt, "strided")
    assert torch.isnan(wide_r[:, n:]).all()
    # x with an odd row stride (not whole vectors), an unaligned residual and out
    odd_x = torch.zeros(T, n + 1, dtype=dt)
    odd_x[:, :n] = x
    flat_r = torch.zeros(T * n + 1, dtype=dt)
    res = flat_r[1:].view(T, n)
    res.copy_(r0)
    flat_o = torch.full((T * n + 1,), float("nan"), dtype=dt)
    out = flat_o[1:].view(T, n)
    normed, h = fusedist.add_rmsnorm(odd_x[:, :n], res, w, EPS, out=out)
    assert normed is out and h is res
    _, a = fake.calls[-1]
    assert a["x_stride"] == n and a["residual"] != res.data_ptr() and a["out"] != out.data_ptr()
    _check(out, res, x, r0, w, dt, "copies")
    assert torch.isnan(flat_o[0])
    # plain RMSNorm: no residual pointer
    plain = fusedist.rmsnorm(x, w, EPS)
    assert fake.calls[-1][1]["residual"] == 0
    _check(plain, x, x, None, w, dt, "plain")


# ------------------------------------------------------------------------------------------------
# FP8 output: e4m3 + one float32 scale per token (tests/ops/_fp8_rows.py states the checks)
# ------------------------------------------------------------------------------------------------

from _fp8_rows import (FP8, check_against_reference, check_fp8_64,  # noqa: E402
                       fp8_rows_spelled_out)

from fusedist.ops.add_rmsnorm import rmsnorm_reference  # noqa: E402

needs_fp8 = pytest.mark.skipif(FP8 is None, reason="torch without float8_e4m3fn")


def _need_fp8_kernel(device):
    """On CUDA the kernel must run, with its FP8 outputs: a fusedist._C built before them
    fails."""
    _need_kernel(device)
    if device == "cuda" and not hasattr(_ext.load().AddRmsNormArgs(), "fp8_out"):
        pytest.fail("fusedist._C predates add_rmsnorm's FP8 output: rebuild fusedist",
                    pytrace=False)


def _fp8_ref(x, r, w, eps=EPS):
    """The reference semantics on the CPU: (q, h, scale) of add_rmsnorm_reference."""
    xc, rc = x.cpu(), None if r is None else r.cpu()
    return add_rmsnorm_reference(xc, rc, w.cpu(), eps, FP8)


def _check_fp8(q, h, scale, x, r, w, device, what):
    """h bitwise x + r (the residual stays in x's dtype); (q, scale) against float64, and on
    CUDA within one e4m3 ulp of the reference semantics (bitwise on the CPU)."""
    if r is not None:   # bitwise, NaN where x + r is NaN
        want = x + r
        assert torch.equal(h.isnan(), want.isnan()) and \
            torch.equal(h.nan_to_num(), want.nan_to_num()), f"residual is not x + residual {what}"
    check_fp8_64(q, scale, _rms64(h, w), what)
    q_ref, _, s_ref = _fp8_ref(x, r, w)
    check_against_reference(q, scale, q_ref, s_ref, device, what)


@needs_fp8
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "plain"])
def test_add_rmsnorm_fp8_odd_shapes(device, dtype, hidden, with_residual):
    _need_fp8_kernel(device)
    gen = _gen(device)
    for T in TOKENS:
        x, r, w = _inputs(T, hidden, dtype, device, gen)
        x0, r0, w0 = x.clone(), r.clone(), w.clone()
        res = r if with_residual else None
        q, h, scale = fusedist.add_rmsnorm(x, res, w, EPS, out_dtype=FP8)
        assert q.dtype == FP8 and q.shape == x.shape and scale.shape == (T,)
        assert scale.dtype == torch.float32 and q.device == x.device
        assert torch.equal(x, x0) and torch.equal(w, w0), "x or weight was written"
        assert h is (r if with_residual else x)
        _check_fp8(q, h, scale, x0, r0 if with_residual else None, w, device, f"T={T}")
        q2, s2 = fusedist.rmsnorm(x, w, EPS, out_dtype=FP8)
        _check_fp8(q2, x, s2, x, None, w, device, f"rmsnorm T={T}")


@needs_fp8
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_add_rmsnorm_fp8_special_rows(device, dtype):
    """A row of zeros (scale = 1e-12 / 448, q = 0), a row with a NaN (all NaN, the others
    untouched), normed values far above 448 (weight 1e4) and far below the 1e-12 floor
    (weight 1e-14: q = y / (1e-12 / 448), not 448), a row already on e4m3 values."""
    _need_fp8_kernel(device)
    gen = _gen(device)
    T, n = 6, 136
    x, r, w = _inputs(T, n, dtype, device, gen)
    r.zero_()
    x[0] = 0
    x[1, 7] = float("nan")
    x[3] = torch.tensor([448.0, -448.0, 1.0, 0.0] * (n // 4), dtype=dtype)
    for wscale in (1.0, 1e4, 1e-14):
        ws = (w * wscale).to(dtype)
        q, h, scale = fusedist.add_rmsnorm(x, r.clone(), ws, EPS, out_dtype=FP8)
        _check_fp8(q, h, scale, x, r, ws, device, f"weight x{wscale}")
        assert float(scale[0]) == float(torch.tensor(1e-12) / 448) and \
            bool((q[0].float() == 0).all())
        assert bool(q[1].float().isnan().all()) and bool(scale[1].isnan())
        assert not bool(q[[0, 2, 3, 4, 5]].float().isnan().any())
        if wscale == 1e-14:   # below the floor: the largest |q| stays under 448
            assert bool((q[2:].float().abs().amax(-1) < 448).all()) and \
                bool((scale[2:] == scale[0]).all())


@needs_fp8
def test_add_rmsnorm_fp8_cpu_is_the_convention_bitwise():
    """The CPU path is rmsnorm_reference(h, out_dtype=FP8) (the fused all-reduce + RMSNorm's
    epilogue) and the convention spelled out in torch ops, bitwise (q bytes and scales)."""
    gen = _gen("cpu")
    for dtype in DTYPES:
        x, r, w = _inputs(17, 136, dtype, "cpu", gen)
        q, h, scale = fusedist.add_rmsnorm(x.view(1, 17, 136), r.clone().view(1, 17, 136), w,
                                           EPS, out_dtype=FP8)
        assert q.shape == (1, 17, 136) and scale.shape == (1, 17)
        q_ref, s_ref = rmsnorm_reference(x + r, w, EPS, FP8)
        hf = (x + r).float()
        y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS) * w.float()
        q_sp, s_sp = fp8_rows_spelled_out(y)
        for qq, ss in ((q_ref, s_ref), (q_sp, s_sp)):
            assert torch.equal(q.view(17, 136).view(torch.uint8), qq.view(torch.uint8))
            assert torch.equal(scale.view(17), ss)
        # out_dtype = x's dtype is the default path
        n1, h1 = fusedist.add_rmsnorm(x, r.clone(), w, EPS, out_dtype=dtype)
        n0, h0 = fusedist.add_rmsnorm(x, r.clone(), w, EPS)
        assert torch.equal(n1, n0) and torch.equal(h1, h0)


@needs_fp8
def test_add_rmsnorm_fp8_bad_out_dtype():
    bf = torch.bfloat16
    x, r, w = torch.randn(3, 64).to(bf), torch.randn(3, 64).to(bf), torch.ones(64, dtype=bf)
    for od in (torch.float16, torch.float32, torch.int8, getattr(torch, "float8_e5m2", None)):
        if od is None:
            continue
        with pytest.raises(ValueError, match="out_dtype must be None, torch.bfloat16 .x's dtype. "
                                             "or torch.float8_e4m3fn"):
            fusedist.add_rmsnorm(x, r, w, EPS, out_dtype=od)
        with pytest.raises(ValueError, match="out_dtype must be"):
            fusedist.rmsnorm(x, w, EPS, out_dtype=od)
    with pytest.raises(ValueError, match="pass out=None"):
        fusedist.add_rmsnorm(x, r, w, EPS, out=torch.empty_like(x), out_dtype=FP8)
    with pytest.raises(ValueError, match="pass out=None"):
        fusedist.rmsnorm(x, w, EPS, out=torch.empty(3, 64, dtype=FP8), out_dtype=FP8)


@needs_fp8
def test_add_rmsnorm_fp8_empty_batch():
    x = torch.zeros(0, 64, dtype=torch.bfloat16)
    q, h, scale = fusedist.add_rmsnorm(x, x.clone(), torch.ones(64, dtype=torch.bfloat16),
                                       out_dtype=FP8)
    assert q.shape == (0, 64) and q.dtype == FP8 and scale.shape == (0,)


@needs_fp8
def test_add_rmsnorm_fp8_registered():
    gen = _gen("cpu")
    x, r, w = _inputs(3, 64, torch.float32, "cpu", gen)
    r0 = r.clone()
    q, scale = torch.ops.fusedist.add_rmsnorm_fp8(x, r, w, EPS)
    _check_fp8(q, r, scale, x, r0, w, "cpu", "torch.ops")


@needs_fp8
def test_launch_path_fp8_on_a_host_fake(monkeypatch):
    """The FP8 launch path through the host stand-in: fp8_out and the scale pointer set, out
    a fresh e4m3 [T, hidden] with its row stride in e4m3 elements (hidden: not always whole
    16-byte vectors), the residual copied around when unaligned; bitwise the reference."""
    from _fake_layers import install

    fake = install(monkeypatch, importlib.import_module("fusedist.ops.add_rmsnorm"))
    gen = _gen("cpu")
    for dt, T, n in ((torch.bfloat16, 5, 136), (torch.float32, 3, 8200)):
        x, r, w = _inputs(T, n, dt, "cpu", gen)
        r0 = r.clone()
        q, h, scale = fusedist.add_rmsnorm(x.view(1, T, n), r.view(1, T, n), w, EPS,
                                           out_dtype=FP8)
        _, a = fake.calls[-1]
        assert a["fp8_out"] and a["scale"] == scale.data_ptr() and a["out"] == q.data_ptr()
        assert (a["tokens"], a["hidden"], a["out_stride"], a["residual"]) == \
            (T, n, n, r.data_ptr())
        _check_fp8(q.view(T, n), r, scale.view(T), x, r0, w, "cpu", "fake")
    flat_r = torch.zeros(T * n + 1, dtype=dt)
    res = flat_r[1:].view(T, n)
    res.copy_(r0)
    q, h, scale = fusedist.add_rmsnorm(x, res, w, EPS, out_dtype=FP8)
    assert h is res and fake.calls[-1][1]["residual"] != res.data_ptr()
    _check_fp8(q, res, scale, x, r0, w, "cpu", "unaligned residual")
    q, scale = fusedist.rmsnorm(x, w, EPS, out_dtype=FP8)
    assert fake.calls[-1][1]["residual"] == 0 and fake.calls[-1][1]["fp8_out"]
    _check_fp8(q, x, scale, x, None, w, "cpu", "plain")
    # the default output leaves fp8_out off and scale 0
    fusedist.rmsnorm(x, w, EPS)
    assert not fake.calls[-1][1]["fp8_out"] and fake.calls[-1][1]["scale"] == 0


@needs_fp8
@pytest.mark.gpu
def test_add_rmsnorm_fp8_cuda_graph():
    """One capture of the FP8 outputs (add_rmsnorm and rmsnorm); replays with new inputs equal
    eager calls bitwise and the reference within one e4m3 ulp."""
    _need_fp8_kernel("cuda")
    gen = _gen("cuda")
    dt = torch.bfloat16
    x, r, w = _inputs(64, 4096, dt, "cuda", gen)
    fusedist.add_rmsnorm(x, r.clone(), w, EPS, out_dtype=FP8)    # warm-up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        q, _, scale = fusedist.add_rmsnorm(x, r, w, EPS, out_dtype=FP8)
        q2, s2 = fusedist.rmsnorm(x, w, EPS, out_dtype=FP8)
    for _ in range(3):
        x0, r0, _ = _inputs(64, 4096, dt, "cuda", gen)
        x.copy_(x0)
        r.copy_(r0)
        for t in (q, q2):
            t.view(torch.uint8).fill_(0x7F)   # NaN
        scale.fill_(float("nan"))
        s2.fill_(float("nan"))
        g.replay()
        qe, he, se = fusedist.add_rmsnorm(x0, r0.clone(), w, EPS, out_dtype=FP8)
        assert torch.equal(q.view(torch.uint8), qe.view(torch.uint8))
        assert torch.equal(scale, se) and torch.equal(r, he)
        qe2, se2 = fusedist.rmsnorm(x0, w, EPS, out_dtype=FP8)
        assert torch.equal(q2.view(torch.uint8), qe2.view(torch.uint8)) and torch.equal(s2, se2)
        _check_fp8(q, r, scale, x0, r0, w, "cuda", "graph replay")
        _check_fp8(q2, x0, s2, x0, None, w, "cuda", "graph replay, plain")


@needs_fp8
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rmsnorm_fp8_every_instantiation(dtype):
    """Each vectors-per-thread instantiation with the FP8 output, with and without a residual,
    on rows whose vectors do not fill the last warp, and the widest row."""
    _need_fp8_kernel("cuda")
    gen = _gen("cuda")
    per = 16 // dtype.itemsize
    for hidden in (8 * 257, 8 * 513, MAX_HIDDEN[dtype]):
        hv = hidden // per
        x, r, w = _inputs(17, hidden, dtype, "cuda", gen)
        for vpt in (1, 2, 4, 8):
            if -(-hv // vpt) > 512:
                continue
            for with_residual in (True, False):
                res = r.clone() if with_residual else None
                q = torch.empty(x.shape, dtype=FP8, device="cuda")
                q.view(torch.uint8).fill_(0x7F)
                scale = torch.full((17,), float("nan"), device="cuda")
                _add_rmsnorm_impl(q, x, res, w, EPS, vectors_per_thread=vpt, scale=scale)
                _check_fp8(q, x if res is None else res, scale, x,
                           r if with_residual else None, w, "cuda",
                           f"hidden={hidden} vpt={vpt} residual={with_residual}")
