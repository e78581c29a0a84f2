"""fusedist.gemm: the Hopper wgmma GEMM (kernel="sm90") and the decode kernel (kernel="decode")
against a float64 reference; argument errors on any machine."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tolerances import GEMM_REL, gemm_rel_err  # noqa: E402

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
    err = gemm_rel_err(y, ref)
    assert y is out and err < GEMM_REL[dt], \
        f"{what} {dt} M={m} K={k} N={n} w={layout} bias={bias}: {err:.3g}"
    c = _fresh((m, n), dt, gen)
    acc = c.clone()
    run(x, w, b, acc, True)
    err = gemm_rel_err(acc, ref + c.double())
    assert err < GEMM_REL[dt], \
        f"{what} accumulate {dt} M={m} K={k} N={n} w={layout} bias={bias}: {err:.3g}"


def test_gemm_rejects_bad_arguments_on_cpu():
    x, w = torch.zeros(4, 8), torch.zeros(8, 16)
    with pytest.raises(TypeError, match="CUDA tensors"):
        fusedist.gemm(x, w)
    with pytest.raises(ValueError, match="kernel must be one of"):
        fusedist.gemm(x, w, kernel="cublas")


def test_gemm_auto_kernel_choice():
    from fusedist.ops.gemm import DECODE_MAX_M, auto_kernel, readable_rows

    # The decode kernel for few rows, then the sm90 GEMM (whose launcher picks the tile).
    assert DECODE_MAX_M == 64
    assert auto_kernel(1, False, True) == "decode"
    assert auto_kernel(64, False, True) == "decode"
    assert auto_kernel(65, False, True) == "sm90"
    assert auto_kernel(4096, False, True) == "sm90"
    # The decode kernel does not accumulate; no Hopper GPU: torch.matmul.
    assert auto_kernel(8, True, True) == "sm90"
    assert auto_kernel(8, True, False) == "torch"
    assert auto_kernel(500, False, False) == "torch"
    buf = torch.zeros(10, 16)
    assert readable_rows(buf[:3]) == 10
    assert readable_rows(buf[4:7]) == 6
    assert readable_rows(buf[:3, :8]) == 10
    assert readable_rows(buf[:3].clone()) == 3


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
    assert gemm_rel_err(out, x.double() @ w.double()) < GEMM_REL[dt]
    # A weight with a padded row stride (a slice of a wider matrix).
    wide = _fresh((k, n + 64), dt, gen)
    y = fusedist.gemm(x.contiguous(), wide[:, :n], kernel="sm90")
    assert gemm_rel_err(y, x.double() @ wide[:, :n].double()) < GEMM_REL[dt]
    with pytest.raises(ValueError, match="multiples of 8"):
        fusedist.gemm(x.contiguous(), _fresh((k, 40), dt, gen)[:, :36], kernel="sm90")
    with pytest.raises(ValueError, match="pass out="):
        fusedist.gemm(x.contiguous(), w, kernel="sm90", accumulate=True)
    with pytest.raises(ValueError, match="does not accumulate"):
        fusedist.gemm(x.contiguous(), w, out=torch.empty(m, n, dtype=dt, device="cuda"),
                      kernel="decode", accumulate=True)
