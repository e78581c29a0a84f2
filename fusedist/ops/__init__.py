"""Public functional ops (also registered as torch.ops.fusedist.*)."""

from .add_rmsnorm import add_rmsnorm, rmsnorm, rmsnorm_reference
from .allreduce import all_reduce, all_reduce_
from .allreduce_rmsnorm import all_reduce_add_rmsnorm
from .attention import DecodePlan, decode, decode_plan, prefill, rope_append, rope_cos_sin
from .device_errors import check_device_errors, clear_device_errors
from .gemm import gemm
from .fp8_linear import FP8Weight, fp8_linear, quantize_fp8
from .gemm_comm import ag_gemm, gemm_ar, gemm_rs
from .gemv import gemv, gemv_reference
from .quantize_rows import quantize_groups, quantize_rows
from .silu_mul import silu_mul

__all__ = ["check_device_errors", "clear_device_errors", "all_reduce", "all_reduce_", "all_reduce_add_rmsnorm", "rmsnorm_reference",
           "gemm", "fp8_linear", "FP8Weight", "quantize_fp8", "ag_gemm", "gemm_rs", "gemm_ar", "gemv", "gemv_reference",
           "rope_cos_sin", "rope_append", "DecodePlan", "decode_plan", "decode", "prefill",
           "add_rmsnorm", "rmsnorm", "silu_mul", "quantize_rows", "quantize_groups"]
