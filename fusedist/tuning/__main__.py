"""python -m fusedist.tuning: which kernel runs for a shape, and why (docs/tuning.md).

    python -m fusedist.tuning --explain "fp8_linear m=16 n=28672 k=4096 layout=channel"
    python -m fusedist.tuning --explain "decode batch=1 heads=32/8 context=32768"
    python -m fusedist.tuning --caps        # what this build of fusedist._C holds
    python -m fusedist.tuning --table       # the merged tuning table and its sources

The plans are the ops' own (fusedist.ops.explain); on a machine without a GPU they are made
for the GPU model the table was measured on, with every kernel of the build assumed present.
"""

from __future__ import annotations

import importlib
import sys

if __name__ == "__main__":
    # The command line hands over to the ops' explainer by name: the table is core and no
    # module of it depends on the ops that read it (this file is run, never imported).
    sys.exit(importlib.import_module("fusedist.ops.explain").main(sys.argv[1:]))
