"""The CUDA extension and what it can do: the one place that asks `fusedist._C` what it holds.

    from fusedist import _ext
    caps = _ext.capabilities()          # built once per process (None fields when _C is absent)
    caps.has("gemv")                    # the build carries the gemv kernel
    _ext.kernel_runs("gemv", device)    # ... and it runs on this CUDA device (its arch is built)
    _ext.why_not("gemv", device)        # the reason it does not ("" when it does)

`import fusedist` works without the extension (CPU machines, docs builds); GPU ops load it on
first use and say how to build it when it is missing. When it loads, its version and ABI are
checked against this package: a `_C` left over from another checkout or an older build is one
ExtensionMismatchError that names both versions and the rebuild command, instead of an
AttributeError deep inside an op.

The kernel names are fusedist's own (one per launcher family, the stem of its csrc/ops file);
KERNELS maps each to the `_C` symbol that carries it, the dtypes it takes and the compute
capabilities it needs. An op asks `kernel_runs(name, device)` (or `why_not`) and never probes
`_C` itself; tests/test_ext.py scans the package for such probes.
"""

from __future__ import annotations

import functools
import importlib
import re
import warnings
from dataclasses import dataclass, field
from typing import Optional

from ._version import __version__
from .errors import ExtensionMismatchError, ExtensionMissingError

# Bumped whenever an argument struct, a constant or a function signature of _C changes in a
# way an older build would misread; csrc/include/fusedist/common/common.h kAbiVersion.
ABI_VERSION = 2
REBUILD = "pip install --no-build-isolation .   (or: bash tests/run.sh, which rebuilds it)"


@dataclass(frozen=True)
class Kernel:
    """One kernel family of _C: the symbol that carries it, the dtypes it takes (what its
    launcher accepts; ops check the call's finer limits) and the least compute capability."""
    symbol: str
    dtypes: tuple = ()
    min_cc: tuple = (9, 0)
    what: str = ""


_FLOATS = ("float32", "float16", "bfloat16")
_HALF = ("float16", "bfloat16")
# Every kernel family an op may ask for. min_cc (9, 0): the build targets sm_90a by default
# (wgmma, TMA, clusters), whose machine code runs on compute capability 9.0 only.
KERNELS = {
    # collectives over symmetric memory (comm/)
    "allreduce": Kernel("allreduce", _FLOATS, (7, 0), "one-shot / two-shot all-reduce"),
    "allreduce_rmsnorm": Kernel("allreduce_rmsnorm", _FLOATS, (7, 0),
                                "all-reduce + residual add + RMSNorm"),
    "fp8_codec": Kernel("fp8_encode", _FLOATS, (9, 0), "FP8 collective payload codec"),
    "call_check": Kernel("call_check", (), (7, 0), "ranks' call descriptors compared"),
    # GEMMs (gemm/)
    "gemm_sm90": Kernel("gemm_sm90", _HALF, (9, 0), "CUTLASS warp-specialized GEMM"),
    "gemm_ar_fused": Kernel("gemm_ar_fused", ("bfloat16",), (9, 0),
                            "decode GEMM + all-reduce in one kernel"),
    "gemv": Kernel("gemv", ("bfloat16", "float8_e4m3fn"), (9, 0), "decode GEMV"),
    "gemv_w8a8": Kernel("GEMV_MAX_M_FP8_X", ("float8_e4m3fn",), (9, 0),
                        "decode GEMV with an e4m3 x"),
    "fp8_gemm": Kernel("fp8_gemm", ("float8_e4m3fn",), (9, 0), "CUTLASS FP8 GEMM"),
    # attention/
    "attention_decode": Kernel("attention_decode", _HALF + ("float8_e4m3fn",), (9, 0),
                               "paged split-KV decode"),
    "attention_decode_cluster": Kernel("ATTENTION_DECODE_MAX_CLUSTER_SPLITS", _HALF, (9, 0),
                                       "decode's cluster merge"),
    "attention_prefill": Kernel("attention_prefill", _HALF + ("float8_e4m3fn",), (8, 0),
                                "paged prefill (mma.sync; wgmma on sm_90a)"),
    "paged_check": Kernel("paged_check", (), (7, 0), "device-side page-table checks"),
    "poison_rows": Kernel("poison_rows", _FLOATS, (7, 0), "NaN rows a check rejected"),
    "rope_append": Kernel("rope_append", _FLOATS, (7, 0), "RoPE + KV-cache append"),
    # layers/
    "add_rmsnorm": Kernel("add_rmsnorm", _FLOATS, (7, 0), "residual add + RMSNorm"),
    "silu_mul": Kernel("silu_mul", _FLOATS, (7, 0), "SwiGLU activation"),
    "quantize_rows": Kernel("quantize_rows", _FLOATS, (8, 9), "per-token / per-group FP8"),
    # mixture of experts (moe/)
    "moe_gating": Kernel("moe_gating", _FLOATS, (7, 0), "router top-k and the layout by expert"),
    "moe_permute": Kernel("moe_permute", _FLOATS, (7, 0), "token permute / unpermute"),
    "moe_grouped_gemm": Kernel("moe_grouped_gemm", ("bfloat16", "float8_e4m3fn"), (9, 0),
                               "CUTLASS grouped GEMM over experts"),
    "moe_grouped_gemv": Kernel("moe_grouped_gemv", ("bfloat16", "float8_e4m3fn"), (9, 0),
                               "decode GEMV over routed experts"),
    # expert parallelism (ep/)
    "ep_low_latency": Kernel("ep_dispatch", ("bfloat16",), (9, 0),
                             "dispatch / combine over symmetric memory"),
}


