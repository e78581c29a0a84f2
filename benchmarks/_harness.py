"""Shared benchmark harness: CUDA-graph timing, metadata, and result writers.

Timing (docs/benchmarks.md): each measurement captures `ops` calls of the op in one CUDA
graph (inputs rotate over `ops` distinct buffers so small messages do not sit in L2), replays
it `reps` times between CUDA events after warm-up, and reports the median per-op time. Every
rank times itself; the row reports the slowest rank's median. CPU (gloo) runs time eager
calls with perf_counter.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from statistics import median
from typing import Callable, Optional

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def llama_projections(models=("8b", "70b"), tps=(1,), lm_head: bool = False) -> list:
    """(model, tp, projection, K, N) of each projection of Llama-3 8B / 70B (fusedist's shipped
    configs: "8b" is llama-3-8b) at tensor-parallel degree tp: column-parallel qkv, gate_up
    (and lm_head) hold N / tp outputs, row-parallel o and down K / tp inputs."""
    from fusedist.models.llama.config import NAMED
    out = []
    for model in models:
        key = f"llama-3-{model}"
        if key not in NAMED:
            raise ValueError(f"unknown model {model!r}: one of 8b, 70b")
        c = NAMED[key]
        for tp in tps:
            out += [(model, tp, "qkv", c.hidden_size,
                     (c.num_heads + 2 * c.num_kv_heads) * c.head_dim // tp),
                    (model, tp, "o", c.num_heads * c.head_dim // tp, c.hidden_size),
                    (model, tp, "gate_up", c.hidden_size, 2 * c.intermediate_size // tp),
                    (model, tp, "down", c.intermediate_size // tp, c.hidden_size)]
            if lm_head:
                out.append((model, tp, "lm_head", c.hidden_size, c.vocab_size // tp))
    return out


def init_gpus(what: str):
    """fusedist.init() for a GPU-only tool: the runtime, or None (after a message and a clean
    shutdown) when the ranks have no GPUs."""
    import fusedist

    rt = fusedist.init()
    if rt.device.type != "cuda":
        print(f"{what} needs GPUs")
        fusedist.shutdown()
        return None
    return rt


def git_commit() -> str:
    """FUSEDIST_COMMIT when set (tests/gpu/run.sh passes it: the GPU host's copy of the tree
    may carry a stale .git), else git's HEAD."""
    if os.environ.get("FUSEDIST_COMMIT"):
        return os.environ["FUSEDIST_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                             capture_output=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               text=True, capture_output=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else \
            os.environ.get("FUSEDIST_COMMIT", "unknown")
    except Exception:
        return os.environ.get("FUSEDIST_COMMIT", "unknown")


def metadata(world: int) -> dict:
    meta = {"commit": git_commit(), "world_size": world, "torch": torch.__version__,
            "python": platform.python_version(), "host": platform.node(),
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if torch.cuda.is_available():
        meta["gpu"] = torch.cuda.get_device_name()
        meta["cuda"] = torch.version.cuda
        try:
            meta["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            pass
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 text=True, capture_output=True, timeout=10).stdout.split()
            meta["driver"] = smi[0] if smi else "?"
        except Exception:
            meta["driver"] = "?"
    try:
        from importlib.metadata import version

        meta["nccl4py"] = version("nccl4py")
    except Exception:
        meta["nccl4py"] = None
    for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS",
              "FUSEDIST_NCCL", "FUSEDIST_PDL"):
        meta[k] = os.environ.get(k)
    return meta


def capture(step: Callable[[int], None], ops: int) -> torch.cuda.CUDAGraph:
    """step(i), i = 0..ops-1, run once eagerly (lazy init, allocator) and then captured in one
    CUDA graph."""
    for i in range(ops):
        step(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(ops):
            step(i)
    return g


_NVML: dict = {}


def sm_clock_mhz() -> Optional[int]:
    """The current SM clock of this process's GPU in MHz, read through NVML (libnvidia-ml,
    ctypes: no Python package needed), or None where NVML is not there."""
    dev = torch.cuda.current_device()
    if dev not in _NVML:
        _NVML[dev] = None
        try:
            import ctypes

            lib = ctypes.CDLL("libnvidia-ml.so.1")
            if lib.nvmlInit_v2() == 0:
                handle = ctypes.c_void_p()
                uuid = str(torch.cuda.get_device_properties(dev).uuid)
                uuid = uuid if uuid.startswith("GPU-") else "GPU-" + uuid
                if lib.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(handle)) == 0:
                    _NVML[dev] = (lib, handle)
        except Exception:
            pass
    if _NVML[dev] is None:
        return None
    import ctypes

    lib, handle = _NVML[dev]
    mhz = ctypes.c_uint()
    return int(mhz.value) if lib.nvmlDeviceGetClockInfo(handle, 1, ctypes.byref(mhz)) == 0 \
        else None  # 1: NVML_CLOCK_SM


def clock_under(g: torch.cuda.CUDAGraph, replay_us: float, busy_us: float = 4000.0
                ) -> Optional[int]:
    """The SM clock (MHz) while g runs: ~busy_us of replays are queued and the clock is read
    about halfway through them, then the GPU is drained. None without NVML. Every rank must
    call it for a collective's graph (it replays g as many times on every rank: the count
    comes from the slowest rank's replay_us)."""
    have = sm_clock_mhz() is not None
    replay_us = slowest(replay_us)
    if dist.is_initialized() and dist.get_world_size() > 1:  # all ranks replay, or none
        flags = [None] * dist.get_world_size()
        dist.all_gather_object(flags, have)
        have = all(flags)
    if not have:
        return None
    for _ in range(max(2, math.ceil(busy_us / max(replay_us, 1.0)))):
        g.replay()
    time.sleep(busy_us / 2e6)
    mhz = sm_clock_mhz()
    torch.cuda.synchronize()
    return mhz


def timed_replays(g: torch.cuda.CUDAGraph, ops: int, reps: int) -> list[float]:
    """Microseconds per call (ops calls per replay) of each of `reps` timed replays of g."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / ops)
    return times


def kernels(fn: Callable[[], None]) -> list[tuple[str, float]]:
    """The GPU kernels one call of fn() launches, (name, device us), longest first (profiled
    once, after one unprofiled call)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type.name == "CUDA"]
    return sorted(((e.name, e.device_time_total) for e in ev), key=lambda t: -t[1])


