"""Where a Llama-family model's weights come from, read one rank's slices at a time.

    src = SafetensorsWeights("/ckpt/dir")       # model.safetensors or a sharded index
    src = RandomWeights(cfg, seed=0)            # --random-weights
    w = src.read("model.layers.0.mlp.up_proj.weight", dim=0, start=r * n, stop=(r + 1) * n,
                 dtype=torch.bfloat16, device=dev)

A safetensors rank reads only the rows / columns it keeps (safe_open + get_slice), never a full
copy of the model. Random weights are defined per tensor by (seed, name) over the FULL tensor,
then sliced, so every tensor-parallel size sees the same model: replicated tensors are equal on
every rank, and rank r's shard is rows / columns of the full random tensor.

Before anything is read, Transformer.load checks the source against the config
(check_weights): every tensor present with the full shape the config implies and a float32 /
float16 / bfloat16 dtype (from the safetensors header: nothing is read), and no bias the model
would not apply; the error names the tensor and its file.

The sharding rules: Transformer.load (model.py) names which dimension of which tensor is split;
fusedist.nn.attention.kv_head_range says which kv heads a rank keeps (replicated when tp > kv
heads), for the model, TPAttention and the tests alike. A mixture of experts (cfg.moe:
moe_names gives Mixtral's and Qwen-MoE's tensor names) splits every expert's gate / up by rows
and down by columns like the dense MLP, the shared expert likewise; the routers are
replicated (moe.py). With expert parallelism (ep) a rank reads only its experts, whole
(num_experts / tp of them: check_ep), and the shared expert's slices as above.

FP8 (the projections q/k/v/o, gate/up, down; docs/design/fp8.md): resolve_quant says how a run
holds them (config.quant.WeightQuant, or None for the model dtype): read from an FP8 checkpoint
(its quantization_config), or quantized at load (`quantize="fp8"` and friends, QUANTIZE; random
weights of an FP8 checkpoint's shape are quantized in its layout). read_projection reads one
rank's slice of a projection as a fusedist.nn.quant.FP8Weight: the e4m3 rows / columns and the
scales that go with them (per-channel scales with the rows; block scales cut along the split
dimension, which must fall on a multiple of 128). A weight quantized at load gets the scales
of the whole weight, so every tp holds the same FP8 model: where a rank's slice does not hold
the whole scale group (per-channel scales of a row-parallel weight, o_proj and down_proj,
whose rows are split by columns; per-tensor scales of any split weight), its amax is the max
over the ranks (reduce_amax: a MAX all-reduce at load).
check_weights checks FP8 tensors too: F8_E4M3 projections, their scale tensors' shapes and
float dtypes.

Values are checked as they are read (check_values, on the host copy before it moves to the
device): a float tensor holding NaN or inf, an e4m3 tensor holding a NaN code (0x7F, 0xFF) or a
negative FP8 scale is refused naming the tensor, its file and the first bad element (one such
value would turn every logit NaN).
"""

from __future__ import annotations

import math
import os
import zlib
from typing import NamedTuple, Optional

import torch

from ...nn.attention import kv_head_range, kv_heads_per_rank
from ...nn.quant import FP8, FP8Weight, quantize_fp8, scale_range, scale_shape
from .config import LlamaConfig, WeightQuant, load_json

# quantize= / --quantize: the scale layout of weights quantized at load ("fp8": per output
# channel).
QUANTIZE = {"fp8": "channel", "fp8-channel": "channel", "fp8-tensor": "tensor",
            "fp8-block": "block"}
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


class MoeNames(NamedTuple):
    """A sparse layer's tensors as Hugging Face names them: the router's weight, each expert's
    (gate, up, down) projections and the shared expert's (Qwen2-MoE; None without one), as
    projection names (`<name>.weight` is the tensor), and the shared expert's gate weight."""
    router: str
    experts: list
    shared: Optional[tuple]
    shared_gate: Optional[str]


