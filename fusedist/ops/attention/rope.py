"""RoPE: the cos / sin tables (rope_cos_sin, with Llama-3 / linear / YaRN-style scaling baked
in) and rope_append, which rotates q and k and writes k, v into the paged cache in one kernel
(csrc/ops/attention/rope_append.cu) or the plain-torch path."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from ... import _align, _dtypes, _ext
from .._plan import KernelPlan, kernel_plan
from ...errors import MetadataError
from .. import device_errors
from .paged import FP8, FP8_MAX, _check_cache, _fail

ROPE_STYLES = ("neox", "gptj")


def rope_inv_freq(rotary_dim: int, base: float = 10000.0,
                  scaling: Optional[dict] = None) -> torch.Tensor:
    """float64 [rotary_dim / 2] inverse frequencies, with the HF rope scaling applied:
    None / "default", "linear" (positions divided by factor) and "llama3" (Llama-3.1: long
    wavelengths divided by factor, a smooth blend between low_freq and high_freq)."""
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"fusedist.rope_cos_sin: rotary_dim must be a positive even number, got "
                         f"{rotary_dim}")
    inv = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    kind = _rope_type(scaling)
    if kind == "default":
        return inv
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv / factor
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    if high <= low:
        raise ValueError(f"fusedist.rope_cos_sin: llama3 scaling needs high_freq_factor > "
                         f"low_freq_factor, got {high} <= {low}")
    wavelen = 2 * math.pi / inv
    low_wavelen, high_wavelen = old_len / low, old_len / high
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def _rope_type(scaling: Optional[dict]) -> str:
    if not scaling:
        return "default"
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "linear", "llama3"):
        raise ValueError(f"fusedist.rope_cos_sin: rope scaling type {kind!r} is not supported; "
                         "use None, 'linear' or 'llama3'")
    if kind != "default" and "factor" not in scaling:
        raise ValueError(f"fusedist.rope_cos_sin: {kind} scaling needs a 'factor'")
    return kind


def rope_cos_sin(head_dim: int, max_position: int, base: float = 10000.0,
                 scaling: Optional[dict] = None, *, device=None, dtype=torch.float32,
                 rotary_dim: Optional[int] = None) -> torch.Tensor:
    """[max_position, rotary_dim] table: cos(pos * f_i) for the rotary_dim/2 frequencies, then
    sin(pos * f_i); computed in float64, stored as `dtype` (float32). rotary_dim defaults to
    head_dim (partial rotary: the first rotary_dim features of a head rotate)."""
    rd = head_dim if rotary_dim is None else rotary_dim
    if rd > head_dim:
        raise ValueError(f"fusedist.rope_cos_sin: rotary_dim {rd} exceeds head_dim {head_dim}")
    if max_position <= 0:
        raise ValueError(f"fusedist.rope_cos_sin: max_position must be > 0, got {max_position}")
    inv = rope_inv_freq(rd, base, scaling)
    ang = torch.arange(max_position, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=-1).to(dtype=dtype, device=device).contiguous()


def rope_append(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slot_mapping: torch.Tensor, *, style: str = "neox",
                k_scale: Optional[torch.Tensor] = None,
                v_scale: Optional[torch.Tensor] = None,
                q_norm: Optional[torch.Tensor] = None, k_norm: Optional[torch.Tensor] = None,
                norm_eps: float = 1e-6) -> None:
    """Rotates q [T, Hq, D] and k [T, Hkv, D] in place (first cos_sin.shape[1] features of each
    head) and writes the rotated k and v into the cache at slot_mapping [T] (negative: skipped).
    FP8 caches get per token-head scales amax / 448 of the rotated (rounded) k and of v.
    q_norm, k_norm ([D], float32 or q's dtype; both or neither): each q and k head is first
    RMS-normalized over D with them (Qwen3's head norms; head_norm_reference), in float32 and
    rounded to q's dtype, in the same kernel."""
    _validate_rope(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, style,
                   k_scale, v_scale, q_norm, k_norm, norm_eps)
    if torch.compiler.is_compiling():
        torch.ops.fusedist.rope_append(q, k, v, positions, cos_sin, k_cache, v_cache,
                                       slot_mapping, style, k_scale, v_scale, q_norm, k_norm,
                                       float(norm_eps))
    else:
        _rope_append_impl(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, style,
                          k_scale, v_scale, q_norm, k_norm, norm_eps)


def _validate_norms(q, q_norm, k_norm, norm_eps) -> None:
    op = "rope_append"
    if (q_norm is None) != (k_norm is None):
        _fail(op, "q_norm and k_norm come together: pass both head-norm weights or neither")
    if q_norm is None:
        return
    D = q.shape[-1]
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if not isinstance(w, torch.Tensor) or w.shape != (D,) or \
                w.dtype not in (torch.float32, q.dtype):
            _fail(op, f"{name} must be a [{D}] (head_dim) tensor of float32 or q's dtype "
                      f"{q.dtype}, got {getattr(w, 'dtype', type(w).__name__)} "
                      f"{tuple(getattr(w, 'shape', ()))}")
        if w.device != q.device:
            _fail(op, f"{name} is on {w.device}; it must be on q's device {q.device}")
    if isinstance(norm_eps, bool) or not isinstance(norm_eps, (int, float)) or \
            not math.isfinite(norm_eps) or norm_eps <= 0:
        _fail(op, f"norm_eps must be a finite number > 0, got {norm_eps!r}")


def _validate_rope(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, style,
                   k_scale, v_scale, q_norm=None, k_norm=None, norm_eps=1e-6):
    op = "rope_append"
    if style not in ROPE_STYLES:
        _fail(op, f"style must be one of {ROPE_STYLES}, got {style!r}")
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        _fail(op, f"q must be [T, Hq, D], k and v [T, Hkv, D]; got {tuple(q.shape)}, "
                  f"{tuple(k.shape)}, {tuple(v.shape)}")
    T, _, D = q.shape
    if k.shape[0] != T or k.shape[2] != D:
        _fail(op, f"k {tuple(k.shape)} must have q's tokens and head_dim ({T}, {D})")
    if k.dtype != q.dtype or v.dtype != q.dtype or q.dtype not in (torch.float32, torch.float16,
                                                                   torch.bfloat16):
        _fail(op, f"q, k, v must share one dtype of float32/float16/bfloat16, got {q.dtype}, "
                  f"{k.dtype}, {v.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            _fail(op, f"{name} needs unit stride in head_dim (stride {t.stride()})")
    if positions.shape != (T,) or positions.dtype not in (torch.int32, torch.int64):
        _fail(op, f"positions must be int32/int64 [{T}], got {tuple(positions.shape)} "
                  f"{positions.dtype}")
    if slot_mapping.shape != (T,) or slot_mapping.dtype != torch.int64:
        _fail(op, f"slot_mapping must be int64 [{T}], got {tuple(slot_mapping.shape)} "
                  f"{slot_mapping.dtype}")
    if cos_sin.dim() != 2 or cos_sin.dtype != torch.float32 or cos_sin.shape[1] % 2 or \
            cos_sin.shape[1] > D or not cos_sin.is_contiguous():
        _fail(op, f"cos_sin must be contiguous float32 [max_position, rotary_dim <= {D}] from "
                  f"rope_cos_sin, got {tuple(cos_sin.shape)} {cos_sin.dtype}")
    _check_cache(op, k_cache, v_cache, k_scale, v_scale)
    if tuple(k_cache.shape[2:]) != tuple(k.shape[1:]):
        _fail(op, f"k [T, {k.shape[1]}, {D}] does not fit the cache's [kv_heads, head_dim] = "
                  f"{list(k_cache.shape[2:])}")
    if FP8 is None or k_cache.dtype != FP8:
        if k_cache.dtype != k.dtype:
            _fail(op, f"cache dtype {k_cache.dtype} must be k's dtype {k.dtype} (or float8_e4m3fn)")
    for name, t in (("q", q), ("k", k), ("v", v), ("positions", positions), ("cos_sin", cos_sin),
                    ("slot_mapping", slot_mapping)):
        if t.device != k_cache.device:
            _fail(op, f"{name} is on {t.device}; it must be on the cache's device "
                      f"{k_cache.device}")
    _validate_norms(q, q_norm, k_norm, norm_eps)


def available(device) -> bool:
    """The rope_append kernel runs on `device`."""
    return _ext.kernel_runs("rope_append", device)


def why_not(q, k, v, positions, cos_sin, k_cache, slot_mapping, q_norm=None,
            k_norm=None) -> str:
    """Why csrc/ops/attention/rope_append.cu does not serve this (valid) call ("" when it
    does); such calls take the plain-torch path."""
    why = _ext.why_not("rope_append", q.device)
    if why:
        return why
    D = q.shape[-1]
    if not (q.dtype in (torch.float16, torch.bfloat16) and D % 8 == 0 and D <= 256
            and cos_sin.shape[1] % 16 == 0 and _align.is_aligned(cos_sin)
            and _align.is_aligned(k_cache) and all(_rows_ok(t) for t in (q, k, v))
            and positions.is_contiguous() and slot_mapping.is_contiguous()):
        return "a dtype, head_dim, layout or alignment the kernel does not serve"
    if q_norm is not None and not all(w.is_contiguous() and _align.is_aligned(w)
                                      for w in (q_norm, k_norm)):
        return "head-norm weights that are not contiguous and 16-byte aligned"
    return ""


def plan(q, k, v, positions, cos_sin, k_cache, slot_mapping, q_norm=None,
         k_norm=None) -> KernelPlan:
    return kernel_plan("rope_append", why_not(q, k, v, positions, cos_sin, k_cache,
                                              slot_mapping, q_norm, k_norm))


def _rope_kernel_ok(q, k, v, positions, cos_sin, k_cache, slot_mapping) -> bool:
    return not why_not(q, k, v, positions, cos_sin, k_cache, slot_mapping)


def _rows_ok(t: torch.Tensor) -> bool:
    """[T, H, D] with contiguous heads at a 16-byte aligned token stride (a contiguous tensor
    or a slice of a fused QKV output)."""
    return (t.stride(2) == 1 and (t.shape[1] == 1 or t.stride(1) == t.shape[2])
            and _align.whole_vectors(t.stride(0) * t.element_size()) and _align.is_aligned(t))


def _rope_append_impl(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, style,
                      k_scale, v_scale, q_norm=None, k_norm=None, norm_eps=1e-6) -> None:
    if q.shape[0] == 0:
        return
    run(plan(q, k, v, positions, cos_sin, k_cache, slot_mapping, q_norm, k_norm), q, k, v,
        positions, cos_sin, k_cache, v_cache, slot_mapping, style, k_scale, v_scale, q_norm,
        k_norm, norm_eps)


def run(p: KernelPlan, q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, style,
        k_scale, v_scale, q_norm=None, k_norm=None, norm_eps=1e-6) -> None:
    """Execute p on validated, non-empty arguments."""
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if p.kernel:
        device_errors.check_before_launch(q)
        C = _ext.load()
        a = C.RopeAppendArgs()
        a.q, a.k, a.v = q.data_ptr(), k.data_ptr(), v.data_ptr()
        a.positions, a.cos_sin = positions.data_ptr(), cos_sin.data_ptr()
        a.k_cache, a.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        if k_scale is not None:
            a.k_scale, a.v_scale = k_scale.data_ptr(), v_scale.data_ptr()
        a.slot_mapping = slot_mapping.data_ptr()
        a.tokens, a.q_heads, a.kv_heads, a.head_dim = q.shape[0], q.shape[1], k.shape[1], \
            q.shape[2]
        a.rot, a.max_position = cos_sin.shape[1], cos_sin.shape[0]
        a.num_slots, a.err = num_slots, device_errors.record_ptr(q.device)
        a.q_stride, a.k_stride, a.v_stride = q.stride(0), k.stride(0), v.stride(0)
        a.positions_int64 = positions.dtype == torch.int64
        a.style = ROPE_STYLES.index(style)
        a.dtype, a.cache_dtype = _dtypes.code(q.dtype), _dtypes.code(k_cache.dtype)
        if q_norm is not None:
            a.q_norm, a.k_norm = q_norm.data_ptr(), k_norm.data_ptr()
            a.norm_eps, a.norm_dtype = float(norm_eps), _dtypes.code(q_norm.dtype)
        C.rope_append(a, _ext.stream(q.device))
        return
    p.warn_if_reference(q.device)
    if not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        check_rope_host(positions, slot_mapping, cos_sin.shape[0], num_slots)
    rope_append_reference(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping,
                          style=style, k_scale=k_scale, v_scale=v_scale, q_norm=q_norm,
                          k_norm=k_norm, norm_eps=norm_eps)


def check_rope_host(positions: torch.Tensor, slot_mapping: torch.Tensor, max_position: int,
                    num_slots: int) -> None:
    """MetadataError unless every position lies in [0, max_position) and every slot below
    num_slots (a negative slot is padding: skipped). Checked before anything is written."""
    bad_pos = (positions < 0) | (positions >= max_position)
    bad_slot = slot_mapping >= num_slots
    if bool(bad_pos.any()):
        t = int(bad_pos.nonzero()[0, 0])
        raise MetadataError(f"fusedist.rope_append: positions[{t}] = {int(positions[t])} is "
                            f"outside the RoPE table's [0, {max_position}) positions; build "
                            "cos_sin for max_position tokens (rope_cos_sin)")
    if bool(bad_slot.any()):
        t = int(bad_slot.nonzero()[0, 0])
        raise MetadataError(f"fusedist.rope_append: slot_mapping[{t}] = {int(slot_mapping[t])} "
                            f"is outside the cache's {num_slots} slots (num_pages x page_size)")


def apply_rope_reference(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                         style: str = "neox") -> torch.Tensor:
    """Rotated copy of x [T, H, D] in fp32 (first cos_sin.shape[1] features of each head)."""
    half = cos_sin.shape[1] // 2
    cs = cos_sin[positions.long()].float()
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    xf = x.float()
    r = xf[..., :2 * half]
    if style == "neox":
        x1, x2 = r[..., :half], r[..., half:]
        rot = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = r[..., 0::2], r[..., 1::2]
        rot = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return torch.cat([rot, xf[..., 2 * half:]], dim=-1)


def quantize_fp8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (e4m3 [..., D], float32 scale [...]) with scale = amax / 448 over D;
    an all-zero row gets scale 0 and zeros."""
    xf = x.float()
    scale = xf.abs().amax(-1) / FP8_MAX
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    return (xf * inv[..., None]).to(FP8), scale


def head_norm_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] RMS-normalized over D with weight w [D], in float32, rounded to x's dtype."""
    return F.rms_norm(x.float(), (x.shape[-1],), w.float(), eps).to(x.dtype)


def rope_append_reference(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, *,
                          style="neox", k_scale=None, v_scale=None, q_norm=None, k_norm=None,
                          norm_eps=1e-6) -> None:
    """Plain-torch rope_append (fp32 rotation, one rounding to q's dtype; with q_norm / k_norm
    the heads are normalized first: head_norm_reference)."""
    if q_norm is not None:
        q.copy_(head_norm_reference(q, q_norm, norm_eps))
        k.copy_(head_norm_reference(k, k_norm, norm_eps))
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    pos = positions.clamp(0, cos_sin.shape[0] - 1)   # callers check; never index past the table
    q.copy_(apply_rope_reference(q, pos, cos_sin, style).to(q.dtype))
    k.copy_(apply_rope_reference(k, pos, cos_sin, style).to(k.dtype))
    slots = slot_mapping
    kk, vv = k, v
    keep = (slots >= 0) & (slots < num_slots)
    if not bool(keep.all()):
        slots, kk, vv = slots[keep], kk[keep], vv[keep]
    H, D = k_cache.shape[2], k_cache.shape[3]
    fk, fv = k_cache.view(-1, H, D), v_cache.view(-1, H, D)
    if FP8 is not None and k_cache.dtype == FP8:
        for src, dst, sc in ((kk, fk, k_scale), (vv, fv, v_scale)):
            qv, s = quantize_fp8_reference(src)
            dst[slots] = qv
            sc.view(-1, H)[slots] = s
    else:
        fk[slots] = kk.to(k_cache.dtype)
        fv[slots] = vv.to(v_cache.dtype)


@torch.library.custom_op("fusedist::rope_append",
                         mutates_args=("q", "k", "k_cache", "v_cache", "k_scale", "v_scale"))
def _rope_append_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, style: str, k_scale: Optional[torch.Tensor],
                    v_scale: Optional[torch.Tensor], q_norm: Optional[torch.Tensor],
                    k_norm: Optional[torch.Tensor], norm_eps: float) -> None:
    _rope_append_impl(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, style,
                      k_scale, v_scale, q_norm, k_norm, norm_eps)


@_rope_append_op.register_fake
def _(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, style, k_scale, v_scale,
      q_norm, k_norm, norm_eps):
    return None


reference = rope_append_reference   # the op's shape: available / why_not / plan / run above
