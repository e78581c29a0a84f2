"""The paged KV cache as the attention ops read it: the argument checks every op shares and
the gather the plain-torch paths (and prefill's SDPA path) use. Layouts: the package
docstring."""

from __future__ import annotations

from typing import Optional

import torch

from ... import _dtypes, _ext
from ...errors import MetadataError
from .. import device_errors

FP8, FP8_MAX = _dtypes.FP8, _dtypes.FP8_MAX
KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32) + ((FP8,) if FP8 is not None else ())


_CAPS: dict = {}


def capability(dev: torch.device) -> tuple:
    """A CUDA device's compute capability (queried once per device; the attention ops pick
    their Hopper paths with it)."""
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    if idx not in _CAPS:
        _CAPS[idx] = tuple(torch.cuda.get_device_capability(idx))
    return _CAPS[idx]


def _fail(op: str, msg: str):
    raise ValueError(f"fusedist.{op}: {msg}")


def _check_cache(op, k_cache, v_cache, k_scale, v_scale):
    if k_cache.dim() != 4:
        _fail(op, f"k_cache must be [num_pages, page_size, kv_heads, head_dim], got "
                  f"{tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        _fail(op, f"v_cache {tuple(v_cache.shape)} {v_cache.dtype} must match k_cache "
                  f"{tuple(k_cache.shape)} {k_cache.dtype}")
    if k_cache.dtype not in KV_DTYPES:
        _fail(op, f"cache dtype {k_cache.dtype} is not supported; use one of {KV_DTYPES}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not t.is_contiguous():
            _fail(op, f"{name} must be contiguous (stride {t.stride()}); allocate it with "
                      "PagedKVCache")
    fp8 = FP8 is not None and k_cache.dtype == FP8
    if fp8:
        want = tuple(k_cache.shape[:3])
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s is None:
                _fail(op, f"an FP8 cache needs {name} (float32 {list(want)}); pass the cache's "
                          "scales")
            if tuple(s.shape) != want or s.dtype != torch.float32 or not s.is_contiguous():
                _fail(op, f"{name} must be contiguous float32 {list(want)}, got "
                          f"{tuple(s.shape)} {s.dtype}")
    elif k_scale is not None or v_scale is not None:
        _fail(op, f"k_scale/v_scale are only for float8_e4m3fn caches (cache is {k_cache.dtype})")
    return fp8


def _check_tables(op, block_table, seq_lens, batch, device):
    if block_table.dim() != 2 or block_table.dtype != torch.int32 or block_table.shape[0] != batch:
        _fail(op, f"block_table must be int32 [batch={batch}, max_pages], got "
                  f"{tuple(block_table.shape)} {block_table.dtype}")
    if seq_lens.shape != (batch,) or seq_lens.dtype != torch.int32:
        _fail(op, f"seq_lens must be int32 [{batch}], got {tuple(seq_lens.shape)} "
                  f"{seq_lens.dtype}")
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens)):
        if t.device != device:
            _fail(op, f"{name} is on {t.device}; it must be on {device} with the cache")


def _check_query(op, q, k_cache, fp8, rows):
    """q [rows, q_heads, head_dim] against a cache [pages, page_size, kv_heads, head_dim]: its
    dtype, shape, GQA ratio and device (decode: rows = "batch", prefill: "tokens")."""
    if q.dim() != 3 or q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        _fail(op, f"q must be [{rows}, q_heads, head_dim] of float32/float16/bfloat16, got "
                  f"{tuple(q.shape)} {q.dtype}")
    _, Hq, D = q.shape
    Hkv, Dc = k_cache.shape[2], k_cache.shape[3]
    if Dc != D or Hq % Hkv:
        _fail(op, f"q [{rows}, {Hq}, {D}] does not fit the cache's [kv_heads, head_dim] = "
                  f"[{Hkv}, {Dc}] (q_heads must be a multiple of kv_heads)")
    if not fp8 and k_cache.dtype != q.dtype:
        _fail(op, f"cache dtype {k_cache.dtype} must be q's dtype {q.dtype} (or float8_e4m3fn)")
    if q.device != k_cache.device:
        _fail(op, f"q is on {q.device}; it must be on the cache's device {k_cache.device}")


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, num_pages: int,
              scale: Optional[torch.Tensor] = None, dtype=torch.float32) -> torch.Tensor:
    """[B, num_pages * page_size, H, D] of `dtype`: each row's first num_pages pages laid end to
    end (entries clamped into range; the caller masks tokens past seq_len), FP8 dequantized."""
    P, ps, H, D = cache.shape
    bt = block_table[:, :num_pages].long().clamp(0, P - 1)
    g = cache[bt]                                            # [B, n, ps, H, D]
    if scale is not None:   # dequantize in fp32, round once
        g = g.float() * scale[bt][..., None]
    out = g.to(dtype)
    return out.reshape(bt.shape[0], num_pages * ps, H, D)


def _gather_seqs(cache, pages, length, scale, dtype):
    """[B, length, H, D] of B sequences from their page lists (long [B, pages])."""
    P, ps, H, D = cache.shape
    g = cache[pages]                                         # [B, pages, ps, H, D]
    if scale is not None:   # dequantize in fp32, round once
        g = (g.float() * scale[pages][..., None]).to(dtype)
    return g.to(dtype).reshape(pages.shape[0], -1, H, D)[:, :length]


