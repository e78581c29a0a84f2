"""fusedist.models.prefix_cache: the hash chain, reference counts, LRU eviction of cached pages
nobody holds, registration, and the three page states checked after every operation of a
random sequence of them."""

from __future__ import annotations

import random

from fusedist.models.prefix_cache import PagePool, page_hash, page_hashes


def test_the_hash_chain_keys_a_page_by_everything_before_it():
    a = page_hashes(list(range(40)), 16)
    assert len(a) == 2                                  # the partial third page has none
    b = page_hashes([99] + list(range(1, 40)), 16)
    assert a[0] != b[0] and a[1] != b[1]               # page 1 differs through page 0
    assert page_hashes(list(range(40)), 16, a[:1]) == a
    assert page_hash(0, [1, 2]) == page_hash(0, [1, 2]) != page_hash(1, [1, 2])


def test_match_acquire_release_and_lru_eviction():
    pool = PagePool(range(4), 2)
    h = page_hashes([1, 2, 3, 4, 5, 6], 2)
    pages = pool.allocate(3)
    for p, x in zip(pages, h):
        pool.register(p, x)
    assert pool.match(h) == pages and pool.match([h[0], 123, h[2]]) == pages[:1]
    pool.release(pages[::-1])                           # LRU order: page 2, 1, 0
    assert pool.num_free == 4 and pool.num_cached == 3
    pool.acquire(pages[:1])                             # a hit: page 0 held again
    got = pool.allocate(2)                              # the free page, then the LRU's oldest
    assert got == [3, pages[2]] and pool.evictions == 1
    assert pool.match(h) == pages[:2]                   # page 2's entry is gone
    assert pool.allocate(2) is None and pool.num_free == 1      # nothing changed
    pool.check()
    pool.release(got + pages[:1])
    pool.reset_cache()
    assert pool.num_cached == 0 and pool.num_free == 4
    pool.check()


def test_shared_pages_are_copied_before_a_write():
    pool = PagePool(range(3), 4)
    p = pool.allocate(1)
    assert not pool.shared(p[0])
    pool.acquire(p)                                     # a second holder (an n > 1 choice)
    assert pool.shared(p[0])
    pool.release(p)
    assert not pool.shared(p[0])
    pool.register(p[0], 7)                              # registered: immutable
    assert pool.shared(p[0])
    q = pool.allocate(1)
    pool.register(q[0], 7)                              # the same content again: not indexed
    assert pool.match([7]) == p and not pool.shared(q[0])


def test_random_operations_keep_the_states_consistent():
    rng = random.Random(5)
    pool = PagePool(range(23), 4)
    held: list = []
    for _ in range(600):
        op = rng.random()
        if op < 0.4:
            got = pool.allocate(rng.randint(1, 4))
            if got:
                held += got
                for p in got:
                    if rng.random() < 0.5:
                        pool.register(p, rng.randint(0, 40))
        elif op < 0.7 and held:
            p = held.pop(rng.randrange(len(held)))
            pool.release([p])
        elif op < 0.85:
            hit = pool.match([rng.randint(0, 40)])
            pool.acquire(hit)
            held += hit
        else:
            pool.acquire(held[:1])
            held += held[:1]
        pool.check()
        assert pool.num_free == 23 - len(set(held))
    pool.release(held)
    pool.check()
    assert pool.num_free == 23