def time_graph(step: Callable[[int], None], ops: int, reps: int, warmup: int = 3) -> float:
    """Median microseconds per call of step(i), i = 0..ops-1, captured in one CUDA graph."""
    g = capture(step, ops)
    for _ in range(warmup):
        g.replay()
    torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()
    times = timed_replays(g, ops, reps)
    del g
    return median(times)


def time_graphs_interleaved(steps: dict, ops: int, rounds: int, reps: int,
                            warmup: int = 2, pacer: Optional[str] = None,
                            pace_us: float = 30000.0, clocks: Optional[dict] = None
                            ) -> tuple[dict, dict, dict]:
    """Microseconds per call of every step of `steps` ({name: step(i)}), timed interleaved.
    Each step's calls i = 0..ops-1 are captured in one CUDA graph; then an untimed round
    brings the GPU to its loaded state (after the captures it is idle and cool, and the first
    steps of a first timed round ran up to 10% fast), and `rounds` rounds replay every graph
    in turn (in order, then reversed, alternately): `warmup` untimed replays, then `reps`
    timed ones. With `pacer` (a step's name), every burst starts after ~pace_us of that step's
    graph, so each step starts from the same clock state rather than its neighbour's (without
    it, one configuration timed under two names differed by 5% in both of two runs). Returns
    ({name: median over all timed replays}, {name: the median of each round}, {name: "ok" or
    why it did not run}). With `clocks` (a dict), clocks[name] gets the SM clock in MHz read
    while that step's graph ran, once per round, right after its timed replays (clock_under;
    empty without NVML).

    Why interleaved: under sustained GEMM load an H200 lowers its SM clock from 1980 MHz to
    ~1450-1530 MHz within a fraction of a second (the 700 W power limit), and a GEMM takes
    12-15% longer (benchmarks/NOTES.md, "Measuring on a GPU under load"). Steps timed one
    after another in single blocks each saw the clock of their place in the run; in rounds
    they all see the same mix."""
    graphs, status = {}, {}
    for name, step in steps.items():
        try:
            graphs[name], status[name] = capture(step, ops), "ok"
        except Exception as e:
            status[name] = f"n/a ({type(e).__name__}: {str(e)[:60]})"
            torch.cuda.synchronize()
    samples = {name: [] for name in graphs}
    per_round = {name: [] for name in graphs}
    names = list(graphs)
    pace = 0
    if pacer in graphs:  # replays of the pacer's graph that take about pace_us
        graphs[pacer].replay()
        pace = max(1, math.ceil(pace_us / median(timed_replays(graphs[pacer], 1, 3))))
    for r in range(-1, rounds):  # round -1: untimed
        for name in names if r % 2 == 0 else names[::-1]:
            g = graphs[name]
            for _ in range(pace):
                graphs[pacer].replay()
            for _ in range(warmup if r >= 0 else warmup + reps):
                g.replay()
            torch.cuda.synchronize()
            if dist.is_initialized():
                dist.barrier()
            if r < 0:
                continue
            got = timed_replays(g, ops, reps)
            samples[name] += got
            per_round[name].append(median(got))
            if clocks is not None:
                mhz = clock_under(g, median(got) * ops)
                clocks.setdefault(name, []).extend([] if mhz is None else [mhz])
    graphs.clear()
    return ({name: median(s) for name, s in samples.items()}, per_round, status)


