"""fusedist.ops.gemv: the decode GEMV kernel (bf16 and float8_e4m3fn weights; per-tensor,
per-channel and 128 x 128 block scales) against a float64 reference of the dequantized
weights; NaN-poisoned outputs, fresh inputs, odd shapes, split strips forced, the e4m3 code
table, scales at e4m3's limits, NaN inputs, bitwise determinism, CUDA graphs. The CPU tier
checks the reference path and the argument errors (and the launcher's own checks where
fusedist._C is built); the gpu tier needs a Hopper GPU and the kernel."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tolerances import GEMM_REL, count_bad_gemm, gemm_err  # noqa: E402

import fusedist  # noqa: E402,F401
from fusedist import _ext  # noqa: E402

G = importlib.import_module("fusedist.ops.gemv")  # the module (fusedist.ops.gemv is the op)
gemv, gemv_reference = G.gemv, G.gemv_reference

FP8 = getattr(torch, "float8_e4m3fn", None)
BF = torch.bfloat16
MODES = ("none", "tensor", "channel", "block")
needs_fp8 = pytest.mark.skipif(FP8 is None, reason="this torch has no float8_e4m3fn")


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


HOPPER = [pytest.mark.gpu, pytest.mark.skipif(not _hopper(), reason="the gemv kernel needs a "
                                              "Hopper (sm_90) GPU")]


def hopper_gpu(fn):
    """The gpu tier, on a Hopper GPU (the kernel is built for sm_90a)."""
    for mark in reversed(HOPPER):
        fn = mark(fn)
    return fn


def _need_kernel():
    """On a Hopper GPU the kernel must run: a missing one would pass through the reference
    (tests/conftest.py's rule)."""
    from conftest import require_kernel
    require_kernel("gemv")
    assert G.kernel_available(torch.device("cuda")), \
        "the build has the gemv kernel but fusedist.ops.gemv does not take it"


def _gen(device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(int(torch.randint(1 << 30, ())))
    return g


def _randn(shape, gen, device, std=0.5) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=device) * std


def _blocks(n, k):
    return -(-n // 128), -(-k // 128)


def _expand(scale: torch.Tensor, mode: str, n: int, k: int) -> torch.Tensor:
    """scale as a float64 [n, k] multiplier."""
    s = scale.double()
    if mode == "tensor":
        return s.reshape(()).expand(n, k)
    if mode == "channel":
        return s.reshape(-1, 1).expand(n, k)
    if mode == "block":
        return s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return torch.ones(n, k, dtype=torch.float64, device=scale.device)


def _fp8_weight(n, k, mode, gen, device):
    """A [n, k] float8_e4m3fn weight quantized from a random fp32 one with `mode` scales (the
    amax of each group at 448), and the float32 scale (None for mode "none")."""
    w = _randn((n, k), gen, device)
    if mode == "none":
        return w.clamp(-448, 448).to(FP8), None
    if mode == "tensor":
        s = (w.abs().amax() / 448).clamp_min(1e-12).reshape(1)
    elif mode == "channel":
        s = (w.abs().amax(dim=1) / 448).clamp_min(1e-12)
    else:
        nb, kb = _blocks(n, k)
        pad = torch.zeros(nb * 128, kb * 128, device=device)
        pad[:n, :k] = w.abs()
        s = (pad.view(nb, 128, kb, 128).amax(dim=(1, 3)) / 448).clamp_min(1e-12)
    q = (w.double() / _expand(s, mode, n, k)).clamp(-448, 448).float().to(FP8)
    return q, s.float()


def _weight(n, k, wdt, mode, gen, device):
    if wdt == "bf16":
        return _randn((n, k), gen, device).to(BF), None
    return _fp8_weight(n, k, mode, gen, device)


def _ref64(x, w, scale, mode, bias=None):
    n, k = w.shape
    wd = w.double() if scale is None else w.double() * _expand(scale, mode, n, k)
    r = x.double() @ wd.t()
    return r + bias.double() if bias is not None else r


def _check(out, ref, what):
    err = gemm_err(out, ref)
    assert err < GEMM_REL[BF], f"{what}: error {err:.3g} (bad elements {count_bad_gemm(out, ref)})"


# ---- CPU tier: the reference path and the argument checks ---------------------------------
@pytest.mark.parametrize("wdt,mode", [("bf16", "none")] +
                         [pytest.param("fp8", m, marks=needs_fp8) for m in MODES])
@pytest.mark.parametrize("m,n,k", [(1, 1, 16), (3, 7, 64), (13, 129, 4112), (16, 300, 272),
                                   (40, 33, 144)])
def test_gemv_cpu_reference_matches_float64(wdt, mode, m, n, k):
    """CPU tensors: dequantized in fp32, fp32 matmul, rounded once; with bias and out=."""
    gen = _gen("cpu")
    x = _randn((m, k), gen, "cpu").to(BF)
    w, s = _weight(n, k, wdt, mode, gen, "cpu")
    b = _randn((n,), gen, "cpu").to(BF)
    for bias in (None, b):
        out = torch.full((m, n), float("nan"), dtype=BF)
        y = gemv(x, w, scale=s, bias=bias, out=out)
        assert y is out
        _check(y, _ref64(x, w, s, mode, bias), f"cpu {wdt} {mode} M={m} N={n} K={k}")
        exact = x.float() @ G.dequantize(w, s).t() + (bias.float() if bias is not None else 0)
        assert torch.equal(y, exact.to(BF))  # rounded once
        assert torch.equal(gemv(x, w, scale=s, bias=bias), y)


def test_gemv_rejects_bad_arguments():
    x, w = torch.zeros(4, 64, dtype=BF), torch.zeros(40, 64, dtype=BF)
    with pytest.raises(ValueError, match="x must be a 2-D"):
        gemv(x.float(), w)
    with pytest.raises(ValueError, match="x must be a 2-D"):
        gemv(x[0], w)
    with pytest.raises(ValueError, match=r"w must be \[N, K\] with K = x.shape\[1\] = 64"):
        gemv(x, torch.zeros(40, 72, dtype=BF))
    with pytest.raises(ValueError, match="w must be bfloat16 or float8_e4m3fn"):
        gemv(x, w.half())
    with pytest.raises(ValueError, match="K contiguous"):
        gemv(x, torch.zeros(64, 40, dtype=BF).t())
    with pytest.raises(ValueError, match="K = 12 must be a multiple of 8"):
        gemv(torch.zeros(4, 12, dtype=BF), torch.zeros(40, 12, dtype=BF))
    with pytest.raises(ValueError, match="scale is for float8_e4m3fn"):
        gemv(x, w, scale=torch.ones(40))
    with pytest.raises(ValueError, match=r"bias must be a \[40\]"):
        gemv(x, w, bias=torch.zeros(41, dtype=BF))
    with pytest.raises(ValueError, match=r"bias must be a \[40\]"):
        gemv(x, w, bias=torch.zeros(40))
    with pytest.raises(ValueError, match=r"out must be a contiguous \(4, 40\)"):
        gemv(x, w, out=torch.empty(4, 41, dtype=BF))
    with pytest.raises(ValueError, match=r"out must be a contiguous \(4, 40\)"):
        gemv(x, w, out=torch.empty(40, 4, dtype=BF).t())
    buf = torch.zeros(4 * 64, dtype=BF)
    with pytest.raises(ValueError, match="out overlaps x"):
        gemv(buf.view(4, 64), torch.zeros(40, 64, dtype=BF)[:16], out=buf[:64].view(4, 16))


@needs_fp8
def test_gemv_rejects_bad_scales():
    x, w8 = torch.zeros(4, 64, dtype=BF), torch.zeros(40, 64).to(FP8)
    with pytest.raises(ValueError, match="K = 24 must be a multiple of 16"):
        gemv(torch.zeros(4, 24, dtype=BF), torch.zeros(40, 24).to(FP8))
    with pytest.raises(ValueError, match="scale must be float32"):
        gemv(x, w8, scale=torch.ones(40, dtype=BF))
    with pytest.raises(ValueError, match=r"scale has shape \(39,\).*\[40\] or \[40, 1\].*\[1, 1\]"):
        gemv(x, w8, scale=torch.ones(39))
    with pytest.raises(TypeError, match="scale must be a float32 tensor"):
        gemv(x, w8, scale=2.0)
    for shape, mode in (((), "tensor"), ((1,), "tensor"), ((40,), "channel"),
                        ((40, 1), "channel"), ((1, 1), "block")):
        assert G.scale_mode(w8, torch.ones(shape)) == mode
    assert G.scale_mode(w8, None) == "none"
    assert G.scale_mode(torch.zeros(300, 520).to(FP8), torch.ones(3, 5)) == "block"


def test_gemv_empty_and_k_zero():
    x, w = torch.zeros(0, 64, dtype=BF), torch.zeros(40, 64, dtype=BF)
    assert gemv(x, w).shape == (0, 40)
    b = torch.arange(16.0).to(BF)
    y = gemv(torch.zeros(3, 0, dtype=BF), torch.zeros(16, 0, dtype=BF), bias=b)
    assert torch.equal(y, b.expand(3, 16))
    assert torch.equal(gemv(torch.zeros(3, 0, dtype=BF), torch.zeros(16, 0, dtype=BF)),
                       torch.zeros(3, 16, dtype=BF))


def test_gemv_launcher_checks_its_arguments():
    """The C++ launcher's checks (no CUDA call before them: they raise on any machine)."""
    from conftest import require_kernel
    require_kernel("gemv", "cpu")
    C = _ext.load()
    assert C.GEMV_MAX_M == G.MAX_M and C.GEMV_SCALE_BLOCK == G.SCALE_BLOCK
    assert C.GEMV_MAX_STAGES == G.MAX_STAGES
    assert dict(C.GEMV_SCALE_MODES) == {m: i for i, m in enumerate(G.SCALE_MODES)}

    def args(**kw):
        a = C.GemvArgs()
        a.x, a.w, a.out = 1 << 20, 2 << 20, 3 << 20
        a.m, a.n, a.k, a.ldx, a.ldw, a.ldo = 4, 40, 64, 64, 64, 40
        a.dtype, a.w_dtype = 2, 2
        for key, v in kw.items():
            setattr(a, key, v)
        return a
    cases = [(dict(m=17), "m \\(rows of x\\) must be in \\[1, 16\\]"),
             (dict(m=0), "m \\(rows of x\\)"),
             (dict(n=0), "n \\(rows of w\\)"),
             (dict(k=12, ldx=16, ldw=16), "k \\(columns of x and w\\) must be a multiple of 8"),
             (dict(w_dtype=3, k=24, ldx=24, ldw=32), "multiple of 16 for float8_e4m3fn"),
             (dict(dtype=1), "dtype \\(x, bias, out\\) must be bfloat16"),
             (dict(w_dtype=0), "w_dtype must be bfloat16 or float8_e4m3fn"),
             (dict(scale_mode=2, scale=4 << 20), "scales are for float8_e4m3fn weights"),
             (dict(scale_mode=7), "scale_mode must be"),
             (dict(x=(1 << 20) + 2), "x and w must be 16-byte aligned"),
             (dict(ldx=60), "ldx"),
             (dict(ldw=68), "ldw"),
             (dict(ldo=39), "ldo"),
             (dict(w_dtype=3, scale_mode=2), "scale must be a non-null"),
             (dict(w_dtype=3, scale_mode=3, scale=4 << 20, scale_ld=0), "scale_ld"),
             (dict(max_ctas=-1), "max_ctas"),
             (dict(stages=-2), "stages must be -1 \\(auto\\), 0"),
             (dict(stages=C.GEMV_MAX_STAGES + 1), "stages must be")]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            C.gemv(args(**kw), 0)


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=HOPPER)])
def test_gemv_under_torch_compile(dev):
    """gemv inside torch.compile(fullgraph=True) reaches torch.ops.fusedist.gemv and gives the
    eager result; out= is written and returned."""
    torch._dynamo.reset()
    gen = _gen(dev)
    x = _randn((5, 64), gen, dev).to(BF)
    w = _randn((40, 64), gen, dev).to(BF)
    b = _randn((40,), gen, dev).to(BF)

    def compiled(fn):
        return torch.compile(fn, fullgraph=True, backend="aot_eager")

    want = gemv(x, w, bias=b)
    assert torch.equal(compiled(lambda: gemv(x, w, bias=b))(), want)
    out = torch.full((5, 40), float("nan"), dtype=BF, device=dev)
    got = compiled(lambda o: gemv(x, w, bias=b, out=o))(out)
    assert torch.equal(out, want) and torch.equal(got, want)
    if FP8 is not None:
        w8, s = _fp8_weight(40, 64, "channel", gen, dev)
        want = gemv(x, w8, scale=s)
        assert torch.equal(compiled(lambda: gemv(x, w8, scale=s))(), want)
    torch._dynamo.reset()


