"""The layered path's kernels by device: the set of functions that fold a call's terms
(``_C.fold``'s contract), run a codec's step over every segment of a call at once
(``fold_segments``) and write and judge its stamps (``write_stamp``, ``judge_stamps``), for
CPU or CUDA tensors; and how many terms one fold takes."""
from __future__ import annotations

import torch

from .. import _C


def kernels_for(device, choice):
    """The kernels for tensors on ``device``, a module with the four functions: ``_C`` (the
    CPU ops for CPU tensors; pycomm's CUDA kernels) or ``triton_kernels``, as ``choice``
    (PYCOMM_KERNELS: auto, cuda, triton) says for CUDA tensors, auto taking the CUDA
    kernels where pycomm was built with them."""
    if device.type != "cuda" or (choice == "cuda" or (choice == "auto" and _C.has_cuda)):
        if device.type == "cuda" and not _C.has_cuda:
            raise ValueError("pycomm: PYCOMM_KERNELS=cuda, and this pycomm was built without CUDA kernels")
        return _C
    return triton_kernels("CUDA tensors need pycomm's CUDA build or its Triton kernels")


def triton_kernels(need):
    """The Triton kernels; a ValueError that says ``need`` where triton is missing."""
    try:
        from .. import triton_kernels as kernels
    except ImportError as e:
        raise ValueError(f"pycomm: {need}, and triton cannot be imported ({e}); install it, e.g. "
                         "pip install 'pycomm[triton]'") from e
    return kernels


# The type a fold's partial values are kept in (Stage.Partial): 16-bit floats accumulate in
# float32, bool in uint8, everything else in its own type.
PARTIAL_DTYPES = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.bool: torch.uint8}
# The most terms one launch of pycomm's CUDA kernels folds (their parameter holds 64).
CUDA_FOLD_TERMS = 64


def terms_per_fold(kernels, device):
    """The most terms one fold of ``kernels`` takes on ``device`` (None: any number; the
    CPU ops and the Triton kernel, which loops over runs of terms). A fold of more runs in
    slices, each slice's accumulation handed to the next as a partial term: the same bits
    as one fold, since terms fold left in order and a partial holds the accumulation
    exactly. Exact mode rounds its sum once over every term, so it cannot be sliced: past
    this many ranks its folds run on the Triton kernel, which gives the same bits."""
    return CUDA_FOLD_TERMS if device.type == "cuda" and kernels is _C else None