def rotation_sets(bytes_per_call: int, most: int = 2000) -> int:
    """How many distinct input sets a graph's calls should rotate over so that one replay
    streams at least twice the L2 (each call's inputs then come from HBM, as in a model's
    step, not from the previous replay's L2), at most `most`."""
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(1, min(most, math.ceil(2 * l2 / max(bytes_per_call, 1))))


def rate_columns(times: dict, nbytes: int, hbm_tbs: float, head: str = "fusedist",
                 baselines: tuple = ("torch", "compile")) -> dict:
    """A memory-bound op's row: {name}_us for every timed name, and for `head` its GB/s (bytes
    read + written / time), % of the same run's HBM copy rate, and vs_{b} = b's time / head's
    (above 1: head is faster) for each baseline b timed."""
    row = {f"{n}_us": t for n, t in times.items()}
    t = times.get(head)
    if t:
        row[f"{head}_gbs"] = nbytes / (t * 1e-6) / 1e9
        row["pct_hbm"] = 100.0 * row[f"{head}_gbs"] / (hbm_tbs * 1e3)
        for b in baselines:
            if times.get(b):
                row[f"vs_{b}"] = times[b] / t
    return row


def sync_quietly() -> None:
    """Wait for the GPU after a failed call or capture, ignoring the error again (the caller
    reports it)."""
    try:
        torch.cuda.synchronize()
    except Exception:
        pass


def time_eager(step: Callable[[int], None], ops: int, reps: int) -> float:
    for i in range(ops):
        step(i)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        for i in range(ops):
            step(i)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6 / ops)
    return median(times)


def slowest(t_us: float) -> float:
    """The slowest rank's time: a collective is as fast as its last rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return t_us
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, t_us)
    return max(out)


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(text: str, flag: str = "--sizes") -> int:
    """A byte count as nccl-tests writes it: 4096, 4K, 4M, 1G (binary multiples; KB / KiB /
    MB / MiB / GB / GiB spell the same). ValueError naming `flag` otherwise."""
    t = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in ("K", "M", "G") else ""
    digits = t[:len(t) - len(unit)]
    if not digits.isdigit() or int(digits) <= 0:
        raise ValueError(f"{flag}: {text!r} is not a size; use bytes or a K / M / G suffix, e.g. "
                         "4096, 4K, 4M, 1G")
    return int(digits) * _UNITS[unit]


def size_range(begin: str, end: str, factor: int) -> list:
    """nccl-tests' -b / -e / -f: begin, begin * factor, ... up to end (both included)."""
    b, e = parse_bytes(begin, "-b/--begin"), parse_bytes(end, "-e/--end")
    if e < b:
        raise ValueError(f"-e/--end ({end}) is below -b/--begin ({begin})")
    if not isinstance(factor, int) or factor < 2:
        raise ValueError(f"-f/--factor must be an int >= 2, got {factor!r}")
    out = [b]
    while out[-1] * factor <= e:
        out.append(out[-1] * factor)
    return out


