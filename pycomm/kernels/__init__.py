"""pycomm's kernels and which of them serves a device.

Three sets of kernels run pycomm's arithmetic, with the same bits element for element:

* the CPU ops (``pycomm._C``, csrc/device/cpu_ops.cc) for CPU tensors;
* pycomm's CUDA kernels (``pycomm._C`` of a CUDA build, csrc/cuda/) for CUDA tensors;
* the Triton kernels (``pycomm.kernels.triton``, with the formats and codecs of
  ``pycomm.kernels.numerics``, and ``pycomm.kernels.binned`` for the exact gradient
  accumulator's bins) for CUDA tensors where pycomm was built without nvcc, or where
  PYCOMM_KERNELS=triton asks for them.

Each set is a module with the same functions, the contract of the ``_C`` ones: ``fold``,
``fold_segments``, ``write_stamp``, ``judge_stamps`` (the layered path's steps and the
codecs) and ``add_to_bins``, ``align_bins``, ``merge_bins``, ``value_of_bins`` (the exact
accumulator). This package imports only ``pycomm._C``, torch, triton and its own modules:
the layered path, the public codecs (pycomm.encode, decode), the DDP hooks and the exact
accumulator take their kernels from here, never from one another.
"""
from __future__ import annotations

from .. import _C


def kernels_for(device, choice):
    """The kernels of the layered path and the codecs for tensors on ``device``, a module
    with their four functions: ``_C`` (the CPU ops for CPU tensors; pycomm's CUDA kernels)
    or the Triton kernels, as ``choice`` (PYCOMM_KERNELS: auto, cuda, triton) says for CUDA
    tensors, auto taking the CUDA kernels where pycomm was built with them."""
    if device.type != "cuda" or (choice == "cuda" or (choice == "auto" and _C.has_cuda)):
        if device.type == "cuda" and not _C.has_cuda:
            raise ValueError("pycomm: PYCOMM_KERNELS=cuda, and this pycomm was built without CUDA kernels")
        return _C
    return triton_kernels("CUDA tensors need pycomm's CUDA build or its Triton kernels")


def triton_kernels(need):
    """The Triton kernels; a ValueError that says ``need`` where triton is missing."""
    try:
        from . import triton as kernels
    except ImportError as e:
        raise ValueError(f"pycomm: {need}, and triton cannot be imported ({e}); install it, e.g. "
                         "pip install 'pycomm[triton]'") from e
    return kernels


def triton_for(tensor):
    """The Triton kernels where ``tensor`` is a CUDA tensor that takes them (PYCOMM_KERNELS,
    read at each call, or a build without CUDA kernels), else None: the codecs and the
    compression hook's error feedback then run there instead of in ``_C``."""
    if not tensor.is_cuda:
        return None
    kernels = kernels_for(tensor.device, _C.LayeredConfig().kernels())
    return None if kernels is _C else kernels


def binned_ops(device):
    """The binned-sum operations (add_to_bins, align_bins, merge_bins, value_of_bins) on
    ``device``'s tensors: the C++ ones on the CPU, the Triton kernels on CUDA
    (``pycomm.kernels.binned``, the same bits)."""
    if device.type != "cuda":
        return _C
    try:
        from . import binned
    except ImportError as e:
        raise ValueError(f"pycomm.exact_data_parallel: CUDA parameters need triton ({e}); install it, e.g. "
                         "pip install 'pycomm[triton]'") from e
    return binned


def terms_per_fold(kernels, device):
    """The most terms one fold of ``kernels`` takes on ``device`` (None: any number; the
    CPU ops and the Triton kernel, which loops over runs of terms). A fold of more runs in
    slices, each slice's accumulation handed to the next as a partial term: the same bits
    as one fold, since terms fold left in order and a partial holds the accumulation
    exactly. Exact mode rounds its sum once over every term, so it cannot be sliced: past
    this many ranks its folds run on the Triton kernel, which gives the same bits."""
    return _C.CUDA_FOLD_TERMS if device.type == "cuda" and kernels is _C else None  # (a CUDA build's _C)
