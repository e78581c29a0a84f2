"""LlamaConfig: the shape of a Llama-family decoder, read from a Hugging Face config.json.

    cfg = LlamaConfig.from_dir("/ckpt/Meta-Llama-3-8B")      # config.json in a checkpoint dir
    cfg = LlamaConfig.from_hf_config(json.load(open(path)))  # the parsed dict
    cfg = LlamaConfig.named("llama-3-8b")                    # shipped shapes (no network)

Covers LlamaForCausalLM (Llama 2, 3, 3.1, 3.2: RoPE scaling "llama3"; attention_bias true: biases
on q, k, v and o_proj, as transformers builds them), MistralForCausalLM, Qwen2ForCausalLM
(Qwen2 / 2.5: biases on q, k, v) and Qwen3ForCausalLM (a per-head RMSNorm of q and k: qk_norm),
and the mixture-of-experts decoders built on the same attention (cfg.moe, a MoeConfig):
MixtralForCausalLM (every layer's MLP 8 experts, top 2, renormalized), Qwen2MoeForCausalLM
(q/k/v biases; a shared expert gated by sigmoid(shared_expert_gate(x)); norm_topk_prob;
decoder_sparse_step / mlp_only_layers leave some layers dense) and Qwen3MoeForCausalLM (q/k
RMSNorm, norm_topk_prob, mlp_only_layers). Anything else raises with the list, and so does a
router the model does not serve (MoeConfig.UNSUPPORTED_KEYS: scoring other than softmax,
group-limited or biased selection, a routed scaling factor, jitter at inference).

FP8 checkpoints (cfg.quant, a WeightQuant, from config.json's quantization_config; the
projections q/k/v/o, gate/up, down are e4m3 with float32 scales, everything else is
bf16 / fp16 / fp32):
  quant_method "fp8"                 Hugging Face's fine-grained FP8 (DeepSeek-V3 / Qwen3-FP8):
                                     `*.weight_scale_inv`, which multiplies the e4m3 values,
                                     per 128 x 128 block (weight_block_size [128, 128]) or per
                                     tensor (weight_block_size null); activation_scheme
                                     "dynamic" only.
  quant_method "compressed-tensors"  format "float-quantized" / "naive-quantized" with 8-bit
                                     float weights: `*.weight_scale` per channel ([N, 1]), per
                                     tensor ([] / [1]) or per 128 x 128 block. Static input
                                     scales (input_activations.dynamic false, `*.input_scale`)
                                     are accepted and not used: fusedist scales activations
                                     per token at run time.
Anything else in quantization_config (another method, block size, scale format, static
activations of quant_method "fp8", integer weights) raises naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Optional

from ..._check import as_int

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM") + MOE_ARCHITECTURES
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM"}
# Architectures whose attention RMS-normalizes each head of q and k (over head_dim, with a
# learned [head_dim] weight each) before RoPE.
_QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# config.json keys without a default (Hugging Face's names).
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings")


def _check_llama3_rope(scaling: dict, key: str, fail) -> dict:
    """scaling with its llama3 factors checked: each present, a finite number > 0, and
    high_freq_factor > low_freq_factor (else the RoPE table has NaN or inf entries)."""
    for k in _LLAMA3_KEYS:
        if k not in scaling:
            fail(f"{key} has no {k!r}; llama3 RoPE scaling needs {', '.join(_LLAMA3_KEYS)}")
        v = scaling[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or \
                v <= 0:
            fail(f"{key} {k} must be a finite number > 0, got {v!r}")
    if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        fail(f"{key} high_freq_factor must be > low_freq_factor, got "
             f"{scaling['high_freq_factor']!r} <= {scaling['low_freq_factor']!r}")
    return dict(scaling)


def load_json(path: str, fix: str):
    """The JSON document in `path`; a ValueError naming the file and `fix` when it is not JSON."""
    with open(path) as fh:
        try:
            return json.load(fh)
        except ValueError as e:   # json.JSONDecodeError, UnicodeDecodeError
            raise ValueError(f"fusedist.models: {path} is not valid JSON ({e}); {fix}") from None


QUANT_METHODS = ("fp8", "compressed-tensors")
FP8_BLOCK = [128, 128]


@dataclass(frozen=True)
class WeightQuant:
    """How the projection weights (q/k/v/o, gate/up, down) are FP8: `method` "fp8" or
    "compressed-tensors" (read from the checkpoint) or "quantize" (a floating checkpoint
    quantized at load); `layout` of the scales ("tensor", "channel", "block": 128 x 128);
    `scale_suffix`, the checkpoint's scale tensor of `<proj>.weight` (`<proj>.<suffix>`; "" when
    quantized at load); `input_scales`: the checkpoint also holds static input scales (read
    past: activations get dynamic per-token scales)."""
    method: str
    layout: str
    scale_suffix: str = ""
    input_scales: bool = False

    def describe(self) -> dict:
        """The weight format as the CLI's report states it."""
        src = {"fp8": "checkpoint (quantization_config.quant_method fp8)",
               "compressed-tensors": "checkpoint (quantization_config.quant_method "
                                     "compressed-tensors)",
               "quantize": "quantized at load (amax / 448)"}[self.method]
        scales = {"tensor": "per-tensor", "channel": "per-output-channel",
                  "block": "128x128 blocks"}[self.layout]
        d = {"format": "fp8", "dtype": "float8_e4m3fn", "scales": scales, "source": src,
             "layers": "q/k/v/o, gate/up, down (embeddings, norms, LM head: the model dtype)"}
        if self.input_scales:
            d["input_scales"] = "static scales in the checkpoint not used (dynamic per-token)"
        return d


