"""fusedist.ops.quantize_rows: per-token FP8 quantization (e4m3 + one float32 scale a row).

The convention (fusedist/ops/quantize_rows.py): scale = max(amax |x|, 1e-30) / 448 (1 for a row
of zeros), q = e4m3(x / scale) with +-448 saturation. The kernel does the same fp32 operations
as the torch reference (a conversion, one IEEE division, one rounding), so it must agree with
the CPU reference bit for bit, NaN payloads aside (torch's own ops on CUDA divide by the scalar
448 as a multiply by its reciprocal: their scales can differ in the last bit). The reference
itself is checked against float64 here: every |q * scale - x| within half an e4m3 ulp
(2^-4 |x|) plus half the subnormal step (2^-10 scale), the row's largest |q| exactly 448."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fusedist  # noqa: E402
QR = importlib.import_module("fusedist.ops.quantize_rows")

FP8 = getattr(torch, "float8_e4m3fn", None)
pytestmark = pytest.mark.skipif(FP8 is None, reason="torch without float8_e4m3fn")
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _need_kernel(device):
    if device == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        why = QR.kernel_why_not(torch.empty(1, 8, dtype=torch.bfloat16, device="cuda"))
        if why:
            pytest.fail(f"the gpu tier needs the quantize_rows kernel: {why}")


def _same(q, s, q_ref, s_ref, what=""):
    """Bitwise, except that NaN bytes only have to be NaN at the same places."""
    q, s, q_ref, s_ref = q.cpu(), s.cpu(), q_ref.cpu(), s_ref.cpu()
    assert q.shape == q_ref.shape and s.shape == s_ref.shape, what
    qn, rn = q.float().isnan(), q_ref.float().isnan()
    assert torch.equal(qn, rn), f"NaN places differ {what}"
    assert torch.equal(q.view(torch.uint8)[~qn], q_ref.view(torch.uint8)[~rn]), \
        f"{int((q.view(torch.uint8) != q_ref.view(torch.uint8))[~qn].sum())} e4m3 bytes differ {what}"
    sn = s.isnan()
    assert torch.equal(sn, s_ref.isnan()) and torch.equal(s[~sn], s_ref[~sn]), f"scales {what}"


def _check_64(q, s, x, what=""):
    """(q, s) against float64 on x's values (module docstring); NaN rows all NaN."""
    x64 = x.double().cpu().reshape(-1, x.shape[-1])
    q64, s64 = q.double().cpu().reshape(x64.shape), s.double().cpu().reshape(-1, 1)
    nan = x64.isnan().any(-1)
    assert bool(q64[nan].isnan().all() and s64[nan].isnan().all()), f"NaN rows {what}"
    q64, s64, x64 = q64[~nan], s64[~nan], x64[~nan]
    amax = x64.abs().amax(-1, keepdim=True)
    want = torch.where(amax == 0, torch.ones_like(amax), amax.clamp_min(1e-30) / 448.0)
    assert bool(((s64 - want).abs() <= 2.0 ** -23 * want).all()), f"scales {what}"
    err = (q64 * s64 - x64).abs()
    assert bool((err <= 2.0 ** -4 * x64.abs() + 2.0 ** -10 * s64).all()), f"values {what}"
    full = (amax >= 1e-30).squeeze(-1)   # below the floor the row maps under 448
    assert bool((q64[full].abs().amax(-1) == 448.0).all()), f"largest |q| {what}"