def _cc(arch: str) -> Optional[tuple]:
    """'90a' -> (9, 0); '100a' -> (10, 0); None for a malformed entry."""
    m = re.fullmatch(r"(\d+?)(\d)[af]?", arch.strip())
    return (int(m[1]), int(m[2])) if m else None


@dataclass(frozen=True)
class Capabilities:
    """What the loaded _C holds (built once per process: capabilities())."""
    built: bool
    why_missing: str = ""           # why _C did not load (built False)
    version: str = ""               # the package version _C was built from
    abi: int = 0
    cuda_archs: tuple = ()          # e.g. ("90a",)
    cuda_runtime: int = 0           # CUDART_VERSION it was compiled against, e.g. 13000
    kernels: frozenset = field(default_factory=frozenset)

    def has(self, kernel: str) -> bool:
        """The build carries `kernel` (a KERNELS name)."""
        if kernel not in KERNELS:
            raise KeyError(f"fusedist._ext: unknown kernel {kernel!r}; known: {sorted(KERNELS)}")
        return kernel in self.kernels

    def runs_on(self, capability: tuple) -> bool:
        """Some architecture of the build runs on a device of this compute capability (sm_XYa
        code runs on exactly X.Y; plain sm_XY from X.Y up within the major version)."""
        for arch in self.cuda_archs:
            cc = _cc(arch)
            if cc is None:
                continue
            exact = arch.endswith(("a", "f"))
            if cc == tuple(capability) or (not exact and cc[0] == capability[0]
                                          and cc <= tuple(capability)):
                return True
        return False

    def table(self) -> str:
        """The table as text (python -m fusedist.tuning --caps prints it)."""
        if not self.built:
            return f"fusedist._C: not loaded ({self.why_missing})"
        lines = [f"fusedist._C {self.version} (ABI {self.abi}), archs "
                 f"{', '.join(self.cuda_archs) or '?'}, CUDA runtime {self.cuda_runtime}"]
        for name, k in KERNELS.items():
            mark = "yes" if name in self.kernels else "no "
            lines.append(f"  {mark} {name:26s} cc >= {k.min_cc[0]}.{k.min_cc[1]}  "
                         f"{'/'.join(k.dtypes) or '-':42s} {k.what}")
        return "\n".join(lines)


@functools.lru_cache(maxsize=1)
def load():
    """fusedist._C, checked against this package (ExtensionMissingError when it cannot be
    imported, ExtensionMismatchError when it was built from another version)."""
    try:
        # By name: _C is a compiled module, and a `from . import _C` would read (to import
        # linters) as this core module importing the whole package.
        _C = importlib.import_module("fusedist._C")
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ExtensionMissingError(
            "fusedist: the CUDA extension fusedist._C is not available "
            f"({e}). Build it with `pip install --no-build-isolation .` on a machine with nvcc "
            "(CUDA >= 12.4), or use CPU tensors for the reference path."
        ) from e
    check_build(getattr(_C, "VERSION", None), getattr(_C, "ABI_VERSION", None),
                getattr(_C, "__file__", "?"))
    return _C


def check_build(version: Optional[str], abi: Optional[int], where: str = "?") -> None:
    """ExtensionMismatchError unless _C's version and ABI are this package's."""
    if version == __version__ and abi == ABI_VERSION:
        return
    built = "an unversioned build (older than the capability table)" if version is None else \
        f"version {version} with ABI {abi}"
    raise ExtensionMismatchError(
        f"fusedist: the compiled extension {where} is {built}, but this fusedist package is "
        f"version {__version__} with ABI {ABI_VERSION}: the extension is stale. Rebuild it "
        f"from this checkout: {REBUILD}")