def parse_quantization(q, fail) -> Optional[WeightQuant]:
    """The WeightQuant of config.json's quantization_config (None when absent); fail(msg) for
    what fusedist does not read, naming the field."""
    if q is None:
        return None
    if not isinstance(q, dict):
        fail(f"quantization_config must be a JSON object, got {q!r}")
    method = q.get("quant_method")
    if method == "fp8":
        return _parse_hf_fp8(q, fail)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(q, fail)
    fail(f"quantization_config.quant_method {method!r} is not supported; fusedist reads FP8 "
         f"checkpoints of quant_method {' or '.join(repr(m) for m in QUANT_METHODS)} (or "
         "quantizes a bf16 checkpoint at load: --quantize fp8)")


def _parse_hf_fp8(q: dict, fail) -> WeightQuant:
    scheme = q.get("activation_scheme", "dynamic")
    if not isinstance(scheme, str) or scheme.lower() != "dynamic":
        fail(f"quantization_config.activation_scheme {scheme!r} is not supported; fusedist "
             "scales activations at run time (\"dynamic\"), it does not apply static "
             "activation scales")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        fail(f"quantization_config.fmt {fmt!r} is not supported; fusedist reads e4m3 weights")
    sfmt = q.get("scale_fmt", "float")
    if sfmt not in (None, "float"):
        fail(f"quantization_config.scale_fmt {sfmt!r} is not supported; fusedist reads float32 "
             "scales (\"float\")")
    block = q.get("weight_block_size", FP8_BLOCK)
    if block is None:
        layout = "tensor"
    elif isinstance(block, (list, tuple)) and list(block) == FP8_BLOCK:
        layout = "block"
    else:
        fail(f"quantization_config.weight_block_size {block!r} is not supported; fusedist reads "
             f"{FP8_BLOCK} blocks or null (one scale per tensor)")
    return WeightQuant("fp8", layout, "weight_scale_inv")


