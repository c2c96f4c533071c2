"""FSDP2 with pycomm's reductions: gradients reduce-scattered deterministically or
compressed, over whatever group FSDP shards on (nccl, gloo, or a pycomm group).

Usage, one line after ``fully_shard``::

    fully_shard(layer) for each layer; fully_shard(model)
    pycomm.fsdp.use_reduce_scatter(model, deterministic="exact")   # or compression="fp8_e4m3"

FSDP calls the comm with the op and divide factor it chose (AVG, SUM after a pre-divide,
or PREMUL_SUM); pycomm honours each, through ``pycomm.reduce_scatter_tensor``: natively on
a pycomm group, on the layered path (pycomm.layered) on any other.
"""
from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _Comm

import pycomm

__all__ = ["ReduceScatter", "use_reduce_scatter"]


class ReduceScatter(_Comm):
    """FSDP2's reduce-scatter comm (``FSDPModule.set_custom_reduce_scatter``) running
    ``pycomm.reduce_scatter_tensor(..., compression=, deterministic=)``; None takes the
    group's setting (PYCOMM_COMPRESSION, PYCOMM_DETERMINISTIC)."""

    def __init__(self, *, compression=None, deterministic=None):
        self.compression, self.deterministic = compression, deterministic

    def __repr__(self):
        return f"pycomm.fsdp.ReduceScatter(compression={self.compression!r}, deterministic={self.deterministic!r})"

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        return pycomm.reduce_scatter_tensor(output_tensor, input_tensor, op, group, compression=self.compression,
                                            deterministic=self.deterministic, async_op=async_op)


def use_reduce_scatter(module, *, compression=None, deterministic=None):
    """Installs one :class:`ReduceScatter` on every FSDP module in ``module`` (``module``
    included) and returns it. Raises ValueError where ``module`` holds no FSDP module."""
    comm = ReduceScatter(compression=compression, deterministic=deterministic)
    sharded = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not sharded:
        raise ValueError("pycomm.fsdp: the module holds no FSDP module; call fully_shard first")
    for m in sharded:
        m.set_custom_reduce_scatter(comm)
    return comm
