"""fusedist.ops.moe permute / unpermute: tokens gathered into per-expert segments (optionally as
e4m3 with per-row or per-128-column scales) and the experts' rows summed back to token order.

CPU tier: the references against brute-force definitions: permute row by row (zeros in padding
rows; the FP8 forms bit for bit quantize_rows / quantize_groups of those rows), unpermute
against float64 (error model below) and bit for bit against a per-token float32 loop in the
documented order; every bad input; the torch.library ops (opcheck, torch.compile).

gpu tier: the kernels against the references on fresh random inputs and odd shapes, outputs
poisoned with NaN first: permute bitwise (its FP8 bits equal to fusedist.ops.quantize_rows /
quantize_groups on the reference rows, on the GPU and on the CPU), unpermute bitwise (the
reference's fp32 operations in its order, rounded once), bad layout entries (NaN rows, a
recorded MetadataError, nothing outside the tensors touched), CUDA graph replays with new
routings, torch.compile.

unpermute's error against float64 (u = 2^-24): the k products and k - 1 sums (plus the
residual's add) each round once in fp32, so |acc - exact| <= (2 k + 1) u sum_j |w_j y_j| (+ u
|residual|), then one rounding to the dtype: half an ulp of |ref| (2^-24, 2^-11, 2^-8), or half
the subnormal step below the dtype's normal range (float16: 2^-25).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fusedist  # noqa: E402,F401
from fusedist import _ext  # noqa: E402
from fusedist.errors import MetadataError  # noqa: E402
from fusedist.ops import device_errors  # noqa: E402
from fusedist.ops.moe import gating as G  # noqa: E402
from fusedist.ops.moe.gating import MoeLayout, RouterSpec, route_and_sort  # noqa: E402
from fusedist.ops.moe.permute import (permute, permute_reference, unpermute,  # noqa: E402
                                      unpermute_reference)

QR = importlib.import_module("fusedist.ops.quantize_rows")
P = importlib.import_module("fusedist.ops.moe.permute")   # the module (moe.permute: the function)
FP8 = getattr(torch, "float8_e4m3fn", None)
U = 2.0 ** -24
HALF_ULP = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
HALF_SUBNORMAL = {torch.float32: 2.0 ** -150, torch.float16: 2.0 ** -25,
                  torch.bfloat16: 2.0 ** -134}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
need_fp8 = pytest.mark.skipif(FP8 is None, reason="torch without float8_e4m3fn")


def _gen(device="cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(int(torch.randint(1 << 30, ())))
    return g


def _layout(T, E, k, align, device, gen, skew=False, rows=None):
    """A layout of a fresh routing (distinct experts per token, as route gives); skew: a
    quarter of the experts take every pair."""
    logits = torch.randn(T, E, generator=gen)
    if skew:
        logits[:, : max(k, E // 4)] += 20.0
    _, w, lay = route_and_sort(logits.to(device), RouterSpec(k, "softmax", True), align=align,
                               rows=rows)
    return lay, w


def _x(T, H, dtype, device, gen):
    x = torch.randn(T, H, generator=gen) * torch.logspace(-2, 2, T)[:, None]
    return x.to(dtype).to(device)


def brute_permute(x, lay: MoeLayout):
    out = torch.zeros(lay.rows, x.shape[1], dtype=x.dtype)
    for r, s in enumerate(lay.src_index.tolist()):
        if s >= 0:
            out[r] = x[s // lay.top_k].cpu()
    return out


def unpermute_loop32(y, lay: MoeLayout, w, residual=None):
    """Per token, in float32 tensors: acc = w0 y0, acc = acc + wj yj (each rounded), + residual,
    one rounding to y's dtype."""
    T, k = w.shape
    out = torch.empty(T, y.shape[1], dtype=y.dtype)
    dest = lay.dest_index.tolist()
    for t in range(T):
        acc = w[t, 0].float() * y[dest[t * k]].float()
        for j in range(1, k):
            acc = acc + w[t, j].float() * y[dest[t * k + j]].float()
        if residual is not None:
            acc = acc + residual[t].float()
        out[t] = acc.to(y.dtype)
    return out