def moe_names(cfg: LlamaConfig, layer: int) -> MoeNames:
    """The tensors of sparse layer `layer`: Mixtral's block_sparse_moe.experts.{e}.w1 (gate),
    w3 (up), w2 (down); Qwen-MoE's mlp.experts.{e}.gate_proj / up_proj / down_proj and
    mlp.shared_expert.* / mlp.shared_expert_gate."""
    m = cfg.moe
    if cfg.architecture == "MixtralForCausalLM":
        p = f"model.layers.{layer}.block_sparse_moe."
        experts = [tuple(f"{p}experts.{e}.{w}" for w in ("w1", "w3", "w2"))
                   for e in range(m.num_experts)]
    else:
        p = f"model.layers.{layer}.mlp."
        experts = [tuple(f"{p}experts.{e}.{w}_proj" for w in ("gate", "up", "down"))
                   for e in range(m.num_experts)]
    shared = tuple(f"{p}shared_expert.{w}_proj" for w in ("gate", "up", "down")) \
        if m.shared_intermediate_size else None
    return MoeNames(p + "gate.weight", experts, shared,
                    p + "shared_expert_gate.weight" if shared else None)


def _mlp_projections(cfg: LlamaConfig, layer: int) -> list[tuple[str, str]]:
    """(projection name, "gate" | "up" | "down") of every projection of `layer`'s MLP."""
    if not cfg.sparse(layer):
        return [(f"model.layers.{layer}.mlp.{x}_proj", x) for x in ("gate", "up", "down")]
    n = moe_names(cfg, layer)
    groups = n.experts + ([n.shared] if n.shared else [])
    return [(name, kind) for g in groups for name, kind in zip(g, ("gate", "up", "down"))]


def hf_names(cfg: LlamaConfig) -> list[str]:
    """Every tensor a checkpoint of cfg must hold (HF names)."""
    return list(expected_tensors(cfg))


def projection_names(cfg: LlamaConfig) -> list[str]:
    """The FP8-able projections' weight names: q/k/v/o and the MLP's gate/up, down of every
    layer (every expert's, and the shared expert's; not the routers)."""
    return [f"model.layers.{i}.self_attn.{x}_proj.weight" for i in range(cfg.num_layers)
            for x in "qkvo"] + \
        [name + ".weight" for i in range(cfg.num_layers) for name, _ in _mlp_projections(cfg, i)]


def _mlp_splits(cfg: LlamaConfig, ep: bool = False) -> list[tuple[str, int, bool]]:
    """(config key, size, split) of every intermediate dimension of the MLPs: the dense MLP's
    (when a layer has one), each expert's and the shared expert's; split: tensor parallelism
    splits it (every one but the experts' under expert parallelism, which keeps experts
    whole)."""
    out = []
    if any(not cfg.sparse(i) for i in range(cfg.num_layers)):
        out.append(("intermediate_size", cfg.intermediate_size, True))
    m = cfg.moe
    if m is not None:
        out.append(("intermediate_size" if cfg.architecture == "MixtralForCausalLM" else
                    "moe_intermediate_size", m.intermediate_size, not ep))
        if m.shared_intermediate_size:
            out.append(("shared_expert_intermediate_size", m.shared_intermediate_size, True))
    return list(dict.fromkeys(out))


def check_ep(cfg: LlamaConfig, tp: int) -> None:
    """Expert parallelism over a group of tp ranks: cfg has experts, num_experts / tp each."""
    name = cfg.name or "the model"
    if cfg.moe is None:
        raise ValueError(f"fusedist.models: expert parallelism (ep / --ep) shards a mixture of "
                         f"experts' experts over the tensor-parallel group, and {name} is a "
                         "dense model (no experts); drop ep / --ep")
    e = cfg.moe.num_experts
    if e % tp:
        raise ValueError(f"fusedist.models: expert parallelism (ep / --ep) puts num_experts / tp "
                         f"experts on every rank, and {name} has num_experts={e}, not divisible "
                         f"by tp={tp}; pick a tp among "
                         f"{[w for w in range(1, e + 1) if e % w == 0]} or drop ep / --ep")


