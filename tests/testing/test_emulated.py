"""fusedist.testing's emulated ranks, the host side (CPU tier): the runtimes and groups each
rank thread sees, the all-gather among the threads, failures and timeouts reported with the
rank, what a rank may not do. The GPU side runs the workers' checks on emulated ranks
(tests/ops/test_emulated_ranks.py)."""

from __future__ import annotations

import threading
import time

import pytest

import fusedist
from fusedist.comm import streams
from fusedist.distributed import runtime
from fusedist.distributed.groups import Group
from fusedist.testing import (EmulatedGroup, EmulatedNccl, EmulatedSymmetricMemory,
                              EmulationTimeoutError, RankError, run_ranks)
from fusedist.testing.emulated import _Exchange, _PeerFailed


def ranks(world, fn, **kw):
    return run_ranks(world, fn, device="cpu", **kw)


@pytest.mark.parametrize("world", (1, 2, 3))
def test_each_rank_runs_under_its_own_runtime(world):
    def body(rt):
        assert fusedist.get_runtime() is rt and fusedist.is_initialized()
        assert rt.rank == rt.tp.rank == rt.world.rank == rt.intra_node.rank
        assert rt.world_size == rt.tp.size == world and rt.tp.ranks == tuple(range(world))
        assert rt.dp.size == rt.inter_node.size == 1 and rt.dp.rank == 0
        assert rt.topology.local_rank == rt.rank and rt.tp.single_node
        assert rt.tp.backend == "emulated" and rt.tp.pg is None
        return rt.rank, rt.tp.name, threading.current_thread().name

    got = ranks(world, body)
    assert [r for r, _, _ in got] == list(range(world))
    assert {n for _, n, _ in got} == {"emulated.tp"}  # the same on every rank, as on real ones
    assert len({t for _, _, t in got}) == world  # one thread each
    assert not fusedist.is_initialized()  # the caller's thread has no runtime


def test_the_process_runtime_stays_the_callers():
    rt0 = fusedist.init(backend="gloo", rank=0, world_size=1, local_rank=0, local_world_size=1)
    try:
        seen = ranks(2, lambda rt: fusedist.get_runtime() is not rt0)
        assert seen == [True, True]
        assert fusedist.get_runtime() is rt0
    finally:
        fusedist.shutdown()


def test_all_gather_object_gathers_copies_in_rank_order_round_after_round():
    def body(rt):
        out = []
        for rnd in range(50):
            if (rnd + rt.rank) % 7 == 0:
                time.sleep(0.001)  # ranks arrive in changing orders
            got = rt.tp.all_gather_object({"rank": rt.rank, "round": rnd})
            assert got == [{"rank": p, "round": rnd} for p in range(rt.tp.size)], got
            got[0]["rank"] = "mine"  # a copy: no other rank sees this
            out.append(got)
        return out

    results = ranks(3, body)
    assert all(results[r][5][0]["rank"] == "mine" for r in range(3))
    assert all(results[r][5][1] == {"rank": 1, "round": 5} for r in range(3))


def test_barrier_lets_no_rank_through_before_every_rank_arrived():
    arrived, passed = {}, {}

    def body(rt):
        time.sleep(0.05 * rt.rank)
        arrived[rt.rank] = time.monotonic()
        rt.tp.barrier()
        passed[rt.rank] = time.monotonic()

    ranks(3, body)
    assert min(passed.values()) >= max(arrived.values())


def test_an_object_torch_distributed_could_not_send_fails_on_that_rank():
    def body(rt):
        rt.tp.all_gather_object(threading.Lock() if rt.rank == 1 else None)

    with pytest.raises(RankError, match="emulated rank 1 of 2 failed") as e:
        ranks(2, body)
    assert isinstance(e.value.error, TypeError)