# ---- metadata ranges -----------------------------------------------------------------------
# A page id outside the cache, a length longer than its block-table row, a slot or position out
# of range must never reach memory. CPU tensors (and the CUDA reference paths outside graph
# capture) raise MetadataError at once; the kernels record it on the device and poison the
# outputs (fusedist/ops/device_errors.py).

def check_pages_host(op: str, block_table: torch.Tensor, seq_lens, num_pages: int,
                     page_size: int, rows=None) -> None:
    """Raise MetadataError unless every length lies in [0, columns * page_size] and the
    block-table entries it reads, columns [0, ceil(len / page_size)), in [0, num_pages).
    seq_lens: a tensor or a host list; rows: the row numbers to report (default 0..)."""
    lens = seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else list(seq_lens)
    cols = block_table.shape[1]
    for i, n in enumerate(lens):
        r = i if rows is None else rows[i]
        if n < 0 or n > cols * page_size:
            raise MetadataError(
                f"fusedist.{op}: seq_lens[{r}] = {n} is outside [0, {cols * page_size}], the "
                f"tokens its block-table row can hold ({cols} columns x page_size {page_size})")
    if not lens:
        return
    used = max(-(-n // page_size) for n in lens)
    if used == 0:
        return
    bt = block_table[:len(lens), :used]
    need = torch.arange(used, device=bt.device)[None, :] < \
        torch.tensor([-(-n // page_size) for n in lens], device=bt.device)[:, None]
    bad = need & ((bt < 0) | (bt >= num_pages))
    if bool(bad.any()):
        i, c = (int(x) for x in bad.nonzero()[0])
        r = i if rows is None else rows[i]
        raise MetadataError(
            f"fusedist.{op}: sequence {r} reads block_table[{r}, {c}] = {int(bt[i, c])}, "
            f"outside the cache's {num_pages} pages (ids 0..{num_pages - 1})")


def check_pages_device(op: str, block_table: torch.Tensor, seq_lens: torch.Tensor,
                       num_pages: int, page_size: int) -> torch.Tensor:
    """The same check on the GPU, without synchronizing: bool [rows], True where a row's
    length or pages are out of range (recorded in the device's error record)."""
    rows = seq_lens.shape[0]
    bad = torch.empty(rows, dtype=torch.uint8, device=seq_lens.device)
    if rows == 0:
        return bad.bool()
    C = _ext.load()
    bt = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    lens = seq_lens.contiguous()
    a = C.PagedCheckArgs()
    a.block_table, a.seq_lens, a.bad_rows = bt.data_ptr(), lens.data_ptr(), bad.data_ptr()
    a.err = device_errors.record_ptr(seq_lens.device)
    a.rows, a.cols, a.bt_stride = rows, bt.shape[1], bt.stride(0)
    a.page_size, a.num_pages = page_size, num_pages
    a.op = {"decode": 1, "prefill": 3}[op]
    C.paged_check(a, _ext.stream(seq_lens.device))
    return bad.view(torch.bool)   # the kernel writes 0 / 1: a bool view, no conversion


def device_check_available() -> bool:
    return _ext.capabilities().has("paged_check")


_NAN_BITS = {torch.bfloat16: 0x7FC0, torch.float16: 0x7E00, torch.float32: 0x7FC00000}


def poison_rows(out: torch.Tensor, bad: torch.Tensor, tokens: int) -> None:
    """NaN into out's rows of the sequences `bad` marks: out [seqs * tokens, ...] holds
    `tokens` rows per sequence in order, bad bool [seqs] (a device check's mask). On CUDA
    one small kernel that reads the mask and writes only the bad sequences' rows (no
    synchronization, no pass over the good rows); elsewhere, or for rows it cannot address
    (a row not contiguous in memory), a masked fill."""
    seqs = bad.shape[0]
    if out.shape[0] != seqs * tokens:
        _fail("poison_rows", f"out has {out.shape[0]} rows, not {seqs} sequences x {tokens}")
    if seqs == 0 or tokens == 0:
        return
    row = out[0].numel()
    if out.device.type == "cuda" and out.dtype in _NAN_BITS and out.dim() >= 2 and \
            out[0].is_contiguous() and \
            (row * out.element_size()) % 4 == 0 and out.data_ptr() % 4 == 0 and \
            (out.stride(0) * out.element_size()) % 4 == 0 and out.stride(0) >= row and \
            _ext.kernel_runs("poison_rows", out.device):
        C = _ext.load()
        a = C.PoisonRowsArgs()
        a.bad_rows, a.out = bad.contiguous().data_ptr(), out.data_ptr()
        a.token_stride, a.row_bytes = out.stride(0) * out.element_size(), row * out.element_size()
        a.seqs, a.tokens, a.elem_bytes = seqs, tokens, out.element_size()
        a.nan_bits = _NAN_BITS[out.dtype]
        C.poison_rows(a, _ext.stream(out.device))
        return
    mask = bad[:, None].expand(seqs, tokens).reshape(-1)
    out.masked_fill_(mask.view(-1, *([1] * (out.dim() - 1))), float("nan"))
