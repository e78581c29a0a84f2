"""Which kernel runs for a shape, and why: the ops' own plans, printed (python -m
fusedist.tuning --explain).

Each explainer takes the shape as key=value words and answers with the path the op would take,
the reason, and the tuning-table knobs (with the benchmark that measured them) that decided it.
On a machine with a CUDA GPU the plans are made for that GPU and this build of fusedist._C; on
one without, for the GPU model the shipped table was measured on (its "measured_on"), every
kernel of the build assumed present, compute capability 9.0 and 132 SMs (an H100 / H200).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .. import _dtypes, _ext, tuning

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
          "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32,
          "fp8": _dtypes.FP8, "e4m3": _dtypes.FP8}


@dataclass(frozen=True)
class Target:
    """The device a plan is explained for."""
    gpu: str
    capability: tuple
    sms: int
    kernels: frozenset          # kernel families (fusedist._ext.KERNELS) that run there
    assumed: bool               # True: no such GPU here, the facts are assumed
    table: dict

    def runs(self, kernel: str) -> bool:
        return kernel in self.kernels

    def describe(self) -> str:
        how = "assumed: no CUDA device here; every kernel of the build" if self.assumed else \
            f"this build: {len(self.kernels)} of {len(_ext.KERNELS)} kernel families run"
        return (f"{self.gpu} (compute capability {self.capability[0]}.{self.capability[1]}, "
                f"{self.sms} SMs; {how})")


def target(gpu: Optional[str] = None, capability: Optional[tuple] = None) -> Target:
    """The local CUDA device's facts, or the assumed ones (module docstring)."""
    if torch.cuda.is_available() and gpu is None and capability is None:
        dev = torch.device("cuda", torch.cuda.current_device())
        kernels = frozenset(k for k in _ext.KERNELS if _ext.kernel_runs(k, dev))
        return Target(torch.cuda.get_device_name(dev), _ext.device_capability(dev),
                      torch.cuda.get_device_properties(dev).multi_processor_count, kernels,
                      False, tuning.gpu_table(dev))
    table = tuning.gpu_table(None)
    name = gpu or table.get("measured_on", "NVIDIA H200")
    cc = capability or (9, 0)
    kernels = frozenset(k for k, v in _ext.KERNELS.items() if cc >= v.min_cc)
    return Target(name, cc, 132, kernels, True, table)


def _knobs_line(t: Target, section: str) -> str:
    values = tuning.section_values(t.table, section)
    src = t.table.get("sources", {}).get(section, "the declared defaults")
    bench = t.table.get(section, {}).get("benchmark", "not measured")
    vals = ", ".join(f"{k}={v}" for k, v in values.items())
    return f"  knobs: {section} {{{vals}}}\n         from {src}; measured by {bench}"


def _int(args: dict, key: str, default: Optional[int] = None) -> int:
    if key not in args:
        if default is None:
            raise ValueError(f"explain: give {key}=N")
        return default
    try:
        return int(float(args[key]))
    except ValueError:
        raise ValueError(f"explain: {key} must be a number, got {args[key]!r}") from None


