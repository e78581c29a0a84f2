"""Tiny random Hugging Face checkpoints (save_pretrained) for the model tests: several
architectures and GQA ratios, one with tied embeddings and an odd vocabulary, one sharded."""

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
    # Multi-head (GQA 1), q/k/v biases, tied embeddings, a vocabulary that TP 2 must pad.
    "qwen2": ("Qwen2", dict(vocab_size=250, hidden_size=64, intermediate_size=96,
                            num_attention_heads=4, num_key_value_heads=4,
                            tie_word_embeddings=True), {}),
}


def make_checkpoint(kind: str, path: str, seed: int = 0) -> str:
    import transformers

    cls_name, kw, save_kw = KINDS[kind]
    cfg_cls = getattr(transformers, f"{cls_name}Config")
    model_cls = getattr(transformers, f"{cls_name}ForCausalLM")
    cfg = cfg_cls(num_hidden_layers=2, max_position_embeddings=256, initializer_range=0.1,
                  rms_norm_eps=1e-6, **kw)
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias") or name.endswith("norm.weight"):
                # HF starts biases at 0 and norms at 1: make them matter.
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, **save_kw)
    return path


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
