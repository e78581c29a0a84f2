"""fusedist.gemm: the Hopper wgmma GEMM (kernel="sm90") and the decode kernel (kernel="decode")
against a float64 reference; argument errors on any machine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tolerances import GEMM_REL, count_bad_gemm, gemm_err, gemm_rel_err  # noqa: E402

import fusedist  # noqa: E402


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _seeded() -> torch.Generator:
    """A CUDA generator with a fresh seed: new inputs on every run."""
    gen = torch.Generator(device="cuda")
    gen.manual_seed(int(torch.randint(1 << 30, ())))
    return gen


def _launcher_setup():
    """What the launch_sm90 tests share: the extension, a fresh generator, the stream."""
    from fusedist import _ext
    return _ext.load(), _seeded(), torch.cuda.current_stream()


def _fresh(shape, dt, gen):
    return (torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32) * 0.5).to(dt)


def _weight(k, n, layout, dt, gen):
    return _fresh((k, n), dt, gen) if layout == "kn" else _fresh((n, k), dt, gen).t()


def _check_against_float64(run, m, k, n, layout, dt, gen, bias: bool, what: str):
    """run(x, w, b, out, accumulate) on fresh x [m, k], w [k, n] in `layout` and a bias when
    `bias`: out (poisoned with NaN) against a float64 reference, then accumulate=True onto a
    fresh c (out += x @ w + b, the epilogue reading out with beta = 1)."""
    x = _fresh((m, k), dt, gen)
    w = _weight(k, n, layout, dt, gen)
    b = _fresh((n,), dt, gen) if bias else None
    ref = x.double() @ w.double()
    if b is not None:
        ref += b.double()
    out = torch.full((m, n), float("nan"), dtype=dt, device="cuda")
    y = run(x, w, b, out, False)
    torch.cuda.synchronize()
    err = gemm_err(y, ref)
    assert y is out and err < GEMM_REL[dt], \
        f"{what} {dt} M={m} K={k} N={n} w={layout} bias={bias}: {err:.3g}"
    c = _fresh((m, n), dt, gen)
    acc = c.clone()
    run(x, w, b, acc, True)
    err = gemm_err(acc, ref + c.double())
    assert err < GEMM_REL[dt], \
        f"{what} accumulate {dt} M={m} K={k} N={n} w={layout} bias={bias}: {err:.3g}"


def test_gemm_rejects_bad_arguments_on_cpu():
    x, w = torch.zeros(4, 8), torch.zeros(8, 16)
    with pytest.raises(TypeError, match="must share a dtype"):
        fusedist.gemm(x, w)  # float32
    xb, wb = x.bfloat16(), w.bfloat16()
    with pytest.raises(ValueError, match="kernel must be one of"):
        fusedist.gemm(xb, wb, kernel="cublas")
    with pytest.raises(ValueError, match="kernel='sm90' needs CUDA tensors"):
        fusedist.gemm(xb, wb, kernel="sm90")
    with pytest.raises(ValueError, match="accumulate=True adds into out"):
        fusedist.gemm(xb, wb, accumulate=True)
    with pytest.raises(ValueError, match=r"out must be a contiguous \(4, 16\)"):
        fusedist.gemm(xb, wb, out=torch.empty(4, 15, dtype=torch.bfloat16))


def _cpu(shape, dt):
    return (torch.randn(shape, dtype=torch.float32) * 0.5).to(dt)


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k,n", [(1, 8, 8), (37, 72, 40), (129, 1000, 776), (5, 4104, 24)])
@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_gemm_cpu_reference_matches_float64(dt, m, k, n, layout):
    """CPU tensors: fp32 accumulation rounded once, with bias, out= and accumulate=True."""
    x = _cpu((m, k), dt)
    w = _cpu((k, n), dt) if layout == "kn" else _cpu((n, k), dt).t()
    b = _cpu((n,), dt)
    ref = x.double() @ w.double()
    for bias in (None, b):
        want = ref + (b.double() if bias is not None else 0)
        out = torch.full((m, n), float("nan"), dtype=dt)
        y = fusedist.gemm(x, w, bias, out=out)
        assert y is out
        assert count_bad_gemm(y, want) == 0 and gemm_err(y, want) < GEMM_REL[dt]
        # Rounded once: exactly the fp32 result rounded to dt.
        exact = (x.float() @ w.float() + (b.float() if bias is not None else 0)).to(dt)
        assert torch.equal(y, exact)
        c = _cpu((m, n), dt)
        acc = c.clone()
        assert fusedist.gemm(x, w, bias, out=acc, accumulate=True) is acc
        assert count_bad_gemm(acc, want + c.double()) == 0
        exact = (x.float() @ w.float() + (b.float() if bias is not None else 0) + c.float())
        assert torch.equal(acc, exact.to(dt))
    assert fusedist.gemm(x, w).dtype == dt and fusedist.gemm(x, w).shape == (m, n)


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("kernel", ["auto", "decode", "sm90"])
def test_gemm_empty_batch(dev, kernel):
    """M = 0 (an idle rank's batch): an empty [0, N] result, out untouched, on every kernel."""
    if dev == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU")
    if dev == "cpu" and kernel != "auto" or dev == "cuda" and kernel != "auto" and not _hopper():
        pytest.skip("that kernel does not run here")
    dt = torch.bfloat16
    x = torch.empty(0, 64, dtype=dt, device=dev)
    w = torch.randn(64, 48, device=dev).to(dt)
    y = fusedist.gemm(x, w, kernel=kernel)
    assert y.shape == (0, 48) and y.dtype == dt
    y = fusedist.gemm(x, w.t().contiguous().t(), torch.ones(48, dtype=dt, device=dev),
                      kernel=kernel)
    assert y.shape == (0, 48)
    if kernel != "decode":
        out = torch.empty(0, 48, dtype=dt, device=dev)
        assert fusedist.gemm(x, w, out=out, accumulate=True, kernel=kernel) is out


def test_gemm_check_catches_one_stale_vector():
    """One 16-byte vector never written in a 258 x 776 output: the Frobenius error
    alone stays under GEMM_REL (bf16), the element-wise bound (gemm_err) fails it; so does one
    NaN."""
    dt = torch.bfloat16
    x, w = _cpu((258, 520), dt), _cpu((520, 776), dt)
    ref = x.double() @ w.double()
    out = (x.float() @ w.float()).to(dt)
    assert gemm_err(out, ref) < GEMM_REL[dt] and count_bad_gemm(out, ref) == 0
    stale = out.clone()
    # One 16-byte vector never stored (left from a zeroed buffer): the vector of median norm
    # among all the output's, a typical one. Its share of the Frobenius norm is then
    # ~sqrt(8 / (258 x 776)) = 0.006, beside the bf16 rounding's ~2^-9 rms (0.002): ~0.0063 in
    # all, under the 1e-2 bound whatever the draw (the median of the output's 25k vector norms
    # moves little). A vector of median norm within one row could reach the bound: the row's
    # own norm varies from draw to draw.
    blocks = ref.view(-1, 8).norm(dim=1)
    flat = int(blocks.argsort()[len(blocks) // 2])
    i, j = divmod(flat, 776 // 8)
    stale[i, 8 * j:8 * j + 8] = 0
    assert gemm_rel_err(stale, ref) < GEMM_REL[dt]  # what the old check saw
    assert count_bad_gemm(stale, ref) > 0 and gemm_err(stale, ref) == float("inf")
    nan = out.clone()
    nan[5, 3] = float("nan")
    assert count_bad_gemm(nan, ref) == 1 and gemm_err(nan, ref) == float("inf")


def test_gemm_k_zero_is_the_bias():
    x = torch.empty(3, 0, dtype=torch.bfloat16)
    w = torch.empty(0, 16, dtype=torch.bfloat16)
    b = torch.arange(16.0).bfloat16()
    assert torch.equal(fusedist.gemm(x, w, b), b.expand(3, 16))


def test_gemm_auto_kernel_follows_the_rules():
    from fusedist.ops.gemm import auto_kernel, readable_rows
    table = {"gemm": {"rules": [
        {"kernel": "decode", "layout": "nk", "dtype": "bfloat16", "k": 14336, "n": 8192,
         "m": [16, 32]},
        {"kernel": "sm90", "layout": "kn", "dtype": "bfloat16", "k": 4096, "n": 8192,
         "m": [96, 112]}]}}
    bf = torch.bfloat16
    assert auto_kernel(16, 14336, 8192, "nk", bf, False, True, table) == "decode"
    assert auto_kernel(32, 14336, 8192, "nk", bf, False, True, table) == "decode"
    # Outside the measured region, another layout, dtype or shape: torch.matmul.
    assert auto_kernel(33, 14336, 8192, "nk", bf, False, True, table) == "torch"
    assert auto_kernel(1, 14336, 8192, "nk", bf, False, True, table) == "torch"
    assert auto_kernel(16, 14336, 8192, "kn", bf, False, True, table) == "torch"
    assert auto_kernel(16, 14336, 8192, "nk", torch.float16, False, True, table) == "torch"
    assert auto_kernel(16, 14336, 4096, "nk", bf, False, True, table) == "torch"
    assert auto_kernel(100, 4096, 8192, "kn", bf, False, True, table) == "sm90"
    assert auto_kernel(100, 4096, 8192, "kn", bf, True, True, table) == "sm90"
    # The decode kernel does not accumulate; no Hopper GPU or no rows: torch.matmul.
    assert auto_kernel(16, 14336, 8192, "nk", bf, True, True, table) == "torch"
    assert auto_kernel(100, 4096, 8192, "kn", bf, False, False, table) == "torch"
    assert auto_kernel(0, 4096, 8192, "kn", bf, False, True, table) == "torch"
    assert auto_kernel(16, 14336, 8192, "nk", bf, False, True, {}) == "torch"
    buf = torch.zeros(10, 16)
    assert readable_rows(buf[:3]) == 10
    assert readable_rows(buf[4:7]) == 6
    assert readable_rows(buf[:3, :8]) == 10
    assert readable_rows(buf[:3].clone()) == 3


# The shapes where fusedist's kernel measured slower than torch.matmul on H200 (bf16, the
# nn.Linear weight passed as w.t()): auto must take torch.matmul there.
LOSING = [(1, 14336, 4096), (1, 4096, 6144), (1, 4096, 28672), (2048, 4096, 4096),
          (4096, 8192, 8192), (64, 4096, 8192), (128, 14336, 8192), (512, 4096, 8192)]


@pytest.mark.parametrize("m,k,n", LOSING)
def test_shipped_rules_take_torch_where_fusedist_lost(m, k, n):
    from fusedist import tuning
    from fusedist.ops.gemm import auto_kernel
    table = tuning.load_table("NVIDIA H200", 1)
    for layout in ("kn", "nk"):
        assert auto_kernel(m, k, n, layout, torch.bfloat16, False, True, table) == "torch"


def test_derive_gemm_rules_keeps_only_consistent_wins():
    from fusedist import tuning
    base = {"layout": "nk", "dtype": "bfloat16", "k": 4096, "n": 8192}
    pts = [{**base, "kernel": "decode", "m": m, "ratio": r} for m, rs in
           ((1, (1.02, 1.01)), (8, (1.00, 1.03)), (16, (1.05, 0.95)), (32, (1.01,)),
            (64, (0.98, 0.99))) for r in rs]
    pts += [{**base, "kernel": "sm90", "m": m, "ratio": r} for m, r in
            ((32, 1.04), (128, 1.02), (256, 1.01), (512, 0.97))]
    pts += [{**base, "layout": "kn", "kernel": "decode", "m": 1, "ratio": 1.2}]
    rules = tuning.derive_gemm_rules(pts)
    assert rules == [
        {"kernel": "decode", "layout": "kn", "dtype": "bfloat16", "k": 4096, "n": 8192,
         "m": [1, 1]},
        # 1 and 8 win; 16 lost once (0.95); 32: sm90 has the larger median; 64 lost.
        {"kernel": "decode", "layout": "nk", "dtype": "bfloat16", "k": 4096, "n": 8192,
         "m": [1, 8]},
        {"kernel": "sm90", "layout": "nk", "dtype": "bfloat16", "k": 4096, "n": 8192,
         "m": [32, 32]},
        {"kernel": "sm90", "layout": "nk", "dtype": "bfloat16", "k": 4096, "n": 8192,
         "m": [128, 256]}]
    for r in rules:
        assert tuning.choose_gemm_kernel({"gemm": {"rules": rules}}, r["m"][0], r["k"], r["n"],
                                         r["layout"], r["dtype"]) == r["kernel"]
    assert tuning.choose_gemm_kernel({"gemm": {"rules": rules}}, 16, 4096, 8192, "nk",
                                     "bfloat16") == "torch"
    with pytest.raises(ValueError, match="gemm rule"):
        tuning.gemm_rules({"gemm": {"rules": [{"kernel": "cublas"}]}})


# M: 1 row, odd, the swap tile's range, one past a row block, many waves; (K, N): not multiples
# of the 128 x 256 x 64 tile.
SM90_MS = (1, 37, 100, 129, 1000, 2053)
SM90_KN = ((72, 40), (1000, 776), (4104, 520), (520, 2312))


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="kernel='sm90' needs a Hopper GPU")
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_gemm_sm90_matches_float64(dt):
    gen = _seeded()
    for m in SM90_MS:
        for k, n in SM90_KN:
            for layout in ("kn", "nk"):
                _check_against_float64(
                    lambda x, w, b, out, acc: fusedist.gemm(x, w, b, out=out, kernel="sm90",
                                                            accumulate=acc),
                    m, k, n, layout, dt, gen, bias=(m + n) % 2 == 1, what="gemm sm90")


# Every tile configuration in every tile order forced in turn (kernel="sm90" picks both by M):
# one row, odd rows, a full narrow tile, past it (2 and 3 row blocks, the last partial, where
# the order decides which tiles share a wave), at the odd (K, N) above.
TILE_MS = (1, 37, 128, 200, 300)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="kernel='sm90' needs a Hopper GPU")
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_gemm_sm90_every_tile_matches_float64(dt):
    from fusedist.ops.gemm import launch_sm90

    C, gen, stream = _launcher_setup()
    assert set(C.GEMM_SM90_TILES) == {"wide", "narrow", "mid", "swap", "swap_1wg"}
    assert set(C.GEMM_SM90_RASTERS) == {"along_n", "along_m"}
    for name, tile in C.GEMM_SM90_TILES.items():
        for order, raster in C.GEMM_SM90_RASTERS.items():
            for m in TILE_MS:
                for k, n in SM90_KN:
                    for layout in ("kn", "nk"):
                        _check_against_float64(
                            lambda x, w, b, out, acc, tile=tile, raster=raster: launch_sm90(
                                x, w, b, out, stream, accumulate=acc, tile=tile, raster=raster),
                            m, k, n, layout, dt, gen, bias=(m + k) % 2 == 1,
                            what=f"gemm sm90 tile {name} raster {order}")
    x, w = _fresh((8, 64), dt, gen), _fresh((64, 64), dt, gen)
    out = torch.empty(8, 64, dtype=dt, device="cuda")
    with pytest.raises(ValueError, match="tile must be"):
        launch_sm90(x, w, None, out, stream, tile=99)
    with pytest.raises(ValueError, match="raster must be"):
        launch_sm90(x, w, None, out, stream, raster=7)
    # The fused engines' waits run on the wide tile, handing tiles out along N only.
    flags = torch.zeros(2, dtype=torch.int32, device="cuda")
    for small in ("narrow", "mid", "swap", "swap_1wg"):
        with pytest.raises(ValueError, match="wide tile only"):
            launch_sm90(x, w, None, out, stream, flags=flags, block_rows=4,
                        tile=C.GEMM_SM90_TILES[small])
    with pytest.raises(ValueError, match="along N only"):
        launch_sm90(x, w, None, out, stream, flags=flags, block_rows=4,
                    raster=C.GEMM_SM90_RASTERS["along_m"])


# x as the first rows of a larger buffer: the mainloop then reads whole tiles of rows (no
# tile load past the tensor's end). The rows past M are NaN: none may reach out.
@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="kernel='sm90' needs a Hopper GPU")
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_gemm_sm90_slice_of_larger_buffer_matches_float64(dt):
    from fusedist.ops.gemm import launch_sm90, readable_rows

    C, gen, stream = _launcher_setup()
    for name, tile in C.GEMM_SM90_TILES.items():
        for m in (1, 37, 200, 300):
            for k, n in SM90_KN:
                for layout in ("kn", "nk"):
                    def run(x, w, b, out, acc, tile=tile, m=m):
                        buf = torch.full((m + 130, x.shape[1]), float("nan"), dtype=dt,
                                         device="cuda")
                        buf[:m].copy_(x)
                        xs = buf[:m]
                        assert readable_rows(xs) == m + 130
                        return launch_sm90(xs, w, b, out, stream, accumulate=acc, tile=tile)
                    _check_against_float64(run, m, k, n, layout, dt, gen, bias=m % 2 == 1,
                                           what=f"gemm sm90 tile {name}, x a slice")


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="kernel='sm90' needs a Hopper GPU")
def test_gemm_sm90_views_and_errors():
    gen = _seeded()
    dt = torch.bfloat16
    # x and out starting off a 16-byte boundary go through aligned copies.
    m, k, n = 77, 264, 136
    x = _fresh((m * k + 1,), dt, gen)[1:].view(m, k)
    w = _fresh((k, n), dt, gen)
    out = torch.full((m * n + 1,), float("nan"), dtype=dt, device="cuda")[1:].view(m, n)
    fusedist.gemm(x, w, out=out, kernel="sm90")
    assert gemm_err(out, x.double() @ w.double()) < GEMM_REL[dt]
    # A weight with a padded row stride (a slice of a wider matrix).
    wide = _fresh((k, n + 64), dt, gen)
    y = fusedist.gemm(x.contiguous(), wide[:, :n], kernel="sm90")
    assert gemm_err(y, x.double() @ wide[:, :n].double()) < GEMM_REL[dt]
    with pytest.raises(ValueError, match="multiples of 8"):
        fusedist.gemm(x.contiguous(), _fresh((k, 40), dt, gen)[:, :36], kernel="sm90")
    with pytest.raises(ValueError, match="pass out="):
        fusedist.gemm(x.contiguous(), w, kernel="sm90", accumulate=True)
    with pytest.raises(ValueError, match="does not accumulate"):
        fusedist.gemm(x.contiguous(), w, out=torch.empty(m, n, dtype=dt, device="cuda"),
                      kernel="decode", accumulate=True)


