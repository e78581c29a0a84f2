"""tests/conftest.py's tier decision (CPU tier): missing GPUs skip the GPU tier, a GPU host
whose CUDA does not initialize fails it."""

from __future__ import annotations

import conftest


def test_gpus_present_run():
    assert conftest.gpu_tier(2, None, True, 2, None) == (2, None)


def test_no_gpus_listed_skips():
    assert conftest.gpu_tier(0, None, True, 0, "RuntimeError: no driver") == (0, None)
    assert conftest.gpu_tier(0, None, False, 0, None) == (0, None)


def test_listed_gpus_with_a_cuda_init_failure_fail():
    have, broken = conftest.gpu_tier(8, None, True, 0, "RuntimeError: CUDA driver too old")
    assert have == 0 and "nvidia-smi lists 8 GPU(s)" in broken and "driver too old" in broken
    have, broken = conftest.gpu_tier(1, "0", True, 0, None)
    assert "is_available() is False" in broken


def test_listed_gpus_with_a_cpu_only_torch_fail():
    have, broken = conftest.gpu_tier(1, None, False, 0, None)
    assert have == 0 and "built without CUDA" in broken


def test_gpus_hidden_on_purpose_skip():
    assert conftest.gpu_tier(8, "", True, 0, None) == (0, None)
    assert conftest.gpu_tier(8, "-1", False, 0, None) == (0, None)


# ---- tests/gpu/run.sh: its exit status ------------------------------------------------------
def _gpu_run_stage_block() -> tuple[str, str]:
    from pathlib import Path

    text = (Path(__file__).resolve().parent / "gpu" / "run.sh").read_text()
    return text, text[text.index("WORST=0"):text.index("\nwant()")]


def test_gpu_run_exit_status_is_the_worst_stage(tmp_path):
    """tests/gpu/run.sh's stage(): every stage runs, and the run's status is the largest of
    theirs (a failed GPU tier, sanitizer or compare is the run's failure, a timeout's 124
    included); the script ends with that status (nothing after it can reset it)."""
    import subprocess

    text, block = _gpu_run_stage_block()
    script = block + "\n" + "\n".join([
        "stage first 30 true",
        "stage tests 30 bash -c 'exit 1'",
        "stage compare 30 bash -c 'exit 2'",
        "stage hung 1 sleep 30",
        "stage last 30 true",
        "stage pytest 30 echo '== 3 failed, 765 passed, 14 skipped in 178.70s =='",
        "stage bench 30 echo '  Case(proj=down) fp8 scaled_mm_loop: rel err RuntimeError: "
        "CUDA error: CUBLAS_STATUS_NOT_SUPPORTED; not timed'",
        "stage crash 30 bash -c 'echo Traceback; echo \"  File x\"; "
        "echo \"ValueError: x must be bfloat16\"; exit 1'",
        "stage build 30 bash -c 'echo \"csrc/x.cu(12): error: identifier y is undefined\"; "
        "echo \"ninja: build stopped\"; exit 1'",
        'echo "status=$WORST failed=$FAILED"'])
    out = subprocess.run(["bash", "-c", "set -uo pipefail\n" + script], capture_output=True,
                         text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path),
                              "LOGS": str(tmp_path)}).stdout
    assert "status=124 failed= tests compare hung crash build" in out, out
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert len(summary) == 9
    # Each line quotes the log's outcome: pytest's counts, an uncaught exception; a benchmark
    # row that records a baseline's error as text is not one.
    line = {s.split()[0]: s for s in summary}
    assert line["pytest"].endswith("3 failed, 765 passed, 14 skipped in 178.70s =="), summary
    assert line["bench"].rstrip().endswith("s"), summary
    assert "CUDA error" not in line["bench"], summary
    assert line["crash"].endswith("ValueError: x must be bfloat16"), summary
    assert line["build"].endswith("csrc/x.cu(12): error: identifier y is undefined"), summary
    assert text.rstrip().endswith('exit "$WORST"'), "tests/gpu/run.sh must end in exit $WORST"


def test_gpu_run_gate_set_reruns_committed_results():
    """tests/gpu/run.sh's one-GPU `gate` stage runs each benchmark with the arguments a
    committed result file of each single-GPU machine records (one H200, one H100), so
    compare.py pairs every file it writes with a committed one there."""
    import json
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    text, _ = _gpu_run_stage_block()
    m = re.search(r'GATE_SET=\$\{FUSEDIST_GATE_SET:-"([^"]+)"\}', text)
    assert m, "tests/gpu/run.sh has no default GATE_SET"
    gate = [" ".join(c.split()) for c in m[1].split("|")]
    assert len(gate) >= 8
    for machine in ("h200-w1", "h100_80gb_hbm3-w1"):
        recorded = set()
        for f in (root / "benchmarks" / "results" / machine).glob("*.json"):
            words = json.loads(f.read_text())["meta"]["command"].split()
            recorded.add(" ".join(w for w in words[1:] if w != "-P").removeprefix("benchmarks/"))
        missing = [c for c in gate if c not in recorded]
        assert not missing, f"{machine}: no committed result was run as {missing}"


