"""Benchmark size flags (benchmarks/_harness.py): nccl-tests' spelling (4096, 4K, 4M, 1G) and
its -b / -e / -f sweep; benchmarks/allreduce.py refuses a bad size before starting."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _harness import parse_bytes, size_range  # noqa: E402


@pytest.mark.parametrize("text,n", [("4096", 4096), ("4K", 4096), ("4k", 4096), ("4KB", 4096),
                                    ("4KiB", 4096), ("4M", 4 << 20), ("1G", 1 << 30),
                                    (" 64K ", 65536), ("3", 3)])
def test_parse_bytes(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize("text", ["", "4X", "-4K", "0", "K", "4.5M", "M4"])
def test_parse_bytes_refuses(text):
    with pytest.raises(ValueError, match="--sizes: .* is not a size"):
        parse_bytes(text)


def test_size_range():
    assert size_range("8K", "64K", 2) == [8192, 16384, 32768, 65536]
    assert size_range("1K", "100K", 4) == [1024, 4096, 16384, 65536]
    assert size_range("4M", "4M", 2) == [4 << 20]
    with pytest.raises(ValueError, match="below"):
        size_range("4M", "4K", 2)
    with pytest.raises(ValueError, match="factor"):
        size_range("4K", "4M", 1)


def test_allreduce_bench_refuses_a_bad_size_before_starting():
    from launch import python

    p = python([str(ROOT / "benchmarks" / "allreduce.py"), "--sizes", "4X"], timeout=120)
    assert p.returncode == 2 and "--sizes: '4X' is not a size" in p.stderr, p.stderr[-2000:]
