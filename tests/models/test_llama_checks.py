"""Loading a Llama-family checkpoint checks its input before using it: config.json (required
keys, head counts, RoPE factors, valid JSON), the safetensors files and index (readable, a
weight_map), and every tensor's full shape and dtype against the config; the error names the
key or tensor and its file. The model refuses positions past max_position_embeddings (or the
sliding window), naming which. CPU tier, one-layer checkpoints written here from RandomWeights
(no transformers needed)."""

from __future__ import annotations

import json
import math
import os
import re
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytest.importorskip("safetensors")

from safetensors.torch import save_file  # noqa: E402

from fusedist.models import LlamaConfig, build_model  # noqa: E402
from fusedist.models.llama import RandomWeights, SafetensorsWeights  # noqa: E402
from fusedist.models.llama.weights import hf_names  # noqa: E402
from model_fixtures import rt  # noqa: E402,F401 - the shared runtime fixture

# A one-layer Llama: q_size 32 (4 heads x 8), kv_size 16 (2 kv heads), intermediate 48.
HF = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=40, hidden_size=32,
          intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
          rope_theta=10000.0, tie_word_embeddings=False)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def _tensors(d: dict) -> dict:
    cfg = LlamaConfig.from_hf_config(d)
    src = RandomWeights(cfg, seed=3)
    return {n: src.read(n, dtype=torch.float32, device="cpu") for n in hf_names(cfg)}


def write_ckpt(path, edit=None, config=None, sharded=False) -> str:
    """A checkpoint directory of config (default HF) and its RandomWeights(seed=3) tensors,
    edit(tensors) applied first; sharded: two files behind model.safetensors.index.json."""
    d = dict(HF if config is None else config)
    tensors = _tensors(d)
    if edit is not None:
        edit(tensors)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(d, f)
    if not sharded:
        save_file(tensors, os.path.join(path, "model.safetensors"))
        return str(path)
    names = sorted(tensors)
    half = {"model-00001-of-00002.safetensors": names[:len(names) // 2],
            "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for fname, part in half.items():
        save_file({n: tensors[n] for n in part}, os.path.join(path, fname))
        weight_map.update({n: fname for n in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return str(path)


def _load(path):
    return build_model(LlamaConfig.from_dir(path), SafetensorsWeights(path),
                       dtype=torch.float32, device="cpu")


# ---- config.json ----------------------------------------------------------------------------
def _config_error(tmp_path, d=None, text=None):
    tmp_path.mkdir(exist_ok=True)
    f = tmp_path / "config.json"
    f.write_text(json.dumps(d) if text is None else text)
    with pytest.raises(ValueError) as e:
        LlamaConfig.from_dir(str(tmp_path))
    assert str(f) in str(e.value), e.value
    return str(e.value)


@pytest.mark.parametrize("key", ["vocab_size", "hidden_size", "intermediate_size",
                                 "num_hidden_layers", "num_attention_heads"])
def test_config_missing_key(tmp_path, key):
    d = {k: v for k, v in HF.items() if k != key}
    msg = _config_error(tmp_path, d)
    assert f"no {key!r}" in msg, msg


@pytest.mark.parametrize("value", [0, -2, 3, 2.0, "2", True])
def test_config_bad_kv_heads(tmp_path, value):
    msg = _config_error(tmp_path, dict(HF, num_key_value_heads=value))
    assert "num_key_value_heads" in msg and repr(value) in msg, msg


@pytest.mark.parametrize("key,value", [("hidden_size", 0), ("vocab_size", -1),
                                       ("num_hidden_layers", 1.5), ("head_dim", -8),
                                       ("max_position_embeddings", 0), ("rope_theta", 0),
                                       ("rms_norm_eps", -1e-6), ("sliding_window", 0)])
def test_config_bad_values(tmp_path, key, value):
    msg = _config_error(tmp_path, dict(HF, **{key: value}))
    assert key in msg and repr(value) in msg, msg


@pytest.mark.parametrize("key,value", [("factor", 0), ("factor", -8.0),
                                       ("low_freq_factor", 0), ("high_freq_factor", 0.0),
                                       ("high_freq_factor", 0.5), ("low_freq_factor", math.nan),
                                       ("original_max_position_embeddings", 0),
                                       ("original_max_position_embeddings", -16),
                                       ("factor", None), ("factor", "8")])
def test_config_bad_rope_factors(tmp_path, key, value):
    """Each would give a NaN / inf RoPE table (or a type error while building it)."""
    bad = dict(LLAMA3_ROPE, **{key: value})
    msg = _config_error(tmp_path, dict(HF, rope_scaling=bad))
    assert f"rope_scaling {key}" in msg, msg
    msg = _config_error(tmp_path, dict(HF, rope_scaling=None, rope_parameters=bad))
    assert key in msg, msg
    missing = {k: v for k, v in LLAMA3_ROPE.items() if k != key}
    msg = _config_error(tmp_path, dict(HF, rope_scaling=missing))
    assert f"rope_scaling has no {key!r}" in msg, msg


def test_config_rope_tables_are_finite(rt):
    cfg = LlamaConfig.from_hf_config(dict(HF, rope_scaling=LLAMA3_ROPE))
    for backend in ("fusedist", "torch"):
        m = build_model(cfg, RandomWeights(cfg), backend=backend, dtype=torch.float32,
                        device="cpu")
        assert all(torch.isfinite(b).all() for b in m.buffers()), backend


def test_config_not_json(tmp_path):
    msg = _config_error(tmp_path, text='{"vocab_size": 40,')
    assert "not valid JSON" in msg, msg
    msg = _config_error(tmp_path, text="[1, 2]")
    assert "JSON object" in msg, msg


def test_config_rope_scaling_not_a_dict(tmp_path):
    msg = _config_error(tmp_path, dict(HF, rope_scaling="llama3"))
    assert "rope_scaling" in msg, msg


def test_config_from_hf_config_names_the_key():
    d = {k: v for k, v in HF.items() if k != "hidden_size"}
    with pytest.raises(ValueError, match="no 'hidden_size'"):
        LlamaConfig.from_hf_config(d)