def test_a_failing_rank_releases_its_waiting_peers_and_is_named():
    released = []

    def body(rt):
        if rt.rank == 1:
            time.sleep(0.1)
            raise ValueError("rank 1's own error")
        try:
            rt.tp.barrier()  # rank 1 never comes
        except _PeerFailed as e:
            released.append((rt.rank, str(e)))
            raise

    # Ranks left waiting would end in the emulation's timeout (an EmulationTimeoutError naming
    # them), not in rank 1's error.
    with pytest.raises(RankError, match="rank 1 of 3 failed: ValueError: rank 1's own error") as e:
        ranks(3, body, timeout_s=30)
    assert e.value.rank == 1 and isinstance(e.value.__cause__, ValueError)
    assert sorted(r for r, _ in released) == [0, 2]
    assert all("rank 1 failed (ValueError" in m for _, m in released)


def test_the_first_failure_is_the_one_reported():
    def body(rt):
        time.sleep(0.3 if rt.rank == 0 else 0.0)
        raise RuntimeError(f"rank {rt.rank}")

    with pytest.raises(RankError) as e:
        ranks(2, body)
    assert e.value.rank == 1


def test_a_rank_that_never_comes_times_out_the_exchange_naming_it():
    def body(rt):
        if rt.rank == 2:
            time.sleep(1.0)  # skips the exchange, ends late but within the grace
            return
        rt.tp.barrier()

    t0 = time.monotonic()
    with pytest.raises(RankError) as e:
        ranks(3, body, timeout_s=0.3, grace_s=10)
    assert time.monotonic() - t0 < 5
    err = e.value.error
    assert isinstance(err, EmulationTimeoutError)
    assert "members [0, 1]" in str(err) and "for members [2], which never came" in str(err)


def test_a_late_rank_is_a_timeout():
    with pytest.raises(EmulationTimeoutError, match=r"ranks \[1\] of 2 ran past the timeout"):
        ranks(2, lambda rt: time.sleep(0.6 if rt.rank == 1 else 0), timeout_s=0.2, grace_s=10)


def test_a_stuck_rank_is_named_with_where_it_is():
    stop = threading.Event()

    def body(rt):
        if rt.rank == 1:
            stop.wait(30)  # the line the error names

    try:
        with pytest.raises(EmulationTimeoutError) as e:
            ranks(2, body, timeout_s=0.2, grace_s=0.2)
        assert "ranks [1] of 2 still run" in str(e.value)
        assert "stop.wait(30)" in str(e.value), str(e.value)
    finally:
        stop.set()


def test_a_base_exception_passes_through_as_it_is():
    class Outcome(BaseException):
        pass

    with pytest.raises(Outcome):
        ranks(2, lambda rt: (_ for _ in ()).throw(Outcome()) if rt.rank == 0 else None)


def test_what_a_rank_may_not_do():
    def body(rt):
        for fn, match in ((lambda: fusedist.init(backend="gloo"), "fusedist.init"),
                          (fusedist.shutdown, "fusedist.shutdown"),
                          (lambda: run_ranks(2, lambda r: None, device="cpu"), "do not nest")):
            with pytest.raises(RuntimeError, match=match):
                fn()
        # The CPU path's collectives run over a torch process group, which these groups lack.
        with pytest.raises(ValueError, match="no torch.distributed process group"):
            fusedist.Communicator(rt.tp)

    ranks(2, body)


def test_bad_arguments():
    for world in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="world must be a positive int"):
            run_ranks(world, lambda rt: None, device="cpu")
    with pytest.raises(ValueError, match="timeout_s"):
        run_ranks(2, lambda rt: None, device="cpu", timeout_s=0)
    with pytest.raises(ValueError, match="device must be a CUDA device"):
        run_ranks(2, lambda rt: None, device="meta")


def test_each_rank_thread_has_its_own_comm_stream_pool():
    def body(rt):
        return id(streams._pools_here())

    ids = ranks(3, body)
    assert len(set(ids)) == 3 and id(streams._pools) not in ids
    assert streams._pools_here() is streams._pools


