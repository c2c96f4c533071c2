"""pycomm's direct API: all-reduce, reduce-scatter and all-gather with per-call options, on
any group: run by the group's pycomm backend where it has one for the tensors' device, else
by pycomm's layered path over the group's backend. Public as ``pycomm.all_reduce`` and the
like; the exact gradient accumulator (pycomm.data_parallel) calls it from here, below the
package's API."""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import _C, layered

ReduceOp = dist.ReduceOp


def group_of(group):
    """``group``, or the default group for None (torch's error where there is none)."""
    pg = group if group is not None else dist.GroupMember.WORLD
    return pg if pg is not None else dist.distributed_c10d._get_default_group()  # raises torch's "not initialized"


def pycomm_backend(group, device):
    """The group's pycomm backend for ``device``, or None where another backend serves it
    (the collectives then take the layered path, that backend moving the bytes)."""
    backend = group._get_backend(torch.device(device))
    return backend if isinstance(backend, _C.ProcessGroupPycomm) else None


def call_options(algorithm, compression, deterministic):
    """The per-call options as the layered path takes them: strings, "" for the group's
    setting."""
    if deterministic is None:
        det = ""
    elif deterministic is True:
        det = "1"
    elif deterministic is False:
        det = "0"
    else:
        det = str(deterministic)
    return (algorithm or "", compression or "", det)


# The direct API. Each call is one call into _C, which runs it on the group's pycomm
# backend (small blocking calls on this thread, without a Work) and returns None when
# blocking, the Work when not; or NotImplemented where the group's backend for the
# tensors' device is another one, which then moves the bytes of pycomm's layered path.

def all_reduce(tensor, op=ReduceOp.SUM, group=None, *, algorithm=None, compression=None,
               deterministic=None, async_op=False):
    """In-place all-reduce of ``tensor`` like ``dist.all_reduce``, with per-call options:
    ``algorithm`` (auto|ring|...), ``compression`` (none|fp16|...), ``deterministic``
    (False|True|"exact"); None takes the group's setting from the environment."""
    group = group_of(group)
    work = _C.all_reduce(group, tensor, op, algorithm, compression, deterministic, async_op)
    if work is NotImplemented:
        return layered.all_reduce(tensor, op, group, *call_options(algorithm, compression, deterministic), async_op)
    return work


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, *, algorithm=None,
                          compression=None, deterministic=None, async_op=False):
    """Like ``dist.reduce_scatter_tensor``, with the per-call options of :func:`all_reduce`."""
    group = group_of(group)
    work = _C.reduce_scatter_tensor(group, output, input, op, algorithm, compression, deterministic, async_op)
    if work is NotImplemented:
        return layered.reduce_scatter_tensor(output, input, op, group,
                                             *call_options(algorithm, compression, deterministic), async_op)
    return work


def all_gather_into_tensor(output, input, group=None, *, algorithm=None, compression=None,
                           deterministic=None, async_op=False):
    """Like ``dist.all_gather_into_tensor``, with the per-call options of :func:`all_reduce`."""
    group = group_of(group)
    work = _C.all_gather_into_tensor(group, output, input, algorithm, compression, deterministic, async_op)
    if work is NotImplemented:
        return layered.all_gather_into_tensor(output, input, group,
                                              *call_options(algorithm, compression, deterministic), async_op)
    return work