# ---- GPU tier: the kernel -------------------------------------------------------------------
MS = (1, 2, 3, 7, 8, 9, 13, 16)
# (N, K): one output, a few, one past a 128-row block, many strips; K at the 16-byte minimum,
# one past 4096 (a partial unit and scale block), a whole number of units.
NK_BF16 = ((1, 16), (7, 64), (129, 4104), (1000, 1024), (4096, 520), (33, 8))
NK_FP8 = ((1, 16), (7, 64), (129, 4112), (1000, 1024), (4096, 528), (33, 16))


def _run_case(m, n, k, wdt, mode, gen, bias, launch_kw=None):
    x = _randn((m, k), gen, "cuda").to(BF)
    w, s = _weight(n, k, wdt, mode, gen, "cuda")
    b = _randn((n,), gen, "cuda").to(BF) if bias else None
    out = torch.full((m, n), float("nan"), dtype=BF, device="cuda")
    if launch_kw is None:
        y = gemv(x, w, scale=s, bias=b, out=out)
        assert y is out
    else:
        G.launch(out, x, w, s, b, **launch_kw)
    torch.cuda.synchronize()
    _check(out, _ref64(x, w, s, mode, b),
           f"{wdt} {mode} M={m} N={n} K={k} bias={bias} {launch_kw or ''}")
    return x, w, s, b, out