def check_unpermute_64(out, y, lay, w, residual, what=""):
    T, k = w.shape
    g = y.double().cpu()[lay.dest_index.long().cpu()].view(T, k, -1)
    wd = w.double().cpu()[:, :, None]
    ref = (wd * g).sum(1) + (residual.double().cpu() if residual is not None else 0)
    mag = (wd * g).abs().sum(1) + (residual.double().cpu().abs() if residual is not None else 0)
    bound = (2 * k + 1) * U * mag + HALF_ULP[out.dtype] * ref.abs() + HALF_SUBNORMAL[out.dtype]
    err = (out.double().cpu() - ref).abs()
    bad = ~(err <= bound)
    assert not bool(bad.any()), f"{what}: {int(bad.sum())} elements off float64, worst " \
                                f"{float((err - bound).max()):.3g} over the bound"


def same_fp8(q, s, q_ref, s_ref, what=""):
    """Bitwise, NaN bytes only at the same places."""
    q, s, q_ref, s_ref = q.cpu(), s.cpu(), q_ref.cpu(), s_ref.cpu()
    assert q.dtype == FP8 and q.shape == q_ref.shape and s.shape == s_ref.shape, what
    qn, rn = q.float().isnan(), q_ref.float().isnan()
    assert torch.equal(qn, rn), f"NaN places differ {what}"
    nbad = int((q.view(torch.uint8) != q_ref.view(torch.uint8))[~qn].sum())
    assert nbad == 0, f"{nbad} e4m3 bytes differ {what}"
    sn = s.isnan()
    assert torch.equal(sn, s_ref.isnan()) and torch.equal(s[~sn], s_ref[~sn]), f"scales {what}"


# ---- CPU tier --------------------------------------------------------------------------------

