"""Paged KV cache, sized in model terms and allocated once.

Layout (docs/design/attention.md): per layer, K and V are [num_pages, page_size, kv_heads,
head_dim] views of one [num_layers, num_pages, page_size, kv_heads, head_dim] buffer each;
token t of a sequence lives in page block_table[b, t // page_size] at offset t % page_size,
i.e. slot page * page_size + offset of the flattened [num_pages * page_size, kv_heads,
head_dim] view. FP8 caches (kv_dtype=torch.float8_e4m3fn) carry float32 scales
[num_pages, page_size, kv_heads] per layer: one per token-head, value = fp8 * scale.

    cache = PagedKVCache(num_layers, kv_heads, head_dim, num_pages, page_size=16)
    table = BlockTable(cache.allocator, cache.page_size, max_batch=8, max_pages_per_seq=256)
    table.add(seq_id); slots = table.append(seq_id, n_new)   # pages allocated as needed
    block_table = table.tensor(device)                        # int32 [max_batch, max_pages]
"""

from __future__ import annotations

import operator
from typing import Iterable, Optional, Sequence

import torch

from .._check import as_int
from .._dtypes import FP8


def _is_int(v) -> bool:
    """An integer as users hold one (a Python or numpy int), not a bool or a float."""
    if isinstance(v, bool):
        return False
    try:
        operator.index(v)
    except TypeError:
        return False
    return True


def _positive_int(where: str, name: str, v) -> int:
    return as_int(where, name, v, 1, what="a positive int")


class PageAllocator:
    """Free list of page ids 0 .. num_pages-1; allocate(n) hands out the lowest free ids."""

    def __init__(self, num_pages: int):
        num_pages = _positive_int("PageAllocator", "num_pages", num_pages)
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))   # a stack: pop() gives the lowest id
        self._used = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if not _is_int(n) or n < 0:
            raise ValueError(f"PageAllocator.allocate: n must be an int >= 0, got {n!r}")
        n = operator.index(n)
        if n > len(self._free):
            raise RuntimeError(f"PageAllocator: {n} pages requested, {len(self._free)} of "
                               f"{self.num_pages} free; free finished sequences or size the "
                               "cache larger")
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        seen = set()
        for p in pages:
            if p in seen:
                raise ValueError(f"PageAllocator.free: page {p} is listed twice; free each page "
                                 "once")
            seen.add(p)
            if p not in self._used:
                raise ValueError(f"PageAllocator.free: page {p} is not allocated")
        for p in pages:
            self._used.remove(p)
            self._free.append(p)
        self._free.sort(reverse=True)


