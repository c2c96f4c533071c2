"""Builds pycomm._C against the torch that is already installed (no build isolation).

The C++ core (csrc/core, device, transport, algorithms, runtime) includes no torch header; only
csrc/binding does. The CUDA runtime and kernels (csrc/cuda) are compiled when
PYCOMM_WITH_CUDA allows it: auto (the default) when torch has CUDA and nvcc exists, 1 to
require them, 0 never. PYCOMM_CUDA_ARCH lists the compute capabilities to compile for
(default "90"; e.g. "80;90").
"""
import glob
import os

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
# The binding first: its units, which parse torch's headers, take the longest, and ninja
# starts the units in this order, so that none of them is left running alone at the end.
SOURCE_DIRS = ["binding", "core", "device", "transport", "algorithms", "runtime"]
# -fno-trapping-math: nothing reads floating-point exception flags, so selects between
# float results may compute both sides, which lets the branch-free conversions of
# numerics.h vectorize; every result stays bit for bit the same.
# -g1: line tables for backtraces, not the full debug info that Python's CFLAGS ask for
# with -g (the later flag wins): full debug info of torch's headers made each binding unit
# compile 5x slower and its object 6 MB.
CXX_FLAGS = ["-O3", "-g1", "-std=c++17", "-fno-trapping-math", "-Wall", "-Wno-unused-parameter"]
# No fused multiply-adds: the kernels must round exactly as the CPU path does.
NVCC_FLAGS = ["-O3", "-std=c++17", "-fmad=false"]


def sources(dirs, pattern):
    files = []
    for d in dirs:
        files += sorted(glob.glob(os.path.join("csrc", d, pattern)))
    return files


def with_cuda():
    choice = os.environ.get("PYCOMM_WITH_CUDA", "auto")
    if choice not in ("auto", "0", "1"):
        raise SystemExit("PYCOMM_WITH_CUDA=%r: expected auto, 0 or 1" % choice)
    available = torch.version.cuda is not None and CUDA_HOME is not None
    if choice == "1" and not available:
        raise SystemExit("PYCOMM_WITH_CUDA=1, but %s" % (
            "this torch has no CUDA" if torch.version.cuda is None else "nvcc was not found (CUDA_HOME)"))
    return choice != "0" and available


def cuda_arch_list():
    archs = [a.strip() for a in os.environ.get("PYCOMM_CUDA_ARCH", "90").split(";") if a.strip()]
    if not archs or not all(a.isdigit() and len(a) >= 2 for a in archs):
        raise SystemExit("PYCOMM_CUDA_ARCH=%r: expected compute capabilities such as 90 or 80;90" % archs)
    return ";".join("%s.%s" % (a[:-1], a[-1]) for a in archs)


def extension():
    include = [os.path.join(ROOT, "csrc")]
    if not with_cuda():
        return CppExtension("pycomm._C", sources(SOURCE_DIRS, "*.cc"), include_dirs=include,
                            extra_compile_args=CXX_FLAGS)
    os.environ["TORCH_CUDA_ARCH_LIST"] = cuda_arch_list()
    return CUDAExtension("pycomm._C", sources(SOURCE_DIRS, "*.cc") + sources(["cuda"], "*.cu"),
                         include_dirs=include, define_macros=[("PYCOMM_WITH_CUDA", None)],
                         extra_compile_args={"cxx": CXX_FLAGS, "nvcc": NVCC_FLAGS})


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
