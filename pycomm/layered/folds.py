"""The layered path's folds by device: the kernels that reduce, encode and decode its
terms (``_C.fold``'s contract) for CPU or CUDA tensors, and how many terms one of their
calls takes."""
from __future__ import annotations

import torch

from .. import _C


def kernels_for(device):
    """The fold (``_C.fold``'s contract) for tensors on ``device``: the CPU ops for CPU
    tensors; for CUDA tensors, pycomm's CUDA kernels or its Triton kernels as
    PYCOMM_KERNELS (auto, cuda, triton) says, auto taking the CUDA kernels where pycomm
    was built with them."""
    choice = _C.kernel_choice() if device.type == "cuda" else "cpu"
    if device.type != "cuda" or (choice == "cuda" or (choice == "auto" and _C.has_cuda)):
        if device.type == "cuda" and not _C.has_cuda:
            raise ValueError("pycomm: PYCOMM_KERNELS=cuda, and this pycomm was built without CUDA kernels")
        return _C.fold
    return _triton_fold("CUDA tensors need pycomm's CUDA build or its Triton kernels")


def _triton_fold(need):
    """The Triton kernels' fold; a ValueError that says ``need`` where triton is missing."""
    try:
        from .. import triton_kernels
    except ImportError as e:
        raise ValueError(f"pycomm: {need}, and triton cannot be imported ({e}); install it, e.g. "
                         "pip install 'pycomm[triton]'") from e
    return triton_kernels.fold


# The type a fold's partial values are kept in (Stage.Partial): 16-bit floats accumulate in
# float32, bool in uint8, everything else in its own type.
PARTIAL_DTYPES = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.bool: torch.uint8}
# The most terms one launch of pycomm's CUDA kernels folds (their parameter holds 64).
CUDA_FOLD_TERMS = 64


def terms_per_fold(kernel, device):
    """The most terms one call of ``kernel`` folds on ``device`` (None: any number; the
    CPU ops and the Triton kernel, which loops over runs of terms). A fold of more runs in
    slices, each slice's accumulation handed to the next as a partial term: the same bits
    as one fold, since terms fold left in order and a partial holds the accumulation
    exactly. Exact mode rounds its sum once over every term, so it cannot be sliced: past
    this many ranks its folds run on the Triton kernel, which gives the same bits."""
    return CUDA_FOLD_TERMS if device.type == "cuda" and kernel is _C.fold else None