def test_exchange_abort_and_end():
    ex = _Exchange(2, "g", time.monotonic() + 30)
    errors = []

    def waiter():
        try:
            ex.all_gather(0, "x")
        except _PeerFailed as e:
            errors.append(str(e))

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.05)
    ex.abort("rank 1 failed (ValueError: boom)")
    t.join(5)
    assert errors and "gave up: rank 1 failed (ValueError: boom)" in errors[0]
    with pytest.raises(_PeerFailed):  # later callers too
        ex.all_gather(1, "y")
    ex.end()  # every member gone: a closing barrier answers at once
    assert ex.all_gather(0, None) == [None, None]


def test_the_emulated_transports():
    assert Group.symmetric_memory_class is None and Group.nccl_class is None
    assert EmulatedGroup.symmetric_memory_class is EmulatedSymmetricMemory
    assert EmulatedGroup.nccl_class is EmulatedNccl

    class _G:
        name, size = "g", 3

    nccl = EmulatedNccl(_G())
    for call in (nccl.all_reduce, nccl.all_gather, nccl.reduce_scatter):
        with pytest.raises(fusedist.NcclUnavailableError, match="emulated ranks"):
            call(None, None)
    nccl.abort()
    assert nccl.aborted
    # Grids for a share of the SMs: two kernels of every rank fit beside each other.
    symm = EmulatedSymmetricMemory.__new__(EmulatedSymmetricMemory)
    symm.group = _G()
    assert symm._max_blocks(132) == 22
    symm.group.size = 2
    assert symm._max_blocks(132) == 33 and symm._max_blocks(3) == 1


def _when_rank0_went_on(rank) -> float:
    """Run rank(0, 0.0) and rank(1, 0.3) on two threads: seconds until rank 0 went on (rank
    returns when it goes on)."""
    went = {}

    def body(i, delay):
        rank(i, delay)
        went[i] = time.monotonic()

    t0 = time.monotonic()
    threads = [threading.Thread(target=body, args=(0, 0.0)),
               threading.Thread(target=body, args=(1, 0.3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return went[0] - t0


def test_launches_meet_in_step_but_never_wait_past_their_patience():
    ex = _Exchange(2, "g", time.monotonic() + 30)

    def rank(i, delay):
        time.sleep(delay)
        ex.meet(i, patience=5.0)

    assert _when_rank0_went_on(rank) >= 0.3, "rank 0 launched before rank 1 came"
    # A peer that never makes this launch (it called something else): go on after the patience.
    t0 = time.monotonic()
    ex.meet(0, patience=0.2)
    assert 0.2 <= time.monotonic() - t0 < 2


def test_after_launching_a_rank_waits_until_its_peers_launched():
    """The after-launch meet counts launches made, apart from launches come to: a rank that
    launched waits for a peer that came to the launch but has not made it yet."""
    ex = _Exchange(2, "g", time.monotonic() + 30)

    def rank(i, delay):
        ex.meet(i, patience=5.0)                    # both come to the launch
        time.sleep(delay)                           # rank 1 is slow to make it
        ex.meet(i, patience=5.0, launched=True)

    assert _when_rank0_went_on(rank) >= 0.3, "rank 0 went on before rank 1 had launched"
    # The two counts are apart: a peer's launch made does not stand for its next launch come to.
    ex = _Exchange(2, "g", time.monotonic() + 30)
    ex.meet(1, patience=0.0, launched=True)
    t0 = time.monotonic()
    ex.meet(0, patience=0.2)
    assert 0.2 <= time.monotonic() - t0 < 2, "a launched meet let a before-launch meet through"


def test_the_environment_it_needs_is_checked(monkeypatch):
    from fusedist.testing.emulated import _check_environment

    monkeypatch.setenv("CUDA_MODULE_LOADING", "LAZY")
    monkeypatch.setenv("FUSEDIST_PDL", "1")
    with pytest.warns(RuntimeWarning) as got:
        _check_environment()
    text = " ".join(str(w.message) for w in got)
    assert "CUDA_MODULE_LOADING is not EAGER" in text and "dependent launch is on" in text
    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")
    monkeypatch.setenv("FUSEDIST_PDL", "0")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _check_environment()
