"""fusedist.init / shutdown on 4 CPU ranks emulating 2 nodes x 2 ranks, launched by torchrun
and by mpirun: tests/dist/worker_runtime.py (topology, groups, all-reduce over each group,
an engine's ProcessGroup; mode tp_spans: init errors and re-init in one process) and
tests/dist/worker_adopt.py (init() adopts an engine's process group, shutdown() keeps it)."""

from __future__ import annotations

import pytest

from launch import assert_passed, mpirun, mpirun_available, torchrun

NPROC = 4
# A hung rendezvous or collective fails within a minute instead of the default 300 s.
CPU_ENV = {"CUDA_VISIBLE_DEVICES": "", "FUSEDIST_INIT_TIMEOUT_S": "60"}
CASES = [
    pytest.param("worker_runtime.py", (), id="runtime"),
    pytest.param("worker_runtime.py", ("tp_spans",), id="tp_spans"),
    pytest.param("worker_adopt.py", (), id="adopt"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("worker,args", CASES)
def test_runtime_cpu_torchrun(worker, args):
    # The runtime case under torchrun itself (the launch environment it makes, its agent
    # store); the others on the test pool's ranks, which get the same environment.
    launcher = worker == "worker_runtime.py" and not args
    assert_passed(torchrun(worker, NPROC, CPU_ENV, timeout=280, args=args, launcher=launcher),
                  NPROC)


@pytest.mark.timeout(300)
@pytest.mark.skipif(not mpirun_available(), reason="mpirun not installed")
@pytest.mark.parametrize("worker,args", CASES)
def test_runtime_cpu_mpirun(worker, args):
    assert_passed(mpirun(worker, NPROC, CPU_ENV, timeout=280, args=args), NPROC)


# ---- the launcher helper itself -----------------------------------------------------------------
def test_worker_output_is_logged_as_it_runs(tmp_path, monkeypatch):
    """With FUSEDIST_WORKER_LOG_DIR, a worker's output is captured and also on disk; a worker
    killed at its timeout still leaves what it printed, and the error names the log."""
    import sys

    import launch

    monkeypatch.setenv("FUSEDIST_WORKER_LOG_DIR", str(tmp_path))
    p = launch._run([sys.executable, "-c", "print('[ok] check_one')"], launch._env(None), 60)
    assert p.returncode == 0 and "[ok] check_one" in p.stdout
    assert [f.read_text() for f in tmp_path.iterdir()] == ["[ok] check_one\n"]
    slow = [sys.executable, "-u", "-c", "import time; print('[ok] first', flush=True); "
            "time.sleep(60)"]
    with pytest.raises(AssertionError, match=r"timed out after 2s \(log: .*\)\n\[ok\] first"):
        launch._run(slow, launch._env(None), 2)
    monkeypatch.delenv("FUSEDIST_WORKER_LOG_DIR")
    p = launch._run([sys.executable, "-c", "print('plain')"], launch._env(None), 60)
    assert p.stdout == "plain\n" and len(list(tmp_path.iterdir())) == 2
    with pytest.raises(AssertionError, match=r"timed out after 2s\n\[ok\] first"):
        launch._run(slow, launch._env(None), 2)


def test_a_check_skipped_on_some_ranks_only_fails_the_worker():
    """tests/dist/worker_checks_selftest.py: rank 1 skips a check rank 0 runs; the harness must
    report it as a failure on every rank (a skip is never a pass, and the ranks disagree). A
    failing check names the seed (FUSEDIST_TEST_SEED) to rerun it with, as does the run's
    first line; every rank runs with rank 0's seed."""
    p = torchrun("worker_checks_selftest.py", 2, {"CUDA_VISIBLE_DEVICES": "",
                                                  "FUSEDIST_TEST_SEED": "4242"}, timeout=120)
    assert p.returncode != 0, p.stdout[-3000:]
    assert "skipped_on_rank_1_only: skipped on some ranks only (rank 0 ok, rank 1 skip)" \
        in p.stdout, p.stdout[-3000:]
    assert "all checks passed" not in p.stdout
    assert "checks on 2 ranks, seed 4242: rerun with FUSEDIST_TEST_SEED=4242" in p.stdout
    assert "[FAIL] rank 0 fails_with_the_seed (seed 4242: rerun with FUSEDIST_TEST_SEED=4242)" \
        in p.stdout, p.stdout[-3000:]
    assert "failed with seed 4242" in p.stdout and "seed_is_rank_0s" not in \
        p.stdout.split("failed:")[-1], p.stdout[-3000:]
    # unset: a fresh seed, printed first
    p = torchrun("worker_checks_selftest.py", 2, {"CUDA_VISIBLE_DEVICES": "",
                                                  "FUSEDIST_TEST_SEED": ""}, timeout=120)
    assert "checks on 2 ranks, seed " in p.stdout and "rerun with FUSEDIST_TEST_SEED=" in p.stdout
