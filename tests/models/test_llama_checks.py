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


# ---- tensors against the config -------------------------------------------------------------
def test_good_checkpoint_equals_random_weights(rt, tmp_path):
    path = write_ckpt(tmp_path / "ok")
    sharded = write_ckpt(tmp_path / "sharded", sharded=True)
    cfg = LlamaConfig.from_dir(path)
    ref = build_model(cfg, RandomWeights(cfg, seed=3), dtype=torch.float32, device="cpu")
    from fusedist.models.llama.weights import check_weights
    check_weights(RandomWeights(cfg, seed=3), cfg)     # random weights pass their own check
    for p in (path, sharded):
        got = _load(p)
        for (n, a), (_, b) in zip(got.named_parameters(), ref.named_parameters()):
            assert torch.equal(a, b), n


Q = "model.layers.0.self_attn.q_proj.weight"
K = "model.layers.0.self_attn.k_proj.weight"
NORM = "model.layers.0.input_layernorm.weight"


def _set(name, value):
    def edit(t):
        t[name] = value
    return edit


BAD_TENSORS = {
    # extra rows: read as rows [0, 32) and the rest dropped
    "extra_rows": (_set(Q, torch.randn(33, 32)), Q, r"shape \[33, 32\].*\[32, 32\]"),
    # too few rows: a torch size error naming no tensor
    "too_small": (_set(K, torch.randn(8, 32)), K, r"shape \[8, 32\].*\[16, 32\]"),
    # [1]-shaped tensors: broadcast by copy_
    "norm_1": (_set(NORM, torch.ones(1)), NORM, r"shape \[1\].*\[32\]"),
    "head_1": (_set("lm_head.weight", torch.randn(1, 32)), "lm_head.weight",
               r"shape \[1, 32\].*\[40, 32\]"),
    "final_norm_2d": (_set("model.norm.weight", torch.ones(1, 32)), "model.norm.weight",
                      r"shape \[1, 32\].*\[32\]"),
    # integer weights: cast to float
    "int32": (_set("model.embed_tokens.weight", torch.ones(40, 32, dtype=torch.int32)),
              "model.embed_tokens.weight", r"dtype I32.*float32, float16 and bfloat16"),
    "float64": (_set(K, torch.randn(16, 32, dtype=torch.float64)), K, r"dtype F64"),
    # FP8 without a quantization_config: no scales to read it with
    "fp8": (_set(Q, torch.randn(32, 32).to(torch.float8_e4m3fn)), Q,
            r"F8_E4M3 \(FP8\), but config.json has no quantization_config"),
    # a bias the model would not apply (Llama attention_bias puts one on o_proj)
    "o_proj_bias": (_set("model.layers.0.self_attn.o_proj.bias", torch.randn(32)),
                    "model.layers.0.self_attn.o_proj.bias", r"not apply"),
}


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("case", list(BAD_TENSORS))
def test_bad_tensor_names_tensor_and_file(rt, tmp_path, case, sharded):
    edit, name, what = BAD_TENSORS[case]
    path = write_ckpt(tmp_path / case, edit=edit, sharded=sharded)
    weight_map = os.path.join(path, "model.safetensors.index.json")
    fname = json.load(open(weight_map))["weight_map"][name] if sharded else "model.safetensors"
    with pytest.raises(ValueError, match=re.escape(name) + ".*" + re.escape(fname) + ".*" + what):
        _load(path)


def test_read_past_the_tensor_is_refused(tmp_path):
    path = write_ckpt(tmp_path / "ok")
    src = SafetensorsWeights(path)
    with pytest.raises(ValueError, match=re.escape(K) + r".*rows \[8, 24\).*16"):
        src.read(K, 0, 8, 24, dtype=torch.float32, device="cpu")
    assert src.read(K, 1, 0, 32, dtype=torch.float32, device="cpu").shape == (16, 32)


# ---- files ----------------------------------------------------------------------------------
def _rewrite(path, fname, data: bytes):
    with open(os.path.join(path, fname), "wb") as f:
        f.write(data)


