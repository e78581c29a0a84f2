"""The one registry of fusedist's environment variables.

Every FUSEDIST_* variable the library reads is declared here once: its type, default, when it
is read and what it does. Library code reads them through :func:`get`, which parses the value
and raises a ValueError naming the variable and the accepted values when it is malformed.
The environment table of docs/configuration.md is generated from this registry:

    python -m fusedist.envs --markdown

Variables used only by the test harness and the benchmarks (FUSEDIST_TEST_ONLY,
FUSEDIST_BENCH_*, FUSEDIST_RESULTS_DIR, ...) are not read by the library and are not registered
here; they are described with the tests and benchmarks that read them. FUSEDIST_TEST_SEED is
the exception: the test suite's seed, which a user sets to rerun a failing test, is registered
so that a malformed one fails with the others. The NVLink-multicast settings that
fusedist.init() applies to NCCL and torch are fusedist.distributed.runtime.SAFE_ENV.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

@dataclass(frozen=True)
class Var:
    name: str
    type: str                 # "str", "choice", "int", "float", "bool", "path"
    default: Any              # parsed value when unset (None: unset means "not given")
    read: str                 # when the library reads it
    doc: str                  # what it does (one line, user's words)
    choices: tuple = ()       # for type "choice"
    minimum: Optional[float] = None  # numbers: smallest accepted value
    positive: bool = False    # numbers: must be > 0 (and finite)
    default_doc: str = ""     # how the default reads in the table, when not the value itself


def _parse_bool(name: str, raw: str) -> bool:
    v = raw.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"fusedist: {name}={raw!r} is not a boolean; use 1 or 0")


VARS: dict[str, Var] = {}


def _register(*vs: Var) -> None:
    for v in vs:
        VARS[v.name] = v


_register(
    Var("FUSEDIST_NODE_ID", "str", None, "by fusedist.init()",
        "Node identity of this rank. Ranks with equal ids are treated as one node, which is how "
        "several nodes are emulated on one host. `init(node_id=)` takes precedence.",
        default_doc="hostname (`SLURM_NODEID` under srun)"),
    Var("FUSEDIST_TIMEOUT_S", "float", 30.0,
        "when a Communicator is created; by Runner.generate() (each call)",
        "Bounded device-side wait for a peer inside symmetric kernels, in seconds (> 0). "
        "`Communicator(timeout_s=)` overrides it. Also bounds Runner.generate()'s gloo "
        "collectives after its request check (a peer that stops answering raises "
        "PeerLostError); `Runner(peer_timeout_s=)` overrides that.", positive=True),
    Var("FUSEDIST_INIT_TIMEOUT_S", "float", 300.0, "by fusedist.init()",
        "Timeout of the process groups that `init()` creates (bootstrap and their collectives), "
        "in seconds (> 0). `init(timeout_s=)` overrides it. Not applied to an adopted group "
        "(the subgroups `init()` makes beside it take it).", positive=True),
    Var("FUSEDIST_ALLREDUCE_ALGO", "choice", "auto", "when a Communicator is created",
        "Forces the algorithm of `algo=\"auto\"` all-reduce calls; the capacity fallbacks "
        "(one-shot -> two-shot -> NCCL) still apply. Rank 0's value is used on every rank.",
        choices=("auto", "one_shot", "two_shot", "nccl")),
    Var("FUSEDIST_TUNING_FILE", "path", None, "when a Communicator is created; the op "
        "sections once per process and GPU model",
        "JSON dispatch table, merged per section over the --tune cache and the shipped default: "
        "the collective tables and the op sections (GEMM rules, `decode`, `prefill`, "
        "`fp8_linear`, `moe`, `moe_gating`; docs/tuning.md). A path that is not a file raises "
        "ValueError.", default_doc="unset"),
    Var("FUSEDIST_NCCL", "choice", "nccl4py", "when a Communicator is created",
        "`nccl4py`, or `torch` for torch.distributed's NCCL.", choices=("nccl4py", "torch")),
    Var("FUSEDIST_NCCL_CALL_CHECK", "bool", True, "when a Communicator is created",
        "Before each NCCL call of a communicator with symmetric memory, a call check (a "
        "one-warp device barrier, a few us) compares what every rank is calling, so ranks "
        "that call NCCL with different sizes raise CollectiveMismatchError instead of hanging "
        "or summing misread bytes. `0` skips it. Rank 0's value is used on every rank."),
    Var("FUSEDIST_PDL", "bool", True, "once per process, by the extension's first launch",
        "`0` launches kernels without programmatic dependent launch."),
    Var("FUSEDIST_NVTX", "bool", True, "at import",
        "`0` turns off the NVTX ranges around ops."),
    Var("FUSEDIST_COMM_STREAMS", "int", 2, "at import",
        "Size of the per-device pool of high-priority communication streams (>= 1). "
        "`async_op=True` calls all use stream 0 of the pool.", minimum=1),
    Var("FUSEDIST_GEMM_ENGINE", "choice", "auto", "on every GEMM + collective call",
        "Forces the engine of `engine=\"auto\"` GEMM + collective calls (`fused` only where the "
        "fused kernel takes the call, the table elsewhere). Set it identically on every rank.",
        choices=("auto", "unfused", "overlap", "fused")),
    Var("FUSEDIST_OVERLAP_NCCL_CTAS", "int", 0, "when a Communicator is created",
        "`0`: the overlap engine shares the communicator's NCCL communicator. `n > 0`: a second "
        "NCCL communicator (nccl4py only) limited to `n` CTAs, for the overlap engine.",
        minimum=0),
    Var("FUSEDIST_BUILD", "choice", "auto", "at install time, by CMake (pip install .)",
        "`auto` builds fusedist._C when nvcc and the CUTLASS headers are present and otherwise "
        "installs the pure-Python package; `1` builds it and fails when either is missing; `0` "
        "installs the pure-Python package without running CMake (docs/install.md).",
        choices=("auto", "0", "1")),
    Var("FUSEDIST_CUDA_ARCHS", "str", "90a", "at build time, by CMake",
        "CUDA architectures the extension is built for (e.g. `90a;100a`)."),
    Var("FUSEDIST_CUTLASS_INCLUDE", "path", None, "at build time, by CMake",
        "CUTLASS include directory; default: the headers of the `nvidia-cutlass` package.",
        default_doc="from nvidia-cutlass"),
    Var("FUSEDIST_TEST_SEED", "int", None, "by the test suite (tests/conftest.py, multi-rank "
        "test workers)",
        "Seed of the tests' random inputs: each test's torch / random / numpy generators are "
        "seeded from it and the test's name, and multi-rank test workers take it. Printed in "
        "pytest's header and with every failure; set it to rerun a failure with the same "
        "inputs.", minimum=0, default_doc="a fresh seed per run"),
)


def _parse(v: Var, raw: str) -> Any:
    if v.type in ("str", "path"):
        return raw.strip()
    if v.type == "choice":
        if raw not in v.choices:
            raise ValueError(f"fusedist: {v.name} must be one of {', '.join(v.choices)}, got "
                             f"{raw!r}")
        return raw
    if v.type == "bool":
        return _parse_bool(v.name, raw)
    conv: Callable[[str], Any] = int if v.type == "int" else float
    try:
        x = conv(raw.strip())
    except ValueError:
        raise ValueError(f"fusedist: {v.name}={raw!r} is not a{'n' if v.type == 'int' else ''} "
                         f"{v.type}") from None
    if v.type == "float" and not math.isfinite(x):
        raise ValueError(f"fusedist: {v.name}={raw!r} must be finite")
    if v.positive and not x > 0:
        raise ValueError(f"fusedist: {v.name}={raw!r} must be > 0")
    if v.minimum is not None and x < v.minimum:
        raise ValueError(f"fusedist: {v.name}={raw!r} must be >= {v.minimum:g}")
    return x


def get(name: str, environ: Optional[Mapping[str, str]] = None) -> Any:
    """The parsed value of registered variable `name` (its default when unset). Raises
    ValueError naming the variable when the value is malformed, KeyError for a name that is
    not registered."""
    v = VARS.get(name)
    if v is None:
        raise KeyError(f"fusedist: {name} is not a registered variable (fusedist/envs/)")
    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is None or not raw.strip():  # blank counts as unset
        return v.default
    return _parse(v, raw)


def check_all(environ: Optional[Mapping[str, str]] = None) -> None:
    """Parse every registered variable that is set, so a malformed value fails at once (by
    fusedist.init()) on every path, also where nothing reads it yet (a CPU run reads
    FUSEDIST_ALLREDUCE_ALGO nowhere). Raises one ValueError naming every malformed variable."""
    errors = []
    for v in VARS.values():
        try:
            get(v.name, environ)
        except ValueError as e:
            errors.append(str(e).removeprefix("fusedist: "))
    if errors:
        raise ValueError("fusedist: " + "; ".join(errors))


def is_set(name: str, environ: Optional[Mapping[str, str]] = None) -> bool:
    if name not in VARS:
        raise KeyError(f"fusedist: {name} is not a registered variable (fusedist/envs/)")
    raw = (os.environ if environ is None else environ).get(name)
    return raw is not None and bool(raw.strip())


def markdown() -> str:
    """The environment table of docs/configuration.md."""
    rows = ["| variable | effect | read | default |", "|---|---|---|---|"]
    for v in VARS.values():
        if v.default_doc:
            default = v.default_doc
        elif v.type == "bool":
            default = "`1`" if v.default else "`0`"
        else:
            default = f"`{v.default:g}`" if isinstance(v.default, float) else f"`{v.default}`"
        effect = v.doc
        if v.choices:
            effect = f"{' / '.join(f'`{c}`' for c in v.choices)}. {effect}"
        rows.append(f"| `{v.name}` | {effect} | {v.read} | {default} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args != ["--markdown"]:
        print("usage: python -m fusedist.envs --markdown", file=sys.stderr)
        return 2
    print(markdown())
    return 0