@hopper_gpu
@pytest.mark.parametrize("m", MS)
def test_gemv_bf16_matches_float64(m):
    _need_kernel()
    gen = _gen("cuda")
    for i, (n, k) in enumerate(NK_BF16):
        _run_case(m, n, k, "bf16", "none", gen, bias=(i + m) % 2 == 0)


@hopper_gpu
@needs_fp8
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("m", MS)
def test_gemv_fp8_matches_float64(m, mode):
    _need_kernel()
    gen = _gen("cuda")
    for i, (n, k) in enumerate(NK_FP8):
        _run_case(m, n, k, "fp8", mode, gen, bias=(i + m) % 2 == 1)


def _counters_zero():
    for ws in G._WORKSPACES.values():
        assert int(ws.counters.count_nonzero()) == 0, "a strip counter was left non-zero"


@hopper_gpu
@pytest.mark.parametrize("wdt,mode", [("bf16", "none"),
                                      pytest.param("fp8", "channel", marks=needs_fp8),
                                      pytest.param("fp8", "block", marks=needs_fp8)])
def test_gemv_split_strips_match_float64(wdt, mode):
    """Grids forced small and large: strips split across 1 .. 16 CTAs at uneven points (the
    partial sums and the last-CTA reduction), and whole strips; counters left at zero."""
    _need_kernel()
    gen = _gen("cuda")
    for m in (1, 5, 16):
        for n, k in ((40, 8192), (300, 2064), (4096, 1024)):
            x, w, s, b, _ = _run_case(m, n, k, wdt, mode, gen, bias=True)
            for cap in (1, 2, 3, 7, 64, 100000):
                p = G.plan(x, w, s, max_ctas=cap)
                assert 1 <= p.grid <= cap and p.ctas_per_sm >= 1
                out = torch.full((m, n), float("nan"), dtype=BF, device="cuda")
                G.launch(out, x, w, s, b, max_ctas=cap)
                torch.cuda.synchronize()
                _check(out, _ref64(x, w, s, mode, b), f"{wdt} {mode} M={m} N={n} K={k} "
                       f"max_ctas={cap} grid={p.grid}")
    _counters_zero()