def _parse_compressed_tensors(q: dict, fail) -> WeightQuant:
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        fail("quantization_config.config_groups must be a non-empty JSON object (compressed-"
             "tensors)")
    layouts, static = set(), False
    for gname, g in groups.items():
        key = f"quantization_config.config_groups.{gname}"
        if not isinstance(g, dict):
            fail(f"{key} must be a JSON object, got {g!r}")
        fmt = g.get("format") or q.get("format")
        if fmt not in ("float-quantized", "naive-quantized"):
            fail(f"{key}.format / quantization_config.format {fmt!r} is not supported; fusedist "
                 "reads compressed-tensors FP8 in \"float-quantized\" or \"naive-quantized\" "
                 "format")
        w = g.get("weights")
        if not isinstance(w, dict):
            fail(f"{key}.weights must be a JSON object, got {w!r}")
        if w.get("type") != "float" or w.get("num_bits") != 8:
            fail(f"{key}.weights is {w.get('type')!r} with num_bits {w.get('num_bits')!r}; "
                 "fusedist reads 8-bit float (FP8 e4m3) weights only")
        if w.get("symmetric", True) is not True:
            fail(f"{key}.weights.symmetric must be true (FP8 weights have no zero point)")
        if w.get("dynamic", False):
            fail(f"{key}.weights.dynamic true is not supported; fusedist reads stored weight "
                 "scales")
        strategy = w.get("strategy")
        if strategy in ("tensor", "channel"):
            layouts.add(strategy)
        elif strategy == "block":
            bs = w.get("block_structure")
            if not isinstance(bs, (list, tuple)) or list(bs) != FP8_BLOCK:
                fail(f"{key}.weights.block_structure {bs!r} is not supported; fusedist reads "
                     f"{FP8_BLOCK} blocks")
            layouts.add("block")
        else:
            fail(f"{key}.weights.strategy {strategy!r} is not supported; fusedist reads "
                 "\"tensor\", \"channel\" or \"block\" ([128, 128]) FP8 weight scales")
        a = g.get("input_activations")
        if a is not None:
            if not isinstance(a, dict) or a.get("type") != "float" or a.get("num_bits") != 8:
                fail(f"{key}.input_activations {a!r} is not supported; fusedist runs 8-bit float "
                     "activations (dynamic, per token) or unquantized ones")
            static = static or not a.get("dynamic", False)
    if len(layouts) > 1:
        fail(f"quantization_config.config_groups use several weight strategies "
             f"{sorted(layouts)}; fusedist reads one for every projection")
    return WeightQuant("compressed-tensors", layouts.pop(), "weight_scale", input_scales=static)


@dataclass(frozen=True)
class MoeConfig:
    """The sparse MLP of a mixture-of-experts decoder. Each sparse layer routes every token to
    top_k of num_experts SwiGLU experts (intermediate_size each) by softmax over the router's
    logits, the top_k probabilities renormalized to sum to 1 when `renormalize`, and adds a
    shared SwiGLU expert of shared_intermediate_size scaled by sigmoid(shared_expert_gate(x))
    when that is > 0 (Qwen2-MoE). Layers in dense_layers have the decoder's dense MLP
    (LlamaConfig.intermediate_size) instead."""
    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool = True
    shared_intermediate_size: int = 0
    dense_layers: tuple = ()

    # config.json keys of routers fusedist does not serve (DeepSeek-style scoring, group-limited
    # selection, a routed scaling factor, shared experts counted as experts); each with the
    # value that means "not used".
    UNSUPPORTED_KEYS = {"scoring_func": "softmax", "topk_method": "greedy", "n_group": 1,
                        "topk_group": 1, "routed_scaling_factor": 1.0, "n_shared_experts": 0,
                        "num_shared_experts": 0, "moe_layer_freq": 1}

    def __post_init__(self):
        for k in ("num_experts", "top_k", "intermediate_size"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"MoeConfig: {k} must be a positive int, got {v!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoeConfig: top_k={self.top_k} exceeds num_experts="
                             f"{self.num_experts}")
        s = self.shared_intermediate_size
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(f"MoeConfig: shared_intermediate_size must be an int >= 0, got "
                             f"{s!r}")
        object.__setattr__(self, "dense_layers", tuple(sorted(set(self.dense_layers))))

    def sparse(self, layer: int) -> bool:
        """Whether `layer`'s MLP is the mixture of experts."""
        return layer not in self.dense_layers


