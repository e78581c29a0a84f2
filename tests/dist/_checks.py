"""Shared harness for multi-process test workers (launched by torchrun or mpirun).

Every rank runs every check; failures are gathered so one failing rank fails all of them
(no rank hangs waiting for another); the worker exits non-zero if any rank failed.

The same checks run on ranks emulated on one GPU (tests/dist/emulate.py: emulated_main, over
fusedist.testing.run_ranks) where they are marked @emulated; @not_emulated(why) says why a
check cannot run there.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
import zlib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fusedist  # noqa: E402
import fusedist.envs  # noqa: E402,F401 - run_seed reads FUSEDIST_TEST_SEED through it

CHECKS = []
# Check name -> None (it runs on emulated ranks too: @emulated) or why it cannot
# (@not_emulated); checks in neither are not run there.
EMULATION: dict = {}


def check(fn):
    CHECKS.append(fn)
    return fn


def emulated(fn):
    """Mark a check to run on emulated ranks too (tests/dist/emulate.py)."""
    EMULATION[fn.__name__] = None
    return fn


def not_emulated(why: str):
    """Mark a check that cannot run on emulated ranks, and say why."""
    def mark(fn):
        EMULATION[fn.__name__] = why
        return fn
    return mark


# Why checks cannot run on emulated ranks (fusedist/testing/emulated.py).
NEEDS_NCCL = ("it calls NCCL, which runs one rank per GPU and process (emulated ranks refuse "
              "NCCL routes)")
NEEDS_GRAPHS = ("CUDA-graph capture: torch captures in the global mode, in which the other "
                "rank threads' CUDA calls invalidate the capture")
NEEDS_COMPILE = "torch.compile in several threads at once (dynamo traces one frame at a time)"
PERSISTENT_HOPPER = ("the fused Hopper ag_gemm / gemm_rs are persistent GEMMs with a CTA on every "
                     "SM whose tiles wait for a peer: one rank's GEMM holds the GPU, the peer's "
                     "work it waits for never starts, and the wait times out")
CPU_ONLY = "the CPU path's check (gloo); emulated ranks run on a GPU"


def is_emulated(rt) -> bool:
    """Whether rt is the runtime of an emulated rank (fusedist.testing)."""
    from fusedist.testing import EmulatedGroup

    return isinstance(rt.tp, EmulatedGroup)


class SkipCheck(Exception):
    """Raised by skip(): the check did not run here (reported as [skip] with its reason)."""


def skip(reason: str):
    """End the current check as skipped (never as passed): it cannot run on this tier."""
    raise SkipCheck(reason)


def rank_seed(*parts) -> int:
    """Stable across processes (unlike hash() of a str)."""
    h = 1469598103934665603
    for p in parts:
        v = zlib.crc32(str(p).encode())
        h = ((h ^ v) * 1099511628211) & ((1 << 62) - 1)
    return h


def fresh(shape, dtype, device, seed) -> torch.Tensor:
    """Fresh random input from a seed every rank can recompute (so every rank can build the
    float64 reference of all ranks' inputs locally)."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dtype)


def captured(body) -> torch.cuda.CUDAGraph:
    """body() once eagerly (lazy init and allocations stay outside the capture), then body()
    captured into a CUDA graph, returned for replays."""
    body()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    return g


def expect_timeout(comm, call, timeout_s: float, match: str = ""):
    """call() on a rank whose peer skipped it: it must return (no hang), and comm.check() must
    raise CommunicatorTimeoutError naming the wait (and `match`) within 5x the timeout.
    Returns call()'s result for further checks."""
    t0 = time.time()
    y = call()
    torch.cuda.synchronize()
    waited = time.time() - t0
    try:
        comm.check()
    except fusedist.CommunicatorTimeoutError as e:
        assert f"waited more than {timeout_s:g} s" in str(e) and match in str(e), str(e)
    else:
        raise AssertionError("no CommunicatorTimeoutError after a peer skipped the call")
    assert waited < 5 * timeout_s, f"took {waited:.1f}s to give up"
    return y


def _wait_idle(device, deadline: float, what: str) -> None:
    """Poll (no synchronize) until the current stream and the comm-stream pool of `device`
    ran everything queued so far, or fail at `deadline` (time.time())."""
    from fusedist.comm import streams

    events = []
    for s in [torch.cuda.current_stream(device)] + [streams.comm_stream(device, i)
                                                    for i in range(streams.POOL_SIZE)]:
        ev = torch.cuda.Event()
        ev.record(s)
        events.append(ev)
    while not all(ev.query() for ev in events):
        if time.time() > deadline:
            raise AssertionError(f"{what}: the GPU is still busy (a kernel was not released)")
        time.sleep(0.005)


def expect_mismatch(comm, call, timeout_s: float, *matches: str):
    """call() on ranks that called differently: it returns (or raises CollectiveMismatchError
    itself), comm.check() raises CollectiveMismatchError naming `matches` before the timeout
    would have run out, and the GPU then drains. check() is polled before any CUDA call: a
    synchronize could wait on an NCCL kernel that only check()'s abort releases. Returns
    (call()'s result or None, the error)."""
    t0 = time.time()
    y, err = None, None
    try:
        y = call()
    except fusedist.CollectiveMismatchError as e:  # a later step of the call saw the record
        err = e
    while err is None:
        try:
            comm.check()
        except fusedist.CollectiveMismatchError as e:
            err = e
        else:
            if time.time() - t0 > timeout_s:
                raise AssertionError(f"no CollectiveMismatchError within {timeout_s:g} s")
            time.sleep(0.005)
    waited = time.time() - t0
    for m in ("called different collectives",) + matches:
        assert m in str(err), f"message {str(err)!r} lacks {m!r}"
    assert waited < timeout_s, f"took {waited:.1f}s: the mismatch waited out the timeout"
    _wait_idle(comm.device, t0 + 2 * timeout_s, "after the mismatch")
    return y, err


def expect_errors(cases, errors=(ValueError, TypeError)) -> None:
    """Each (call, text): call() must raise one of `errors` (ValueError or TypeError) whose
    message has text."""
    for call, text in cases:
        try:
            call()
        except errors as e:
            assert text in str(e), f"{e!r} lacks {text!r}"
        else:
            raise AssertionError(f"no error for {text}")


def rmsnorm_reference(group, tokens, hidden, dtype, device, seed, eps):
    """Inputs and float64 reference of all_reduce_add_rmsnorm over `group` with the op's
    roundings, round(all_reduce), round(+ residual): (this rank's x, residual, weight, h,
    normed). Every rank rebuilds every member's x from the seed."""
    xs = [fresh((tokens, hidden), dtype, device, rank_seed(seed, p)) for p in range(group.size)]
    # The residual stream is replicated across tensor-parallel ranks.
    res = fresh((tokens, hidden), dtype, device, rank_seed(seed, "res"))
    w = fresh((hidden,), dtype, device, rank_seed(seed, "w"))
    ar = sum(x.double() for x in xs).to(dtype)
    h = (ar.double() + res.double()).to(dtype)
    hd = h.double()
    y = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    return xs[group.rank], res, w, h, y


def assert_identical_across_ranks(rt, y, what):
    """Bitwise equality of `y` on every rank of the tp group (a positional digest)."""
    y = y.reshape(-1)
    bits = y.view(torch.uint8) if y.element_size() == 1 else y.view(
        {4: torch.int32, 2: torch.int16}[y.element_size()])
    digest = (int(bits.long().sum()), int((bits.long() * torch.arange(
        bits.numel(), device=bits.device) % 1000003).sum()))
    got = rt.tp.all_gather_object(digest)
    assert all(d == got[0] for d in got), f"{what}: outputs differ across ranks: {got}"


def run_seed() -> int:
    """FUSEDIST_TEST_SEED (the pytest session passes its own), else a fresh seed. Every check
    gets it (rank 0's, on every rank); it is printed first and with every failure."""
    seed = fusedist.envs.get("FUSEDIST_TEST_SEED")
    return seed if seed is not None else int.from_bytes(os.urandom(4), "little")


def _rerun(seed: int) -> str:
    return f"seed {seed}: rerun with FUSEDIST_TEST_SEED={seed}"


def record_failure(failures: list, rank: int, name: str, e: Exception,
                   seed: int | None = None) -> None:
    """Keep check `name`'s failure on this rank for the final gather, and print it at once: a
    check that fails on one rank can leave the others in a collective it skipped, and then
    the gather never comes (the launcher's timeout ends the run), so this line is the only
    record of the cause."""
    seed_note = f" ({_rerun(seed)})" if seed is not None else ""
    failures.append(f"rank {rank} {name}{seed_note}: {type(e).__name__}: {e}\n"
                    + traceback.format_exc(limit=4))
    print(f"[FAIL] rank {rank} {name}{seed_note}: {type(e).__name__}: {str(e)[:300]}",
          flush=True)


def selected(select: str | None = None) -> list:
    """The checks this run does, in order: those whose name contains `select` (else
    FUSEDIST_TEST_ONLY) if given, less those FUSEDIST_TEST_SKIP names (comma-separated, whole
    names: a run whose launcher is what it tests leaves out a check another run covers). A
    selection that matches no check, or a skipped name no check has, is an error: a typo
    must not make a run that checks nothing and passes."""
    only = select or os.environ.get("FUSEDIST_TEST_ONLY")
    skip = {n.strip() for n in os.environ.get("FUSEDIST_TEST_SKIP", "").split(",") if n.strip()}
    unknown = skip - {fn.__name__ for fn in CHECKS}
    if unknown:
        raise SystemExit(f"FUSEDIST_TEST_SKIP names no check of this worker: {sorted(unknown)}")
    chosen = [fn for fn in CHECKS if not only or only in fn.__name__]
    if not chosen:  # a mistyped selection would otherwise run nothing and pass
        raise SystemExit(f"FUSEDIST_TEST_ONLY={only!r} matches no check of this worker")
    return [fn for fn in chosen if fn.__name__ not in skip]


def main(select: str | None = None, **init_kwargs) -> None:
    """Every check on this rank after fusedist.init(**init_kwargs), failures gathered."""
    rt = fusedist.init(**init_kwargs)
    failures, statuses = [], []
    # Rank 0's seed for everyone: ranks rebuild each other's inputs from it.
    run_id = rt.world.all_gather_object(run_seed())[0]
    if rt.rank == 0:
        print(f"checks on {rt.world_size} ranks, {_rerun(run_id)}", flush=True)
    for fn in selected(select):
        t0 = time.time()
        reason = ""
        try:
            fn(rt, run_id)
            status = "ok"
        except SkipCheck as e:
            status, reason = "skip", f": {e}"
        except Exception as e:  # noqa: BLE001 - every failure is reported, then gathered
            status = "FAIL"
            record_failure(failures, rt.rank, fn.__name__, e, run_id)
        statuses.append((fn.__name__, status))
        if rt.rank == 0:
            print(f"[{status}] {fn.__name__} ({time.time() - t0:.2f}s){reason}", flush=True)
    if rt.rank == 0:
        print("summary: " + " ".join(f"{n}={s}" for n, s in statuses), flush=True)
        counts = {k: sum(1 for _, s in statuses if s == k) for k in ("ok", "skip", "FAIL")}
        print(f"checks: {counts['ok']} ok, {counts['skip']} skipped, {counts['FAIL']} failed",
              flush=True)
    gathered = rt.world.all_gather_object((failures, statuses))
    fusedist.shutdown()
    flat = [f for fs, _ in gathered for f in fs]
    # A check skipped on some ranks and run on others is a failure: the ranks disagree on
    # what this tier can run (and a collective inside it had no peer on the skipping ranks).
    for i, (name, _) in enumerate(statuses):
        seen = {st[i][1] for _, st in gathered}
        if "skip" in seen and len(seen) > 1:
            flat.append(f"{name}: skipped on some ranks only ("
                        + ", ".join(f"rank {r} {st[i][1]}" for r, (_, st) in enumerate(gathered))
                        + ")")
    if flat:
        if rt.rank == 0:
            # Short first (the launcher keeps only the tail), tracebacks after.
            print("\n".join(flat), flush=True)
            print("failed: " + " | ".join(f.splitlines()[0][:200] for f in flat), flush=True)
            print(f"failed with {_rerun(run_id)}", flush=True)
        sys.exit(1)
    print(f"rank {rt.rank}: all checks passed (seed {run_id})", flush=True)


def _on_rank(fn, rt, seed):
    """fn(rt, seed) on one emulated rank: None when it ran, the reason when it skipped."""
    try:
        fn(rt, seed)
    except SkipCheck as e:
        return str(e)
    return None


def emulated_main(world: int, select: str | None = None) -> None:
    """The checks marked @emulated, each on `world` fresh emulated ranks of this process on its
    GPU (fusedist.testing.run_ranks), reported as main() reports them: a line per check, the
    summary, "rank r: all checks passed" per rank, exit 1 on any failure."""
    from fusedist.testing import RankError, run_ranks

    seed = run_seed()
    failures, statuses = [], []
    print(f"emulated ranks: {world} on {torch.cuda.get_device_name()} (seed {seed})", flush=True)
    for fn in selected(select):
        name = fn.__name__
        t0 = time.time()
        reason = ""
        if name not in EMULATION:
            status, reason = "skip", ": not marked @emulated (tests/dist/_checks.py)"
        elif EMULATION[name] is not None:
            status, reason = "skip", f": not on emulated ranks: {EMULATION[name]}"
        else:
            try:
                skips = run_ranks(world, lambda rt: _on_rank(fn, rt, seed), timeout_s=600)
                if all(s is None for s in skips):
                    status = "ok"
                elif all(s is not None for s in skips):
                    status, reason = "skip", f": {skips[0]}"
                else:
                    raise AssertionError("skipped on some ranks only: " + ", ".join(
                        f"rank {r} {'skip' if s else 'ok'}" for r, s in enumerate(skips)))
            except Exception as e:  # noqa: BLE001 - every failure is reported
                status = "FAIL"
                record_failure(failures, e.rank if isinstance(e, RankError) else -1, name, e,
                               seed)
        statuses.append((name, status))
        print(f"[{status}] {name} ({time.time() - t0:.2f}s){reason}", flush=True)
    print("summary: " + " ".join(f"{n}={s}" for n, s in statuses), flush=True)
    counts = {k: sum(1 for _, s in statuses if s == k) for k in ("ok", "skip", "FAIL")}
    print(f"checks: {counts['ok']} ok, {counts['skip']} skipped, {counts['FAIL']} failed",
          flush=True)
    if failures:
        print("\n".join(failures), flush=True)
        print("failed: " + " | ".join(f.splitlines()[0][:200] for f in failures), flush=True)
        print(f"failed with {_rerun(seed)}", flush=True)
        sys.exit(1)
    for r in range(world):
        print(f"rank {r}: all checks passed (seed {seed}, emulated)", flush=True)