@hopper_gpu
@pytest.mark.parametrize("wdt,mode", [("bf16", "none"),
                                      pytest.param("fp8", "channel", marks=needs_fp8),
                                      pytest.param("fp8", "block", marks=needs_fp8)])
def test_gemv_pipelines_agree_bitwise(wdt, mode):
    """The register pipeline (stages=0) and shared-memory rings of 1 .. MAX_STAGES units
    (deeper than a CTA's units, shallower, at ragged N and K) give the float64 result, and at
    one grid (max_ctas below every occupancy: the same split points) the same bits."""
    _need_kernel()
    gen = _gen("cuda")
    for m, n, k in ((1, 4096, 4096), (5, 300, 2064), (16, 129, 8200), (9, 1000, 14336)):
        kk = k - k % (16 if wdt == "fp8" else 8)
        x = _randn((m, kk), gen, "cuda").to(BF)
        w, s = _weight(n, kk, wdt, mode, gen, "cuda")
        ref = _ref64(x, w, s, mode)
        for cap in (3, 100):
            first = None
            for stages in (0, 1, 2, 3, G.MAX_STAGES, G.STAGES_AUTO):
                p = G.plan(x, w, s, max_ctas=cap, stages=stages)
                if stages != G.STAGES_AUTO:
                    assert (p.stages == 0) == (stages == 0) and p.stages <= stages, p
                out = torch.full((m, n), float("nan"), dtype=BF, device="cuda")
                G.launch(out, x, w, s, None, max_ctas=cap, stages=stages)
                torch.cuda.synchronize()
                what = f"{wdt} {mode} M={m} N={n} K={kk} max_ctas={cap} stages={stages}"
                _check(out, ref, what)
                if first is None:
                    first = out
                else:
                    assert torch.equal(out, first), what + ": bits differ from stages=0"
    _counters_zero()