def _parse_moe(arch: str, d: dict, size, fail, num_layers: int) -> MoeConfig:
    """The MoeConfig of a mixture-of-experts config.json (Hugging Face's keys)."""
    for key, neutral in MoeConfig.UNSUPPORTED_KEYS.items():
        v = d.get(key)
        if v is not None and v != neutral:
            fail(f"{key}={v!r} is not supported; fusedist's {arch} routes by softmax top-k "
                 f"({key} {neutral!r} or absent)")
    def need(key: str, what: str) -> int:
        if d.get(key) is None:
            fail(f"has no {key!r}; {arch} needs it ({what})")
        return size(key)

    names = ("num_local_experts", "num_experts")
    given = {k: d[k] for k in names if d.get(k) is not None}
    if not given:
        fail(f"has no 'num_local_experts' or 'num_experts'; {arch} needs the expert count")
    if len(set(given.values())) > 1:
        fail(f"num_local_experts={given['num_local_experts']!r} and num_experts="
             f"{given['num_experts']!r} disagree")
    num_experts = size(next(iter(given)))
    top_k = need("num_experts_per_tok", "the experts each token is routed to")
    if top_k > num_experts:
        fail(f"num_experts_per_tok={top_k} exceeds the {num_experts} experts")
    if arch == "MixtralForCausalLM":
        return MoeConfig(num_experts, top_k, size("intermediate_size"), renormalize=True)
    inter = need("moe_intermediate_size", "each expert's intermediate size")
    renorm = d.get("norm_topk_prob", False)
    if not isinstance(renorm, bool):
        fail(f"norm_topk_prob must be true or false, got {renorm!r}")
    shared = 0
    if arch == "Qwen2MoeForCausalLM":
        shared = need("shared_expert_intermediate_size",
                      "the shared expert's intermediate size")
    step = size("decoder_sparse_step", required=False, default=1)
    only = d.get("mlp_only_layers") or []
    if not isinstance(only, (list, tuple)) or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers
            for i in only):
        fail(f"mlp_only_layers must be a list of layer indices in [0, {num_layers}), got "
             f"{d.get('mlp_only_layers')!r}")
    dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
    return MoeConfig(num_experts, top_k, inter, renormalize=renorm,
                     shared_intermediate_size=shared, dense_layers=dense)


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0                  # 0: hidden_size // num_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None  # HF's dict, e.g. {"rope_type": "llama3", "factor": 8, ...}
    max_position: int = 8192
    qkv_bias: bool = False
    o_bias: bool = False               # a bias on o_proj (Llama's attention_bias: true)
    tie_word_embeddings: bool = False
    architecture: str = "LlamaForCausalLM"
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple = ()
    sliding_window: Optional[int] = None  # Mistral: sequences stay within it (not applied)
    quant: Optional[WeightQuant] = None  # FP8 projections of the checkpoint (quantization_config)
    qk_norm: bool = False              # Qwen3: RMSNorm of each q / k head before RoPE
    moe: Optional[MoeConfig] = None    # the sparse MLP of a mixture-of-experts decoder
    name: str = ""
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "max_position"):
            low = 0 if k == "head_dim" else 1      # head_dim 0: hidden_size // num_heads
            object.__setattr__(self, k, as_int("LlamaConfig", k, getattr(self, k), low,
                                               what="a positive int"))
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
            if self.head_dim == 0:
                raise ValueError(f"LlamaConfig: hidden_size={self.hidden_size} is smaller than "
                                 f"num_heads={self.num_heads}; give head_dim")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"LlamaConfig: num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.moe is not None and any(not 0 <= i < self.num_layers
                                        for i in self.moe.dense_layers):
            raise ValueError(f"LlamaConfig: moe.dense_layers {list(self.moe.dense_layers)} "
                             f"must be layer indices in [0, {self.num_layers})")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def sparse(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a mixture of experts (cfg.moe)."""
        return self.moe is not None and self.moe.sparse(layer)

    def mlp_params(self, layer: int) -> tuple[int, int]:
        """(parameters, those a token uses) of `layer`'s MLP."""
        h = self.hidden_size
        if not self.sparse(layer):
            return 3 * h * self.intermediate_size, 3 * h * self.intermediate_size
        m = self.moe
        expert, router = 3 * h * m.intermediate_size, m.num_experts * h
        shared = 3 * h * m.shared_intermediate_size + h if m.shared_intermediate_size else 0
        return m.num_experts * expert + router + shared, m.top_k * expert + router + shared

    def _params(self, active: bool) -> int:
        h, v = self.hidden_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 2 * h + \
            (2 * self.head_dim if self.qk_norm else 0)
        mlp = sum(self.mlp_params(i)[int(active)] for i in range(self.num_layers))
        head = 0 if self.tie_word_embeddings else v * h
        return self.num_layers * attn + mlp + v * h + head + h

    def num_params(self) -> int:
        """Every parameter of the model (all experts of a mixture of experts)."""
        return self._params(active=False)

    def active_params(self) -> int:
        """The parameters one token's forward multiplies by: num_params() less the experts it
        is not routed to (top_k of num_experts in each sparse layer)."""
        return self._params(active=True)

    def replace(self, **kw) -> "LlamaConfig":
        return dataclasses.replace(self, **kw)

    def position_limit(self) -> tuple:
        """(the most positions a sequence may use, what sets that limit): max_position_embeddings,
        or the sliding window when it is shorter (fusedist does not apply a sliding window)."""
        if self.sliding_window is not None and self.sliding_window < self.max_position:
            return (self.sliding_window, f"the sliding window ({self.sliding_window} tokens), "
                    "which the model does not apply")
        return self.max_position, f"max_position_embeddings ({self.max_position})"

    @classmethod
    def from_hf_config(cls, d: dict, name: str = "", *, source: str = "") -> "LlamaConfig":
        """The config of a Hugging Face config.json's dict; `source` (the file) is named in the
        errors. Every value fusedist reads is checked here: a missing key, a non-positive size
        or head count, kv heads that do not divide the heads, RoPE factors that would give a
        NaN table raise a ValueError naming the key."""
        where = f"config.json ({source})" if source else "the config"

        def fail(msg: str):
            raise ValueError(f"fusedist.models: {where}: {msg}")

        if not isinstance(d, dict):
            fail(f"must be a JSON object, got {type(d).__name__}")
        archs = d.get("architectures") or [_MODEL_TYPES.get(d.get("model_type", ""), "")]
        arch = archs[0] if isinstance(archs, list) and archs else ""
        if arch not in SUPPORTED_ARCHITECTURES:
            fail(f"architecture {arch or d.get('model_type')!r} is not supported; supported: "
                 f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        if d.get("mlp_bias"):
            fail("mlp_bias=True is not supported (no Llama-family checkpoint fusedist knows "
                 "uses it)")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            fail(f"hidden_act {act!r} is not supported; only 'silu'")

        def size(key, required=True, default=None):
            """A positive int (None when absent and not required)."""
            if key not in d or (d[key] is None and not required):
                if required:
                    fail(f"has no {key!r}; a Llama-family config.json needs "
                         f"{', '.join(_REQUIRED)}")
                return default
            v = d[key]
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                fail(f"{key} must be a positive int, got {v!r}")
            return v

        def number(key, default):
            v = d.get(key)
            if v is None:
                return default
            if isinstance(v, bool) or not isinstance(v, (int, float)) or \
                    not math.isfinite(v) or v <= 0:
                fail(f"{key} must be a finite number > 0, got {v!r}")
            return float(v)

        vocab, hidden, inter, layers, heads = (size(k) for k in _REQUIRED)
        kv_heads = size("num_key_value_heads", required=False, default=heads)
        if heads % kv_heads:
            fail(f"num_key_value_heads={kv_heads} must divide num_attention_heads={heads}")
        head_dim = size("head_dim", required=False)
        if head_dim is None:
            if hidden % heads:
                fail(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads}; "
                     "give head_dim")
            head_dim = hidden // heads
        max_position = size("max_position_embeddings", required=False, default=8192)
        window = size("sliding_window", required=False) if d.get("use_sliding_window", True) \
            else None
        rope_theta = number("rope_theta", 10000.0)
        scaling, scaling_key = d.get("rope_scaling"), "rope_scaling"
        if scaling is None and d.get("rope_parameters") is not None:
            # transformers >= 5 writes rope_theta and the scaling into rope_parameters.
            scaling_key = "rope_parameters"
            if not isinstance(d["rope_parameters"], dict):
                fail(f"rope_parameters must be a JSON object, got {d['rope_parameters']!r}")
            rp = dict(d["rope_parameters"])
            theta = rp.pop("rope_theta", None)
            if rp.get("rope_type", rp.get("type", "default")) != "default":
                scaling = rp
            if theta is not None:
                d = {**d, "rope_theta": theta}
                rope_theta = number("rope_theta", 10000.0)
        if scaling is not None:
            if not isinstance(scaling, dict):
                fail(f"{scaling_key} must be a JSON object or null, got {scaling!r}")
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind == "default":
                scaling = None
            elif kind != "llama3":
                fail(f"rope_scaling type {kind!r} is not supported; supported: 'llama3' "
                     "(Llama 3.1 / 3.2) or none")
            else:
                scaling = _check_llama3_rope(scaling, scaling_key, fail)
        quant = parse_quantization(d.get("quantization_config"), fail)
        eos = d.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        attention_bias = d.get("attention_bias", False)
        if not isinstance(attention_bias, bool):
            fail(f"attention_bias must be true or false, got {attention_bias!r}")
        if arch == "Qwen2ForCausalLM":
            qkv_bias = True
        elif arch == "Qwen2MoeForCausalLM":
            qkv_bias = d.get("qkv_bias", True)    # Hugging Face's default: biases on q, k, v
            if not isinstance(qkv_bias, bool):
                fail(f"qkv_bias must be true or false, got {qkv_bias!r}")
        else:
            qkv_bias = attention_bias
        # transformers' Llama puts attention_bias on o_proj too; Qwen2's o_proj has none.
        o_bias = arch == "LlamaForCausalLM" and attention_bias
        moe = _parse_moe(arch, d, size, fail, layers) if arch in MOE_ARCHITECTURES else None
        return cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                   num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                   rms_norm_eps=number("rms_norm_eps", 1e-6), rope_theta=rope_theta,
                   rope_scaling=scaling, max_position=max_position,
                   qkv_bias=qkv_bias, o_bias=o_bias,
                   tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                   architecture=arch, bos_token_id=d.get("bos_token_id"), eos_token_ids=eos,
                   sliding_window=window, quant=quant, qk_norm=arch in _QK_NORM, moe=moe,
                   name=name, extra=dict(d))

    @classmethod
    def from_dir(cls, path: str) -> "LlamaConfig":
        f = os.path.join(path, "config.json")
        if not os.path.isfile(f):
            raise FileNotFoundError(f"fusedist.models: no config.json in {path!r}; pass the "
                                    "directory of a Hugging Face checkpoint")
        d = load_json(f, "fix or re-download the checkpoint's config.json")
        return cls.from_hf_config(d, name=os.path.basename(path.rstrip("/")), source=f)

    @classmethod
    def named(cls, name: str) -> "LlamaConfig":
        if name not in NAMED:
            raise ValueError(f"fusedist.models: unknown config {name!r}; named configs: "
                             f"{', '.join(NAMED)}")
        return NAMED[name]


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# Shapes shipped with fusedist (no network access assumed): Meta's published configs.
NAMED = {
    "llama-3-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                              num_layers=32, num_heads=32, num_kv_heads=8, rms_norm_eps=1e-5,
                              rope_theta=500000.0, max_position=8192, eos_token_ids=(128001,),
                              bos_token_id=128000, name="llama-3-8b"),
    "llama-3.1-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                num_layers=32, num_heads=32, num_kv_heads=8, rms_norm_eps=1e-5,
                                rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
                                max_position=131072, eos_token_ids=(128001, 128008, 128009),
                                bos_token_id=128000, name="llama-3.1-8b"),
    "llama-3-70b": LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                               num_layers=80, num_heads=64, num_kv_heads=8, rms_norm_eps=1e-5,
                               rope_theta=500000.0, max_position=8192, eos_token_ids=(128001,),
                               bos_token_id=128000, name="llama-3-70b"),
    # Small enough for a CPU to generate tokens in seconds at TP 2 over gloo.
    "tiny": LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_layers=2,
                        num_heads=4, num_kv_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
                        max_position=2048, name="tiny"),
    # Mixtures of experts: the published config.json of Qwen/Qwen3-30B-A3B and
    # mistralai/Mixtral-8x7B-v0.1 (30.5 B and 46.7 B parameters, 3.3 B and 12.9 B per token).
    "qwen3-30b-a3b": LlamaConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                 num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
                                 rms_norm_eps=1e-6, rope_theta=1000000.0, max_position=40960,
                                 bos_token_id=151643, eos_token_ids=(151645,), qk_norm=True,
                                 moe=MoeConfig(num_experts=128, top_k=8, intermediate_size=768,
                                               renormalize=True),
                                 architecture="Qwen3MoeForCausalLM", name="qwen3-30b-a3b"),
    "mixtral-8x7b": LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                num_layers=32, num_heads=32, num_kv_heads=8, rms_norm_eps=1e-5,
                                rope_theta=1000000.0, max_position=32768, bos_token_id=1,
                                eos_token_ids=(2,),
                                moe=MoeConfig(num_experts=8, top_k=2, intermediate_size=14336,
                                              renormalize=True),
                                architecture="MixtralForCausalLM", name="mixtral-8x7b"),
    # A Qwen3-MoE shape small enough for the CPU at TP 2 (8 experts, top 2).
    "tiny-moe": LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                            num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                            rms_norm_eps=1e-6, rope_theta=10000.0, max_position=2048,
                            qk_norm=True, moe=MoeConfig(num_experts=8, top_k=2,
                                                        intermediate_size=128,
                                                        renormalize=True),
                            architecture="Qwen3MoeForCausalLM", name="tiny-moe"),
}
