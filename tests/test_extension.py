"""fusedist._C: built and importable (CPU tier, where CI builds it), and its primitives on one
GPU (gpu tier)."""

from __future__ import annotations

import ctypes
import os

import pytest


def _ext():
    import fusedist._ext as ext

    return ext


def test_extension_builds_and_imports():
    """CI builds every CUDA source; FUSEDIST_REQUIRE_EXT=1 turns a missing _C into a failure."""
    ext = _ext()
    if not ext.available():
        if os.environ.get("FUSEDIST_REQUIRE_EXT") == "1":
            ext.load()  # raises with the reason
        pytest.skip("fusedist._C not built here")
    C = ext.load()
    assert C.MAX_RANKS == 8 and C.GENERATIONS == 3
    assert C.EMPTY_WORD == 0x80008000
    assert C.ERROR_RECORD_BYTES == 64 and C.CONTROL_BYTES == 16
    assert C.ALGO_ONE_SHOT == 0 and C.ALGO_TWO_SHOT == 1


def test_extension_without_gpu_raises_cuda_error():
    ext = _ext()
    if not ext.available():
        pytest.skip("fusedist._C not built here")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="fusedist: CUDA error"):
        ext.load().device_alloc(16)


@pytest.mark.gpu
def test_primitives_on_one_gpu():
    import torch

    C = _ext().load()
    info = C.device_info(torch.cuda.current_device())
    assert info.sm_count > 0 and info.pci_bus_id
    n = 1027
    p = C.device_alloc(n * 4)
    try:
        s = torch.cuda.current_stream().cuda_stream
        C.fill_u32(p, C.EMPTY_WORD, n, s)
        C.stream_synchronize(s)
        host = (ctypes.c_uint32 * n).from_buffer_copy(C.copy_to_host(p, n * 4))
        assert all(v == C.EMPTY_WORD for v in host)
    finally:
        C.device_free(p)
    h = C.host_mapped_alloc(32)
    try:
        assert C.host_mapped_device_ptr(h) != 0
        assert (ctypes.c_uint32 * 8).from_address(h)[0] == 0
    finally:
        C.host_mapped_free(h)


@pytest.mark.gpu
def test_world_size_one_all_reduce_is_identity():
    import torch

    import fusedist
    from tolerances import TOL_EPILOGUE, count_bad

    fusedist.init(rank=0, world_size=1)
    try:
        x = torch.randn(1023, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(fusedist.all_reduce(x), x)
        for dtype in (torch.float32, torch.bfloat16):
            tokens, hidden, eps = 3, 1016, 1e-6
            g = torch.Generator(device="cuda")
            g.manual_seed(int.from_bytes(os.urandom(4), "little"))
            x, res, w = (torch.randn(shape, device="cuda", generator=g).to(dtype)
                         for shape in ((tokens, hidden), (tokens, hidden), (hidden,)))
            n, r = fusedist.all_reduce_add_rmsnorm(x, res, w, eps)
            # float64 reference with the op's roundings: round(x + residual), then the norm.
            h = (x.double() + res.double()).to(dtype)
            hd = h.double()
            y = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + eps) * w.double()
            assert count_bad(r, h, dtype, TOL_EPILOGUE) == 0, f"{dtype}: new residual"
            assert count_bad(n, y, dtype, TOL_EPILOGUE) == 0, f"{dtype}: normed"
    finally:
        fusedist.shutdown()
