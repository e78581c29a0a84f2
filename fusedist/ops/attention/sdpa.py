"""torch SDPA as fusedist's prefill uses it: the backend priority (sdpa_priority) and one
causal chunk of new tokens over its cached prefix (_sdpa_chunk), with the fp32 plain-torch
chunk beside it (_reference_chunk)."""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch
import torch.nn.functional as F

from .paged import _fail


# Prefill on CUDA: torch SDPA backends in this order of preference (the first that takes the
# inputs runs), and whether GQA heads are expanded (repeat_interleave) so backends without
# native GQA (cuDNN on some torch builds) can take the call. benchmarks/attention_prefill.py
# measures the alternatives; docs/design/attention.md records the choice.
PREFILL_SDPA_BACKENDS = ("cudnn", "flash", "efficient", "math")
PREFILL_EXPAND_GQA = False


SDPA_NAMES = ("cudnn", "flash", "efficient", "math")
_sdpa_default_set = False


def _init_sdpa_default(device) -> None:
    """Make torch settle its own default SDPA priority before fusedist first changes it.
    torch sets that default (cuDNN first on Hopper / Blackwell with a recent cuDNN) once per
    process, at its first backend selection; `sdpa_kernel(..., set_priority=True)` restores
    on exit the order it found on entry. A process whose first SDPA call ran inside such a
    context therefore kept the pre-default order (flash > efficient > math > cuDNN) for good:
    every later plain SDPA call, a torch baseline's included, took the memory-efficient kernel
    for a masked call cuDNN would have run. One backend selection (no kernel) settles it."""
    global _sdpa_default_set
    if _sdpa_default_set:
        return
    _sdpa_default_set = True
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return
    try:
        t = torch.empty((1, 1, 2, 8), device=device, dtype=torch.float16)
        choose(t, t, t)
    except Exception:  # noqa: BLE001 - a torch without the private op keeps its behavior
        pass


# torch's flag getters of the four CUDA backends, by the names of SDPA_NAMES
_ENABLED_FLAG = {"cudnn": "cudnn", "flash": "flash", "efficient": "mem_efficient",
                 "math": "math"}


def _state_is(backends) -> bool:
    """Whether torch's SDPA state already is what sdpa_kernel(backends, set_priority=True)
    would set for CUDA calls: the four CUDA backends enabled and, among them, in this
    priority order (other backends do not serve CUDA tensors). Reads five flags: ~2 us,
    against ~35 us of Python to enter and leave the context."""
    try:
        want = [int(b) for b in backends]
        cur = [int(b) for b in torch._C._get_sdp_priority_order() if int(b) in want]
        return cur == want and all(getattr(torch._C, f"_get_{flag}_sdp_enabled")()
                                   for flag in _ENABLED_FLAG.values())
    except (AttributeError, TypeError, ValueError):   # a torch without these: set it
        return False


def sdpa_priority(device, order: Sequence[str] = SDPA_NAMES):
    """A context in which SDPA calls on `device` try the backends `order` (names of
    SDPA_NAMES) first, in that order, then the others in torch's order (CUDA; a null context
    on other devices or inside torch.compile, where the caller sets it around the compiled
    call, and when torch's state already is that: the prefill's order is torch's own default
    on Hopper). Leaving it restores torch's own default order (_init_sdpa_default)."""
    device = torch.device(device)
    if device.type != "cuda" or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    order = tuple(order)
    backends = _priorities.get(order)
    if backends is None:
        bad = [n for n in order if n not in SDPA_NAMES]
        if bad:
            _fail("sdpa_priority", f"unknown SDPA backends {bad}; use names of {SDPA_NAMES}")
        names = _backends()
        backends = _priorities[order] = (
            [names[n] for n in order] + [b for n, b in names.items() if n not in order],
            [names[n] for n in order])
    _init_sdpa_default(device)
    if _state_is(backends[0]):
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel
    try:
        return sdpa_kernel(list(backends[0]), set_priority=True)   # copies: torch's own
    except TypeError:   # torch without set_priority: the allowed set only
        return sdpa_kernel(list(backends[1]))


# sdpa_priority's backend lists by order: (the full priority list, the named ones)
_priorities: dict = {}


def _backends() -> dict:
    from torch.nn.attention import SDPBackend
    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def _sdpa_context(device):
    return sdpa_priority(device, PREFILL_SDPA_BACKENDS)


def _sdpa_chunk(q, k, v, scale):
    """q [B, n, Hq, D] against k, v [B, L, Hkv, D]; token i sees keys [0, L - n + i]."""
    from torch.nn.attention.bias import causal_lower_right
    n, L = q.shape[1], k.shape[1]
    rep = q.shape[2] // k.shape[2]
    if rep > 1 and PREFILL_EXPAND_GQA:
        k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))   # [B, H, len, D]
    gqa = qh.shape[1] != kh.shape[1]
    with _sdpa_context(q.device):
        if n == L:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                               enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(n, L),
                                               scale=scale, enable_gqa=gqa)
    return o.transpose(1, 2)


def _reference_chunk(q, k, v, scale):
    B, n, Hq, D = q.shape
    L, Hkv = k.shape[1], k.shape[2]
    qf = q.float().unflatten(2, (Hkv, Hq // Hkv))
    s = torch.einsum("bnhgd,blhd->bhgnl", qf, k.float()) * scale
    allowed = torch.arange(L, device=q.device)[None, :] <= \
        (L - n + torch.arange(n, device=q.device))[:, None]
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("bhgnl,blhd->bnhgd", p, v.float()).reshape(B, n, Hq, D)
