"""The two-level workers in one job: the checks of worker_hierarchical.py, worker_fp8_comm.py
and worker_hierarchical_ops.py, in that order, on one runtime made as worker_hierarchical_ops.py
makes it (the tensor-parallel group is the world, spanning nodes). The first two build their
communicators over the world and never read the runtime's groups, so their checks are the same
as in their own runs. tests/test_netns_nodes.py starts this once in two network namespaces:
one launch (two torchrun agents and four interpreters) instead of three."""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _checks import main  # noqa: E402
from _runtime_util import emulate_nodes  # noqa: E402

import fusedist  # noqa: E402

# Importing a worker registers its checks (tests/dist/_checks.py CHECKS), in import order.
import worker_hierarchical  # noqa: E402,F401
import worker_fp8_comm  # noqa: E402,F401
import worker_hierarchical_ops  # noqa: E402,F401

if __name__ == "__main__":
    emulate_nodes()
    os.environ.setdefault("NCCL_HOSTID", os.environ["FUSEDIST_NODE_ID"])
    main(tp_size=fusedist.detect_launch_env().world_size, tp_spans_nodes=True)
