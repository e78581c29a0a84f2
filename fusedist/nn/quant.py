"""FP8 weights in the layers: the parameter type and its quantizers, re-exported from the op
that multiplies them (fusedist.ops.fp8_linear: FP8Weight, quantize_fp8, fp8_linear and its
dispatch). fusedist.nn holds parameters and calls ops; the choice of kernel is the op's."""

from ..ops.fp8_linear import *  # noqa: F401,F403 - this module's public names are the op's
from ..ops.fp8_linear import __all__  # noqa: F401
from ..ops.fp8_linear import (BLOCKWISE_PROBE, _DEVICE, _device_facts,  # noqa: F401
                              _probe_blockwise, quantize_groups)