@hopper_gpu
@needs_fp8
@pytest.mark.parametrize("m", (1, 16))
def test_gemv_fp8_every_code_exact(m):
    """Every finite e4m3 code (subnormals, +-0, +-448) is widened exactly: w row n holds code
    n at k = n % 16 and zeros elsewhere, x is all ones, so out[:, n] is that code's value
    (times a power-of-two scale), which bf16 holds exactly."""
    _need_kernel()
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes[codes == 0x7F] = 0
    codes[codes == 0xFF] = 0  # the NaN encodings are left out
    w = torch.zeros(256, 16, dtype=torch.uint8)
    w[torch.arange(256), torch.arange(256) % 16] = codes
    w8 = w.view(FP8).cuda()
    vals = codes.view(FP8).float().cuda()
    x = torch.ones(m, 16, dtype=BF, device="cuda")
    for s, mode in ((None, "none"), (torch.tensor([0.125]), "tensor"),
                    (torch.full((256,), 2.0 ** -10), "channel"),
                    (torch.tensor([[4.0, 1.0]]).T.contiguous(), "block")):
        s = None if s is None else s.cuda()
        assert G.scale_mode(w8, s) == mode
        want = (vals if s is None else vals * _expand(s, mode, 256, 16)[:, 0].float()).to(BF)
        y = gemv(x, w8, scale=s)
        assert torch.equal(y, want.expand(m, 256)), f"{mode}: codes " \
            f"{codes[(y[0] != want).cpu()].tolist()} differ"


@hopper_gpu
@needs_fp8
@pytest.mark.parametrize("mode", ("tensor", "channel", "block"))
def test_gemv_fp8_scales_at_the_limits(mode):
    """Weights at +-448 with scales of 448, 1, 1e-20 and 0 -- one value everywhere, and (per
    channel / per block) all four side by side: outputs match float64 (per channel: each
    scale's columns on their own), zero scales give exactly 0 (or the bias)."""
    _need_kernel()
    gen = _gen("cuda")
    m, n, k = 5, 520, 1040
    x = _randn((m, k), gen, "cuda").to(BF)
    wf = (_randn((n, k), gen, "cuda", std=200.0)).clamp(-448, 448)
    wf[:, :16], wf[:, 16:32] = 448.0, -448.0  # the largest finite values in every row
    w8 = wf.to(FP8)
    b = _randn((n,), gen, "cuda").to(BF)
    vals = [448.0, 1.0, 1e-20, 0.0]
    shape = {"tensor": (1,), "channel": (n,), "block": _blocks(n, k)}[mode]
    count = int(torch.Size(shape).numel())
    cycling = torch.tensor(vals, device="cuda")[torch.arange(count, device="cuda") % 4]
    scales = [torch.full(shape, v, device="cuda") for v in vals]
    if mode != "tensor":
        scales.append(cycling.view(shape).contiguous())
    for s in scales:
        for bias in (None, b):
            y = gemv(x, w8, scale=s, bias=bias)
            ref = _ref64(x, w8, s, mode, bias)
            what = f"{mode} scale {s.flatten()[:4].tolist()} bias={bias is not None}"
            assert torch.isfinite(y).all(), f"{what}: non-finite output"
            if bool((s == 0).all()):
                want = torch.zeros(m, n, dtype=BF, device="cuda") if bias is None \
                    else bias.expand(m, n)
                assert torch.equal(y, want), f"{what}: zero scale"
            elif mode == "channel" and s is scales[-1]:
                for v in vals:  # each scale's columns on their own
                    cols = s == v
                    if v == 0:
                        want = torch.zeros(m, int(cols.sum()), dtype=BF, device="cuda") \
                            if bias is None else bias[cols].expand(m, -1)
                        assert torch.equal(y[:, cols], want), f"{what}: zero-scale columns"
                    else:
                        _check(y[:, cols], ref[:, cols], f"{what}, columns of scale {v}")
            else:
                _check(y, ref, what)


@hopper_gpu
@pytest.mark.parametrize("wdt,mode", [("bf16", "none"),
                                      pytest.param("fp8", "channel", marks=needs_fp8),
                                      pytest.param("fp8", "block", marks=needs_fp8)])
@pytest.mark.parametrize("m", (3, 13))
def test_gemv_nan_input_stays_nan(wdt, mode, m):
    """A NaN in row 2 of x makes row 2 of out all NaN (also through split strips); the other
    rows are unaffected."""
    _need_kernel()
    gen = _gen("cuda")
    n, k = 600, 4096
    x = _randn((m, k), gen, "cuda").to(BF)
    x[2, 777] = float("nan")
    w, s = _weight(n, k, wdt, mode, gen, "cuda")
    for cap in (0, 5):
        out = torch.full((m, n), float("nan"), dtype=BF, device="cuda")
        out[2] = 0
        G.launch(out, x, w, s, None, max_ctas=cap)
        assert torch.isnan(out[2]).all(), "the NaN row has finite outputs"
        rest = [i for i in range(m) if i != 2]
        _check(out[rest], _ref64(x[rest], w, s, mode), f"{wdt} rows beside the NaN row")


@hopper_gpu
@pytest.mark.parametrize("wdt,mode", [("bf16", "none"),
                                      pytest.param("fp8", "tensor", marks=needs_fp8),
                                      pytest.param("fp8", "block", marks=needs_fp8)])
