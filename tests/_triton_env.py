"""Where the Triton kernel tests run, imported by them before anything imports Triton: in
Triton's interpreter on this CPU (TRITON_INTERPRET=1, which Triton reads when its kernels
are defined), or on a GPU's compiled kernels where PYCOMM_TRITON_ON_GPU=1 (the GPU check)."""

import os

import pytest

ON_GPU = os.environ.get("PYCOMM_TRITON_ON_GPU") == "1"
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
# Where the Triton side's operands live: the interpreter reads host memory.
DEVICE = "cuda" if ON_GPU else "cpu"

# The interpreter computes in numpy, which warns where a float32 product overflows to
# infinity (values past a codec's range) or an operation makes a NaN (inf - inf of the
# special inputs), as the kernels mean it to.
NUMPY_WARNINGS = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
                  pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]