def _x(shape, dtype, device, seed, spread=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if spread:   # rows of very different magnitudes
        x = x * torch.logspace(-3, 3, shape[0]).reshape(-1, *([1] * (len(shape) - 1)))
    return x.to(dtype).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k", [(1, 8), (7, 136), (33, 4096), (5, 14336 + 8), (3, 24584)])
def test_odd_shapes_against_float64_and_reference(device, dtype, m, k):
    _need_kernel(device)
    if k % (16 // torch.empty((), dtype=dtype).element_size()):
        k += 4
    x = _x((m, k), dtype, device, m * 31 + k)
    q, s = QR.quantize_rows(x)
    assert q.dtype == FP8 and s.dtype == torch.float32 and s.shape == (m, 1)
    assert q.device == x.device
    _check_64(q, s, x, f"{device} {dtype} {m}x{k}")
    _same(q, s, *QR.quantize_rows_reference(x.cpu()), f"{device} {dtype} {m}x{k}")


@pytest.mark.parametrize("device", DEVICES)
def test_special_rows(device):
    """Zeros (scale 1), a NaN (row all NaN), an infinity (scale inf: that element NaN, the
    rest 0), a tiny row (amax floored at 1e-30), -0 kept, values on e4m3's rounding
    boundaries, one huge element beside small ones (they flush to e4m3 subnormals / 0)."""
    _need_kernel(device)
    k = 64
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(3))
    x[0] = 0.0
    x[1, 5] = float("nan")
    x[2, 9] = float("inf")
    x[3] = x[3] * 1e-36
    x[4] = -0.0
    x[4, 0] = 1.0
    x[5] = torch.arange(k) * (448.0 / 63)          # amax 448: scale 1, q = x rounded
    x[6, 0] = 3e38
    x[7] = x[7].abs() * -1
    q, s = QR.quantize_rows(x.to(device))
    q_ref, s_ref = QR.quantize_rows_reference(x)
    _same(q, s, q_ref, s_ref, device)
    s = s.cpu()
    assert s[0] == 1.0 and q.cpu()[0].float().eq(0).all()
    assert s[1].isnan() and q.cpu()[1].float().isnan().all()
    assert s[2].isinf() and q.cpu()[2, 9].float().isnan() and q.cpu()[2].float()[:9].eq(0).all()
    assert s[3] == torch.tensor(1e-30) / 448.0
    assert (q.cpu()[4, 1:].view(torch.uint8) == 0x80).all()    # -0 stays -0
    _check_64(q[[0, 3, 4, 5, 6, 7]], s[[0, 3, 4, 5, 6, 7]], x[[0, 3, 4, 5, 6, 7]], device)


@pytest.mark.parametrize("device", DEVICES)
def test_layouts(device):
    """3-d input (scale [..., 1]), a strided row view (row stride > K), an unaligned start
    (copied first), K not a whole vector (the reference path), empty."""
    _need_kernel(device)
    x = _x((2, 5, 136), torch.bfloat16, device, 9)
    q, s = QR.quantize_rows(x)
    assert q.shape == (2, 5, 136) and s.shape == (2, 5, 1)
    _same(q, s, *QR.quantize_rows_reference(x.cpu()), "3-d")
    wide = _x((6, 200), torch.bfloat16, device, 10)
    _same(*QR.quantize_rows(wide[:, :136]), *QR.quantize_rows_reference(wide[:, :136].cpu()),
          "strided")
    flat = _x((6 * 136 + 1, 1), torch.bfloat16, device, 11).reshape(-1)
    odd = flat[1:].view(6, 136)
    _same(*QR.quantize_rows(odd), *QR.quantize_rows_reference(odd.cpu()), "unaligned")
    x12 = _x((4, 12), torch.bfloat16, device, 12)
    if device == "cuda":
        assert "multiple of 8" in QR.kernel_why_not(x12)
    # the torch ops on x's device (on CUDA torch divides by the scalar 448 as a multiply by its
    # reciprocal, so its scales can differ from the CPU's in the last bit)
    q12, s12 = QR.quantize_rows(x12)
    _same(q12, s12, *QR.quantize_rows_reference(x12), "K = 12")
    _check_64(q12, s12, x12, "K = 12")
    q, s = QR.quantize_rows(x[:, :0])
    assert q.shape == (2, 0, 136) and s.shape == (2, 0, 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,group", [(1, 128, 128), (7, 384, 128), (33, 4096, 128),
                                       (300, 2048 + 128, 128), (5, 192, 64), (3, 96, 32)])