def test_corrupt_safetensors_names_the_file(rt, tmp_path):
    path = write_ckpt(tmp_path / "trunc")
    full = os.path.join(path, "model.safetensors")
    data = open(full, "rb").read()
    _rewrite(path, "model.safetensors", data[:-100])             # truncated
    with pytest.raises(ValueError, match=re.escape(full) + ".*not a readable safetensors"):
        _load(path)
    _rewrite(path, "model.safetensors", b"not a safetensors file at all")
    with pytest.raises(ValueError, match=re.escape(full) + ".*not a readable safetensors"):
        _load(path)
    # one shard of a sharded checkpoint
    path = write_ckpt(tmp_path / "shard", sharded=True)
    shard = os.path.join(path, "model-00002-of-00002.safetensors")
    _rewrite(path, "model-00002-of-00002.safetensors", open(shard, "rb").read()[:50])
    with pytest.raises(ValueError, match=re.escape(shard) + ".*not a readable safetensors"):
        _load(path)


def test_bad_index_json_names_the_file(tmp_path):
    path = write_ckpt(tmp_path / "idx", sharded=True)
    index = os.path.join(path, "model.safetensors.index.json")
    _rewrite(path, "model.safetensors.index.json", b'{"metadata": {}}')
    with pytest.raises(ValueError, match=re.escape(index) + ".*weight_map"):
        SafetensorsWeights(path)
    _rewrite(path, "model.safetensors.index.json", b'{"weight_map": [1, 2]}')
    with pytest.raises(ValueError, match=re.escape(index) + ".*weight_map"):
        SafetensorsWeights(path)
    _rewrite(path, "model.safetensors.index.json", b'{"weight_map": {')
    with pytest.raises(ValueError, match=re.escape(index) + ".*not valid JSON"):
        SafetensorsWeights(path)


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


# ---- positions ------------------------------------------------------------------------------
def test_max_position_names_max_position_embeddings(rt):
    cfg = LlamaConfig.named("tiny")                      # 2048 positions, no sliding window
    assert build_model(cfg, RandomWeights(cfg), dtype=torch.float32,
                       device="cpu").max_position == 2048
    with pytest.raises(ValueError, match=r"max_position=2049 exceeds max_position_embeddings "
                                         r"\(2048\)") as e:
        build_model(cfg, RandomWeights(cfg), dtype=torch.float32, device="cpu",
                    max_position=2049)
    assert "sliding window" not in str(e.value)
    # a sliding window longer than the positions: the positions bound the length
    wide = cfg.replace(sliding_window=4096, architecture="MistralForCausalLM")
    assert wide.position_limit()[0] == 2048
    with pytest.raises(ValueError, match=r"max_position_embeddings \(2048\)"):
        build_model(wide, RandomWeights(wide), dtype=torch.float32, device="cpu",
                    max_position=3000)
    narrow = cfg.replace(sliding_window=64, architecture="MistralForCausalLM")
    with pytest.raises(ValueError, match=r"exceeds the sliding window \(64 tokens\)"):
        build_model(narrow, RandomWeights(narrow), dtype=torch.float32, device="cpu",
                    max_position=65)


def test_config_takes_numpy_sizes_and_names_bad_ones():
    import numpy as np

    cfg = LlamaConfig(vocab_size=np.int64(32), hidden_size=np.int64(64),
                      intermediate_size=np.int32(96), num_layers=np.int64(2),
                      num_heads=np.int64(4), num_kv_heads=np.int64(2))
    assert type(cfg.vocab_size) is int and cfg.head_dim == 16
    for kw, match in (({"hidden_size": 0}, "hidden_size must be a positive int, got 0"),
                      ({"num_heads": 2.5}, r"num_heads must be a positive int, got 2.5 \(a "
                                           r"float\)"),
                      ({"vocab_size": True}, "vocab_size must be a positive int, got the bool"),
                      ({"hidden_size": 2, "num_heads": 4}, "hidden_size=2 is smaller than "
                                                           "num_heads=4; give head_dim")):
        args = {**dict(vocab_size=32, hidden_size=64, intermediate_size=96, num_layers=2,
                       num_heads=4, num_kv_heads=2), **kw}
        with pytest.raises(ValueError, match="LlamaConfig: " + match):
            LlamaConfig(**args)


def test_attention_bias_must_be_a_bool(tmp_path):
    d = dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32,
             intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
             attention_bias="yes")
    with pytest.raises(ValueError, match="attention_bias must be true or false, got 'yes'"):
        LlamaConfig.from_hf_config(d)
    d["attention_bias"] = True
    cfg = LlamaConfig.from_hf_config(d)
    assert cfg.qkv_bias and cfg.o_bias
    qwen = LlamaConfig.from_hf_config(dict(d, architectures=["Qwen2ForCausalLM"]))
    assert qwen.qkv_bias and not qwen.o_bias      # Qwen2's o_proj has no bias
