"""The README's Python examples run as written on a CPU machine: the usage block and the
torch.distributed block on 2 gloo ranks under torchrun, the model API block on a tiny
checkpoint (its path put in place of the example's)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from launch import _env, _run

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CPU_ENV = {"CUDA_VISIBLE_DEVICES": "", "FUSEDIST_INIT_TIMEOUT_S": "60",
           "PYTHONPATH": str(ROOT)}


def block_after(heading: str) -> str:
    """The first ```python block after the line `heading`."""
    at = README.index("\n" + heading + "\n")
    m = re.compile(r"```python\n(.*?)```", re.S).search(README, at)
    assert m, f"no python block after {heading!r}"
    return m.group(1)


def run_ranks(tmp_path, code: str, nproc: int):
    script = tmp_path / "example.py"
    script.write_text(code)
    cmd = [sys.executable, "-P", "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(nproc), str(script)]
    p = _run(cmd, _env(CPU_ENV), 240)
    assert p.returncode == 0, p.stdout[-5000:]
    return p.stdout


@pytest.mark.timeout(300)
def test_usage_block_on_two_cpu_ranks(tmp_path):
    code = block_after("## Usage")
    assert "torch.cuda.CUDAGraph" in code      # the GPU-only lines are behind a device check
    out = run_ranks(tmp_path, code + "\nimport sys\nsys.stdout.write('example done\\n')\n", 2)
    assert out.count("example done") == 2, out[-3000:]


@pytest.mark.timeout(300)
def test_torch_distributed_block_on_two_cpu_ranks(tmp_path):
    code = block_after("### Under torch.distributed")
    check = ("\nassert dist.group.WORLD.routed >= 1, 'the row-parallel all-reduce skipped fusedist'"
             "\nimport sys\nsys.stdout.write(f'example done {tuple(y.shape)}\\n')"
             "\nsys.stdout.flush()\ndist.destroy_process_group()\n")   # one write per rank
    out = run_ranks(tmp_path, code + check, 2)
    assert out.count("example done (8, 256)") == 2, out[-3000:]


@pytest.mark.timeout(300)
def test_model_api_block(tmp_path):
    sys.path.insert(0, str(ROOT / "tests" / "models"))
    from hf_tiny import make_checkpoint
    from test_llm import write_tokenizer

    ckpt = make_checkpoint("llama3", str(tmp_path / "ckpt"), seed=3)
    write_tokenizer(ckpt)
    code = block_after("## Model")
    assert '"/ckpt/Qwen2.5-0.5B-Instruct"' in code
    code = code.replace('"/ckpt/Qwen2.5-0.5B-Instruct"', repr(ckpt))
    out = run_ranks(tmp_path, code + "\nprint('\\nexample done')\n", 1)
    assert "example done" in out, out[-3000:]
