"""Compiling pycomm's Triton kernels for sm_90 without a GPU (Triton compiles for a named
target), so that tests can check their PTX: what each kernel was launched with is
recorded by a stand-in (Launches), then compiled in a process of its own (a process that
imported Triton to interpret holds interpreted functions of triton.language, which the
compiler cannot call), one for all of a test's kernels (it imports torch and Triton:
seconds of CPU)."""

import json
import os
import pickle
import re
import subprocess
import sys

import pytest

# Approximate division or reciprocal, fused multiply-adds, and arithmetic that flushes
# subnormals to zero: what the CPU ops never do.
INEXACT_PTX = re.compile(r"\b(?:div\.(?:full|approx)|rcp\.approx|fma\.|mad(?:\.[a-z]+)*\.f(?:16|32|64)"
                         r"|[a-z]+\.(?:[a-z]+\.)*ftz)[\w.]*")

# Reads (kernel "module:name", its launches' (args, kwargs)) pairs as a pickle,
# specializes each launch as Triton's launcher does, writes (kernel, PTX) pairs. argv[1]:
# the sys.path to find pycomm on, as JSON.
_COMPILE = """
import importlib, json, pickle, sys
sys.path[:] = json.loads(sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

target = GPUTarget("cuda", 90, 32)
backend = make_backend(target)
ptx = []
for name, calls in pickle.load(sys.stdin.buffer):
    module, attribute = name.split(":")
    kernel = getattr(importlib.import_module(module), attribute)
    bind = create_function_from_signature(kernel.signature, kernel.params, backend)
    for args, kwargs in calls:
        bound, specialization, options = bind(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
        source = ASTSource(kernel, signature, constexprs, attrs)
        ptx.append((name, triton.compile(source, target=target, options=options.__dict__).asm["ptx"]))
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


def compile_sm90(launches):
    """(kernel, PTX) of each recorded launch for sm_90, in order: ``launches`` maps each
    kernel ("module:name") to its Launches."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    calls = [(kernel, recorded.calls) for kernel, recorded in launches.items()]
    child = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(sys.path)], env=env,
                           capture_output=True, input=pickle.dumps(calls), timeout=300)
    assert child.returncode == 0, child.stderr.decode()[-6000:]
    return pickle.loads(child.stdout)
