"""Tensor-parallel modules built from fusedist ops."""

from .attention import AttentionMetadata, TPAttention
from .kv_cache import BlockTable, PageAllocator, PagedKVCache, build_block_table, slot_mapping
from .linear import ColumnParallelLinear, RowParallelLinear
from .moe import FP8Experts, MoE

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "TPAttention", "AttentionMetadata",
           "PagedKVCache", "PageAllocator", "BlockTable", "build_block_table", "slot_mapping",
           "MoE", "FP8Experts"]
