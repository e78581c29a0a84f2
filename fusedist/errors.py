"""Exceptions raised by fusedist. Argument errors are plain ValueError/TypeError whose message
names the function, the argument and the fix; these classes are for everything else."""

from __future__ import annotations


class FusedistError(RuntimeError):
    """Base class of fusedist's runtime errors."""


class NotInitializedError(FusedistError):
    """fusedist.init() was not called, or fusedist.shutdown() already ran."""


class ExtensionMissingError(FusedistError, ImportError):
    """The CUDA extension fusedist._C is not built or cannot be loaded."""


class ExtensionMismatchError(FusedistError):
    """The compiled fusedist._C was built from another version of fusedist (a stale build):
    rebuild it from this checkout. Not an ImportError, so that no fallback swallows it."""


class PeerAccessError(FusedistError):
    """Symmetric memory cannot be set up: peers are on other nodes or P2P is unavailable."""


class NcclUnavailableError(FusedistError):
    """nccl4py or libnccl is missing where a GPU op needs NCCL."""


class CommunicatorTimeoutError(FusedistError):
    """A symmetric-memory kernel waited longer than the timeout for a peer."""


class CollectiveMismatchError(FusedistError):
    """Ranks of a group disagree: they called a collective with another op, dtype or size, or
    created a communicator with different sizes or timeouts. The message names every rank's
    call (or values)."""


class RendezvousError(FusedistError, TimeoutError):
    """fusedist.init() could not bring the ranks together within its timeout: the rendezvous
    address is unreachable or unresolvable, or some ranks never arrived."""


class PeerLostError(FusedistError):
    """A collective of a group failed because a peer is gone (its process exited: the message
    names its rank) or stopped answering within the timeout. The group cannot be used again."""


class CommunicatorClosedError(FusedistError):
    """The communicator was closed (or broke after a timeout) and cannot be used."""


class MetadataError(FusedistError, ValueError):
    """A kernel met metadata it must not follow (a page id outside the cache, a sequence longer
    than its block-table row, a slot or position out of range, an expert id or a MoE layout
    index out of range). The kernel touched no memory
    outside its tensors and poisoned the affected outputs with NaN; the message names the op,
    the row and the value. Raised at the next check after the kernel ran; the record stays set
    until fusedist.clear_device_errors()."""


class RequestMismatchError(CollectiveMismatchError, ValueError):
    """Ranks of a tensor-parallel group were handed different requests (Runner.generate: other
    prompts, sampling parameters, limits or stop ids). The message names each differing field
    and every rank's value. Also a ValueError: the input is what is wrong."""


class NonFiniteError(FusedistError, FloatingPointError):
    """A model produced NaN logits (Runner.generate / stream, LLM): there is no next token to
    sample. The message names the sequences and the step; the usual causes are weights that
    are not finite or an activation that overflowed its dtype (float16)."""