class PagedKVCache:
    """K and V pages for every layer. k[layer], v[layer]: [num_pages, page_size, kv_heads,
    head_dim] of the cache dtype (dtype, or kv_dtype when given); k_scale[layer],
    v_scale[layer]: float32 [num_pages, page_size, kv_heads] for FP8, None otherwise."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, num_pages: int,
                 page_size: int = 16, dtype: torch.dtype = torch.bfloat16, device=None,
                 kv_dtype: Optional[torch.dtype] = None):
        num_layers, kv_heads, head_dim, num_pages, page_size = (
            _positive_int("PagedKVCache", name, val) for name, val in (
                ("num_layers", num_layers), ("kv_heads", kv_heads), ("head_dim", head_dim),
                ("num_pages", num_pages), ("page_size", page_size)))
        cache_dtype = dtype if kv_dtype is None else kv_dtype
        allowed = (torch.bfloat16, torch.float16, torch.float32) + ((FP8,) if FP8 else ())
        if cache_dtype not in allowed:
            raise ValueError(f"PagedKVCache: cache dtype {cache_dtype} is not supported; use one "
                             f"of {allowed}")
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.num_pages, self.page_size = num_pages, page_size
        self.dtype = dtype                  # the model's activation dtype
        self.kv_dtype = cache_dtype         # what the pages hold
        self.fp8 = FP8 is not None and cache_dtype == FP8
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        shape = (num_layers, num_pages, page_size, kv_heads, head_dim)
        self.k_buffer = torch.zeros(shape, dtype=cache_dtype, device=self.device)
        self.v_buffer = torch.zeros(shape, dtype=cache_dtype, device=self.device)
        self.k = [self.k_buffer[i] for i in range(num_layers)]
        self.v = [self.v_buffer[i] for i in range(num_layers)]
        if self.fp8:
            sshape = shape[:-1]
            self.k_scale_buffer = torch.zeros(sshape, dtype=torch.float32, device=self.device)
            self.v_scale_buffer = torch.zeros(sshape, dtype=torch.float32, device=self.device)
            self.k_scale = [self.k_scale_buffer[i] for i in range(num_layers)]
            self.v_scale = [self.v_scale_buffer[i] for i in range(num_layers)]
        else:
            self.k_scale_buffer = self.v_scale_buffer = None
            self.k_scale = [None] * num_layers
            self.v_scale = [None] * num_layers
        self.allocator = PageAllocator(num_pages)

    @staticmethod
    def bytes_per_page(num_layers: int, kv_heads: int, head_dim: int, page_size: int,
                       kv_dtype: torch.dtype) -> int:
        """K + V bytes of one page over all layers (FP8: the float32 scale of each token and kv
        head included). The one formula of a KV cache's size: the cache, the models'
        kv_bytes_per_token, the Runner's sizing and fusedist.generate's memory estimate all
        read it here."""
        elem = torch.empty((), dtype=kv_dtype).element_size()
        per = 2 * num_layers * page_size * kv_heads * head_dim * elem
        if FP8 is not None and kv_dtype == FP8:
            per += 2 * num_layers * page_size * kv_heads * 4
        return per

    @classmethod
    def from_budget(cls, bytes_budget: int, num_layers: int, kv_heads: int, head_dim: int,
                    page_size: int = 16, dtype: torch.dtype = torch.bfloat16, device=None,
                    kv_dtype: Optional[torch.dtype] = None) -> "PagedKVCache":
        """As many pages as fit in bytes_budget."""
        per = cls.bytes_per_page(num_layers, kv_heads, head_dim, page_size,
                                 dtype if kv_dtype is None else kv_dtype)
        num_pages = int(bytes_budget) // per
        if num_pages <= 0:
            raise ValueError(f"PagedKVCache.from_budget: {bytes_budget} bytes hold no page of "
                             f"{per} bytes; raise the budget or lower page_size")
        return cls(num_layers, kv_heads, head_dim, num_pages, page_size, dtype, device, kv_dtype)

    def layer(self, i: int):
        """(k, v, k_scale, v_scale) of layer i."""
        if not _is_int(i) or not 0 <= i < self.num_layers:
            raise ValueError(f"PagedKVCache.layer: layer index must be an int in [0, "
                             f"{self.num_layers}), got {i!r}")
        i = operator.index(i)
        return self.k[i], self.v[i], self.k_scale[i], self.v_scale[i]

    @property
    def tokens_capacity(self) -> int:
        return self.num_pages * self.page_size

    @property
    def nbytes(self) -> int:
        n = self.k_buffer.nbytes + self.v_buffer.nbytes
        if self.fp8:
            n += self.k_scale_buffer.nbytes + self.v_scale_buffer.nbytes
        return n

    def __repr__(self) -> str:
        return (f"PagedKVCache(layers={self.num_layers}, kv_heads={self.kv_heads}, "
                f"head_dim={self.head_dim}, pages={self.num_pages}x{self.page_size}, "
                f"{self.kv_dtype}, {self.nbytes / 2**30:.2f} GiB on {self.device})")


def slot_mapping(block_table_row: Sequence[int] | torch.Tensor, positions, page_size: int,
                 device=None) -> torch.Tensor:
    """int64 slots of token positions in one sequence: row[pos // page_size] * page_size +
    pos % page_size."""
    page_size = _positive_int("slot_mapping", "page_size", page_size)
    row = torch.as_tensor(block_table_row, dtype=torch.int64)
    pos = torch.as_tensor(positions, dtype=torch.int64).to(row.device)
    if pos.numel() and int(pos.min()) < 0:
        raise ValueError(f"slot_mapping: positions must be >= 0, got {int(pos.min())}")
    if pos.numel() and int(pos.max()) // page_size >= row.numel():
        raise ValueError(f"slot_mapping: position {int(pos.max())} needs page "
                         f"{int(pos.max()) // page_size} but the row has {row.numel()} pages")
    out = row[pos // page_size] * page_size + pos % page_size
    return out.to(device) if device is not None else out


def build_block_table(pages_per_seq: Sequence[Sequence[int]], max_pages: Optional[int] = None,
                      device=None, pad: int = 0) -> torch.Tensor:
    """int32 [len(pages_per_seq), max_pages] with each row's pages first, `pad` after."""
    width = max((len(p) for p in pages_per_seq), default=0)
    max_pages = width if max_pages is None else max_pages
    if not _is_int(max_pages) or max_pages < 0:
        raise ValueError(f"build_block_table: max_pages must be >= 0, got {max_pages!r}")
    if width > max_pages:
        raise ValueError(f"build_block_table: a sequence has {width} pages, more than "
                         f"max_pages={max_pages}")
    t = torch.full((len(pages_per_seq), max(max_pages, 1)), pad, dtype=torch.int32)
    for i, p in enumerate(pages_per_seq):
        if len(p):
            t[i, :len(p)] = torch.as_tensor(list(p), dtype=torch.int32)
    return t.to(device) if device is not None else t


class BlockTable:
    """Host-side page bookkeeping for up to max_batch sequences: rows of page ids grown by
    append() (pages from the allocator as needed), freed by remove(). tensor() / slots are what
    the attention ops read."""

    def __init__(self, allocator: PageAllocator, page_size: int, max_batch: int,
                 max_pages_per_seq: int):
        if not isinstance(allocator, PageAllocator):
            raise TypeError(f"BlockTable: allocator must be a PageAllocator (e.g. "
                            f"PagedKVCache.allocator), got {type(allocator).__name__}")
        page_size, max_batch, max_pages_per_seq = (
            _positive_int("BlockTable", name, v) for name, v in (
                ("page_size", page_size), ("max_batch", max_batch),
                ("max_pages_per_seq", max_pages_per_seq)))
        self.allocator, self.page_size = allocator, page_size
        self.max_batch, self.max_pages_per_seq = max_batch, max_pages_per_seq
        self.pages: dict = {}     # seq id -> list of page ids
        self.lengths: dict = {}   # seq id -> tokens stored
        self.order: list = []     # row order of tensor()

    def add(self, seq_id) -> None:
        if seq_id in self.pages:
            raise ValueError(f"BlockTable.add: sequence {seq_id!r} already present")
        if len(self.order) >= self.max_batch:
            raise RuntimeError(f"BlockTable.add: max_batch={self.max_batch} sequences already")
        self.pages[seq_id], self.lengths[seq_id] = [], 0
        self.order.append(seq_id)

    def _known(self, op: str, seq_id) -> None:
        if seq_id not in self.lengths:
            raise ValueError(f"BlockTable.{op}: sequence {seq_id!r} is not in the table (present: "
                             f"{self.order[:8]!r}{' ...' if len(self.order) > 8 else ''}); "
                             "add() it first")

    def _rows(self, op: str, rows: Optional[int]) -> int:
        rows = self.max_batch if rows is None else rows
        if not _is_int(rows) or rows < len(self.order):
            raise ValueError(f"BlockTable.{op}: rows={rows!r} is fewer than the "
                             f"{len(self.order)} sequences in the table; pass rows >= "
                             f"{len(self.order)} (default max_batch={self.max_batch})")
        return rows

    def append(self, seq_id, n: int) -> list[int]:
        """Reserve n more tokens for seq_id; returns their slots (page * page_size + offset).
        A call that raises leaves the table as it was."""
        self._known("append", seq_id)
        if not _is_int(n) or n < 0:
            raise ValueError(f"BlockTable.append: n must be an int >= 0 (tokens to add), got "
                             f"{n!r}; remove() a finished sequence instead of shrinking it")
        n = operator.index(n)
        start = self.lengths[seq_id]
        need = -(-(start + n) // self.page_size)
        have = self.pages[seq_id]
        if need > self.max_pages_per_seq:
            raise ValueError(f"BlockTable.append: sequence {seq_id!r} holds {start} tokens; "
                             f"n={n} more make {start + n}, which needs {need} pages, more than "
                             f"max_pages_per_seq={self.max_pages_per_seq} "
                             f"({self.max_pages_per_seq * self.page_size} tokens); build the "
                             "table with more pages per sequence")
        if need > len(have):
            have.extend(self.allocator.allocate(need - len(have)))
        self.lengths[seq_id] = start + n
        ps = self.page_size
        return [have[t // ps] * ps + t % ps for t in range(start, start + n)]

    def remove(self, seq_id) -> None:
        self._known("remove", seq_id)
        self.allocator.free(self.pages.pop(seq_id))
        del self.lengths[seq_id]
        self.order.remove(seq_id)

    def seq_len(self, seq_id) -> int:
        self._known("seq_len", seq_id)
        return self.lengths[seq_id]

    def tensor(self, device=None, rows: Optional[int] = None) -> torch.Tensor:
        """int32 [rows (default max_batch), max_pages_per_seq], sequences in add() order."""
        rows = self._rows("tensor", rows)
        t = build_block_table([self.pages[s] for s in self.order], self.max_pages_per_seq)
        if t.shape[0] < rows:
            t = torch.cat([t, torch.zeros(rows - t.shape[0], t.shape[1], dtype=torch.int32)])
        return t.to(device) if device is not None else t

    def seq_lens(self, device=None, rows: Optional[int] = None) -> torch.Tensor:
        rows = self._rows("seq_lens", rows)
        lens = [self.lengths[s] for s in self.order] + [0] * (rows - len(self.order))
        return torch.tensor(lens, dtype=torch.int32, device=device)
