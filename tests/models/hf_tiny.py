"""Tiny random Hugging Face checkpoints (save_pretrained) for the model tests: several
architectures and GQA ratios, one with tied embeddings and an odd vocabulary, one sharded, a
Llama with attention_bias (q, k, v and o_proj biases).
FP8_KINDS: shapes whose projections are whole 128 x 128 blocks at TP 1 and 2 (q 512, k / v 256,
gate / up 512 rows); write_fp8_checkpoint writes a bf16 checkpoint's FP8 form in the layouts
of Hugging Face's quant_method "fp8" and of compressed-tensors."""

from __future__ import annotations

import os

import torch

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

# kind -> (class name, config kwargs, save kwargs)
KINDS = {
    # Llama 3.1-style RoPE scaling, GQA 2.
    "llama3": ("Llama", dict(vocab_size=256, hidden_size=64, intermediate_size=96,
                             num_attention_heads=4, num_key_value_heads=2,
                             rope_scaling=LLAMA3_ROPE, rope_theta=10000.0), {}),
    # GQA 4, head_dim 8, several safetensors files behind model.safetensors.index.json.
    "llama_sharded": ("Llama", dict(vocab_size=320, hidden_size=64, intermediate_size=128,
                                    num_attention_heads=8, num_key_value_heads=2),
                      dict(max_shard_size="100KB")),
    # One kv head (GQA 4): replicated on both ranks at TP 2.
    "mistral": ("Mistral", dict(vocab_size=256, hidden_size=64, intermediate_size=96,
                                num_attention_heads=4, num_key_value_heads=1,
                                sliding_window=None), {}),
    # Llama with attention_bias: transformers puts biases on q, k, v and o_proj.
    "llama_bias": ("Llama", dict(vocab_size=256, hidden_size=64, intermediate_size=96,
                                 num_attention_heads=4, num_key_value_heads=2,
                                 attention_bias=True), {}),
    # Multi-head (GQA 1), q/k/v biases, tied embeddings, a vocabulary that TP 2 must pad.
    "qwen2": ("Qwen2", dict(vocab_size=250, hidden_size=64, intermediate_size=96,
                            num_attention_heads=4, num_key_value_heads=4,
                            tie_word_embeddings=True), {}),
}


# Kept out of KINDS (which the HF-equality tests iterate).
FP8_KINDS = {
    # head_dim 128, 4 heads / 2 kv heads, intermediate 512: whole 128-row blocks per rank at
    # TP 1 and 2 (k / v rows per rank 256 / 128), a vocabulary no block covers evenly.
    "llama_fp8": ("Llama", dict(vocab_size=320, hidden_size=256, intermediate_size=512,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                rope_theta=10000.0), {}),
}


# Mixtures of experts and dense Qwen3 (q/k RMSNorm), kept out of KINDS too
# (tests/models/test_moe_models.py iterates them): odd expert counts, top-k 2 and 3, expert
# intermediate sizes whose TP 2 shards are not whole 16-byte vectors, a dense layer beside a
# sparse one (decoder_sparse_step, mlp_only_layers), a shared expert, tied embeddings.
MOE_KINDS = {
    "mixtral": ("Mixtral", dict(vocab_size=256, hidden_size=64, intermediate_size=48,
                                num_attention_heads=4, num_key_value_heads=2,
                                num_local_experts=5, num_experts_per_tok=2,
                                sliding_window=None), {}),
    # layer 0 dense (decoder_sparse_step 2), layer 1 sparse with the shared expert
    "qwen2_moe": ("Qwen2Moe", dict(vocab_size=250, hidden_size=64, intermediate_size=80,
                                   num_attention_heads=4, num_key_value_heads=4, num_experts=6,
                                   num_experts_per_tok=3, moe_intermediate_size=40,
                                   shared_expert_intermediate_size=56, norm_topk_prob=False,
                                   decoder_sparse_step=2, tie_word_embeddings=True), {}),
    # layer 0 sparse, layer 1 dense (mlp_only_layers)
    "qwen3_moe": ("Qwen3Moe", dict(vocab_size=256, hidden_size=64, intermediate_size=80,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   num_experts=7, num_experts_per_tok=2,
                                   moe_intermediate_size=40, norm_topk_prob=True,
                                   mlp_only_layers=[1]), {}),
    "qwen3": ("Qwen3", dict(vocab_size=256, hidden_size=64, intermediate_size=96,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32), {}),
}
# A Qwen3-MoE whose projections are whole 128 x 128 blocks at TP 1 and 2 (experts' gate / up
# 256 rows: 128 per rank), for the FP8 checkpoints.
MOE_FP8_KINDS = {
    "qwen3_moe_fp8": ("Qwen3Moe", dict(vocab_size=320, hidden_size=256, intermediate_size=512,
                                       num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=128, num_experts=5, num_experts_per_tok=2,
                                       moe_intermediate_size=256, norm_topk_prob=True), {}),
}


