# Sourced by every fusedist launcher and setup script: the environment every rank needs.
# NVLink multicast (NVLS) stays off: fusedist never uses multicast objects or multimem
# instructions, and NCCL / torch symmetric memory / NVSHMEM must not either on hosts where
# multicast is unsupported or unstable. A value already set is kept, never overwritten.
# The Python side of the same defaults is fusedist.distributed.runtime.SAFE_ENV (applied by init()).
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
export TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}"
export NVSHMEM_DISABLE_NVLS="${NVSHMEM_DISABLE_NVLS:-1}"
