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
        'echo "status=$WORST failed=$FAILED"'])
    out = subprocess.run(["bash", "-c", "set -uo pipefail\n" + script], capture_output=True,
                         text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path),
                              "LOGS": str(tmp_path)}).stdout
    assert "status=124 failed= tests compare hung" in out, out
    assert (tmp_path / "summary.txt").read_text().count("\n") == 5
    assert text.rstrip().endswith('exit "$WORST"'), "tests/gpu/run.sh must end in exit $WORST"
