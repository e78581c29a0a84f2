"""TPAttention / PagedKVCache: TP 1 in process (CPU; GPU under the gpu marker) and TP 2 over
gloo (tests/dist/worker_attention.py) against a float64 attention layer with the full
weights; kv-head sharding and replication; the cache helpers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(TESTS / "dist"))
from launch import assert_passed, torchrun  # noqa: E402
from tolerances import GEMM_REL  # noqa: E402
import worker_attention as W  # noqa: E402

from fusedist.nn import (AttentionMetadata, BlockTable, PageAllocator, PagedKVCache,  # noqa: E402
                         TPAttention, build_block_table, slot_mapping)
from fusedist.nn.attention import kv_head_range  # noqa: E402

CPU_ENV = {"CUDA_VISIBLE_DEVICES": ""}
FP8 = getattr(torch, "float8_e4m3fn", None)


def _seed():
    return int(torch.randint(1 << 30, ()))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("cfg", W.CONFIGS, ids=[f"h{c[1]}kv{c[2]}d{c[3]}" for c in W.CONFIGS])
def test_tp1_matches_full_layer(device, cfg):
    dtypes = (torch.float32, torch.bfloat16) if device == "cpu" else (torch.bfloat16,
                                                                     torch.float16)
    for dtype in dtypes:
        err = W.run_scenario(cfg, dtype, device, _seed())
        assert err <= GEMM_REL[dtype], f"{cfg} {dtype}: relative error {err:.3g}"


@pytest.mark.skipif(FP8 is None, reason="torch without float8_e4m3fn")
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_tp1_fp8_cache(device):
    err = W.run_scenario(W.CONFIGS[0], torch.bfloat16, device, _seed(), kv_dtype=FP8)
    assert err <= GEMM_REL[torch.bfloat16], f"fp8 cache: relative error {err:.3g}"


@pytest.mark.timeout(600)
def test_tp2_cpu_torchrun():
    assert_passed(torchrun("worker_attention.py", 2, CPU_ENV), 2)


@pytest.mark.gpu2
@pytest.mark.timeout(900)
def test_tp2_gpu():
    assert_passed(torchrun("worker_attention.py", 2, timeout=850), 2)


def test_kv_head_sharding():
    assert [kv_head_range(8, 2, r) for r in range(2)] == [(0, 4), (4, 8)]
    assert [kv_head_range(2, 8, r) for r in range(8)] == [(0, 1)] * 4 + [(1, 2)] * 4
    assert [kv_head_range(1, 4, r) for r in range(4)] == [(0, 1)] * 4
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        kv_head_range(3, 4, 0)
    with pytest.raises(ValueError, match="not divisible"):
        kv_head_range(6, 4, 0)
    # every rank's q heads read the kv head it holds
    for H, Hkv, tp in ((32, 8, 2), (32, 8, 8), (32, 4, 8), (64, 8, 16), (8, 1, 8)):
        for r in range(tp):
            first, last = kv_head_range(Hkv, tp, r)
            hq = H // tp
            for h in range(r * hq, (r + 1) * hq):
                assert first <= h // (H // Hkv) < last, (H, Hkv, tp, r, h)


def test_load_full_bad_shapes():
    attn = TPAttention(64, 4, 2, dtype=torch.float32)
    w = torch.zeros(64, 64)
    with pytest.raises(ValueError, match="k_w must be"):
        attn.load_full(w, w, w, w)
    with pytest.raises(ValueError, match="qkv_bias"):
        attn.load_full(w, w[:32], w[:32], w, q_b=torch.zeros(64))


def test_metadata_checks():
    t = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="mode must be"):
        AttentionMetadata("train", t, t[0], t[0].long())
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        AttentionMetadata("prefill", t, t[0], t[0].long())


def test_paged_cache_and_helpers():
    c = PagedKVCache(3, 2, 64, 10, page_size=16, dtype=torch.bfloat16)
    assert c.k[1].shape == (10, 16, 2, 64) and c.k[1].is_contiguous() and c.k_scale[1] is None
    assert c.k[2].data_ptr() - c.k[1].data_ptr() == 10 * 16 * 2 * 64 * 2
    if FP8 is not None:
        f = PagedKVCache(2, 2, 64, 4, 16, torch.bfloat16, kv_dtype=FP8)
        assert f.k[0].dtype == FP8 and f.k_scale[0].shape == (4, 16, 2)
        per = PagedKVCache.bytes_per_page(2, 2, 64, 16, FP8)
        assert per == 2 * 2 * 16 * 2 * (64 + 4)
        g = PagedKVCache.from_budget(per * 7 + 5, 2, 2, 64, 16, torch.bfloat16, kv_dtype=FP8)
        assert g.num_pages == 7 and g.nbytes == per * 7
    with pytest.raises(ValueError, match="hold no page"):
        PagedKVCache.from_budget(100, 2, 2, 64)
    a = PageAllocator(4)
    assert a.allocate(2) == [0, 1] and a.num_free == 2
    a.free([0])
    assert a.allocate(1) == [0]
    with pytest.raises(RuntimeError, match="requested"):
        a.allocate(3)
    with pytest.raises(ValueError, match="not allocated"):
        a.free([3])
    assert slot_mapping([5, 2], [0, 15, 16, 17], 16).tolist() == [80, 95, 32, 33]
    with pytest.raises(ValueError, match="needs page"):
        slot_mapping([5], [16], 16)
    bt = build_block_table([[3], [1, 2]], 4, pad=0)
    assert bt.dtype == torch.int32 and bt.tolist() == [[3, 0, 0, 0], [1, 2, 0, 0]]
    table = BlockTable(PageAllocator(8), 4, max_batch=3, max_pages_per_seq=3)
    table.add("a")
    table.add("b")
    assert table.append("a", 5) == [0, 1, 2, 3, 4]
    assert table.append("b", 1) == [8]
    assert table.append("a", 1) == [5]
    assert table.tensor().tolist() == [[0, 1, 0], [2, 0, 0], [0, 0, 0]]
    assert table.seq_lens().tolist() == [6, 1, 0]
    with pytest.raises(ValueError, match="max_pages_per_seq"):
        table.append("b", 12)
    table.remove("a")
    assert table.tensor(rows=1).tolist() == [[2, 0, 0]]