def _dtype(args: dict, key: str, default: str) -> torch.dtype:
    name = args.get(key, default)
    if name not in DTYPES or DTYPES[name] is None:
        raise ValueError(f"explain: {key} must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def _heads(args: dict) -> tuple:
    h = args.get("heads", "32/8")
    try:
        q, kv = (int(v) for v in h.split("/"))
    except ValueError:
        raise ValueError(f"explain: heads must be Q/KV (e.g. 32/8), got {h!r}") from None
    return q, kv


# ---- the explainers ----------------------------------------------------------------------------

def explain_fp8_linear(t: Target, a: dict) -> str:
    from .fp8_linear import LAYOUTS, plan_shape
    m, n, k = _int(a, "m"), _int(a, "n"), _int(a, "k")
    layout = a.get("layout", "channel")
    if layout not in LAYOUTS:
        raise ValueError(f"explain: layout must be one of {LAYOUTS}, got {layout!r}")
    x = _dtype(a, "x", "bf16")
    p = plan_shape(m, n, k, layout, x, None, t.capability, t.runs("gemv"),
                     t.capability == (9, 0), t.runs("fp8_gemm"),
                     knobs=tuning.section_values(t.table, "fp8_linear"))
    return (f"fp8_linear x [{m}, {k}] {x} @ FP8 w [{n}, {k}] ({layout} scales)\n"
            f"  path: {p.path}\n  why: {p.why or 'the first path that takes the call'}\n"
            + _knobs_line(t, "fp8_linear"))


def explain_gemm(t: Target, a: dict) -> str:
    from .gemm import auto_kernel
    m, n, k = _int(a, "m"), _int(a, "n"), _int(a, "k")
    layout = a.get("layout", "nk")
    dt = _dtype(a, "dtype", "bf16")
    if not t.runs("gemm_sm90"):
        kern, why = "torch", "the Hopper GEMM does not run here"
    else:
        kern = auto_kernel(m, k, n, layout, dt, False, True, t.table)
        why = ("a tuning-table gemm rule covers this shape (measured faster than torch.matmul)"
               if kern != "torch" else "no gemm rule covers it: torch.matmul (cuBLAS)")
    bench = t.table.get("gemm", {}).get("benchmark", "not measured")
    return (f"gemm x [{m}, {k}] @ w ({layout}, N = {n}) {dt}\n  kernel: {kern}\n  why: {why}\n"
            f"  rules: gemm ({len(tuning.gemm_rules(t.table))} rules) from "
            f"{t.table.get('sources', {}).get('gemm', '?')}; measured by {bench}")


def explain_decode(t: Target, a: dict) -> str:
    from .attention import _decode as D
    batch, context = _int(a, "batch", 1), _int(a, "context", 4096)
    q, kv = _heads(a)
    hd = _int(a, "head_dim", 128)
    if not t.runs("attention_decode"):
        return "decode: the kernel does not run here: the plain-torch path"
    rule = tuning.section_values(t.table, "decode")
    q_tiles = -(-(q // kv) // D.TILE_HEADS)
    splits = D.choose_num_splits(batch, kv, q_tiles, context, t.sms, rule)
    most = rule["cluster_merge_max_splits"]
    merge = "none" if splits == 1 else (
        "cluster" if splits <= most and t.runs("attention_decode_cluster") and
        t.capability >= (9, 0) else "workspace")
    ctas = batch * kv * q_tiles * splits
    return (f"decode batch {batch} x {context} tokens, heads {q}/{kv}, head_dim {hd}\n"
            f"  kernel: split-KV decode, {splits} split(s) per sequence ({ctas} CTAs on "
            f"{t.sms} SMs), merge: {merge}\n"
            f"  why: about {'two CTAs' if ctas > t.sms else 'one CTA'} per SM while each split "
            f"keeps >= {rule['min_slabs_per_split']} slabs of 16 tokens\n"
            + _knobs_line(t, "decode"))


def explain_prefill(t: Target, a: dict) -> str:
    from .attention import _prefill as P
    new, context, seqs = _int(a, "new", 128), _int(a, "context", 0), _int(a, "seqs", 1)
    q, kv = _heads(a)
    hd = _int(a, "head_dim", 128)
    fp8 = a.get("kv", "bf16") in ("fp8", "e4m3")
    total = max(context, new)
    lens, cu = [total] * seqs, [i * new for i in range(seqs + 1)]
    wgmma = hd == 128 and t.capability == (9, 0)
    kn = tuning.section_values(t.table, "prefill")
    if not t.runs("attention_prefill"):
        path, why = "sdpa", "the paged kernel does not run here"
    else:
        import unittest.mock as _mock   # the rule asks whether a capture is under way: no
        with _mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: False):
            paged = P._auto_paged(seqs * new, lens, cu, object(), q * hd, fp8, wgmma, kn)
        pairs = seqs * (new * (total - new) + new * (new + 1) // 2)
        flops = 4 * q * hd * pairs
        path = "paged kernel" if paged else "sdpa (cuDNN on gathered K/V)"
        why = f"{flops:.3g} causal FLOPs; " + ("fresh prompts" if total == new else
                                                f"{total - new} cached tokens") + \
            f"; mainloop {'wgmma' if wgmma else 'mma.sync'}" + ("; FP8 cache" if fp8 else "")
    return (f"prefill {seqs} x {new} new tokens behind {total - new}, heads {q}/{kv}, "
            f"head_dim {hd}\n  path: {path}\n  why: {why}\n" + _knobs_line(t, "prefill"))


def explain_allreduce(t: Target, a: dict) -> str:
    nbytes, world = _int(a, "bytes"), _int(a, "world", 2)
    table = tuning.load_table(t.gpu, world)
    algo = tuning.choose(table, nbytes, world)
    rules = table.get("allreduce", {}).get(str(world))
    src = "measured rules" if rules else "the alpha-beta model (no rules for this world size)"
    return (f"all_reduce {nbytes} bytes at world {world}\n  algorithm: {algo}\n"
            f"  from: {src} in {table.get('source', '?')}")


def explain_moe(t: Target, a: dict) -> str:
    tokens, k = _int(a, "tokens", 1), _int(a, "top_k", 8)
    pairs = tokens * k
    kn = tuning.section_values(t.table, "moe")
    if not (t.runs("moe_grouped_gemm") or t.runs("moe_grouped_gemv")):
        path, why = "reference", "the grouped kernels do not run here"
    elif pairs <= kn["gemv_max_pairs"]:
        path = "grouped GEMV (reads only the routed experts' weights)"
        why = f"{pairs} (token, slot) pairs <= gemv_max_pairs"
    else:
        path, why = "grouped GEMM (CUTLASS ptr-array)", f"{pairs} pairs > gemv_max_pairs"
    return (f"moe grouped GEMM, {tokens} tokens x top-{k}\n  path: {path}\n  why: {why} (an "
            "e4m3 x always takes the GEMM, bf16 x with e4m3 weights the GEMV)\n"
            + _knobs_line(t, "moe"))


EXPLAINERS: dict[str, Callable[[Target, dict], str]] = {
    "moe": explain_moe,
    "fp8_linear": explain_fp8_linear, "gemm": explain_gemm, "decode": explain_decode,
    "prefill": explain_prefill, "allreduce": explain_allreduce,
}


def register(name: str, fn: Callable[[Target, dict], str]) -> None:
    """Add an explainer (the MoE ops register theirs)."""
    EXPLAINERS[name] = fn


def explain(shape: str, t: Optional[Target] = None) -> str:
    """The explanation of SHAPE ("op key=value ..."): ValueError naming what is wrong."""
    words = shape.replace(",", " ").split()
    if not words or words[0] not in EXPLAINERS:
        raise ValueError(f"explain: start with one of {sorted(EXPLAINERS)}, got {shape!r}")
    args = {}
    for w in words[1:]:
        if "=" not in w:
            raise ValueError(f"explain: {w!r} is not key=value")
        key, value = w.split("=", 1)
        args[key] = value
    t = t or target()
    return f"on {t.describe()}\n" + EXPLAINERS[words[0]](t, args)


def main(argv: list) -> int:
    ap = argparse.ArgumentParser(prog="python -m fusedist.tuning",
                                 description="which kernel runs for a shape, and why")
    ap.add_argument("--explain", metavar="SHAPE", action="append", default=[],
                    help=f"an op and its shape, e.g. \"fp8_linear m=16 n=28672 k=4096\"; ops: "
                         f"{', '.join(sorted(EXPLAINERS))}")
    ap.add_argument("--caps", action="store_true", help="the capability table of fusedist._C")
    ap.add_argument("--table", action="store_true", help="the merged tuning table")
    ap.add_argument("--gpu", help="explain for this GPU model's table (default: the local GPU, "
                                  "or the table's measured_on)")
    args = ap.parse_args(argv)
    if not (args.explain or args.caps or args.table):
        ap.print_help()
        return 2
    if args.caps:
        print(_ext.capabilities().table())
    if args.table:
        t = tuning.gpu_table(None)
        print(json.dumps({k: v for k, v in t.items() if not k.startswith("_")}, indent=1))
    t = target(args.gpu) if args.gpu else target()
    for shape in args.explain:
        try:
            print(explain(shape, t))
        except ValueError as e:
            print(f"fusedist.tuning: {e}")
            return 2
    return 0
