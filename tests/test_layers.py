"""tests/check_layers.py (make layer-check) on small trees: an include or an import that goes
up a layer fails, naming its file and line, in C++ and in Python; so does an import cycle
in pycomm/, a deferred import inside a function too; and this checkout passes. No process
but the checker's, no extension needed."""
import os
import pathlib
import subprocess
import sys

CHECKER = pathlib.Path(__file__).resolve().parent / "check_layers.py"
ROOT = CHECKER.parent.parent
CPP = ["core", "device", "binding"]
PYTHON = ["_C", "kernels", "layered", "__init__", "hooks"]


def _tree(tmp_path, files):
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def _check(root, cpp=CPP, python=PYTHON):
    run = subprocess.run([sys.executable, str(CHECKER), "--root", str(root), "--cpp", *cpp, "--python", *python],
                         capture_output=True, text=True, timeout=60)
    return run.returncode, run.stderr


# A tree that keeps every rule: each layer uses only those below it.
GOOD = {
    "csrc/core/types.h": "#pragma once\n",
    "csrc/device/ops.h": '#include "core/types.h"\n',
    "csrc/binding/module.cc": '#include "device/ops.h"\n#include "core/types.h"\n',
    "pycomm/__init__.py": "from . import _C, layered\nfrom .layered import run\n",
    "pycomm/kernels/__init__.py": "from .. import _C\n\n\ndef pick():\n    from . import fast\n    return fast\n",
    "pycomm/kernels/fast.py": "from pycomm import _C\nfrom .numbers import TILE\n",
    "pycomm/kernels/numbers.py": "import torch\n\nTILE = 1024\n",
    "pycomm/layered/__init__.py": "from .run import run\n",
    "pycomm/layered/run.py": "from ..kernels import pick\nfrom . import helpers\n",
    "pycomm/layered/helpers.py": "import pycomm._C\n",
    "pycomm/hooks.py": "import pycomm\nfrom pycomm import kernels\n",
}


def test_a_tree_that_keeps_the_order_passes(tmp_path):
    rc, err = _check(_tree(tmp_path, GOOD))
    assert rc == 0, err


def test_an_include_going_up_fails_naming_file_and_line(tmp_path):
    up = '#include "core/types.h"\n#include "binding/x.h"\n'
    rc, err = _check(_tree(tmp_path, {**GOOD, "csrc/device/ops.h": up}))
    assert rc == 1
    assert 'csrc/device/ops.h:2: #include "binding/x.h": device includes binding, a layer above it' in err


def test_an_import_going_up_fails_naming_file_and_line(tmp_path):
    # Each form of import: absolute, relative to the package and to its parent, deferred.
    for name, text, offence in [
            ("pycomm/kernels/numbers.py", "import torch\nfrom pycomm.layered import run\n",
             "pycomm/kernels/numbers.py:2: from pycomm.layered import run: kernels imports layered"),
            ("pycomm/kernels/numbers.py", "import pycomm.hooks\n",
             "pycomm/kernels/numbers.py:1: import pycomm.hooks: kernels imports hooks"),
            ("pycomm/kernels/fast.py", "from .. import layered\n",
             "pycomm/kernels/fast.py:1: from .. import layered: kernels imports layered"),
            ("pycomm/layered/helpers.py", "def late():\n    from .. import hooks\n",
             "pycomm/layered/helpers.py:2: from .. import hooks: layered imports hooks"),
            ("pycomm/layered/helpers.py", "def late():\n    import pycomm\n",
             "pycomm/layered/helpers.py:2: import pycomm: layered imports __init__")]:
        rc, err = _check(_tree(tmp_path, {**GOOD, name: text}))
        assert rc == 1 and offence + ", a layer above it" in err, (name, text, err)
        _tree(tmp_path, {name: GOOD[name]})
    assert _check(tmp_path)[0] == 0


def test_an_import_cycle_fails_within_a_layer_and_through_a_function(tmp_path):
    # kernels.fast -> kernels.numbers -> kernels.fast: one layer, every import allowed by the
    # order, the cycle closed by an import inside a function.
    rc, err = _check(_tree(tmp_path, {**GOOD, "pycomm/kernels/numbers.py": "def f():\n    from .fast import g\n"}))
    assert rc == 1
    assert "import cycle pycomm.kernels.fast -> pycomm.kernels.numbers -> pycomm.kernels.fast" in err
    assert "pycomm/kernels/numbers.py:2: from .fast import g" in err


def test_a_file_outside_the_layers_fails(tmp_path):
    rc, err = _check(_tree(tmp_path, {**GOOD, "pycomm/extra.py": "", "csrc/extra/a.h": ""}))
    assert rc == 1
    assert "pycomm/extra.py: extra is not a layer" in err and "csrc/extra/a.h: csrc/extra/ is not a layer" in err


def test_this_checkout_keeps_its_layers():
    """make layer-check, with the orders the Makefile states, on this checkout."""
    run = subprocess.run(["make", "--no-print-directory", "-s", "layer-check", f"PYTHON={sys.executable}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env={**os.environ, "MAKEFLAGS": ""})
    assert run.returncode == 0, run.stdout + run.stderr
    assert "every Python import follows" in run.stdout