def _bench_gemm():
    import importlib.util
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gemm.py"
    spec = importlib.util.spec_from_file_location("bench_gemm", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_llama_sweep_plan_and_rules_round_trip(tmp_path):
    """benchmarks/gemm.py --shapes llama: every Llama-3-8B/70B projection at TP 1/2/4/8, TMA-
    legal, within the sweep's time budget; --write-rules output loads as the gemm rules."""
    from fusedist import tuning
    b = _bench_gemm()
    shapes = b.llama_shapes()
    assert len(shapes) == 2 * 4 * 5
    assert ("llama3-8b", 1, "down", 14336, 4096) in shapes
    assert ("llama3-70b", 8, "lm_head", 8192, 16032) in shapes
    assert all(k % 8 == 0 and n % 8 == 0 for *_, k, n in shapes)
    pts = b.sweep_points()
    assert {m for _, m in pts} == set(b.LLAMA_MS)
    assert b.sweep_seconds(pts) < 200
    rows = [{"layout": "nk", "dtype": "bfloat16", "M": m, "K": 14336, "N": 4096,
             "ratio_rounds": {"decode": [1.02, 1.01], "sm90": [0.9, 0.95], "auto": [1.0, 1.0]}}
            for m in (1, 2, 4)] + \
           [{"layout": "nk", "dtype": "bfloat16", "M": 8, "K": 14336, "N": 4096,
             "ratio_rounds": {"decode": [1.02, 0.9]}}]
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"allreduce": {}}))
    b.write_rules(tuning.derive_gemm_rules(b.points_from_results({"rows": rows})), path)
    table = json.loads(path.read_text())
    assert table["allreduce"] == {}
    assert tuning.gemm_rules(table) == [{"kernel": "decode", "layout": "nk", "dtype": "bfloat16",
                                         "k": 14336, "n": 4096, "m": [1, 4]}]


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_gemm_under_torch_compile(dev):
    """fusedist.gemm inside torch.compile(fullgraph=True) reaches torch.ops.fusedist.gemm and
    gives the eager result; out= is written and returned, accumulate=True adds into out."""
    if dev == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU")
    torch._dynamo.reset()
    dt = torch.bfloat16
    x = torch.randn(37, 72, device=dev).to(dt)
    w = torch.randn(40, 72, device=dev).to(dt).t()
    b = torch.randn(40, device=dev).to(dt)

    def compiled(fn):
        return torch.compile(fn, fullgraph=True, backend="aot_eager")

    want = fusedist.gemm(x, w, b)
    assert torch.equal(compiled(lambda: fusedist.gemm(x, w, b))(), want)
    out = torch.full((37, 40), float("nan"), dtype=dt, device=dev)
    got = compiled(lambda o: fusedist.gemm(x, w, b, out=o))(out)
    assert torch.equal(out, want) and torch.equal(got, want)
    c = torch.randn(37, 40, device=dev).to(dt)
    acc_want, acc = c.clone(), c.clone()
    fusedist.gemm(x, w, b, out=acc_want, accumulate=True)
    compiled(lambda o: fusedist.gemm(x, w, b, out=o, accumulate=True))(acc)
    assert torch.equal(acc, acc_want)
    torch._dynamo.reset()
