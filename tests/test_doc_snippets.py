"""Code in the docs runs as written, on the CPU: each snippet is taken from its markdown file
and run (a checkpoint path it names replaced by a tiny checkpoint's). The FP8 docs' block-scaled
GEMM (fp8_gemm(..., block=True)), the Python API's "Below LLM" snippet, the attention
design's TPAttention snippet; and the configuration table is the registry's output, unedited."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from launch import python

ROOT = Path(__file__).resolve().parents[1]
CPU_ENV = {"CUDA_VISIBLE_DEVICES": "", "FUSEDIST_INIT_TIMEOUT_S": "60", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}


def python_block(doc: str, heading: str) -> str:
    """The first ```python block after the line `heading` of ROOT/doc."""
    text = (ROOT / doc).read_text()
    at = text.index("\n" + heading + "\n")
    m = re.compile(r"```python\n(.*?)```", re.S).search(text, at)
    assert m, f"no python block after {heading!r} in {doc}"
    return m.group(1)


def run(tmp_path, code: str, timeout: int = 300) -> str:
    script = tmp_path / "snippet.py"
    script.write_text(code + "\nprint('\\nsnippet done', flush=True)\n")
    p = python(["-P", str(script)], env=dict(os.environ, **CPU_ENV), timeout=timeout,
               cwd=tmp_path)
    assert p.returncode == 0 and "snippet done" in p.stdout, p.stdout[-2000:] + p.stderr[-4000:]
    return p.stdout


def test_fp8_doc_block_scaled_gemm(tmp_path):
    code = python_block("docs/design/fp8.md", "## The weight")
    assert "fp8_gemm(xq, sx, w.data, w.scale, block=True)" in code
    run(tmp_path, code)


def test_configuration_table_is_the_registry_output():
    run = python(["-m", "fusedist.envs", "--markdown"], env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert run.returncode == 0, run.stderr
    out = run.stdout
    doc = (ROOT / "docs" / "configuration.md").read_text()
    marker = "<!-- made by `python -m fusedist.envs --markdown` -->\n"
    assert marker in doc
    table = doc.split(marker, 1)[1]
    assert table.startswith(out), ("docs/configuration.md's table is not the registry's output: "
                                   "regenerate it with python -m fusedist.envs --markdown")


def _long_checkpoint(path: str) -> str:
    """A tiny Llama checkpoint whose positions cover the snippet's max_seq_len 2048."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=2, max_position_embeddings=4096)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.mark.timeout(400)
def test_python_api_below_llm(tmp_path):
    code = python_block("docs/python_api.md", "## Below LLM")
    assert code.count('"/ckpt/Meta-Llama-3-8B"') == 2
    ckpt = _long_checkpoint(str(tmp_path / "ckpt"))
    out = run(tmp_path, code.replace('"/ckpt/Meta-Llama-3-8B"', repr(ckpt)))
    assert "ms per step" in out


@pytest.mark.timeout(400)
def test_attention_design_tpattention(tmp_path):
    code = python_block("docs/design/attention.md", "## TPAttention")
    out = run(tmp_path, code + "\nassert y.shape == (1, 4096) and torch.isfinite(y).all()\n")
    assert "snippet done" in out
