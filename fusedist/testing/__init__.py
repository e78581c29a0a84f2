"""Test support: several ranks emulated on one GPU (emulated.py). Above every other layer:
nothing in fusedist imports it."""

from .emulated import (EmulatedGroup, EmulatedNccl, EmulatedSymmetricMemory, EmulationError,
                       EmulationTimeoutError, RankError, capture_graph, run_ranks)

__all__ = ["run_ranks", "EmulatedGroup", "EmulatedSymmetricMemory", "EmulatedNccl",
           "EmulationError", "EmulationTimeoutError", "RankError", "capture_graph"]
