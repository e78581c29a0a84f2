"""A host stand-in for fusedist._C's layer kernels (add_rmsnorm, silu_mul, quantize_rows), so
the CPU tier runs the CUDA launch path of fusedist/ops/add_rmsnorm.py, silu_mul.py and
quantize_rows.py: the argument
structs, pointers, row strides in elements, the 16-byte rules and the copies around
non-conforming views, the FP8 outputs (fp8_out: e4m3 rows + a float32 scale per row). It
reads and writes the CPU tensors' memory at the pointers it is given (ctypes +
torch.frombuffer) with the kernels' semantics and the reference numerics, and checks every
rule the launchers check."""

from __future__ import annotations

import ctypes
import types

import torch

from fusedist import _dtypes
from fusedist.ops.add_rmsnorm import add_rmsnorm_reference
from fusedist.ops.quantize_rows import quantize_rows_reference
from fusedist.ops.silu_mul import silu_mul_reference

_DTYPES = {0: torch.float32, 1: torch.float16, 2: torch.bfloat16}


def _rows(ptr: int, stride: int, rows: int, width: int, dtype, vector: int = 16) -> torch.Tensor:
    """The [rows, width] matrix at device address ptr (here: host memory), row stride in
    elements (a whole number of `vector` bytes); writes go to that memory."""
    assert ptr % 16 == 0, "a pointer the kernel would get is not 16-byte aligned"
    assert stride * dtype.itemsize % vector == 0 and stride >= width, f"bad row stride {stride}"
    n = (rows - 1) * stride + width
    buf = (ctypes.c_char * (n * dtype.itemsize)).from_address(ptr)
    return torch.frombuffer(buf, dtype=dtype).as_strided((rows, width), (stride, 1))


class FakeLayersC:
    """Records each call's arguments in .calls."""
    ADD_RMSNORM_MAX_VECTORS = 4096

    def __init__(self):
        self.calls = []
        self.AddRmsNormArgs = lambda: types.SimpleNamespace(
            x=0, residual=0, weight=0, out=0, tokens=0, hidden=0, x_stride=0, residual_stride=0,
            out_stride=0, eps=1e-6, dtype=2, vectors_per_thread=0, scale=0, fp8_out=False)
        self.SiluMulArgs = lambda: types.SimpleNamespace(
            gate_up=0, out=0, tokens=0, inter=0, in_stride=0, out_stride=0, dtype=2, scale=0,
            fp8_out=False)
        self.QuantizeRowsArgs = lambda: types.SimpleNamespace(
            x=0, out=0, scale=0, tokens=0, k=0, in_stride=0, out_stride=0, dtype=2, group=0)

    def quantize_rows(self, a, stream):
        self.calls.append(("quantize_rows", vars(a).copy()))
        dt, T, k = _DTYPES[a.dtype], a.tokens, a.k
        assert k % (16 // dt.itemsize) == 0 and T > 0 and a.x and a.out and a.scale
        x = _rows(a.x, a.in_stride, T, k, dt)
        out = _rows(a.out, a.out_stride, T, k, torch.uint8, vector=16 // dt.itemsize)
        if a.group:   # one scale per group: scale [T, k / group] (the launcher's rule)
            per = 16 // dt.itemsize
            assert k % a.group == 0 and a.group % per == 0 and a.group // per in (8, 16, 32)
            q, s = quantize_rows_reference(x.clone().unflatten(-1, (k // a.group, a.group)))
            out.copy_(q.flatten(-2).view(torch.uint8))
            _rows(a.scale, k // a.group, T, k // a.group, torch.float32,
                  vector=4).copy_(s.squeeze(-1))
            return
        q, s = quantize_rows_reference(x.clone())
        _store(types.SimpleNamespace(scale=a.scale), out, q, s)

    def add_rmsnorm(self, a, stream):
        self.calls.append(("add_rmsnorm", vars(a).copy()))
        dt, T, n = _DTYPES[a.dtype], a.tokens, a.hidden
        assert n % 8 == 0 and T > 0
        hv, vpt = n * dt.itemsize // 16, a.vectors_per_thread
        assert hv <= self.ADD_RMSNORM_MAX_VECTORS and vpt in (0, 1, 2, 4, 8)
        if vpt and -(-hv // vpt) > 512:   # the launcher's rule (csrc/ops/layers/add_rmsnorm.cu)
            raise ValueError(f"fusedist: add_rmsnorm: vectors_per_thread {vpt} is too few for "
                             f"hidden {n}")
        x = _rows(a.x, a.x_stride, T, n, dt)
        w = _rows(a.weight, n, 1, n, dt)[0]
        out = _out(a, T, n, dt)
        res = _rows(a.residual, a.residual_stride, T, n, dt) if a.residual else None
        r = add_rmsnorm_reference(x.clone(), None if res is None else res.clone(), w.clone(),
                                  float(a.eps), _dtypes.FP8 if a.fp8_out else None)
        if res is not None:
            res.copy_(r[1])
        _store(a, out, r[0], r[2] if a.fp8_out else None)

    def silu_mul(self, a, stream):
        self.calls.append(("silu_mul", vars(a).copy()))
        dt, T, i = _DTYPES[a.dtype], a.tokens, a.inter
        assert i % 8 == 0 and T > 0
        gu = _rows(a.gate_up, a.in_stride, T, 2 * i, dt)
        out = _out(a, T, i, dt)
        if a.fp8_out:
            _store(a, out, *silu_mul_reference(gu.clone(), _dtypes.FP8))
        else:
            out.copy_(silu_mul_reference(gu.clone()))


def _out(a, rows: int, width: int, dt) -> torch.Tensor:
    """The output rows: dt, or e4m3 bytes (uint8) with a row stride of whole vectors of dt's
    elements (the kernels' e4m3 stores); the launchers' scale / fp8_out rules."""
    assert bool(a.fp8_out) == bool(a.scale), "scale is given exactly with fp8_out"
    if a.fp8_out:
        return _rows(a.out, a.out_stride, rows, width, torch.uint8, vector=16 // dt.itemsize)
    return _rows(a.out, a.out_stride, rows, width, dt)


def _store(a, out, values, scale) -> None:
    if scale is None:
        out.copy_(values)
        return
    out.copy_(values.view(torch.uint8))
    assert a.scale % 4 == 0
    n = scale.numel()
    buf = (ctypes.c_char * (4 * n)).from_address(a.scale)
    torch.frombuffer(buf, dtype=torch.float32).copy_(scale.reshape(-1))


def install(monkeypatch, *modules) -> FakeLayersC:
    """Route `modules` (fusedist.ops.add_rmsnorm, silu_mul, quantize_rows) to one FakeLayersC
    for CPU tensors."""
    from fusedist import _ext

    fake = FakeLayersC()
    monkeypatch.setattr(_ext, "load", lambda: fake)
    monkeypatch.setattr(_ext, "available", lambda: True)
    # The capability table answers "runs here" for the layer kernels, on any device.
    real = _ext.why_not
    layers = {"add_rmsnorm", "silu_mul", "quantize_rows"}
    monkeypatch.setattr(_ext, "why_not",
                        lambda kernel, device: "" if kernel in layers else real(kernel, device))
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: types.SimpleNamespace(cuda_stream=0))
    return fake