def test_gemv_bitwise_deterministic(wdt, mode):
    """The same call gives the same bits, run after run and between other calls (split strips
    are summed in CTA order, not in arrival order)."""
    _need_kernel()
    gen = _gen("cuda")
    for m, n, k in ((1, 4096, 4096), (16, 3072, 4096), (9, 1000, 14336)):
        x = _randn((m, k), gen, "cuda").to(BF)
        w, s = _weight(n, k, wdt, mode, gen, "cuda")
        first = gemv(x, w, scale=s)
        for i in range(20):
            if i % 5 == 0:  # another shape in between
                gemv(x[:, :512].contiguous(), w[:200, :512].contiguous(),
                     scale=None if s is None or mode != "tensor" else s)
            assert torch.equal(gemv(x, w, scale=s), first), f"{wdt} {mode} M={m}: run {i}"
    _counters_zero()


@hopper_gpu
def test_gemv_in_a_cuda_graph():
    """Captured calls (bf16 and fp8, split strips, one workspace shared by the graph) replay
    with new x and give the eager result bit for bit."""
    _need_kernel()
    gen = _gen("cuda")
    cases = [(1, 4096, 4096, "bf16", "none"), (16, 1000, 2048, "bf16", "none")]
    if FP8 is not None:
        cases += [(4, 3072, 4096, "fp8", "channel"), (13, 520, 1040, "fp8", "block")]
    xs, ws, outs = [], [], []
    for m, n, k, wdt, mode in cases:
        xs.append(_randn((m, k), gen, "cuda").to(BF))
        ws.append(_weight(n, k, wdt, mode, gen, "cuda"))
        outs.append(torch.empty(m, n, dtype=BF, device="cuda"))

    def step():
        for x, (w, s), o in zip(xs, ws, outs):
            gemv(x, w, scale=s, out=o)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for _ in range(3):
        for x in xs:
            x.copy_(_randn(tuple(x.shape), gen, "cuda").to(BF))
        for o in outs:
            o.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        for x, (w, s), o, (m, n, k, wdt, mode) in zip(xs, ws, outs, cases):
            assert torch.equal(o, gemv(x, w, scale=s)), f"graph {wdt} {mode} M={m}"
            _check(o, _ref64(x, w, s, mode), f"graph {wdt} {mode} M={m}")
    del g
    _counters_zero()


@hopper_gpu
def test_gemv_views_and_fallbacks():
    """x as the first rows of a larger buffer, x and out off 16-byte boundaries, w with a
    padded row stride; M > 16 takes the reference path; the launcher's workspace check."""
    _need_kernel()
    gen = _gen("cuda")
    n, k = 300, 1040
    w = _randn((n, k), gen, "cuda").to(BF)
    buf = _randn((64, k), gen, "cuda").to(BF)
    for m in (1, 6, 16):
        _check(gemv(buf[:m], w), _ref64(buf[:m], w, None, "none"), f"x = buf[:{m}]")
    x = _randn((5 * k + 1,), gen, "cuda").to(BF)[1:].view(5, k)  # 2 bytes off alignment
    out = torch.full((5 * n + 1,), float("nan"), dtype=BF, device="cuda")[1:].view(5, n)
    assert gemv(x, w, out=out) is out
    _check(out, _ref64(x, w, None, "none"), "misaligned x and out")
    wide = _randn((n, k + 64), gen, "cuda").to(BF)
    _check(gemv(buf[:3], wide[:, :k]), _ref64(buf[:3], wide[:, :k], None, "none"), "padded w")
    for m in (17, 64):
        _check(gemv(buf[:m], w), _ref64(buf[:m], w, None, "none"), f"M = {m} (reference)")
        if FP8 is not None:
            w8, s = _fp8_weight(n, k, "block", gen, "cuda")
            _check(gemv(buf[:m], w8, scale=s), _ref64(buf[:m], w8, s, "block"),
                   f"fp8 M = {m} (reference)")
    C = _ext.load()
    a = C.GemvArgs()
    a.x, a.w = buf.data_ptr(), w.data_ptr()
    o = torch.empty(4, n, dtype=BF, device="cuda")
    a.out, a.m, a.n, a.k, a.ldx, a.ldw, a.ldo = o.data_ptr(), 4, n, k, k, k, n
    a.dtype, a.w_dtype, a.max_ctas = 2, 2, 40
    assert C.gemv_plan(a).workspace_floats > 0
    with pytest.raises(ValueError, match="workspace must hold"):
        C.gemv(a, torch.cuda.current_stream().cuda_stream)