def available() -> bool:
    """_C loads (and matches this package)."""
    try:
        load()
        return True
    except ExtensionMissingError:
        return False


@functools.lru_cache(maxsize=1)
def capabilities() -> Capabilities:
    """The capability table, built once from _C (built=False, with the reason, when absent).
    A stale _C raises ExtensionMismatchError here too: it is never silently ignored."""
    try:
        C = load()
    except ExtensionMissingError as e:
        return Capabilities(built=False, why_missing=str(e))
    archs = tuple(a for a in str(getattr(C, "CUDA_ARCHS", "")).replace(",", ";").split(";")
                  if a.strip())
    kernels = frozenset(name for name, k in KERNELS.items() if hasattr(C, k.symbol))
    return Capabilities(built=True, version=C.VERSION, abi=int(C.ABI_VERSION),
                        cuda_archs=archs, cuda_runtime=int(getattr(C, "CUDA_RUNTIME", 0)),
                        kernels=kernels)


@functools.lru_cache(maxsize=16)
def _device_cc(index: int) -> tuple:
    import torch
    return tuple(torch.cuda.get_device_capability(index))


def device_capability(device) -> tuple:
    """A CUDA device's (major, minor), read once per device index."""
    import torch
    device = torch.device(device)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return _device_cc(idx)


# why_not's answers for CUDA devices, (kernel, device index, compute capability) -> (the
# capability table asked, the answer): the ops ask on every call, and the answer only changes
# with the table or the device (a test that stands in another gets its own answers).
_why_not_seen: dict = {}


def why_not(kernel: str, device) -> str:
    """Why `kernel` cannot run on `device` ("" when it can): the device is not CUDA, _C is
    absent, the build lacks the kernel, no built architecture runs on the device, or the
    device is older than the kernel needs."""
    import torch
    device = torch.device(device)
    k = KERNELS.get(kernel)
    if k is None:
        raise KeyError(f"fusedist._ext: unknown kernel {kernel!r}; known: {sorted(KERNELS)}")
    if device.type != "cuda":
        return f"tensors on {device} (the {kernel} kernel is CUDA)"
    caps = capabilities()
    if not caps.built:
        return "fusedist._C is not built"
    if kernel not in caps.kernels:
        return f"fusedist._C was built without the {kernel} kernel"
    cc = device_capability(device)
    key = (kernel, device.index, cc)
    seen = _why_not_seen.get(key)
    if seen is not None and seen[0] is caps:
        return seen[1]
    why = _why_not_cc(kernel, k, device, caps, cc)
    _why_not_seen[key] = (caps, why)
    return why


def _why_not_cc(kernel: str, k: "Kernel", device, caps: Capabilities, cc: tuple) -> str:
    if cc < k.min_cc:
        return (f"the {kernel} kernel needs compute capability >= {k.min_cc[0]}.{k.min_cc[1]}; "
                f"{device} is {cc[0]}.{cc[1]}")
    if not caps.runs_on(cc):
        return (f"fusedist._C was built for {', '.join(caps.cuda_archs)}, which does not run on "
                f"{device} (compute capability {cc[0]}.{cc[1]}); rebuild with "
                f"FUSEDIST_CUDA_ARCHS={cc[0]}{cc[1]}{'a' if cc >= (9, 0) else ''}")
    return ""


def kernel_runs(kernel: str, device) -> bool:
    """`kernel` is in the build and runs on `device` (why_not says why not)."""
    return not why_not(kernel, device)


def stream(device) -> int:
    """The raw handle (cudaStream_t) of the current stream of CUDA `device` (a torch.device),
    which the launchers take, read without building a torch.cuda.Stream object on every
    launch. Another device type (a test's stand-in for one) asks torch.cuda.current_stream."""
    import torch
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None or device.type != "cuda":
        return torch.cuda.current_stream(device).cuda_stream
    return raw(device.index if device.index is not None else torch.cuda.current_device())


_warned: set = set()


def warn_reference(op: str, why: str) -> None:
    """Once per process and reason: CUDA tensors are taking the plain-torch reference path
    (correct, but far slower than the kernel)."""
    if (op, why) in _warned:
        return
    _warned.add((op, why))
    warnings.warn(f"fusedist.{op}: CUDA tensors run the plain-torch reference path ({why})",
                  RuntimeWarning, stacklevel=4)