def test_gpu_run_gate_stage_runs_each_command_into_the_results(tmp_path):
    """The gate stage's bash, run with a stand-in python3: one stage per benchmark, each
    command's words as separate arguments, FUSEDIST_RESULTS_DIR pointing at the run's
    results; a failing benchmark fails the run and the rest still run."""
    import re
    import subprocess

    text, block = _gpu_run_stage_block()
    gate = re.search(r"\nif want gate; then.*?\nfi\n", text, re.S)
    assert gate, "tests/gpu/run.sh has no gate stage"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "python3"
    fake.write_text('#!/bin/bash\nprintf "%s|" "$FUSEDIST_RESULTS_DIR" "$@" >> "$CALLS"\n'
                    'echo >> "$CALLS"\n[[ $* == *silu_mul* ]] && exit 3\nexit 0\n')
    fake.chmod(0o755)
    script = block + "\nwant() { true; }\nRESULTS=$OUT/results\n" + gate[0] + \
        'echo "status=$WORST failed=$FAILED"'
    calls = tmp_path / "calls.txt"
    out = subprocess.run(["bash", "-c", "set -uo pipefail\n" + script], capture_output=True,
                         text=True, timeout=60,
                         env={"PATH": f"{bindir}:/usr/bin:/bin", "OUT": str(tmp_path),
                              "LOGS": str(tmp_path), "CALLS": str(calls)}).stdout
    assert "status=3 failed= bench_silu_mul" in out, out
    got = [line.split("|")[:-1] for line in calls.read_text().splitlines()]
    results = str(tmp_path / "results")
    assert got[0] == [results, "-P", "benchmarks/add_rmsnorm.py", "--quick"]
    assert [results, "-P", "benchmarks/gemv.py", "--ms", "1,16", "--stages", "2,3"] in got
    assert len(got) == len(re.search(r'GATE_SET=\$\{FUSEDIST_GATE_SET:-"([^"]+)"',
                                     text)[1].split("|"))
    assert (tmp_path / "summary.txt").read_text().count("bench_") == len(got)


# ---- tests/conftest.py's rule for a kernel a test needs ---------------------------------------
def _caps(monkeypatch, built=True, kernels=(), archs=("90a",), cc=(9, 0)):
    from fusedist import _ext

    caps = _ext.Capabilities(built=built, why_missing="" if built else "no module fusedist._C",
                             version="x", abi=_ext.ABI_VERSION, cuda_archs=archs,
                             kernels=frozenset(kernels))
    monkeypatch.setattr(_ext, "capabilities", lambda: caps)
    monkeypatch.setattr(_ext, "device_capability", lambda device: cc)


def test_a_kernel_missing_from_the_build_fails_on_a_gpu(monkeypatch):
    """One rule for every GPU test that needs a kernel: a build without it (or without _C, or
    for other architectures) fails, naming the kernel; only a GPU older than the kernel
    needs skips; a CPU check of the bindings skips without _C (fails with
    FUSEDIST_REQUIRE_EXT=1) and fails on a _C without the kernel."""
    problem = conftest.kernel_problem
    _caps(monkeypatch, kernels=("gemv",))
    assert problem("gemv") == ("", "")
    verdict, why = problem("fp8_gemm")
    assert verdict == "fail" and "fp8_gemm" in why and "built without" in why
    _caps(monkeypatch, built=False)
    verdict, why = problem("silu_mul")
    assert verdict == "fail" and "silu_mul" in why and "not built" in why
    _caps(monkeypatch, kernels=("attention_decode",), archs=("100a",))
    verdict, why = problem("attention_decode")
    assert verdict == "fail" and "built for 100a" in why
    _caps(monkeypatch, kernels=("attention_decode",), archs=("80",), cc=(8, 0))
    assert problem("attention_decode")[0] == "skip"           # sm_80 is older than it needs
    _caps(monkeypatch, built=False)
    monkeypatch.delenv("FUSEDIST_REQUIRE_EXT", raising=False)
    assert problem("gemv", "cpu")[0] == "skip"
    monkeypatch.setenv("FUSEDIST_REQUIRE_EXT", "1")
    assert problem("gemv", "cpu")[0] == "fail"
    _caps(monkeypatch, kernels=("silu_mul",))
    assert problem("gemv", "cpu")[0] == "fail" and problem("silu_mul", "cpu") == ("", "")
    import pytest

    with pytest.raises(KeyError, match="unknown kernel"):
        problem("no_such_kernel")