def make_checkpoint(kind: str, path: str, seed: int = 0, dtype=None) -> str:
    """kind of KINDS, FP8_KINDS, MOE_KINDS or MOE_FP8_KINDS, saved in `dtype` (default: as
    created, float32)."""
    import transformers

    cls_name, kw, save_kw = {**KINDS, **FP8_KINDS, **MOE_KINDS, **MOE_FP8_KINDS}[kind]
    cfg_cls = getattr(transformers, f"{cls_name}Config")
    model_cls = getattr(transformers, f"{cls_name}ForCausalLM")
    cfg = cfg_cls(num_hidden_layers=2, max_position_embeddings=256, initializer_range=INIT,
                  rms_norm_eps=1e-6, **kw)
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias") or name.endswith("norm.weight"):
                # HF starts biases at 0 and norms at 1: make them matter.
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    os.makedirs(path, exist_ok=True)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(path, **save_kw)
    return path


INIT = 0.1
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def hf_fp8_config(layout: str) -> dict:
    """quantization_config of Hugging Face's fine-grained FP8 ("block": [128, 128]; "tensor":
    weight_block_size null)."""
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
            "weight_block_size": [128, 128] if layout == "block" else None,
            "modules_to_not_convert": ["lm_head"]}


def compressed_tensors_config(layout: str, static_input: bool = False) -> dict:
    """quantization_config of compressed-tensors FP8 (llm-compressor's FP8 / FP8_DYNAMIC /
    FP8_BLOCK schemes)."""
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
               "strategy": layout, "group_size": None, "observer": "minmax",
               "block_structure": [128, 128] if layout == "block" else None}
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": not static_input,
            "strategy": "tensor" if static_input else "token", "observer": None}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"], "kv_cache_scheme": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": acts}}}


def write_fp8_checkpoint(src: str, dst: str, method: str, layout: str, *,
                         static_input: bool = False, scale_dtype=torch.float32,
                         sharded: bool = False, edit=None) -> str:
    """The checkpoint in src (one model.safetensors) with every q/k/v/o, gate/up, down
    projection quantized by fusedist.nn.quant.quantize_fp8(w, layout) and stored as `method`
    ("fp8": `weight` e4m3 + `weight_scale_inv` float32, [] per tensor or [N/128, K/128] per
    block; "compressed-tensors": `weight` e4m3 + `weight_scale` [1] / [N, 1] / blocks, and with
    static_input a `input_scale` [1]); config.json gains the quantization_config. sharded: two
    files behind an index. edit(tensors) runs before saving."""
    import json

    from safetensors.torch import load_file, save_file

    from fusedist.nn.quant import quantize_fp8

    tensors = load_file(os.path.join(src, "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if not any(name.endswith(f"{p}.weight") for p in PROJECTIONS):
            out[name] = t
            continue
        q = quantize_fp8(t, layout)
        stem = name[:-len("weight")]
        out[name] = q.data
        n = q.data.shape[0]
        if method == "fp8":
            out[stem + "weight_scale_inv"] = q.scale.reshape(()) if layout == "tensor" else \
                q.scale
        else:
            scale = q.scale.reshape(n, 1) if layout == "channel" else q.scale
            out[stem + "weight_scale"] = scale.to(scale_dtype)
            if static_input:
                out[stem + "input_scale"] = torch.tensor([0.05])
    if edit is not None:
        edit(out)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = hf_fp8_config(layout) if method == "fp8" else \
        compressed_tensors_config(layout, static_input)
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    if not sharded:
        save_file(out, os.path.join(dst, "model.safetensors"))
        return dst
    names = sorted(out)
    parts = {"model-00001-of-00002.safetensors": names[::2],
             "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, part in parts.items():
        save_file({n: out[n].contiguous() for n in part}, os.path.join(dst, fname))
        weight_map.update({n: fname for n in part})
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return dst


def load_hf(path: str, dtype=torch.float32, device="cpu"):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """HF generate(do_sample=False) for exactly `steps` tokens with EOS an ordinary token (as
    the runner without eos_ids: neither stops nor suppresses it)."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps,
                         do_sample=False, pad_token_id=0, eos_token_id=[])
    assert out.shape[1] == len(prompt) + steps, out.shape
    return out[0, len(prompt):].tolist()


def assert_greedy_matches(model, prompt: list[int], ours: list[int], tol: float, what: str):
    """ours == HF's greedy ids, except that a divergence is allowed where HF's logits of the
    two tokens tie within tol x max |logit| (a near-tie that fp32 rounding of a different
    summation order can flip); the ids after it are then not compared."""
    ref = hf_greedy(model, prompt, len(ours))
    if ours == ref:
        return
    i = next(j for j, (a, b) in enumerate(zip(ours, ref)) if a != b)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ref[:i]], device=model.device)).logits[0, -1]
    gap = float(logits[ref[i]] - logits[ours[i]])
    bound = tol * float(logits.abs().max())
    assert gap <= bound, (f"{what}: greedy ids differ from HF at step {i} (ours {ours[i]}, HF "
                          f"{ref[i]}); HF's logit gap {gap:.3e} exceeds {bound:.3e}")
    print(f"{what}: near-tie at step {i} (HF logit gap {gap:.2e} <= {bound:.2e}); ids agree "
          "before it", flush=True)
