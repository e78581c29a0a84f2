"""KV pages of the continuous-batching engine: reference counts, the prefix index, LRU eviction.

    pool = PagePool(pages=range(num_pages - 1), page_size=16)
    hit = pool.match(hashes)             # the cached pages of a prompt's leading full pages
    pool.acquire(hit)                    # ... now shared with this sequence
    new = pool.allocate(3)               # free pages first, then the least recently used
                                         # cached pages nobody holds (index entries dropped)
    pool.register(page, h)               # a full page's content is now findable by its hash
    pool.release(pages)                  # held by nobody: cached pages stay findable (LRU),
                                         # the others go back to the free list

A full page is keyed by the hash chain of its tokens: h_i = blake2b(h_{i-1}, tokens of page i)
(page_hashes), so a hit on page i means every token before it matches too. Hashes are
deterministic (not Python's salted hash()): every rank of a tensor-parallel group computes the
same ones and takes the same decisions. A registered page is immutable; a sequence that must
write into a page it does not own alone (a shared or registered page: the partial last page
that n > 1 choices share, or a cached page whose last token a prompt recomputes for its
logits) copies it first (copy on write; scheduler.py does the copy).

Every page is in exactly one of three states: held (ref > 0), cached and evictable (ref 0,
registered, in the LRU), free (ref 0, not registered). num_free counts the last two: what
allocate() can hand out.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from typing import Iterable, Optional, Sequence


def page_hash(parent: int, tokens: Sequence[int]) -> int:
    """The 64-bit hash of a full page of `tokens` after the page hashed `parent` (0 first)."""
    data = struct.pack(f"<Q{len(tokens)}q", parent, *tokens)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def page_hashes(tokens: Sequence[int], page_size: int, start: Sequence[int] = ()) -> list[int]:
    """The hash chain of the full pages of `tokens`, extending `start` (the chain of its
    leading pages, already computed)."""
    out = list(start)
    for i in range(len(out), len(tokens) // page_size):
        out.append(page_hash(out[-1] if out else 0, tokens[i * page_size:(i + 1) * page_size]))
    return out


class PagePool:
    def __init__(self, pages: Iterable[int], page_size: int, caching: bool = True):
        pages = list(pages)
        if not pages:
            raise ValueError("PagePool: no pages; give the engine a KV cache of at least two "
                             "pages (one is the padding rows' scratch page)")
        self.page_size = page_size
        self.caching = caching
        self.total = len(pages)
        self._free = sorted(pages, reverse=True)        # a stack: pop() gives the lowest id
        self.ref = {p: 0 for p in pages}
        self.hash_of: dict[int, int] = {}               # registered page -> its hash
        self.index: dict[int, int] = {}                 # hash -> registered page
        self.lru: "OrderedDict[int, None]" = OrderedDict()   # cached pages nobody holds
        # hit rate: tokens looked up and tokens found, over the prompts admitted
        self.query_tokens = 0
        self.hit_tokens = 0
        self.evictions = 0

    # ---- state ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages allocate() can hand out: free ones and cached ones nobody holds."""
        return len(self._free) + len(self.lru)

    @property
    def num_cached(self) -> int:
        return len(self.index)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def shared(self, page: int) -> bool:
        """Whether a sequence holding `page` must copy it before writing into it."""
        return self.ref[page] > 1 or page in self.hash_of

    # ---- prefix lookup -------------------------------------------------------------------
    def match(self, hashes: Sequence[int]) -> list[int]:
        """The registered pages of the longest prefix of `hashes` (a hash chain)."""
        out = []
        if not self.caching:
            return out
        for h in hashes:
            p = self.index.get(h)
            if p is None:
                break
            out.append(p)
        return out

    def count_query(self, tokens: int, hit: int) -> None:
        self.query_tokens += tokens
        self.hit_tokens += hit

    # ---- references ----------------------------------------------------------------------
    def acquire(self, pages: Iterable[int]) -> None:
        for p in pages:
            if self.ref[p] == 0:
                self.lru.pop(p, None)
            self.ref[p] += 1

    def release(self, pages: Iterable[int]) -> None:
        for p in pages:
            if self.ref[p] <= 0:
                raise RuntimeError(f"PagePool.release: page {p} is not held")
            self.ref[p] -= 1
            if self.ref[p] == 0:
                if p in self.hash_of:
                    self.lru[p] = None            # most recently used at the end
                else:
                    self._free.append(p)

    def allocate(self, n: int) -> Optional[list[int]]:
        """n pages held once by the caller, or None (nothing changed) when fewer than n can be
        had. Free pages first, then the least recently used cached ones."""
        if n > self.num_free:
            return None
        out = []
        for _ in range(n):
            if self._free:
                p = self._free.pop()
            else:
                p, _ = self.lru.popitem(last=False)
                del self.index[self.hash_of.pop(p)]
                self.evictions += 1
            self.ref[p] = 1
            out.append(p)
        return out

    def register(self, page: int, h: int) -> None:
        """Make a full, held page findable under hash h. A hash another page already holds
        keeps that page (this one stays private and is freed as usual)."""
        if not self.caching or page in self.hash_of or h in self.index:
            return
        self.hash_of[page] = h
        self.index[h] = page

    def reset_cache(self) -> None:
        """Forget every cached page nobody holds (they become free)."""
        while self.lru:
            p, _ = self.lru.popitem(last=False)
            del self.index[self.hash_of.pop(p)]
            self._free.append(p)
        self._free.sort(reverse=True)

    def check(self) -> None:
        """Raise AssertionError unless the three states partition the pages (tests)."""
        held = {p for p, r in self.ref.items() if r > 0}
        free, lru = set(self._free), set(self.lru)
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert not (held & free) and not (held & lru) and not (free & lru), "states overlap"
        assert held | free | lru == set(self.ref), "a page is in no state"
        assert all(p in self.hash_of for p in lru), "an unregistered page in the LRU"
        assert all(self.index[h] == p for p, h in self.hash_of.items()), "index mismatch"


__all__ = ["PagePool", "page_hash", "page_hashes"]
