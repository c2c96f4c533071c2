"""pycomm: collective communication for PyTorch.

``import pycomm`` registers the torch.distributed backend ``"pycomm"`` for CPU tensors, so
``dist.init_process_group("pycomm")`` is all a program changes. The direct API below runs
the same collectives with per-call options.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from . import _C

__all__ = ["all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "knobs", "ReduceOp",
           "CODECS", "encode", "decode", "quantize", "compression_error"]

ReduceOp = dist.ReduceOp
BACKEND_NAME = "pycomm"


def _create_backend(dist_opts, backend_opts):
    timeout = dist_opts.timeout
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    return _C.ProcessGroupPycomm(
        dist_opts.store, dist_opts.group_rank, dist_opts.group_size, seconds, str(dist_opts.group_id)
    )


if BACKEND_NAME not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu"])


def knobs():
    """Every environment knob as (name, default, meaning)."""
    return [tuple(k) for k in _C.knobs()]


def _backend_of(group, tensor: torch.Tensor):
    pg = group if group is not None else dist.GroupMember.WORLD
    if pg is None:
        pg = dist.distributed_c10d._get_default_group()  # raises torch's "not initialized"
    backend = pg._get_backend(tensor.device)
    if not isinstance(backend, _C.ProcessGroupPycomm):
        raise ValueError(f"pycomm: the group's backend for {tensor.device} is not pycomm")
    return backend


def _options(algorithm, compression, deterministic):
    if deterministic is None:
        det = ""
    elif deterministic is True:
        det = "1"
    elif deterministic is False:
        det = "0"
    else:
        det = str(deterministic)
    return (algorithm or "", compression or "", det)


def _finish(work, async_op):
    # A blocking call that ran at once comes back as None (done, or it raised).
    if async_op:
        return work
    if work is not None:
        work.wait()
    return None


def all_reduce(tensor, op=ReduceOp.SUM, group=None, *, algorithm=None, compression=None,
               deterministic=None, async_op=False):
    """In-place all-reduce of ``tensor`` like ``dist.all_reduce``, with per-call options:
    ``algorithm`` (auto|ring|...), ``compression`` (none|fp16|...), ``deterministic``
    (False|True|"exact"); None takes the group's setting from the environment."""
    work = _backend_of(group, tensor)._all_reduce(
        tensor, op, *_options(algorithm, compression, deterministic), not async_op)
    return _finish(work, async_op)


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, *, algorithm=None,
                          compression=None, deterministic=None, async_op=False):
    """Like ``dist.reduce_scatter_tensor``, with the per-call options of :func:`all_reduce`."""
    work = _backend_of(group, input)._reduce_scatter_tensor(
        output, input, op, *_options(algorithm, compression, deterministic), not async_op)
    return _finish(work, async_op)


def all_gather_into_tensor(output, input, group=None, *, algorithm=None, compression=None,
                           deterministic=None, async_op=False):
    """Like ``dist.all_gather_into_tensor``, with the per-call options of :func:`all_reduce`."""
    work = _backend_of(group, input)._all_gather_into_tensor(
        output, input, *_options(algorithm, compression, deterministic), not async_op)
    return _finish(work, async_op)


# ---- compression codecs (the same block code the collectives run) ----

CODECS = ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2")


def _block(block):
    return _C.default_compression_block() if block is None else int(block)


def encode(tensor, codec, block=None, out=None):
    """The bytes ``codec`` puts on the wire for ``tensor`` (float32/float16/bfloat16, read
    flat): blocks of ``block`` elements (default PYCOMM_COMPRESSION_BLOCK), each an fp32
    power-of-two scale followed by the codes. Returns a 1-D uint8 tensor (``out`` if
    given)."""
    return _C.encode(tensor, codec, _block(block), out)


def decode(encoded, codec, numel, dtype=torch.float32, block=None, out=None):
    """The values of ``encoded`` (from :func:`encode`) as a flat tensor of ``dtype``
    (``out`` if given)."""
    return _C.decode(encoded, codec, _block(block), int(numel), dtype, out)


def quantize(tensor, codec, block=None):
    """What compression does to ``tensor`` as one rank's contribution: decode(encode(t)),
    in the shape and dtype of ``tensor``. In a compressed all-reduce (ring, oneshot,
    twoshot, tree) every contribution is quantized exactly so, with blocks counted from
    the tensor's first element."""
    return decode(encode(tensor, codec, block), codec, tensor.numel(), tensor.dtype, block).view(tensor.shape)
