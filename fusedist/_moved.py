"""Import paths that moved: `import fusedist.runtime` (and the other old module paths) keeps
working and gives the module at its new path, with a DeprecationWarning that names it. The
finder resolves an old name only when it is imported, so no layer imports another through it."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "fusedist.runtime": "fusedist.distributed.runtime",
    "fusedist.launch_env": "fusedist.distributed.launch_env",
    "fusedist.topology": "fusedist.distributed.topology",
    "fusedist.groups": "fusedist.distributed.groups",
    "fusedist.communicator": "fusedist.comm.communicator",
    "fusedist.symmetric": "fusedist.comm.symmetric",
    "fusedist.nccl": "fusedist.comm.nccl",
    "fusedist.streams": "fusedist.comm.streams",
    "fusedist.comm.engines": "fusedist.ops.gemm_comm",
    "fusedist.comm.engines.base": "fusedist.ops.gemm_comm.base",
    "fusedist.comm.engines.unfused": "fusedist.ops.gemm_comm.unfused",
    "fusedist.comm.engines.overlap": "fusedist.ops.gemm_comm.overlap",
    "fusedist.comm.engines.copy_engine": "fusedist.ops.gemm_comm.copy_engine",
    "fusedist.comm.engines.fused": "fusedist.ops.gemm_comm.fused_sm90",
    "fusedist.comm.engines.decode": "fusedist.ops.gemm_comm.fused_ar",
    "fusedist.ops._attention_decode": "fusedist.ops.attention._decode",
    "fusedist.models.llama.torch_attention": "fusedist.models.llama.baseline",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        warnings.warn(f"{spec.name} moved to {self.new}; import it from there",
                      DeprecationWarning, stacklevel=3)
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # Already loaded at its new path; the import system set __spec__ to the old name's
        # spec, so put the module's own back.
        module.__spec__ = self.spec


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _Alias(new))


def install() -> None:
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        # First: before the path finder would load a moved package's files under the old name.
        sys.meta_path.insert(0, _MovedFinder())
