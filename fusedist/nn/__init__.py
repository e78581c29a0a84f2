"""Tensor-parallel modules built from fusedist ops."""

from .linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]