def test_groups_against_reference(device, dtype, m, k, group):
    """quantize_groups: each group of k quantized as quantize_rows quantizes a row, bit for
    bit the CPU reference (the group kernel where a group is 8-32 vectors, else the row
    kernel on the groups or the torch ops), every group within the float64 bound; a group of
    zeros, a NaN, an infinity and a tiny group stay inside their group."""
    _need_kernel(device)
    x = _x((m, k), dtype, "cpu", m * 7 + k + group).float()
    x[0, :group] = 0.0
    if k >= 2 * group:
        x[0, group + 3] = float("nan")
    if m > 1 and k >= 3 * group:
        x[1, 2 * group + 1] = float("inf")
        x[1, :group] *= 1e-36
    x = x.to(dtype)
    q, s = QR.quantize_groups(x.to(device), group)
    assert q.shape == (m, k) and s.shape == (m, k // group) and s.dtype == torch.float32
    q_ref, s_ref = QR.quantize_groups_reference(x, group)
    _same(q, s, q_ref, s_ref, f"{device} {dtype} {m}x{k}/{group}")
    assert s.cpu()[0, 0] == 1.0 and q.cpu()[0, :group].float().eq(0).all()
    g = k // group
    fin = ~x.float().unflatten(-1, (g, group)).isnan().any(-1) & \
        ~x.float().unflatten(-1, (g, group)).isinf().any(-1)
    xs, qs, ss = (t.cpu().unflatten(-1, (g, group)) if t.shape[-1] == k else t.cpu()
                  for t in (x, q, s))
    _check_64(qs[fin], ss[fin], xs[fin], f"{device} {dtype} groups")
    wide = _x((m, k + 2 * group), dtype, device, 5)[:, group:group + k]   # a strided view
    _same(*QR.quantize_groups(wide, group), *QR.quantize_groups_reference(wide.cpu(), group),
          "strided")
    if device == "cuda":
        torch.cuda.synchronize()


def test_groups_bad_group_and_launch_path(monkeypatch):
    with pytest.raises(ValueError, match="group must be a positive divisor of K = 384"):
        QR.quantize_groups(torch.zeros(2, 384), 100)
    from _fake_layers import install

    fake = install(monkeypatch, importlib.import_module("fusedist.ops.quantize_rows"))
    x = _x((5, 512), torch.bfloat16, "cpu", 4)
    q, s = QR.quantize_groups(x)
    _, a = fake.calls[-1]
    assert a["group"] == 128 and (a["tokens"], a["k"]) == (5, 512) and s.shape == (5, 4)
    _same(q, s, *QR.quantize_groups_reference(x), "fake groups")
    q, s = QR.quantize_groups(x, 256)   # 32 vectors of bf16: the group kernel too
    assert fake.calls[-1][1]["group"] == 256
    _same(q, s, *QR.quantize_groups_reference(x, 256), "fake 256")
    n = len(fake.calls)
    q, s = QR.quantize_groups(x, 512)   # 64 vectors: the row kernel on the groups
    assert fake.calls[-1][1]["group"] == 0 and len(fake.calls) == n + 1
    _same(q, s, *QR.quantize_groups_reference(x, 512), "fake 512")


def test_bad_inputs_name_the_fix():
    with pytest.raises(ValueError, match="x has dtype torch.int32"):
        QR.quantize_rows(torch.zeros(2, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="x must be a tensor"):
        QR.quantize_rows([1.0, 2.0])
    with pytest.raises(ValueError, match="K. must be positive"):
        QR.quantize_rows(torch.zeros(2, 0))


def test_nn_quant_uses_it():
    """fusedist.nn.quant.quantize_rows is this op; the torch baseline's plain-torch path is the
    reference."""
    from fusedist.nn import quant
    assert quant.quantize_rows is QR.quantize_rows
    assert quant.quantize_rows_reference is QR.quantize_rows_reference
    assert fusedist.ops.quantize_rows is QR.quantize_rows


def test_launch_path_on_a_host_fake(monkeypatch):
    """The CUDA launch path on CPU tensors through the host stand-in (tests/ops/
    _fake_layers.py): pointers, row strides in elements, a strided view addressed in place, an
    unaligned x copied first; bitwise the reference."""
    from _fake_layers import install

    fake = install(monkeypatch, importlib.import_module("fusedist.ops.quantize_rows"))
    for dt, k in ((torch.bfloat16, 136), (torch.float32, 12)):
        x = _x((5, k + 8), dt, "cpu", 4)
        q, s = QR.quantize_rows(x[:, :k])
        _, a = fake.calls[-1]
        assert (a["tokens"], a["k"], a["in_stride"], a["out_stride"]) == (5, k, k + 8, k)
        assert a["x"] == x.data_ptr() and a["out"] == q.data_ptr() and a["scale"] == s.data_ptr()
        _same(q, s, *QR.quantize_rows_reference(x[:, :k]), f"fake {dt}")
    flat = torch.zeros(5 * 136 + 1, dtype=torch.bfloat16)
    odd = flat[1:].view(5, 136)
    odd.copy_(_x((5, 136), torch.bfloat16, "cpu", 5))
    n = len(fake.calls)
    _same(*QR.quantize_rows(odd), *QR.quantize_rows_reference(odd), "fake unaligned")
    assert len(fake.calls) == n + 1 and fake.calls[-1][1]["x"] != odd.data_ptr()


@pytest.mark.parametrize("device,backend", [("cpu", "aot_eager"),
                                            pytest.param("cuda", "inductor",
                                                         marks=pytest.mark.gpu)])
def test_under_torch_compile(device, backend):
    _need_kernel(device)
    torch._dynamo.reset()
    x = _x((9, 136), torch.bfloat16, device, 6)
    run = torch.compile(lambda t: QR.quantize_rows(t * 2), fullgraph=True, backend=backend)
    _same(*run(x), *QR.quantize_rows_reference((x * 2).cpu()), "compiled")
    torch._dynamo.reset()


@pytest.mark.gpu
def test_cuda_graph_and_many_rows():
    """One capture; replays with new inputs equal the reference bitwise. Rows past 65535
    (one block a row: the grid's x dimension)."""
    _need_kernel("cuda")
    x = _x((64, 4096), torch.bfloat16, "cuda", 7)
    QR.quantize_rows(x)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        q, s = QR.quantize_rows(x)
    for seed in (1, 2):
        x0 = _x((64, 4096), torch.bfloat16, "cuda", 100 + seed)
        x.copy_(x0)
        q.view(torch.uint8).fill_(0x7F)
        s.fill_(float("nan"))
        g.replay()
        _same(q, s, *QR.quantize_rows_reference(x0.cpu()), f"replay {seed}")
    many = _x((70000, 16), torch.bfloat16, "cuda", 8, spread=False)
    _same(*QR.quantize_rows(many), *QR.quantize_rows_reference(many.cpu()), "many rows")
