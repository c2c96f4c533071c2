"""Compiling pycomm's Triton kernels for sm_90 without a GPU (Triton compiles for a named
target), so that tests can check their PTX: what each kernel was launched with is
recorded by a stand-in (Launches), then compiled in a process of its own (a process that
imported Triton to interpret holds interpreted functions of triton.language, which the
compiler cannot call)."""

import json
import os
import pickle
import re
import subprocess
import sys

import pytest

# Approximate division or reciprocal, and fused multiply-adds: what the CPU ops never do.
INEXACT_PTX = re.compile(r"\b(?:div\.(?:full|approx)|rcp\.approx|fma\.|mad(?:\.[a-z]+)*\.f(?:16|32|64))[\w.]*")

# Reads launches' (args, kwargs) as a pickle, specializes them as Triton's launcher does,
# writes their PTX. argv[1]: the sys.path to find pycomm on, as JSON; argv[2]: the
# kernel, "module:name".
_COMPILE = """
import importlib, json, pickle, sys
sys.path[:] = json.loads(sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

module, name = sys.argv[2].split(":")
kernel = getattr(importlib.import_module(module), name)
target = GPUTarget("cuda", 90, 32)
backend = make_backend(target)
bind = create_function_from_signature(kernel.signature, kernel.params, backend)
ptx = []
for args, kwargs in pickle.load(sys.stdin.buffer):
    bound, specialization, options = bind(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    source = ASTSource(kernel, signature, constexprs, attrs)
    ptx.append(triton.compile(source, target=target, options=options.__dict__).asm["ptx"])
pickle.dump(ptx, sys.stdout.buffer)
"""


class Launches:
    """Stands in for a kernel: records the arguments of each launch."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def skip_without_compiler():
    try:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import get_ptxas
        from triton.compiler import make_backend
        make_backend(GPUTarget("cuda", 90, 32))
        get_ptxas(90)
    except (ImportError, RuntimeError) as e:
        pytest.skip(f"Triton's CUDA compiler is not available: {e}")


def compile_sm90(kernel, launches):
    """The PTX of each recorded launch of ``kernel`` ("module:name") for sm_90."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    child = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(sys.path), kernel], env=env,
                           capture_output=True, input=pickle.dumps(launches.calls), timeout=300)
    assert child.returncode == 0, child.stderr.decode()[-6000:]
    return pickle.loads(child.stdout)