@pytest.mark.parametrize("T,E,k,align,H", [(1, 8, 2, 1, 16), (3, 8, 1, 4, 24), (17, 60, 4, 8, 136),
                                           (64, 128, 8, 1, 256), (5, 16, 16, 128, 128)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_permute_reference_against_brute_force(T, E, k, align, H, dtype):
    gen = _gen()
    lay, _ = _layout(T, E, k, align, "cpu", gen, skew=T % 2 == 1)
    x = _x(T, H, dtype, "cpu", gen)
    xp = permute(x, lay)
    assert xp.shape == (lay.rows, H) and xp.dtype == dtype
    assert torch.equal(xp, brute_permute(x, lay))
    assert torch.equal(permute_reference(x, lay), xp)
    pad = lay.src_index < 0
    assert bool((xp[pad] == 0).all())


@need_fp8
@pytest.mark.parametrize("quant", ("token", "group"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_permute_reference_fp8_is_quantize_rows_of_the_rows(quant, dtype):
    gen = _gen()
    lay, _ = _layout(13, 16, 4, 8, "cpu", gen)
    x = _x(13, 384, dtype, "cpu", gen)
    x[2, 5] = float("nan")
    q, s = permute(x, lay, quant=quant)
    rows = brute_permute(x, lay)
    if quant == "token":
        q_ref, s_ref = QR.quantize_rows_reference(rows)
        s_ref = s_ref.squeeze(-1)
        assert s.shape == (lay.rows,)
    else:
        q_ref, s_ref = QR.quantize_groups_reference(rows)
        assert s.shape == (lay.rows, 3)
    same_fp8(q, s, q_ref, s_ref, quant)
    pad = lay.src_index < 0
    assert bool((s[pad] == 1).all()) and bool((q[pad].view(torch.uint8) == 0).all())


@pytest.mark.parametrize("k", (1, 2, 6, 8))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", (False, True))
def test_unpermute_reference_against_float64_and_loop(k, dtype, residual):
    gen = _gen()
    T, E, H = 11, 16, 40
    lay, w = _layout(T, E, k, 4, "cpu", gen)
    y = _x(lay.rows, H, dtype, "cpu", gen)
    r = _x(T, H, dtype, "cpu", gen) if residual else None
    out = unpermute(y, lay, w, residual=r)
    assert out.shape == (T, H) and out.dtype == dtype
    check_unpermute_64(out, y, lay, w, r, f"k={k} {dtype}")
    assert torch.equal(out, unpermute_loop32(y, lay, w, r))
    buf = torch.full((T, H), float("nan"), dtype=dtype)
    assert unpermute(y, lay, w, residual=r, out=buf) is buf and torch.equal(buf, out)
    if residual:   # out over the residual (in place)
        r2 = r.clone()
        unpermute(y, lay, w, residual=r2, out=r2)
        assert torch.equal(r2, out)


def test_unpermute_never_reads_padding_rows():
    gen = _gen()
    lay, w = _layout(9, 8, 2, 16, "cpu", gen)
    y = _x(lay.rows, 32, torch.float32, "cpu", gen)
    y[lay.src_index < 0] = float("nan")
    assert bool(torch.isfinite(unpermute(y, lay, w)).all())


def _bad_cases():
    gen = _gen()
    lay, w = _layout(4, 8, 2, 1, "cpu", gen)
    x = torch.randn(4, 16)
    y = torch.randn(lay.rows, 16)
    return [
        (lambda: permute(x, "layout"), TypeError, "layout must be a fusedist.ops.moe.MoeLayout"),
        (lambda: permute(x.long(), lay), ValueError, "x must be a 2-D"),
        (lambda: permute(x[0], lay), ValueError, "x must be a 2-D"),
        (lambda: permute(x[:3], lay), ValueError, "x has 3 tokens, the layout 4"),
        (lambda: permute(x, lay, quant="tensor"), ValueError, "quant must be one of"),
        (lambda: permute(torch.randn(4, 136), lay, quant="group"), ValueError,
         "quant='group' takes hidden a multiple of 128, got 136"),
        (lambda: unpermute(y, "layout", w), TypeError, "layout must be"),
        (lambda: unpermute(y.long(), lay, w), ValueError, "y_perm must be a 2-D"),
        (lambda: unpermute(y[1:], lay, w), ValueError, f"y_perm has {lay.rows - 1} rows"),
        (lambda: unpermute(y, lay, w.double()), ValueError, "weights must be float32 \\[4, 2\\]"),
        (lambda: unpermute(y, lay, w[:, :1]), ValueError, "weights must be float32"),
        (lambda: unpermute(y, lay, w, residual=torch.randn(4, 15)), ValueError,
         "residual must be torch.float32 \\[4, 16\\]"),
        (lambda: unpermute(y, lay, w, residual=torch.randn(4, 16).half()), ValueError,
         "residual must be"),
        (lambda: unpermute(y, lay, w, out=torch.empty(3, 16)), ValueError, "out must be"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_input(case):
    fn, exc, match = _bad_cases()[case]
    with pytest.raises(exc, match=match):
        fn()


@need_fp8
def test_ops_registered_and_opcheck():
    gen = _gen()
    lay, w = _layout(6, 8, 2, 4, "cpu", gen)
    x = _x(6, 128, torch.bfloat16, "cpu", gen)
    y = _x(lay.rows, 128, torch.bfloat16, "cpu", gen)
    r = _x(6, 128, torch.bfloat16, "cpu", gen)
    torch.library.opcheck(torch.ops.fusedist.moe_permute.default, (x, lay.src_index, 2))
    for group in (False, True):
        torch.library.opcheck(torch.ops.fusedist.moe_permute_fp8.default,
                              (x, lay.src_index, 2, group))
    for res in (None, r):
        torch.library.opcheck(torch.ops.fusedist.moe_unpermute.default,
                              (y, lay.dest_index, w, res))


def _layer(x, logits, r):
    spec = RouterSpec(2, "softmax", True)
    ids, w, lay = route_and_sort(logits, spec, align=4)
    xp = permute(x, lay)
    q, s = permute(x, lay, quant="group")
    y = unpermute(xp * 2, lay, w, residual=r)
    return y, q.float() * s.repeat_interleave(128, 1), lay.src_index


@need_fp8
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_under_torch_compile_fullgraph(backend):
    torch._dynamo.reset()
    gen = _gen()
    x = _x(7, 128, torch.bfloat16, "cpu", gen)
    logits = torch.randn(7, 8, generator=gen)
    r = _x(7, 128, torch.bfloat16, "cpu", gen)
    want = _layer(x, logits, r)
    got = torch.compile(_layer, fullgraph=True, backend=backend)(x, logits, r)
    for a, e in zip(got, want):
        assert torch.equal(a, e)
    torch._dynamo.reset()


# ---- gpu tier --------------------------------------------------------------------------------

def _need_kernel():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    why = _ext.why_not("moe_permute", "cuda") or _ext.why_not("moe_gating", "cuda")
    if why:
        pytest.fail(f"the gpu tier needs the moe_permute and moe_gating kernels: {why}")


@pytest.fixture
def clean_record():
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        device_errors.clear_device_errors("all")
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        device_errors.clear_device_errors("all")


GPU_SHAPES = [  # (T, E, k, align, H): H in elements of bf16 (float32 rows use H // 2 + 4)
    (1, 8, 2, 1, 8), (3, 8, 1, 128, 136), (17, 60, 4, 8, 2056), (1000, 128, 8, 1, 2048),
    (4097, 256, 8, 128, 1024), (5, 64, 6, 16, 7168), (2, 16, 8, 4, 128)]


def _h(H, dtype):
    return H if dtype != torch.float32 else H // 2 + 4


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,k,align,H", GPU_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_permute_kernel_bitwise(T, E, k, align, H, dtype):
    _need_kernel()
    gen = _gen()
    H = _h(H, dtype)
    lay, _ = _layout(T, E, k, align, "cuda", gen, skew=T % 2 == 1,
                     rows=None if T % 3 else G.capacity(T, E, k, align) + 7)
    x = _x(T, H, dtype, "cuda", gen)
    assert P.plan(x).path == "kernel", P.plan(x).why
    out = torch.full((lay.rows, H), float("nan"), dtype=dtype, device="cuda")
    got = P._permute_impl(x, lay.src_index, k, None, out=out)
    assert got is out
    ref = permute_reference(x, lay)
    assert torch.equal(out, ref), f"{int((out != ref).sum())} elements differ"
    assert torch.equal(permute(x, lay), ref)


@pytest.mark.gpu
@need_fp8
@pytest.mark.parametrize("T,E,k,align,H", [s for s in GPU_SHAPES if s[4] % 256 == 0 or s[4] < 200])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("quant", ("token", "group"))
def test_permute_kernel_fp8_is_quantize_rows(T, E, k, align, H, dtype, quant):
    _need_kernel()
    gen = _gen()
    H = _h(H, dtype) if quant == "token" else max(128, H // 128 * 128)
    lay, _ = _layout(T, E, k, align, "cuda", gen, skew=T % 2 == 1)
    x = _x(T, H, dtype, "cuda", gen)
    if T > 2:
        x[1, 3] = float("nan")
        x[2] = 0
    groups = H // 128
    out = (torch.full((lay.rows, H), float("nan"), device="cuda").to(FP8),
           torch.full((lay.rows,) if quant == "token" else (lay.rows, groups), float("nan"),
                      device="cuda"))
    q, s = P._permute_impl(x, lay.src_index, k, quant, out=out)
    rows = permute_reference(x, lay)
    if quant == "token":
        qk, sk = QR.quantize_rows(rows)           # the quantize_rows kernel on the same rows
        sk = sk.squeeze(-1)
    else:
        qk, sk = QR.quantize_groups(rows)
    same_fp8(q, s, qk, sk, f"{quant} vs the quantize_rows kernel")
    q_cpu, s_cpu = permute_reference(x.cpu(), MoeLayout(*(t.cpu() for t in (
        lay.counts, lay.offsets, lay.src_index, lay.dest_index)), k, align), quant)
    same_fp8(q, s, q_cpu, s_cpu, f"{quant} vs the CPU reference")
    q2, s2 = permute(x, lay, quant=quant)
    same_fp8(q2, s2, q, s, "public path")


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,k,align,H", GPU_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", (False, True))
def test_unpermute_kernel_bitwise(T, E, k, align, H, dtype, residual):
    _need_kernel()
    gen = _gen()
    H = _h(H, dtype)
    lay, w = _layout(T, E, k, align, "cuda", gen, skew=T % 2 == 1)
    y = _x(lay.rows, H, dtype, "cuda", gen)
    y[lay.src_index < 0] = float("nan")                    # padding rows are never read
    r = _x(T, H, dtype, "cuda", gen) if residual else None
    out = torch.full((T, H), float("nan"), dtype=dtype, device="cuda")
    got = P._unpermute_impl(y, lay.dest_index, w, r, out=out)
    assert got is out
    ref = unpermute_reference(y, lay, w, r)
    assert torch.equal(out, ref), f"{int((out != ref).sum())} elements differ"
    cpu = unpermute_reference(y.cpu(), MoeLayout(*(t.cpu() for t in (
        lay.counts, lay.offsets, lay.src_index, lay.dest_index)), k, align), w.cpu(),
        None if r is None else r.cpu())
    assert torch.equal(out.cpu(), cpu)
    if T <= 64:
        check_unpermute_64(out, y, MoeLayout(*(t.cpu() for t in (
            lay.counts, lay.offsets, lay.src_index, lay.dest_index)), k, align), w, r)
    if residual:                                          # in place over the residual
        r2 = r.clone()
        assert unpermute(y, lay, w, residual=r2, out=r2) is r2
        assert torch.equal(r2, ref)
    assert torch.equal(unpermute(y, lay, w, residual=r), ref)


@pytest.mark.gpu
def test_odd_rows_take_the_reference_path():
    """A hidden size that is not whole 16-byte vectors: the reference on the GPU (why_not
    says why), same results."""
    _need_kernel()
    gen = _gen()
    lay, w = _layout(5, 8, 2, 1, "cuda", gen)
    x = _x(5, 12, torch.bfloat16, "cuda", gen)
    assert "multiple of 8" in P.why_not(x)
    _ext._warned.clear()                       # the warning comes once per process and reason
    with pytest.warns(RuntimeWarning, match="reference path"):
        xp = permute(x, lay)
    assert torch.equal(xp, permute_reference(x, lay))
    strided = _x(5, 64, torch.bfloat16, "cuda", gen)[:, 8:40]     # row stride 64: addressed
    assert torch.equal(permute(strided, lay), permute_reference(strided, lay))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_bad_layout_entries_poison_and_record(dtype, clean_record):
    """src_index / dest_index out of range (a hand-made layout): NaN rows / tokens, the first
    recorded, nothing outside the tensors touched; a pair sort_by_expert left out (an id out
    of range) poisons its token's unpermute output."""
    _need_kernel()
    gen = _gen()
    T, E, k, H = 6, 8, 2, 64
    lay, w = _layout(T, E, k, 1, "cuda", gen)
    x = _x(T, H, dtype, "cuda", gen)
    src = lay.src_index.clone()
    src[3] = T * k + 5
    bad = MoeLayout(lay.counts, lay.offsets, src, lay.dest_index, k, 1)
    big = torch.full((lay.rows + 2, H), 7.0, dtype=dtype, device="cuda")
    out = big[1:1 + lay.rows]
    P._permute_impl(x, bad.src_index, k, None, out=out)
    torch.cuda.synchronize()
    with pytest.raises(MetadataError, match=rf"permute: layout.src_index\[3\] = {T * k + 5}"):
        fusedist.check_device_errors()
    device_errors.clear_device_errors()
    assert bool(out[3].isnan().all())
    keep = torch.arange(lay.rows, device="cuda") != 3
    assert torch.equal(out[keep], permute_reference(x, lay)[keep])
    assert bool((big[0] == 7).all()) and bool((big[-1] == 7).all())
    if FP8 is not None:
        q, s = P._permute_impl(x, bad.src_index, k, "token")
        torch.cuda.synchronize()
        device_errors.clear_device_errors()
        assert bool(s[3].isnan()) and bool(q[3].float().isnan().all())
    y = _x(lay.rows, H, dtype, "cuda", gen)
    dest = lay.dest_index.clone()
    dest[2 * k + 1] = lay.rows
    got = P._unpermute_impl(y, dest, w, None)
    torch.cuda.synchronize()
    with pytest.raises(MetadataError, match=rf"unpermute: layout.dest_index\[2 \* top_k \+ 1\] = "
                                            rf"{lay.rows}"):
        fusedist.check_device_errors()
    device_errors.clear_device_errors()
    assert bool(got[2].isnan().all())
    ref = unpermute_reference(y, lay, w)
    others = torch.arange(T, device="cuda") != 2
    assert torch.equal(got[others], ref[others])
    # an id out of range: the sort records it and leaves the pair out (the next MoE launch
    # raises it); unpermute then poisons that token and records the -1
    ids = torch.randint(0, E, (T, k), dtype=torch.int32, device="cuda")
    ids[4, 0] = E + 3
    lay2 = G.sort_by_expert(ids, E)
    y2 = _x(lay2.rows, H, dtype, "cuda", gen)
    torch.cuda.synchronize()
    with pytest.raises(MetadataError, match=r"sort_by_expert: ids\[4, 0\] = 11 is outside the 8 "):
        unpermute(y2, lay2, w)
    device_errors.clear_device_errors()
    assert int(lay2.dest_index[4 * k]) == -1 and int(lay2.counts.sum()) == T * k - 1
    got = unpermute(y2, lay2, w)
    torch.cuda.synchronize()
    with pytest.raises(MetadataError,
                       match=r"unpermute: layout.dest_index\[4 \* top_k \+ 0\] = -1"):
        fusedist.check_device_errors()
    device_errors.clear_device_errors()
    assert bool(got[4].isnan().all()) and bool(torch.isfinite(got[:4]).all())
    assert bool(torch.isfinite(got[5:]).all())


@pytest.mark.gpu
def test_layer_in_a_cuda_graph_replays_new_routings(clean_record):
    """route_and_sort -> permute (bf16 and FP8 per 128) -> unpermute with the residual, captured
    once; replays with new logits and inputs equal eager calls bitwise."""
    _need_kernel()
    gen = _gen()
    for T, E, k, H, align in [(8, 128, 8, 2048, 1), (600, 64, 6, 1024, 128)]:
        spec = RouterSpec(k, "softmax", True)
        logits = torch.randn(T, E, device="cuda")
        x = _x(T, H, torch.bfloat16, "cuda", gen)
        r = _x(T, H, torch.bfloat16, "cuda", gen)

        def step():
            ids, w, lay = route_and_sort(logits, spec, align=align)
            xp = permute(x, lay)
            outs = [xp, unpermute(xp * 0.5, lay, w, residual=r)]
            if FP8 is not None:
                outs += list(permute(x, lay, quant="group"))
            return outs

        step()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs = step()
        for _ in range(3):
            logits.copy_(torch.randn(T, E, device="cuda"))
            x.copy_(_x(T, H, torch.bfloat16, "cuda", gen))
            r.copy_(_x(T, H, torch.bfloat16, "cuda", gen))
            for o in outs:
                o.view(torch.uint8).fill_(0xff)
            g.replay()
            want = step()
            for a, b in zip(outs, want):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"T={T}"


@pytest.mark.gpu
@need_fp8
def test_layer_under_torch_compile_cuda():
    _need_kernel()
    torch._dynamo.reset()
    gen = _gen()
    x = _x(7, 128, torch.bfloat16, "cuda", gen)
    logits = torch.randn(7, 8, device="cuda")
    r = _x(7, 128, torch.bfloat16, "cuda", gen)
    want = _layer(x, logits, r)
    got = torch.compile(_layer, fullgraph=True)(x, logits, r)
    for a, e in zip(got, want):
        assert torch.equal(a, e)
    torch._dynamo.reset()
