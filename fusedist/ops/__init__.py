"""Public functional ops (also registered as torch.ops.fusedist.*)."""

from .allreduce import all_reduce, all_reduce_
from .allreduce_rmsnorm import all_reduce_add_rmsnorm, rmsnorm_reference
from .gemm import gemm
from .gemm_comm import ag_gemm, gemm_ar, gemm_rs

__all__ = ["all_reduce", "all_reduce_", "all_reduce_add_rmsnorm", "rmsnorm_reference",
           "gemm", "ag_gemm", "gemm_rs", "gemm_ar"]
