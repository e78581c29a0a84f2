"""fusedist.ops.moe.grouped_gemm: every expert's rows of the permuted buffer (or of a
token-order x, gather=True) times its weight, against an independent float64 loop over the
(token, slot) pairs.

Error model, element by element, against float64 on the dequantized operands:
  bf16 x (bf16 or e4m3 w)  tests/tolerances.py's GEMM bound (gemm_err < GEMM_REL[bf16]): every
                           product is exact in fp32, the sums are fp32, the output is rounded
                           once to bf16.
  e4m3 x (the FP8 forms)   fusedist.ops.fp8_gemm's model: |y - ref| <= 2^-8 |ref| + (2^-13 +
                           (K + 2) 2^-24) sum_k |x_k w_k| -- the bf16 rounding, Hopper's FP8
                           wgmma keeping ~14 bits inside each promotion interval (512 k per-row
                           form, 128 k block form), the fp32 sums and the scale products.
The reference path (plain torch, fp32) is held to the fp32-only part of the same bounds.

CPU tier: the reference path against the float64 loop (odd shapes, padding rows, gather, every
scale layout) and every argument error. gpu tier (Hopper, fusedist._C with the kernels): the
CUTLASS grouped GEMM (bf16, FP8 per-row x per-channel / per-expert, FP8 blocks) and the
grouped GEMV (bf16 and e4m3 weights, gather) on odd shapes -- experts with no rows, one expert
taking every token, E = 8 / 60 / 128, top-k 1 and 8, Mixtral's 14336 x 4096 and
Qwen3-30B-A3B's 768 x 2048 experts, odd multiples of 16 --, outputs poisoned with NaN (padding
rows must stay NaN, every pair's row must be written), CUDA-graph replays with new routings,
bitwise reproducibility, the auto path's choice.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tolerances import GEMM_REL, count_bad_gemm, gemm_err  # noqa: E402

import fusedist  # noqa: E402,F401
from fusedist import _ext  # noqa: E402
from fusedist.ops.moe import MoeLayout, sort_by_expert  # noqa: E402

GG = importlib.import_module("fusedist.ops.moe.grouped_gemm")
QR = importlib.import_module("fusedist.ops.quantize_rows")
grouped_gemm = GG.grouped_gemm

FP8 = getattr(torch, "float8_e4m3fn", None)
BF = torch.bfloat16
needs_fp8 = pytest.mark.skipif(FP8 is None, reason="this torch has no float8_e4m3fn")


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


HOPPER = [pytest.mark.gpu, pytest.mark.skipif(not _hopper(), reason="the grouped kernels need a "
                                              "Hopper (sm_90) GPU")]


def hopper_gpu(fn):
    """The gpu tier, on a Hopper GPU (the kernels are built for sm_90a)."""
    for mark in reversed(HOPPER):
        fn = mark(fn)
    return fn


def _need_kernels():
    """On a Hopper GPU both kernels must run: a missing one would pass through the reference."""
    for k in ("moe_grouped_gemm", "moe_grouped_gemv"):
        assert _ext.kernel_runs(k, torch.device("cuda")), \
            f"fusedist._C has no {k} kernel ({_ext.why_not(k, torch.device('cuda'))}): rebuild"


def _gen(device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(int(torch.randint(1 << 30, ())))
    return g


# ---- routings, operands and the float64 reference ---------------------------------------------

def _ids(T, E, k, how, gen, device):
    """ids [T, k] int32: "balanced" (each token k distinct experts at random), "one" (every
    token's first slot on expert E // 2, the others distinct and random: that expert takes all
    T tokens), "few" (only experts 0 .. k: the rest get no rows)."""
    if how == "few":
        scores = torch.rand(T, min(E, k + 1), generator=gen, device=device)
    else:
        scores = torch.rand(T, E, generator=gen, device=device)
    if how == "one":
        scores[:, E // 2] = 2.0
    return scores.topk(k, dim=1).indices.to(torch.int32)


def _layout(T, E, k, how, gen, device, align=1) -> tuple[torch.Tensor, MoeLayout]:
    ids = _ids(T, E, k, how, gen, device)
    return ids, sort_by_expert(ids, E, align=align)


def _fp8_weight(E, N, K, mode, gen, device):
    """An e4m3 [E, N, K] weight quantized from a random one with `mode` scales (the amax of each
    group at 448) and its float32 scale."""
    w = torch.randn(E, N, K, generator=gen, device=device) * 0.05
    if mode == "expert":
        s = w.abs().amax(dim=(1, 2)) / 448
        full = s.view(E, 1, 1)
    elif mode == "channel":
        s = w.abs().amax(dim=2) / 448
        full = s.view(E, N, 1)
    else:
        nb, kb = -(-N // 128), -(-K // 128)
        pad = torch.zeros(E, nb * 128, kb * 128, device=device)
        pad[:, :N, :K] = w.abs()
        s = pad.view(E, nb, 128, kb, 128).amax(dim=(2, 4)) / 448
        full = s.repeat_interleave(128, 1)[:, :N].repeat_interleave(128, 2)[:, :, :K]
    s = s.clamp_min(1e-12).float()
    q = (w / full.clamp_min(1e-12)).clamp(-448, 448).to(FP8)
    return q, s


def _weights(E, N, K, wdt, gen, device):
    if wdt == "bf16":
        return (torch.randn(E, N, K, generator=gen, device=device) * 0.05).to(BF), None
    return _fp8_weight(E, N, K, wdt, gen, device)


def _x_tokens(T, K, xq, gen, device):
    """Token-order activations: bf16 [T, K], or e4m3 with per-token ("row") or per-128-k
    ("group") float32 scales."""
    x = (torch.randn(T, K, generator=gen, device=device) * 0.5).to(BF)
    if xq is None:
        return x, None
    if xq == "row":
        q, s = QR.quantize_rows_reference(x)
        return q, s.reshape(-1)
    return QR.quantize_groups_reference(x)


def _permuted(x_tok, sx_tok, layout, fill=0.0):
    """The permuted buffer [rows, K] (row r = x_tok[src_index[r] // k]); padding rows hold
    `fill` (NaN: the kernels must not let them reach a valid row) and scale 1."""
    src = layout.src_index.long()
    valid = src >= 0
    rows = x_tok.index_select(0, src.clamp_min(0) // layout.top_k)
    if x_tok.dtype == BF:
        xp = torch.where(valid[:, None], rows, torch.full_like(rows, fill))
    else:   # e4m3: padding rows are zeros (NaN would be 0x7f, read as a number)
        xp = torch.where(valid[:, None], rows.view(torch.uint8), 0).view(x_tok.dtype)
    if sx_tok is None:
        return xp, None
    s = sx_tok.index_select(0, src.clamp_min(0) // layout.top_k)
    ones = torch.ones_like(s)
    return xp, torch.where(valid.view(-1, *([1] * (s.dim() - 1))), s, ones)


def _x64(x_tok, sx_tok):
    x = x_tok.double()
    if sx_tok is None:
        return x
    if sx_tok.dim() == 1:
        return x * sx_tok.double()[:, None]
    return x * sx_tok.double().repeat_interleave(128, 1)[:, :x.shape[1]]


def _w64(w, w_scale, e):
    """Expert e's weight [N, K] in float64, its scales applied."""
    we = w[e].double()
    if w_scale is None:
        return we
    s = w_scale[e].double()
    if s.dim() == 0:
        return we * s
    if s.dim() == 1:
        return we * s[:, None]
    N, K = we.shape
    return we * s.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]


def _reference64(ids, x_tok, sx_tok, w, w_scale, layout):
    """(ref, mag, valid): float64 [rows, N] with row dest_index[t k + j] = x_tok[t] @ w[e]^T for
    e = ids[t, j], found pair by pair from ids (not from the layout's counts and offsets);
    mag = sum_k |x w|; valid: the rows that hold a pair."""
    T, k = ids.shape
    rows, N = layout.rows, w.shape[1]
    x = _x64(x_tok, sx_tok)
    ref = torch.zeros(rows, N, dtype=torch.float64, device=x.device)
    mag = torch.zeros_like(ref)
    valid = torch.zeros(rows, dtype=torch.bool, device=x.device)
    dest = layout.dest_index.long().view(T, k)
    for e in torch.unique(ids).tolist():
        t, j = (ids == e).nonzero(as_tuple=True)
        we = _w64(w, w_scale, e)
        r = dest[t, j]
        ref[r] = x[t] @ we.t()
        mag[r] = x[t].abs() @ we.abs().t()
        valid[r] = True
    return ref, mag, valid


def _fp8_bad(y, ref, mag, K, wgmma=True) -> int:
    """Elements outside the FP8 model (module docstring); NaN counts as bad."""
    tol = 2.0 ** -8 * ref.abs() + ((2.0 ** -13 if wgmma else 0.0) + (K + 2) * 2.0 ** -24) * mag
    return int((~((y.double() - ref).abs() <= tol)).sum())


def _check(out, ref, mag, valid, K, fp8_x, what, wgmma=True):
    """Every pair's row within the bound; every padding row untouched (still NaN)."""
    assert torch.isnan(out[~valid].float()).all(), f"{what}: a padding row was written"
    y, r, m = out[valid], ref[valid], mag[valid]
    if fp8_x:
        bad = _fp8_bad(y, r, m, K, wgmma)
        assert bad == 0, f"{what}: {bad} elements outside the FP8 bound"
    else:
        err = gemm_err(y, r)
        assert err < GEMM_REL[BF], f"{what}: error {err:.3g} ({count_bad_gemm(y, r)} bad)"


def _case(T, E, k, N, K, how, wdt, xq, gather, gen, device, align=1, path=None, max_ctas=0):
    """One call on fresh data: (out, ids, inputs); out is poisoned first."""
    ids, layout = _layout(T, E, k, how, gen, device, align)
    w, ws = _weights(E, N, K, wdt, gen, device)
    x_tok, sx_tok = _x_tokens(T, K, xq, gen, device)
    if gather:
        x, sx = x_tok, sx_tok
    else:
        x, sx = _permuted(x_tok, sx_tok, layout, fill=float("nan"))
    out = torch.full((layout.rows, N), float("nan"), dtype=BF, device=device)
    if path is None:
        y = grouped_gemm(x, w, layout, w_scale=ws, x_scale=sx, gather=gather, out=out)
    else:
        p = GG.plan(x, w, layout, gather, w_scale=ws, x_scale=sx, path=path, max_ctas=max_ctas)
        y = GG.run(p, x, w, layout, w_scale=ws, x_scale=sx, gather=gather, out=out)
    assert y is out
    return out, ids, layout, (x, w, ws, sx, x_tok, sx_tok)


def _run_and_check(T, E, k, N, K, how, wdt, xq, gather, gen, device, **kw):
    out, ids, layout, (x, w, ws, sx, x_tok, sx_tok) = _case(T, E, k, N, K, how, wdt, xq, gather,
                                                          gen, device, **kw)
    if device != "cpu":
        torch.cuda.synchronize()
    ref, mag, valid = _reference64(ids, x_tok, sx_tok, w, ws, layout)
    what = f"T={T} E={E} k={k} N={N} K={K} {how} w={wdt} x={xq or 'bf16'} gather={gather} {kw}"
    _check(out, ref, mag, valid, K, xq is not None, what, wgmma=device != "cpu")
    return out, layout, (x, w, ws, sx)


# ---- CPU tier: the reference path --------------------------------------------------------------

W_FORMS = ["bf16"] + [pytest.param(m, marks=needs_fp8) for m in ("expert", "channel", "block")]


@pytest.mark.parametrize("wdt", W_FORMS)
@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("T,E,k,N,K,how,align", [
    (1, 1, 1, 16, 32, "balanced", 1), (7, 5, 2, 24, 48, "balanced", 4),
    (13, 8, 3, 40, 144, "one", 1), (5, 16, 4, 8, 272, "few", 8)])
def test_reference_against_float64_loop(T, E, k, N, K, how, align, wdt, gather):
    """The reference path (bf16 x; bf16 or e4m3 w) against the float64 pair loop, padding rows
    left as they were."""
    gen = _gen("cpu")
    _run_and_check(T, E, k, N, K, how, wdt, None, gather, gen, "cpu", align=align)


@needs_fp8
@pytest.mark.parametrize("xq,wdt", [("row", "expert"), ("row", "channel"), ("group", "block"),
                                    ("group", "channel")])
@pytest.mark.parametrize("gather", [False, True])
def test_reference_fp8_x_against_float64_loop(xq, wdt, gather):
    gen = _gen("cpu")
    _run_and_check(9, 6, 2, 48, 256, "balanced", wdt, xq, gather, gen, "cpu", align=2)


def test_reference_new_out_and_empty():
    """A new out from the reference path has zero padding rows; no tokens, no work."""
    gen = _gen("cpu")
    ids, layout = _layout(6, 4, 2, "balanced", gen, "cpu", align=4)
    x = torch.randn(layout.rows, 32, generator=gen).to(BF)
    w = (torch.randn(4, 16, 32, generator=gen) * 0.1).to(BF)
    y = grouped_gemm(x, w, layout)
    pad = layout.src_index < 0
    assert bool(pad.any()) and int(y[pad].count_nonzero()) == 0
    empty = sort_by_expert(torch.zeros(0, 2, dtype=torch.int32), 4)
    assert grouped_gemm(torch.zeros(0, 32, dtype=BF), w, empty).shape == (0, 16)


def test_plan_on_cpu_and_forced_paths():
    """CPU tensors take the reference; forcing a kernel there names the reason."""
    gen = _gen("cpu")
    _, layout = _layout(4, 3, 1, "balanced", gen, "cpu")
    x = torch.randn(layout.rows, 16).to(BF)
    w = torch.randn(3, 8, 16).to(BF)
    p = GG.plan(x, w, layout)
    assert p.path == "reference" and "cpu" in p.why
    assert GG.plan(x, w, layout, path="reference").path == "reference"
    for path in ("gemm", "gemv"):
        with pytest.raises(ValueError, match=f"the {path} kernel cannot take this call"):
            GG.plan(x, w, layout, path=path)
        assert "cpu" in GG.why_not(x, w, path, layout)
    with pytest.raises(ValueError, match="path must be one of"):
        GG.plan(x, w, layout, path="fast")
    with pytest.raises(ValueError, match="path must be 'gemm' or 'gemv'"):
        GG.why_not(x, w, "fast")


def test_under_torch_compile_cpu():
    """grouped_gemm inside torch.compile(fullgraph=True) reaches
    torch.ops.fusedist.moe_grouped_gemm (planned inside the op) and gives the eager result."""
    torch._dynamo.reset()
    gen = _gen("cpu")
    ids, layout = _layout(6, 4, 2, "balanced", gen, "cpu", align=2)
    x = torch.randn(6, 32, generator=gen).to(BF)
    w = (torch.randn(4, 16, 32, generator=gen) * 0.1).to(BF)
    want = grouped_gemm(x, w, layout, gather=True,
                        out=torch.full((layout.rows, 16), float("nan"), dtype=BF))
    fn = torch.compile(lambda o: grouped_gemm(x, w, layout, gather=True, out=o), fullgraph=True,
                       backend="aot_eager")
    out = torch.full((layout.rows, 16), float("nan"), dtype=BF)
    fn(out)
    assert torch.equal(out.nan_to_num(7.0), want.nan_to_num(7.0))
    torch._dynamo.reset()


def test_tuning_section_is_declared_and_shipped():
    """The "moe" knob section: declared here, shipped in tuning_default.json with its benchmark,
    and read through tuning.knobs."""
    from fusedist import tuning
    import json
    table = json.loads(tuning._DEFAULT.read_text())
    assert "moe" in table and "benchmark" in table["moe"]
    assert tuning.section_values(table, "moe")["gemv_max_pairs"] == table["moe"]["gemv_max_pairs"]
    assert tuning.knobs("moe")["gemv_max_pairs"] >= 0
    with pytest.raises(ValueError, match="gemv_max_pairs"):
        tuning.section_values({"moe": {"gemv_max_pairs": -1}}, "moe")


# ---- CPU tier: argument errors -----------------------------------------------------------------

def _small(gen, fp8=False):
    ids, layout = _layout(5, 4, 2, "balanced", gen, "cpu", align=2)
    x = torch.randn(layout.rows, 32, generator=gen).to(BF)
    w = (torch.randn(4, 16, 32, generator=gen) * 0.1).to(BF)
    return layout, x, w


def test_bad_arguments_name_the_fix():
    gen = _gen("cpu")
    layout, x, w = _small(gen)
    M = "fusedist.ops.moe.grouped_gemm: "
    with pytest.raises(TypeError, match=M + "layout must be a fusedist.ops.moe.MoeLayout"):
        grouped_gemm(x, w, (layout.counts, layout.offsets))
    with pytest.raises(ValueError, match="w must be a 3-D .experts, N, K."):
        grouped_gemm(x, w[0], layout)
    with pytest.raises(ValueError, match="w must be a 3-D"):
        grouped_gemm(x, w.float(), layout)
    with pytest.raises(ValueError, match="w has 3 experts, the layout 4"):
        grouped_gemm(x, w[:3], layout)
    with pytest.raises(ValueError, match="w must have K contiguous"):
        grouped_gemm(x, w.transpose(1, 2).contiguous().transpose(1, 2), layout)
    with pytest.raises(ValueError, match=r"x must be \[%d, 32\] \(the layout's permuted rows\)"
                       % layout.rows):
        grouped_gemm(x[:-1], w, layout)
    with pytest.raises(ValueError, match=r"x must be \[5, 32\] in token order \(gather=True\)"):
        grouped_gemm(x, w, layout, gather=True)
    with pytest.raises(ValueError, match="x must be bfloat16"):
        grouped_gemm(x.to(torch.int32), w, layout)
    with pytest.raises(ValueError, match="x is torch.float16 but w is torch.bfloat16"):
        grouped_gemm(x.half(), w, layout)
    with pytest.raises(ValueError, match="out must be a contiguous torch.bfloat16"):
        grouped_gemm(x, w, layout, out=torch.empty(layout.rows, 15, dtype=BF))
    with pytest.raises(ValueError, match="out must be a contiguous"):
        grouped_gemm(x, w, layout, out=torch.empty(layout.rows, 16).float())
    with pytest.raises(ValueError, match="out must be a contiguous"):
        grouped_gemm(x, w, layout, out=torch.empty(16, layout.rows, dtype=BF).t())
    with pytest.raises(ValueError, match="x_scale goes with an e4m3 x"):
        grouped_gemm(x, w, layout, x_scale=torch.ones(layout.rows))
    with pytest.raises(ValueError, match="w_scale goes with float8_e4m3fn weights"):
        grouped_gemm(x, w, layout, w_scale=torch.ones(4))
    buf = torch.empty(layout.rows * 16 * 2, dtype=BF)
    out = buf[:layout.rows * 16].view(layout.rows, 16)
    xa = buf.view(torch.uint8)[:layout.rows * 32 * 2].view(BF).view(layout.rows, 32)
    xa.copy_(x)
    with pytest.raises(ValueError, match="out overlaps x"):
        grouped_gemm(xa, w, layout, out=out)


@needs_fp8
def test_bad_fp8_arguments_name_the_fix():
    gen = _gen("cpu")
    layout, x, w = _small(gen)
    w8, ws = _fp8_weight(4, 16, 32, "channel", gen, "cpu")
    xq, sx = QR.quantize_rows_reference(x)
    sx = sx.reshape(-1)
    with pytest.raises(ValueError, match="float8_e4m3fn weights need w_scale"):
        grouped_gemm(x, w8, layout)
    with pytest.raises(ValueError, match="w_scale must be a float32 tensor"):
        grouped_gemm(x, w8, layout, w_scale=ws.double())
    with pytest.raises(ValueError, match=r"w_scale has shape \[4, 15\]; .* \[4\] \(per expert\)"):
        grouped_gemm(x, w8, layout, w_scale=ws[:, :15])
    with pytest.raises(ValueError, match="an e4m3 x takes float8_e4m3fn weights"):
        grouped_gemm(xq, w, layout, x_scale=sx)
    with pytest.raises(ValueError, match=r"an e4m3 x needs x_scale float32 \[%d\]" % layout.rows):
        grouped_gemm(xq, w8, layout, w_scale=ws)
    with pytest.raises(ValueError, match="an e4m3 x needs x_scale"):
        grouped_gemm(xq, w8, layout, w_scale=ws, x_scale=sx[:-1])
    with pytest.raises(ValueError, match="an e4m3 x needs x_scale"):   # group scales, K % 128
        grouped_gemm(xq, w8, layout, w_scale=ws, x_scale=torch.ones(layout.rows, 1))
    wb, sb = _fp8_weight(4, 16, 32, "block", gen, "cpu")
    with pytest.raises(ValueError, match="block-scaled weights take an x quantized per 128"):
        grouped_gemm(xq, wb, layout, w_scale=sb, x_scale=sx)
    with pytest.raises(ValueError, match="out must be a contiguous torch.bfloat16"):
        grouped_gemm(xq, w8, layout, w_scale=ws, x_scale=sx,
                     out=torch.empty(layout.rows, 16, dtype=torch.float32))


def test_launcher_checks_without_a_gpu():
    """The C++ checks behind the kernels answer without a GPU (fusedist._C built): every
    field reaches them, and each limit names itself."""
    if not _ext.capabilities().has("moe_grouped_gemm"):
        pytest.skip("fusedist._C built without the grouped kernels")
    C = _ext.load()
    a = C.MoeGroupedGemmArgs()
    a.x = a.w = a.out = a.counts = a.offsets = a.src_index = 256
    a.experts, a.n, a.k, a.rows, a.x_rows, a.ldx, a.pairs, a.top_k = 8, 64, 128, 64, 64, 128, 32, 2
    a.x_dtype = a.w_dtype = 2
    assert C.moe_grouped_gemm_why_not(a) == ""
    assert C.moe_grouped_gemv_why_not(a) == ""
    a.k = a.ldx = 120
    assert "k must be a multiple of 8" not in C.moe_grouped_gemm_why_not(a)
    a.k = a.ldx = 132
    assert "k must be a multiple of 8" in C.moe_grouped_gemm_why_not(a)
    assert "k must be a multiple of 8" in C.moe_grouped_gemv_why_not(a)
    a.k = a.ldx = 128
    a.n = 60
    assert "n of 8" in C.moe_grouped_gemm_why_not(a)
    assert C.moe_grouped_gemv_why_not(a) == ""        # any N
    a.n = 64
    a.gather = 1
    assert "gather x first" in C.moe_grouped_gemm_why_not(a)
    assert C.moe_grouped_gemv_why_not(a) == ""
    a.gather = 0
    a.w_dtype, a.w_scale_mode, a.w_scale = 3, 2, 256  # bf16 x, e4m3 w: the GEMV only
    assert "takes bf16 x with bf16 w" in C.moe_grouped_gemm_why_not(a)
    assert C.moe_grouped_gemv_why_not(a) == ""
    a.x_dtype, a.x_scale_mode, a.x_scale = 3, 1, 256   # e4m3 x per row: the GEMM only
    assert C.moe_grouped_gemm_why_not(a) == ""
    assert "x must be bfloat16" in C.moe_grouped_gemv_why_not(a)
    a.x_scale_mode, a.w_scale_mode, a.k, a.ldx = 2, 3, 144, 144   # blocks need K % 128
    assert "k % 128" in C.moe_grouped_gemm_why_not(a)
    a.experts = 2000
    a.x_dtype, a.x_scale_mode = 2, 0
    assert "experts must be in [1, 1024]" in C.moe_grouped_gemv_why_not(a)


def test_benchmark_plan():
    """benchmarks/moe_gemm.py: its shapes, routings and token counts (no GPU needed)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "moe_gemm.py"
    spec = importlib.util.spec_from_file_location("bench_moe_gemm", path)
    B = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = B   # its dataclasses look their module up
    try:
        spec.loader.exec_module(B)
    finally:
        del sys.modules[spec.name]
    cases = B.cases(quick=True)
    assert {c.model for c in cases} == {"mixtral-8x7b", "qwen3-30b-a3b"}
    assert {c.proj for c in cases} == {"gate_up", "down"}
    full = B.cases(quick=False)
    tokens = {c.tokens for c in full}
    assert min(tokens) == 1 and max(tokens) == 16384 and 64 in tokens and 512 in tokens
    assert {c.routing for c in full} == {"balanced", "skewed"}
    mix = [c for c in full if c.model == "mixtral-8x7b" and c.proj == "gate_up"][0]
    assert (mix.experts, mix.top_k, mix.n, mix.k) == (8, 2, 2 * 14336, 4096)
    qw = [c for c in full if c.model == "qwen3-30b-a3b" and c.proj == "down"][0]
    assert (qw.experts, qw.top_k, qw.n, qw.k) == (128, 8, 2048, 768)
    ids = B.routing_ids(64, 128, 8, "skewed", torch.Generator().manual_seed(0), "cpu")
    assert ids.shape == (64, 8) and int(ids.max()) < 128
    assert all(len(set(r)) == 8 for r in ids.tolist())   # distinct experts per token


# ---- gpu tier -----------------------------------------------------------------------------------

# (T, E, k, N, K, routing): E = 8 / 60 / 128, top-k 1 and 8, one expert taking every token,
# experts with no rows, Mixtral's and Qwen3-30B-A3B's expert shapes, odd multiples of 16.
GEMM_CASES = [
    (37, 8, 2, 1040, 528, "balanced"),
    (300, 60, 4, 208, 1424, "one"),
    (19, 128, 8, 768, 2048, "balanced"),          # Qwen3-30B-A3B down's N x K .T: most empty
    (513, 128, 8, 2048, 768, "balanced"),         # Qwen3-30B-A3B down
    (200, 8, 1, 336, 4112, "one"),                # top-1: one expert takes all
    (96, 8, 2, 14336, 4096, "few"),               # Mixtral gate (one half of gate|up)
    (33, 5, 3, 8, 16, "balanced"),                # the smallest tiles
]
GEMV_CASES = [
    (1, 8, 2, 14336, 4096, "balanced"),           # Mixtral decode, one token
    (16, 128, 8, 1536, 2048, "balanced"),         # Qwen3-30B-A3B gate|up at 16 tokens
    (16, 128, 8, 2048, 768, "one"),
    (5, 60, 4, 1040, 528, "balanced"),
    (64, 8, 1, 336, 4112, "one"),                 # one expert, 64 rows: 8 chunks of 8
    (3, 7, 3, 7, 16, "few"),                      # N below one strip
    (11, 128, 8, 200, 144, "few"),
]


@hopper_gpu
@pytest.mark.parametrize("case", GEMM_CASES)
def test_gemm_bf16_matches_float64(case):
    _need_kernels()
    gen = _gen("cuda")
    T, E, k, N, K, how = case
    for align in (1, 16):
        _run_and_check(T, E, k, N, K, how, "bf16", None, False, gen, "cuda", align=align,
                       path="gemm")


@hopper_gpu
@needs_fp8
@pytest.mark.parametrize("wdt", ["expert", "channel"])
@pytest.mark.parametrize("case", GEMM_CASES)
def test_gemm_fp8_rows_matches_float64(case, wdt):
    _need_kernels()
    gen = _gen("cuda")
    T, E, k, N, K, how = case
    _run_and_check(T, E, k, N, K, how, wdt, "row", False, gen, "cuda", align=4, path="gemm")


@hopper_gpu
@needs_fp8
@pytest.mark.parametrize("case", [c for c in GEMM_CASES if c[4] % 128 == 0] +
                         [(77, 16, 2, 520, 1280, "one")])
def test_gemm_fp8_block_matches_float64(case):
    _need_kernels()
    gen = _gen("cuda")
    T, E, k, N, K, how = case
    _run_and_check(T, E, k, N, K, how, "block", "group", False, gen, "cuda", align=8,
                   path="gemm")


@hopper_gpu
@pytest.mark.parametrize("wdt", ["bf16"] + [pytest.param(m, marks=needs_fp8)
                                           for m in ("expert", "channel", "block")])
@pytest.mark.parametrize("case", GEMV_CASES)
def test_gemv_matches_float64(case, wdt):
    """The grouped GEMV, permuted and token-order (gather) x, padding rows untouched."""
    _need_kernels()
    gen = _gen("cuda")
    T, E, k, N, K, how = case
    for gather in (False, True):
        _run_and_check(T, E, k, N, K, how, wdt, None, gather, gen, "cuda", align=4, path="gemv")


def _counters_zero():
    for ws in GG._WORKSPACES.values():
        assert int(ws.counters.count_nonzero()) == 0, "a task counter was left non-zero"


@hopper_gpu
@pytest.mark.parametrize("wdt", ["bf16"] + [pytest.param(m, marks=needs_fp8)
                                           for m in ("channel", "block")])
def test_gemv_split_tasks_match_float64(wdt):
    """Grids capped small and large: tasks split over 1 .. many CTAs at uneven points (the
    partial sums, the last CTA's reduction); counters left at zero."""
    _need_kernels()
    gen = _gen("cuda")
    for T, E, k, N, K, how in ((4, 8, 2, 300, 8192, "balanced"), (16, 128, 8, 200, 2064, "one"),
                               (40, 8, 2, 4096, 1024, "few")):
        for cap in (1, 3, 7, 64, 100000):
            _run_and_check(T, E, k, N, K, how, wdt, None, cap % 2 == 1, gen, "cuda",
                           path="gemv", max_ctas=cap)
    _counters_zero()


@hopper_gpu
def test_gather_on_the_gemm_path():
    """gather=True on the grouped GEMM: the rows are gathered first (bf16 and FP8 forms)."""
    _need_kernels()
    gen = _gen("cuda")
    _run_and_check(150, 16, 4, 528, 1040, "balanced", "bf16", None, True, gen, "cuda",
                   path="gemm")
    if FP8 is not None:
        _run_and_check(150, 16, 4, 528, 1024, "balanced", "channel", "row", True, gen, "cuda",
                       path="gemm")
        _run_and_check(150, 16, 4, 528, 1024, "balanced", "block", "group", True, gen, "cuda",
                       path="gemm")


@hopper_gpu
def test_auto_path():
    """The tuning table's gemv_max_pairs splits the kernels; what one kernel cannot take goes to
    the other; the results are right either way."""
    _need_kernels()
    gen = _gen("cuda")
    limit = GG.tuning.knobs("moe", torch.device("cuda"))["gemv_max_pairs"]
    for T in sorted({1, max(1, limit // 8), limit // 8 + 1, 200}):
        out, layout, (x, w, ws, sx) = _run_and_check(T, 64, 8, 256, 512, "balanced", "bf16",
                                                     None, False, gen, "cuda")
        want = "gemv" if 8 * T <= limit else "gemm"
        assert GG.plan(x, w, layout).path == want, f"T={T}, gemv_max_pairs={limit}"
    if FP8 is not None:   # bf16 x with e4m3 w: the GEMV at any size (the GEMM takes e4m3 x)
        out, layout, (x, w, ws, sx) = _run_and_check(200, 64, 8, 256, 512, "balanced", "channel",
                                                     None, False, gen, "cuda")
        assert GG.plan(x, w, layout, w_scale=ws).path == "gemv"
        assert "takes bf16 x with bf16 w" in GG.why_not(x, w, "gemm", layout, w_scale=ws)
        # e4m3 x: the GEMM at any size
        out, layout, (x, w, ws, sx) = _run_and_check(1, 64, 8, 256, 512, "balanced", "channel",
                                                     "row", False, gen, "cuda")
        assert GG.plan(x, w, layout, w_scale=ws, x_scale=sx).path == "gemm"


@hopper_gpu
@pytest.mark.parametrize("path,wdt,xq", [("gemm", "bf16", None), ("gemv", "bf16", None),
                                          pytest.param("gemm", "channel", "row", marks=needs_fp8),
                                          pytest.param("gemm", "block", "group", marks=needs_fp8),
                                          pytest.param("gemv", "block", None, marks=needs_fp8)])
def test_bitwise_reproducible(path, wdt, xq):
    """The same call gives the same bits run after run, with other calls in between."""
    _need_kernels()
    gen = _gen("cuda")
    T = 300 if path == "gemm" else 12
    out, layout, (x, w, ws, sx) = _run_and_check(T, 32, 4, 1024, 1024, "balanced", wdt, xq,
                                                 False, gen, "cuda", path=path)
    p = GG.plan(x, w, layout, w_scale=ws, x_scale=sx, path=path)
    valid = layout.src_index >= 0
    for i in range(10):
        if i % 3 == 0:   # another shape in between
            _case(9, 16, 2, 512, 512, "one", wdt, xq, False, gen, "cuda", path=path)
        again = torch.full_like(out, float("nan"))
        GG.run(p, x, w, layout, w_scale=ws, x_scale=sx, out=again)
        assert torch.equal(again[valid], out[valid]), f"{path} {wdt}: run {i} differs"
    _counters_zero()


@hopper_gpu
@pytest.mark.parametrize("T,path", [(2, "gemv"), (16, "gemv"), (700, "gemm")])
@pytest.mark.parametrize("wdt,xq", [("bf16", None), pytest.param("block", None, marks=needs_fp8),
                                    pytest.param("channel", "row", marks=needs_fp8)])
def test_cuda_graph_replays_new_routings(T, path, wdt, xq):
    """One captured call (fixed token count and capacity) replayed with new routings -- every
    expert's count, offset and rows change, including one expert taking every token -- gives
    the eager result bit for bit and the float64 one."""
    _need_kernels()
    if xq is not None and path == "gemv":
        pytest.skip("an e4m3 x runs the grouped GEMM")
    if wdt == "block" and path == "gemm":
        xq = "group"   # the GEMM takes block weights with x in e4m3 per 128 k (a bf16 x: the GEMV)
    gen = _gen("cuda")
    E, k, N, K = 64, 8 if path == "gemv" else 4, 512, 1024
    ids, layout = _layout(T, E, k, "balanced", gen, "cuda", align=8)
    w, ws = _weights(E, N, K, wdt, gen, "cuda")
    x_tok, sx_tok = _x_tokens(T, K, xq, gen, "cuda")
    gather = path == "gemv"
    static = MoeLayout(layout.counts.clone(), layout.offsets.clone(), layout.src_index.clone(),
                       layout.dest_index.clone(), layout.top_k, layout.align)
    if gather:
        x, sx = x_tok.clone(), None
    else:
        x, sx = _permuted(x_tok, sx_tok, layout)
    out = torch.full((layout.rows, N), float("nan"), dtype=BF, device="cuda")
    p = GG.plan(x, w, static, gather, w_scale=ws, x_scale=sx, path=path)

    def call():
        GG.run(p, x, w, static, w_scale=ws, x_scale=sx, gather=gather, out=out)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()   # warm-up off the capture (workspace allocation)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    for how in ("balanced", "one", "few", "balanced"):
        ids, new = _layout(T, E, k, how, gen, "cuda", align=8)
        x_tok, sx_tok = _x_tokens(T, K, xq, gen, "cuda")
        for name in ("counts", "offsets", "src_index", "dest_index"):
            getattr(static, name).copy_(getattr(new, name))
        if gather:
            x.copy_(x_tok)
        else:
            xp, sp = _permuted(x_tok, sx_tok, new)
            x.copy_(xp)
            if sx is not None:
                sx.copy_(sp)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref, mag, valid = _reference64(ids, x_tok, sx_tok, w, ws, new)
        _check(out, ref, mag, valid, K, xq is not None, f"graph {path} {wdt} {how} T={T}")
        eager = torch.full_like(out, float("nan"))
        GG.run(p, x, w, static, w_scale=ws, x_scale=sx, gather=gather, out=eager)
        assert torch.equal(eager[valid], out[valid]), f"graph {path} {wdt} {how}: eager differs"
    del g
    _counters_zero()


@hopper_gpu
def test_misaligned_views():
    """x a view at a 2-byte offset, out a view off 16 bytes: copies keep the kernels aligned,
    padding rows of out keep their values."""
    _need_kernels()
    gen = _gen("cuda")
    T, E, k, N, K = 40, 8, 2, 264, 272
    ids, layout = _layout(T, E, k, "balanced", gen, "cuda", align=4)
    w, _ = _weights(E, N, K, "bf16", gen, "cuda")
    x_tok, _ = _x_tokens(T, K, None, gen, "cuda")
    xp, _ = _permuted(x_tok, None, layout)
    ref, mag, valid = _reference64(ids, x_tok, None, w, None, layout)
    for path, x in (("gemm", xp), ("gemv", x_tok)):
        xb = torch.empty(x.numel() + 1, dtype=BF, device="cuda")
        xv = xb[1:].view_as(x)
        xv.copy_(x)
        ob = torch.full((layout.rows * N + 1,), float("nan"), dtype=BF, device="cuda")
        out = ob[1:].view(layout.rows, N)
        GG.run(GG.plan(xv, w, layout, path == "gemv", path=path), xv, w, layout,
               gather=path == "gemv", out=out)
        torch.cuda.synchronize()
        _check(out, ref, mag, valid, K, False, f"misaligned {path}")


@hopper_gpu
def test_under_torch_compile():
    """grouped_gemm inside torch.compile(fullgraph=True) reaches
    torch.ops.fusedist.moe_grouped_gemm and gives the eager bits."""
    _need_kernels()
    torch._dynamo.reset()
    gen = _gen("cuda")
    ids, layout = _layout(24, 16, 2, "balanced", gen, "cuda")
    w, _ = _weights(16, 256, 512, "bf16", gen, "cuda")
    x_tok, _ = _x_tokens(24, 512, None, gen, "cuda")
    want = grouped_gemm(x_tok, w, layout, gather=True,
                        out=torch.zeros(layout.rows, 256, dtype=BF, device="cuda"))
    fn = torch.compile(lambda o: grouped_gemm(x_tok, w, layout, gather=True, out=o),
                       fullgraph=True, backend="aot_eager")
    out = torch.zeros(layout.rows, 256, dtype=BF, device="cuda")
    fn(out)
    assert torch.equal(out, want)
    torch._dynamo.reset()