def check_tp(cfg: LlamaConfig, tp: int, quant: Optional[WeightQuant] = None,
             ep: bool = False) -> None:
    """cfg splits over tp ranks (with ep: its experts are sharded whole, check_ep); the error
    names the config key and the fix."""
    if ep:
        check_ep(cfg, tp)
    for what, n, split in [("num_heads", cfg.num_heads, True)] + _mlp_splits(cfg, ep):
        if split and n % tp:
            raise ValueError(f"fusedist.models: {what}={n} of {cfg.name or 'the model'} is not "
                             f"divisible by tp={tp}; pick a tp that divides it")
    kv_head_range(cfg.num_kv_heads, tp, 0)   # raises when the kv heads do not split evenly
    if quant is not None and quant.layout == "block":
        hd = cfg.head_dim
        mlp = [(f"gate / up rows (down_proj columns) per rank: {what} / tp = {n} / {tp}",
                n // tp) if split else
               (f"gate / up rows (down_proj columns) of each expert: {what} = {n}", n)
               for what, n, split in _mlp_splits(cfg, ep)]
        for what, n in [(f"q rows (o_proj columns) per rank: num_attention_heads / tp x head_dim "
                         f"= {cfg.num_heads} / {tp} x {hd}", cfg.num_heads // tp * hd),
                        (f"k / v rows per rank: kv heads per rank x head_dim = "
                         f"{kv_heads_per_rank(cfg.num_kv_heads, tp)} x {hd}",
                         kv_heads_per_rank(cfg.num_kv_heads, tp) * hd)] + mlp:
            if n % 128:
                raise ValueError(
                    f"fusedist.models: FP8 weights with 128 x 128 block scales are split and "
                    f"stacked (q | k | v, gate | up) in whole blocks only, and "
                    f"{cfg.name or 'the model'} at tp={tp} has {what} = {n}, not a multiple of "
                    "128; pick a tp whose shards are whole blocks, or per-channel scales "
                    "(quantize='fp8' of a bf16 checkpoint)")


def quantize_layout(quantize: Optional[str]) -> Optional[str]:
    """The scale layout of a quantize= value (None / "none": no quantization at load)."""
    if quantize is None or quantize == "none":
        return None
    if quantize not in QUANTIZE:
        raise ValueError(f"fusedist.models: quantize must be None, 'none' or one of "
                         f"{', '.join(QUANTIZE)}, got {quantize!r}")
    return QUANTIZE[quantize]


def resolve_quant(cfg: LlamaConfig, quantize: Optional[str], src: "WeightSource"
                  ) -> Optional[WeightQuant]:
    """How this run holds the projection weights: the FP8 checkpoint's format (cfg.quant), FP8
    quantized at load (quantize=, or random weights of an FP8 checkpoint's shape: in its scale
    layout), or None (the model dtype). quantize="fp8" on an FP8 checkpoint reads it as it is;
    a layout it does not have (quantize="fp8-block" of a per-channel checkpoint) raises."""
    layout = quantize_layout(quantize)
    if cfg.quant is None or isinstance(src, RandomWeights):
        layout = layout or (cfg.quant.layout if cfg.quant is not None else None)
        return None if layout is None else WeightQuant("quantize", layout)
    if layout is not None and quantize != "fp8" and layout != cfg.quant.layout:
        raise ValueError(f"fusedist.models: the checkpoint is FP8 already ({cfg.quant.method}, "
                         f"{cfg.quant.layout} scales); quantize={quantize!r} asks for "
                         f"{layout} scales: drop it or pass 'fp8'")
    return cfg.quant


def read_projection(src: "WeightSource", name: str, quant: Optional[WeightQuant],
                    dim: Optional[int] = None, start: int = 0, stop: Optional[int] = None, *,
                    dtype: torch.dtype, device, reduce_amax=None) -> "torch.Tensor | FP8Weight":
    """Rows (dim 0) or columns (dim 1) [start, stop) of the projection weight `name`.weight:
    a `dtype` tensor (quant None), or an FP8Weight read from the checkpoint with its scales
    (`name`.<quant.scale_suffix>) or quantized at load. reduce_amax(amax) -> the max of amax
    over the ranks that split this weight (a collective every rank calls in the same order):
    quantized at load, a slice whose scale groups span ranks takes the whole weight's amax."""
    wname = name + ".weight"
    if quant is None:
        return src.read(wname, dim, start, stop, dtype=dtype, device=device)
    full = src.shape(wname)
    stop = full[dim] if dim is not None and stop is None else stop
    r = None if dim is None else scale_range(quant.layout, dim, start, stop, full[dim],
                                             f"tensor {wname!r}")
    if quant.method == "quantize":
        w = src.read(wname, dim, start, stop, dtype=torch.float32, device=device)
        spans = dim is not None and (quant.layout == "tensor" or
                                     (quant.layout == "channel" and dim == 1))
        try:
            return quantize_fp8(w, quant.layout, reduce_amax if spans else None)
        except ValueError as e:
            raise ValueError(f"fusedist.models: tensor {wname!r} in {src.location(wname)}: "
                             f"{e}") from None
    data = src.read(wname, dim, start, stop, dtype=FP8, device=device)
    sname = f"{name}.{quant.scale_suffix}"
    if r is None:
        scale = src.read(sname, dtype=torch.float32, device=device)
    else:
        scale = src.read(sname, dim, r[0], r[1], dtype=torch.float32, device=device)
    if bool((scale < 0).any()):
        first = [int(i) for i in (scale < 0).nonzero()[0]]
        raise ValueError(f"fusedist.models: tensor {sname!r} in {src.location(sname)} holds a "
                         f"negative FP8 scale ({float(scale[tuple(first)])!r} at index {first}); "
                         "scales of e4m3 weights are amax / 448 >= 0: the checkpoint is corrupt, "
                         "re-download or re-quantize it")
    scale = scale.reshape(scale_shape(quant.layout, *data.shape)).contiguous()
    return FP8Weight(data.contiguous(), scale, quant.layout)


def padded_vocab(cfg: LlamaConfig, tp: int) -> int:
    """Vocabulary rounded up so the LM head splits into tp equal shards of whole 8-row groups
    (16-byte GEMM rows); the padding rows are zero and their logits are cut off."""
    step = 8 * tp
    return (cfg.vocab_size + step - 1) // step * step


def _seed(seed: int, name: str) -> int:
    return (seed * 1000003 + zlib.crc32(name.encode())) & ((1 << 63) - 1)


# Stored dtypes (safetensors' names) that the model reads, converted to its dtype on load.
FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def check_values(t: torch.Tensor, what: str) -> None:
    """Refuse a tensor read from a checkpoint that holds NaN or inf (a float tensor) or the NaN
    codes 0x7F / 0xFF (e4m3, which has no inf): one such value turns every logit NaN. Run on
    the host copy safetensors returns, before it moves to the device; the error names the
    tensor, its file and the first bad element."""
    if t.dtype == FP8:
        bad = (t.view(torch.uint8) & 0x7F) == 0x7F
        kind = "NaN e4m3 codes (0x7F / 0xFF)"
    elif t.is_floating_point():
        bad = ~torch.isfinite(t)
        kind = None
    else:
        return
    if not bool(bad.any()):
        return
    first = int(bad.reshape(-1).nonzero()[0, 0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), t.shape)) \
        if t.dim() else ()
    if kind is None:
        v = float(t.reshape(-1)[first])
        kind = "NaN" if math.isnan(v) else "inf"
    raise ValueError(f"fusedist.models: {what} holds {kind} ({int(bad.sum())} of {t.numel()} "
                     f"elements, the first at index {list(index)}); the checkpoint is corrupt: "
                     "re-download or re-convert it")


class WeightSource:
    """read(name, dim, start, stop, dtype, device) -> the [start:stop] slice of tensor `name`
    along `dim` (the whole tensor when dim is None). shape(name): its full shape; dtype(name):
    its stored dtype as safetensors names it ("F32", "BF16", "F8_E4M3", "I32", ...; None when
    unknown); names(): every tensor it holds (None when unknown); location(name): where it is,
    for messages."""

    def read(self, name: str, dim: Optional[int] = None, start: int = 0,
             stop: Optional[int] = None, *, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        raise NotImplementedError

    def shape(self, name: str) -> tuple:
        raise NotImplementedError

    def dtype(self, name: str) -> Optional[str]:
        return None

    def names(self) -> Optional[list]:
        return None

    def location(self, name: str) -> str:
        return type(self).__name__


class SafetensorsWeights(WeightSource):
    def __init__(self, path: str):
        self.path = path
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.isfile(index):
            self.where = _weight_map(index)
            self.index = index
        elif os.path.isfile(single):
            self.where = None
            self.index = None
        else:
            raise FileNotFoundError(f"fusedist.models: {path!r} has neither model.safetensors nor "
                                    "model.safetensors.index.json; pass a Hugging Face "
                                    "safetensors checkpoint directory")
        self._files: dict = {}

    def _open(self, fname: str, name: Optional[str] = None):
        from safetensors import safe_open

        full = os.path.join(self.path, fname)
        if full not in self._files:
            if not os.path.isfile(full):
                listed = f" (listed for tensor {name!r} in {self.index})" if name else ""
                raise FileNotFoundError(f"fusedist.models: {full}{listed} does not exist")
            try:
                self._files[full] = safe_open(full, framework="pt", device="cpu")
            except Exception as e:  # noqa: BLE001 - safetensors' SafetensorError, OSError
                raise ValueError(f"fusedist.models: {full} is not a readable safetensors file "
                                 f"({type(e).__name__}: {e}); it may be truncated or corrupt: "
                                 "re-download or re-convert the checkpoint") from None
        return full, self._files[full]

    def _file(self, name: str):
        if self.where is None:
            fname = "model.safetensors"
        elif name in self.where:
            fname = self.where[name]
        else:
            raise KeyError(f"fusedist.models: tensor {name!r} is missing: not in the weight map of "
                           f"{self.index}")
        full, f = self._open(fname, name)
        if name not in f.keys():
            raise KeyError(f"fusedist.models: tensor {name!r} is missing from {full}")
        return f

    def location(self, name: str) -> str:
        fname = self.where.get(name, "?") if self.where is not None else "model.safetensors"
        return os.path.join(self.path, fname)

    def names(self) -> list:
        if self.where is not None:
            return list(self.where)
        return list(self._open("model.safetensors")[1].keys())

    def shape(self, name: str) -> tuple:
        return tuple(self._file(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        return self._file(name).get_slice(name).get_dtype()

    def read(self, name, dim=None, start=0, stop=None, *, dtype, device):
        sl = self._file(name).get_slice(name)
        if dim is not None:
            # A slice past the end would come back short (Python slicing), not fail.
            n = sl.get_shape()[dim]
            if not 0 <= start <= (n if stop is None else stop) <= n:
                what = ("rows", "columns")[dim] if dim in (0, 1) else f"dim {dim}"
                raise ValueError(f"fusedist.models: tensor {name!r} in {self.location(name)}: "
                                 f"{what} [{start}, {stop}) requested, but it has {n}")
        if dim is None:
            t = sl[:] if sl.get_shape() else self._file(name).get_tensor(name)
        elif dim == 0:
            t = sl[start:stop]
        else:
            t = sl[:, start:stop]
        check_values(t, f"tensor {name!r} in {self.location(name)}")
        return t.to(device=device, dtype=dtype)

    def close(self):
        self._files.clear()


def _weight_map(index: str) -> dict:
    """The weight_map of a model.safetensors.index.json: {tensor name: file name}."""
    d = load_json(index, "re-download the checkpoint's index")
    wm = d.get("weight_map") if isinstance(d, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise ValueError(f"fusedist.models: {index} has no weight_map object (tensor name -> "
                         "file name); re-download the checkpoint's index")
    return dict(wm)


class RandomWeights(WeightSource):
    """A seeded random model: linear weights and embeddings N(0, std^2) (std 0.02, Hugging
    Face's initializer_range, which keeps the activations of a 32-layer random Llama finite),
    biases N(0, 0.02^2), norm weights 1."""

    def __init__(self, cfg: LlamaConfig, seed: int = 0, std: float = 0.02):
        self.cfg, self.seed, self.std = cfg, seed, std
        self._shapes = _full_shapes(cfg)

    def shape(self, name):
        if name not in self._shapes:
            raise KeyError(f"fusedist.models: tensor {name!r} is not part of the model")
        return self._shapes[name]

    def dtype(self, name):
        self.shape(name)
        return "F32"

    def names(self):
        return list(self._shapes)

    def location(self, name):
        return f"random weights (seed {self.seed})"

    def read(self, name, dim=None, start=0, stop=None, *, dtype, device):
        shape = self.shape(name)
        if name.endswith("norm.weight"):
            full = torch.ones(shape, dtype=torch.float32, device=device)
        else:
            g = torch.Generator(device=device)
            g.manual_seed(_seed(self.seed, name))
            full = torch.randn(shape, generator=g, dtype=torch.float32, device=device)
            full.mul_(self.std)
        if dim is not None:
            full = full.narrow(dim, start, (shape[dim] if stop is None else stop) - start)
        return full.to(dtype).contiguous()


def _full_shapes(cfg: LlamaConfig) -> dict:
    return {n: shape for n, (shape, _) in expected_tensors(cfg).items()}


def expected_tensors(cfg: LlamaConfig) -> dict:
    """{HF name: (full shape, how the config gives it)} for every tensor cfg needs."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q = (cfg.q_size, f"num_attention_heads x head_dim = {cfg.num_heads} x {cfg.head_dim}")
    kv = (cfg.kv_size, f"num_key_value_heads x head_dim = {cfg.num_kv_heads} x {cfg.head_dim}")
    H, I, V = (h, "hidden_size"), (i, "intermediate_size"), (v, "vocab_size")

    def t(*dims):
        return tuple(d for d, _ in dims), "[" + ", ".join(w for _, w in dims) + "]"

    D = (cfg.head_dim, "head_dim")
    s = {"model.embed_tokens.weight": t(V, H), "model.norm.weight": t(H)}
    if not cfg.tie_word_embeddings:
        s["lm_head.weight"] = t(V, H)
    m = cfg.moe
    if m is not None:
        E = (m.num_experts, "num_experts")
        EI = (m.intermediate_size, "intermediate_size" if cfg.architecture ==
              "MixtralForCausalLM" else "moe_intermediate_size")
        S = (m.shared_intermediate_size, "shared_expert_intermediate_size")
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        s[p + "input_layernorm.weight"] = t(H)
        s[p + "post_attention_layernorm.weight"] = t(H)
        s[p + "self_attn.q_proj.weight"] = t(q, H)
        s[p + "self_attn.k_proj.weight"] = t(kv, H)
        s[p + "self_attn.v_proj.weight"] = t(kv, H)
        s[p + "self_attn.o_proj.weight"] = t(H, q)
        if cfg.qkv_bias:
            s[p + "self_attn.q_proj.bias"] = t(q)
            s[p + "self_attn.k_proj.bias"] = t(kv)
            s[p + "self_attn.v_proj.bias"] = t(kv)
        if cfg.qk_norm:
            s[p + "self_attn.q_norm.weight"] = t(D)
            s[p + "self_attn.k_norm.weight"] = t(D)
        if cfg.o_bias:
            s[p + "self_attn.o_proj.bias"] = t(H)
        if not cfg.sparse(n):
            s[p + "mlp.gate_proj.weight"] = t(I, H)
            s[p + "mlp.up_proj.weight"] = t(I, H)
            s[p + "mlp.down_proj.weight"] = t(H, I)
            continue
        names = moe_names(cfg, n)
        s[names.router] = t(E, H)
        for name, kind in _mlp_projections(cfg, n):
            inner = S if ".shared_expert." in name else EI
            s[name + ".weight"] = t(H, inner) if kind == "down" else t(inner, H)
        if names.shared_gate:
            s[names.shared_gate] = t((1, "1"), H)
    return s


_DEFAULT = object()
SCALE_DTYPES = ("F32", "BF16", "F16")
_NO_FP8 = ("fusedist reads FP8 checkpoints whose config.json declares quantization_config "
           "quant_method 'fp8' (weight_block_size [128, 128] or null) or 'compressed-tensors' "
           "(float-quantized FP8), or quantizes a bf16 checkpoint at load (--quantize fp8)")


def fp8_scale_shapes(cfg: LlamaConfig, quant: WeightQuant) -> dict:
    """{scale tensor name: (the shapes it may have, how the config gives them)} of an FP8
    checkpoint's projections."""
    shapes = expected_tensors(cfg)
    out = {}
    for wname in projection_names(cfg):
        (n, k), _ = shapes[wname]
        sname = wname[:-len("weight")] + quant.scale_suffix
        if quant.layout == "tensor":
            out[sname] = (((), (1,)), "one per tensor")
        elif quant.layout == "channel":
            out[sname] = (((n, 1), (n,)), f"one per output channel of {list((n, k))}")
        else:
            out[sname] = ((scale_shape("block", n, k),),
                          f"one per 128 x 128 block of {list((n, k))}")
    return out


def check_weights(src: WeightSource, cfg: LlamaConfig, quant=_DEFAULT) -> None:
    """Check src against cfg before anything is read: every tensor present (KeyError naming
    it), with the full shape cfg implies, a float32 / float16 / bfloat16 dtype, and no bias the
    model does not apply (ValueError naming the tensor and its file). With FP8 projections read
    from the checkpoint (quant, default resolve_quant(cfg, None, src)): each projection weight
    F8_E4M3 and its scale tensor of the layout's shape and a float dtype."""
    if quant is _DEFAULT:
        quant = resolve_quant(cfg, None, src)
    fp8 = quant is not None and quant.method != "quantize"
    what = f"config.json of {cfg.name}" if cfg.name else "the config"
    want = expected_tensors(cfg)
    proj = set(projection_names(cfg)) if fp8 else set()
    for name, (shape, why) in want.items():
        got = tuple(src.shape(name))
        if got != shape:
            raise ValueError(
                f"fusedist.models: tensor {name!r} in {src.location(name)} has shape "
                f"{list(got)}; {what} implies {list(shape)} ({why}); the checkpoint does not "
                "match its config.json")
        dt = src.dtype(name)
        if name in proj:
            if dt is not None and dt != "F8_E4M3":
                raise ValueError(
                    f"fusedist.models: tensor {name!r} in {src.location(name)} has dtype {dt}; "
                    f"the checkpoint's quantization_config (quant_method {quant.method}) makes "
                    "every q/k/v/o, gate/up and down projection F8_E4M3 in fusedist (one left "
                    "unquantized by modules_to_not_convert / ignore, or e5m2 weights, are not "
                    "read)")
            continue
        if dt is None or dt in FLOAT_DTYPES:
            continue
        if dt.startswith("F8"):
            if fp8:
                raise ValueError(
                    f"fusedist.models: tensor {name!r} in {src.location(name)} is {dt} (FP8); "
                    "fusedist keeps embeddings, norms and the LM head (and MoE routers) in the "
                    "model dtype: a checkpoint that quantizes them is not read")
            raise ValueError(
                f"fusedist.models: tensor {name!r} in {src.location(name)} is {dt} (FP8), but "
                f"config.json has no quantization_config that says how; {_NO_FP8}")
        raise ValueError(
            f"fusedist.models: tensor {name!r} in {src.location(name)} has dtype {dt}; fusedist "
            "reads float32, float16 and bfloat16 tensors and FP8 (e4m3) projections; "
            f"{_NO_FP8}")
    if fp8:
        for name, (shapes, why) in fp8_scale_shapes(cfg, quant).items():
            got = tuple(src.shape(name))
            if got not in shapes:
                raise ValueError(
                    f"fusedist.models: tensor {name!r} in {src.location(name)} has shape "
                    f"{list(got)}; {quant.layout} FP8 scales ({why}) are "
                    f"{' or '.join(str(list(x)) for x in shapes)}; the checkpoint does not "
                    "match its quantization_config")
            dt = src.dtype(name)
            if dt is not None and dt not in SCALE_DTYPES:
                raise ValueError(
                    f"fusedist.models: tensor {name!r} in {src.location(name)} has dtype {dt}; "
                    "fusedist reads FP8 scales stored as float32, bfloat16 or float16")
    for name in src.names() or ():
        if name.endswith(".bias") and name not in want:
            raise ValueError(
                f"fusedist.models: tensor {name!r} in {src.location(name)} is a bias the model "
                f"does not apply ({cfg.architecture} with this config has no such bias); the "
                "checkpoint does not match its config.json, or its architecture is not "
                "supported")


def open_weights(path: Optional[str], cfg: LlamaConfig, random_seed: Optional[int]) -> WeightSource:
    if random_seed is not None:
        return RandomWeights(cfg, seed=random_seed)
    if path is None:
        raise ValueError("fusedist.models: pass a checkpoint directory or random weights")
    return SafetensorsWeights(path)
