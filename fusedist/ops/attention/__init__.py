"""Attention over a paged KV cache: RoPE + cache append, decode, chunked prefill.

    cos_sin = rope_cos_sin(head_dim, max_position, base, scaling)       # once per model
    rope_append(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)  # after QKV
    plan = decode_plan(batch, q_heads, kv_heads, head_dim, page_size, max_seq_len, device, dtype)
    out = decode(q, k_cache, v_cache, block_table, seq_lens, plan)      # one token per sequence
    out = prefill(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q)
    plan = prefill_plan(block_table, seq_lens, cu_seqlens_q, tokens=T, page_size=ps,
                        num_pages=P)          # checked once per step; then every layer's
    out = prefill(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, plan=plan)

Layout (docs/design/attention.md):
  k_cache, v_cache  [num_pages, page_size, kv_heads, head_dim], bf16/fp16, or float8_e4m3fn
                    with k_scale, v_scale float32 [num_pages, page_size, kv_heads]
                    (one scale per token-head; value = fp8 * scale; scale = amax / 448).
  block_table       int32 [batch, max_pages_per_seq]; only the first ceil(seq_len/page_size)
                    entries of a row are read.
  seq_lens          int32 [batch], tokens in the cache INCLUDING this step's.
  slot_mapping      int64 [num_tokens] = page * page_size + offset; a negative slot is skipped
                    (padding tokens of a CUDA-graph batch).
  cos_sin           float32 [max_position, rotary_dim]: cos of the rotary_dim/2 frequencies,
                    then their sin (any rope scaling baked in).

Every function has a plain-torch path (fp32 accumulation): CPU tensors always take it. On CUDA,
decode runs the split-KV kernel (_decode.py) when the extension has it, rope_append its fused
kernel (csrc/ops/attention/rope_append.cu), and prefill the paged prefill kernel, or torch SDPA
on the KV gathered from the pages (cuDNN / flash backends; lower-right causal alignment for a
chunk behind a cached prefix) where the tuning table's "prefill" knobs say SDPA is faster. The functions are also torch.ops.fusedist.rope_append /
attention_decode / attention_prefill (torch.compile(fullgraph=True) and CUDA graphs: plans and
cos_sin are built outside the graph; the ops read lengths and tables from device tensors).

Modules: paged (the cache checks and gather every op shares), rope (tables, rope_append),
_decode (decode_plan, decode, the kernel's planner and launcher), _prefill (prefill), sdpa (the
SDPA backend priority and chunk). The decode and prefill modules are private because the
package's public names `decode` and `prefill` are their functions.
"""

from ._decode import DecodePlan, decode, decode_plan, decode_reference
from ._prefill import (PREFILL_BACKENDS, PREFILL_GATHER_TOKENS, PrefillPlan, prefill,
                       prefill_plan, prefill_reference, prefill_runs)
from .paged import FP8, FP8_MAX, KV_DTYPES, gather_kv
from .rope import (ROPE_STYLES, apply_rope_reference, quantize_fp8_reference, rope_append,
                   rope_append_reference, rope_cos_sin, rope_inv_freq)
from .sdpa import SDPA_NAMES, sdpa_priority

__all__ = ["DecodePlan", "decode", "decode_plan", "decode_reference", "prefill",
           "prefill_reference", "prefill_runs", "PrefillPlan", "prefill_plan", "rope_append", "rope_append_reference",
           "rope_cos_sin", "rope_inv_freq", "apply_rope_reference", "quantize_fp8_reference",
           "gather_kv", "sdpa_priority", "KV_DTYPES", "ROPE_STYLES", "PREFILL_BACKENDS",
           "PREFILL_GATHER_TOKENS", "SDPA_NAMES", "FP8", "FP8_MAX"]