def fmt_bytes(n: int) -> str:
    for unit, k in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k} {unit}"
    return f"{n} B"


def machine_dir(meta: dict) -> str:
    """The results folder of a run's machine: <gpu>-w<world>, e.g. h200-w2 (cpu-w2 on CPU)."""
    gpu = str(meta.get("gpu") or "cpu")
    gpu = gpu[len("NVIDIA "):] if gpu.startswith("NVIDIA ") else gpu
    slug = "".join(c if c.isalnum() else "_" for c in gpu.lower()).strip("_") or "cpu"
    return f"{slug}-w{meta['world_size']}"


def reproduce_command(meta: dict) -> str:
    """The command that reruns this benchmark: the launcher included for multi-rank runs."""
    args = " ".join(sys.argv)
    world = int(meta.get("world_size") or 1)
    if world > 1 and os.environ.get("TORCHELASTIC_RUN_ID") is not None:
        return f"python3 -m torch.distributed.run --nproc-per-node {world} {args}"
    if world > 1:
        return f"launchers/mpirun.sh -np {world} {args}"
    return f"python3 {args}"


def _compare_module():
    """benchmarks/compare.py (torch-free), the result schema's reader."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fusedist_bench_compare",
                                                  Path(__file__).with_name("compare.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def result_metrics(rows: list[dict], tables: Optional[dict] = None,
                   metrics: Optional[list] = None) -> list[dict]:
    """The result schema every benchmark's JSON carries as "metrics": one entry per
    measurement, {"key": what was measured (unique in the file), "value": the number, "better":
    "higher" | "lower", "noise": the relative spread of its rounds, or None when not recorded}.
    benchmarks/compare.py compares a new run's metrics with the committed file's, each within
    its noise band. `metrics` given: those (checked); else derived from the rows by
    compare.py's loader (same-run ratios of fusedist's headline path over each baseline, raw
    times where no baseline ran)."""
    cmp = _compare_module()
    if metrics is not None:
        return cmp.check_metrics(list(metrics))
    return cmp.metrics({"rows": rows, **(tables or {})})


def write_results(stem: str, meta: dict, rows: list[dict], markdown: str, plot=None,
                  tables: Optional[dict] = None, metrics: Optional[list] = None) -> list[Path]:
    """benchmarks/results/<gpu>-w<N>/<stem>.{json,md,png}: one current set per benchmark and
    machine (git keeps the older ones). FUSEDIST_RESULTS_DIR replaces benchmarks/results (the
    <gpu>-w<N>/ folder stays, so benchmarks/compare.py pairs a new file with the committed
    one by its relative path). `tables` ({key: rows}) go into the JSON beside "rows": row
    lists of other columns, which readers of "rows" do not see. The JSON's "metrics" are
    result_metrics(rows, tables, metrics): the schema compare.py reads."""
    meta = dict(meta)
    meta.setdefault("reproduce", reproduce_command(meta))
    if metrics is not None:
        metric_rows = result_metrics(rows, tables, metrics)
    else:
        try:
            metric_rows = result_metrics(rows, tables)
        except ValueError as e:   # the run's numbers are kept; compare.py reports the file
            print(f"{stem}: benchmarks/compare.py cannot read these rows ({e}); the JSON is "
                  "written without metrics")
            metric_rows = None
    out = os.environ.get("FUSEDIST_RESULTS_DIR")
    base = (Path(out) if out else RESULTS) / machine_dir(meta)
    base.mkdir(parents=True, exist_ok=True)
    paths = [base / f"{stem}.json", base / f"{stem}.md"]
    doc = {"meta": meta, "rows": rows, **(tables or {})}
    if metric_rows is not None:
        doc["metrics"] = metric_rows
    paths[0].write_text(json.dumps(doc, indent=1))
    head = "\n".join(f"- {k}: {v}" for k, v in meta.items())
    paths[1].write_text(f"# {stem}\n\n{head}\n\n{markdown}\n")
    if plot is not None:
        p = base / f"{stem}.png"
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(f"plot {p.name} skipped: matplotlib is not installed (pip install matplotlib); "
                  "the JSON and Markdown are written")
            return paths
        plot(p)
        paths.append(p)
    return paths