@hopper_gpu
def test_gemv_plan_fills_the_gpu():
    """One wave of resident CTAs at the Llama shapes; strips split only where N alone cannot
    fill the GPU."""
    _need_kernel()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.zeros(1, 4096, dtype=BF, device="cuda")
    for n in (4096, 6144, 28672):
        p = G.plan(x, torch.empty(n, 4096, dtype=BF, device="cuda"))
        assert p.grid == sms * p.ctas_per_sm, p
    print("gemv plan:", G.plan(x, torch.empty(4096, 4096, dtype=BF, device="cuda")))


def _bench():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gemv.py"
    spec = importlib.util.spec_from_file_location("bench_gemv", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_benchmark_plan():
    """benchmarks/gemv.py: the Llama-3-8B / 70B projections at TP 1 and 2 (16 shapes), the
    --quick subset, bytes counted as weights + scales."""
    b = _bench()
    shapes = b.shapes(quick=False)
    assert len(shapes) == 16 and len({(k, n) for _, k, n in shapes}) == 16
    for kn in ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (8192, 10240),
               (8192, 8192), (8192, 57344), (28672, 8192), (4096, 3072), (2048, 4096),
               (4096, 14336), (7168, 4096), (8192, 5120), (4096, 8192), (8192, 28672),
               (14336, 8192)):
        assert kn in {(k, n) for _, k, n in shapes}, kn
    quick = b.shapes(quick=True)
    assert 1 <= len(quick) <= 4 and set(quick) <= set(shapes)
    assert b.weight_bytes(4096, 4096, "bf16") == 2 * 4096 * 4096
    assert b.weight_bytes(4096, 4096, "fp8_tensor") == 4096 * 4096 + 4
    assert b.weight_bytes(4096, 4096, "fp8_channel") == 4096 * 4096 + 4 * 4096
    assert b.weight_bytes(4100, 4096, "fp8_block") == 4096 * 4100 + 4 * 33 * 32


# ---- W8A8: an e4m3 x with per-row scales (x_scale=), e4m3 weights -------------------------
# Bound, element by element, ref = float64 (xq sx) @ dequantize(w)^T (+ bias), mag the same
# product of magnitudes: |y - ref| <= 2^-8 |ref| (bf16 rounding) + (2^-13 + (K + 2) 2^-24) mag.
# The 2^-13 term is the FP8 MMA's own accumulation (Hopper keeps ~14 significant bits inside
# an FP8 tensor-core sum: tests/ops/test_fp8_gemm.py); the kernel adds each 128 k's sums into
# fp32 registers, so it never compounds past that. The reference path meets the fp32-only bound.
W8A8_MODES = ("none", "tensor", "channel")
W8A8_MS = (1, 17, 32, 33, 64)


def _x8(m, k, gen, device):
    """An e4m3 x quantized per row from a random one, and its float32 scales [m]."""
    xq, sx = importlib.import_module("fusedist.ops.quantize_rows").quantize_rows_reference(
        _randn((m, k), gen, device) * torch.logspace(-2, 2, m, device=device).reshape(-1, 1))
    return xq, sx.reshape(-1)


def _bad_w8a8(y, xq, sx, w, s, mode, bias=None, mma=True) -> int:
    n, k = w.shape
    xd = xq.double().cpu() * sx.double().cpu().reshape(-1, 1)
    wd = w.double().cpu() * (_expand(s, mode, n, k).cpu() if s is not None else 1.0)
    ref = xd @ wd.t()
    mag = xd.abs() @ wd.abs().t()
    if bias is not None:
        ref = ref + bias.double().cpu()
    tol = 2.0 ** -8 * ref.abs() + ((2.0 ** -13 if mma else 0.0) + (k + 2) * 2.0 ** -24) * mag
    return int((~((y.double().cpu() - ref).abs() <= tol)).sum())


@needs_fp8
@pytest.mark.parametrize("mode", W8A8_MODES)
@pytest.mark.parametrize("m,n,k", [(17, 7, 64), (64, 129, 4112), (65, 33, 16), (3, 300, 272)])
def test_gemv_w8a8_cpu_reference_matches_float64(mode, m, n, k):
    gen = _gen("cpu")
    xq, sx = _x8(m, k, gen, "cpu")
    w, s = _fp8_weight(n, k, mode, gen, "cpu")
    b = _randn((n,), gen, "cpu").to(BF)
    for bias in (None, b):
        out = torch.full((m, n), float("nan"), dtype=BF)
        y = gemv(xq, w, scale=s, bias=bias, out=out, x_scale=sx)
        assert y is out and y.dtype == BF
        assert _bad_w8a8(y, xq, sx, w, s, mode, bias, mma=False) == 0
        assert torch.equal(gemv(xq, w, scale=s, bias=bias, x_scale=sx.reshape(-1, 1)), y)


