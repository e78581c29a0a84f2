"""fusedist: communication/compute overlap for tensor-parallel LLM inference.

    import fusedist
    rt = fusedist.init()                      # torchrun / mpirun / srun / explicit
    y = fusedist.all_reduce(x)                # over the tensor-parallel group
    normed, res = fusedist.all_reduce_add_rmsnorm(x, res, w, 1e-6)
    normed, res = fusedist.add_rmsnorm(x, res, w, 1e-6)   # one GPU: res += x in place, then norm
    fusedist.shutdown()

Importing fusedist needs neither a GPU, nor libnccl, nor the compiled extension: CPU
tensors take the plain-torch reference path over gloo.
"""

from . import _moved
from ._version import __version__
from .comm import c10d as _c10d  # registers the torch.distributed backend "fusedist"
from .comm.communicator import Communicator, get_communicator
from .errors import (CollectiveMismatchError, CommunicatorClosedError, CommunicatorTimeoutError,
                     ExtensionMismatchError, ExtensionMissingError, FusedistError, MetadataError,
                     NcclUnavailableError, NonFiniteError, NotInitializedError, PeerAccessError,
                     PeerLostError, RendezvousError, RequestMismatchError)
from .comm.fp8 import Fp8Communicator, fp8_all_gather, fp8_all_reduce
from .comm.hierarchical import HierarchicalCommunicator
from .comm.streams import AsyncHandle, comm_stream
from .distributed.groups import Group
from .distributed.launch_env import LaunchEnv, LaunchEnvError, detect_launch_env
from .distributed.runtime import Runtime, get_runtime, init, is_initialized, shutdown
from .distributed.topology import Topology
from .ops import (add_rmsnorm, ag_gemm, all_reduce, all_reduce_, all_reduce_add_rmsnorm,
                  check_device_errors, clear_device_errors, gemm, gemm_ar, gemm_rs, rmsnorm,
                  silu_mul)

_moved.install()   # old module paths (fusedist.runtime, ...) resolve to their new homes

__all__ = [
    "__version__", "init", "shutdown", "is_initialized", "get_runtime", "Runtime", "Topology",
    "Group", "Communicator", "get_communicator", "all_reduce", "all_reduce_",
    "all_reduce_add_rmsnorm", "gemm", "ag_gemm", "gemm_rs", "gemm_ar", "add_rmsnorm", "rmsnorm",
    "silu_mul", "AsyncHandle", "HierarchicalCommunicator", "Fp8Communicator",
    "fp8_all_reduce", "fp8_all_gather",
    "comm_stream", "LaunchEnv", "LaunchEnvError",
    "detect_launch_env", "FusedistError", "NotInitializedError", "ExtensionMissingError", "ExtensionMismatchError",
    "PeerAccessError", "NcclUnavailableError", "CommunicatorTimeoutError",
    "CommunicatorClosedError", "CollectiveMismatchError", "RequestMismatchError",
    "PeerLostError", "RendezvousError", "MetadataError", "NonFiniteError", "check_device_errors",
    "clear_device_errors",
]