@needs_fp8
def test_gemv_w8a8_rejects_bad_arguments():
    gen = _gen("cpu")
    xq, sx = _x8(20, 64, gen, "cpu")
    w, s = _fp8_weight(32, 64, "channel", gen, "cpu")
    with pytest.raises(ValueError, match="x_scale= goes with an e4m3 x"):
        gemv(xq.float().to(BF), w, scale=s, x_scale=sx)
    with pytest.raises(ValueError, match=r"x_scale must be float32 \[20\]"):
        gemv(xq, w, scale=s, x_scale=sx[:19])
    with pytest.raises(ValueError, match="takes float8_e4m3fn weights"):
        gemv(xq, w.float().to(BF), x_scale=sx)
    wb, sb = _fp8_weight(32, 256, "block", gen, "cpu")
    xb, sxb = _x8(20, 256, gen, "cpu")
    with pytest.raises(ValueError, match="not block"):
        gemv(xb, wb, scale=sb, x_scale=sxb)
    with pytest.raises(ValueError, match="2-D .M, K. bfloat16 tensor .or e4m3 with x_scale="):
        gemv(xq, w, scale=s)


@hopper_gpu
@needs_fp8
@pytest.mark.parametrize("mode", W8A8_MODES)
@pytest.mark.parametrize("m", W8A8_MS)
def test_gemv_w8a8_matches_float64(m, mode):
    """The kernel at x rows padded to 32 and 64: odd N, K at the minimum and past a unit,
    poisoned outputs, bias on every other shape; forced split strips on one; M = 65 takes the
    reference path."""
    _need_kernel()
    gen = _gen("cuda")
    for i, (n, k) in enumerate(NK_FP8):
        xq, sx = _x8(m, k, gen, "cuda")
        w, s = _fp8_weight(n, k, mode, gen, "cuda")
        b = _randn((n,), gen, "cuda").to(BF) if (i + m) % 2 else None
        out = torch.full((m, n), float("nan"), dtype=BF, device="cuda")
        gemv(xq, w, scale=s, bias=b, out=out, x_scale=sx)
        assert _bad_w8a8(out, xq, sx, w, s, mode, b) == 0, f"M={m} N={n} K={k} {mode}"
        assert torch.equal(gemv(xq, w, scale=s, bias=b, x_scale=sx), out), "not reproducible"
        if i == 3:
            for cap in (3, 7):
                o2 = torch.full((m, n), float("nan"), dtype=BF, device="cuda")
                G.launch(o2, xq, w, s, b, max_ctas=cap, x_scale=sx)
                assert _bad_w8a8(o2, xq, sx, w, s, mode, b) == 0, f"max_ctas={cap}"
    xq, sx = _x8(65, 64, gen, "cuda")
    w, s = _fp8_weight(40, 64, mode, gen, "cuda")
    assert torch.equal(gemv(xq, w, scale=s, x_scale=sx), gemv_reference(xq, w, s, None, sx))
    _counters_zero()


@hopper_gpu
@needs_fp8
def test_gemv_w8a8_nan_row_graph_and_long_k():
    """A NaN in x row 2 poisons out row 2 only; a CUDA graph replays with new x bitwise equal
    to eager; K = 32768 of positive products stays within the bound (sums promoted to fp32)."""
    _need_kernel()
    gen = _gen("cuda")
    m, n, k = 40, 600, 4096
    xq, sx = _x8(m, k, gen, "cuda")
    xq[2, 777] = float("nan")
    w, s = _fp8_weight(n, k, "channel", gen, "cuda")
    out = gemv(xq, w, scale=s, x_scale=sx)
    assert torch.isnan(out[2]).all()
    rest = [i for i in range(m) if i != 2]
    assert _bad_w8a8(out[rest], xq[rest], sx[rest], w, s, "channel") == 0
    xq[2, 777] = 0
    o = torch.empty(m, n, dtype=BF, device="cuda")
    gemv(xq, w, scale=s, out=o, x_scale=sx)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gemv(xq, w, scale=s, out=o, x_scale=sx)
    for _ in range(2):
        x2, s2 = _x8(m, k, gen, "cuda")
        xq.copy_(x2)
        sx.copy_(s2)
        o.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(o, gemv(xq, w, scale=s, x_scale=sx))
        assert _bad_w8a8(o, xq, sx, w, s, "channel") == 0
    del g
    qrows = importlib.import_module("fusedist.ops.quantize_rows").quantize_rows_reference
    xq, sx = qrows(torch.rand(48, 32768, generator=gen, device="cuda") + 0.5)
    wq, sw = qrows(torch.rand(256, 32768, generator=gen, device="cuda") + 0.5)
    sw = sw.reshape(-1)
    y = gemv(xq, wq, scale=sw, x_scale=sx.reshape(-1))
    assert _bad_w8a8(y, xq, sx.reshape(-1), wq, sw, "channel") == 0
    _counters_zero()
