"""pycomm: collective communication for PyTorch.

``import pycomm`` registers the torch.distributed backend ``"pycomm"`` for CPU tensors (and
CUDA tensors in a CUDA build), so ``dist.init_process_group("pycomm")`` is all a program
changes. The direct API below runs the same collectives with per-call options.
"""
from __future__ import annotations

import json
import sys
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from . import _C, direct, kernels, layered
from .direct import ReduceOp, all_gather_into_tensor, all_reduce, reduce_scatter_tensor

__all__ = ["ProcessGroupPycomm", "Options", "all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "knobs",
           "ReduceOp", "stats", "flight_recorder", "dump_flight_recorder",
           "CODECS", "encode", "decode", "quantize", "compression_error", "exact_data_parallel"]

BACKEND_NAME = "pycomm"


# A group built from a store, without init_process_group (as torch's ProcessGroupGloo):
# ProcessGroupPycomm(store, rank, size, timeout=timedelta(minutes=30), group_name="pycomm",
# options=Options()), for libraries that make their own groups (torchft). Its collectives
# are torch's Backend API: pg.allreduce([t]).wait().
ProcessGroupPycomm = _C.ProcessGroupPycomm


class Options(dict):
    """Knob settings of one group, over the environment's: ``Options(verify=3)`` is
    ``PYCOMM_VERIFY=3`` for the group it is given to, as ``pg_options`` of
    ``dist.init_process_group("pycomm", ...)`` and ``dist.new_group(...)``, or ``options``
    of :class:`ProcessGroupPycomm`. Any knob of :func:`knobs`, named without ``PYCOMM_``
    in lower case; True and False read as 1 and 0. A dict of knob names and values; an
    unknown name or a bad value fails the group's creation (ValueError)."""

    def __init__(self, **settings):
        super().__init__({"PYCOMM_" + name.upper(): str(int(v)) if isinstance(v, bool) else str(v)
                          for name, v in settings.items()})


def _create_backend(dist_opts, backend_opts):
    if backend_opts is not None and not isinstance(backend_opts, Options):
        raise TypeError("pycomm: pg_options must be a pycomm.Options, got %s" % type(backend_opts).__name__)
    timeout = dist_opts.timeout
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    backend = ProcessGroupPycomm(dist_opts.store, dist_opts.group_rank, dist_opts.group_size, seconds,
                                 str(dist_opts.group_id), backend_opts or {})
    devices = _devices_of_pycomm_group(sys._getframe(1))
    if devices:
        return _C.PycommProcessGroup(dist_opts.store, dist_opts.group_rank, dist_opts.group_size, backend, devices)
    return backend


def _devices_of_pycomm_group(caller):
    """The devices of the group being created when pycomm serves every one of them, else
    None. Such a group is made a PycommProcessGroup, which torch keeps as the group itself
    and which is named "pycomm" where torch and DDP read a group's name; a group that
    mixes backends ("cpu:pycomm,cuda:nccl") stays torch's own, named "custom".

    No public hook tells the two apart: torch hands a creator neither the group nor its
    device map (_DistributedBackendOptions holds the store, ranks, timeout and group name),
    and calls it alike for "pycomm" and for "cpu:pycomm,cuda:nccl". Its group helper, the
    caller, holds the map as ``backend_config``, read there. Where a torch no longer has it,
    the group stays torch's own and a RuntimeWarning says so; tests/test_gloo_parity.py
    fails on such a torch (the name it checks becomes "custom")."""
    config = caller.f_locals.get("backend_config") if caller.f_code.co_name == "_new_process_group_helper" else None
    try:
        device_map = config.get_device_backend_map()
    except AttributeError:
        warnings.warn("pycomm: torch's group helper no longer shows the group's device map (backend_config in "
                      "_new_process_group_helper): this group is torch's own ProcessGroup, named 'custom' where "
                      "torch and DDP read a group's name", RuntimeWarning, stacklevel=3)
        return None
    if not device_map or any(name != BACKEND_NAME for name in device_map.values()):
        return None
    return [torch.device(device) for device in device_map]


def _shrunk_group_of(create):
    """torch's builder of the group that shrink_group returns, ``create``, made to return a
    PycommProcessGroup where the new backend is pycomm's: a group that serves every device
    pycomm served in the group shrunk and is named "pycomm", as that one was.

    torch's own builder (_create_shrunk_process_group) registers the new backend of a group
    not bound to a CUDA device under BackendType GLOO, for the CPU alone, so the group names
    itself "gloo". DDP's logger, on a group so named, takes its GLOO backend for a
    ProcessGroupGloo (a static_cast) and reads the thread count through that class's
    options pointer: from a pycomm backend, bytes of another member taken for a pointer,
    a segmentation fault. The builder's result is rebuilt here because torch offers no
    later hook: shrink_group registers what the builder returns as the new group (the new
    default group where the default one was shrunk), and every call of shrink_group, under
    whichever name it was imported, passes through this module attribute."""

    def create_shrunk_group(new_backend, *args, **kwargs):
        group = create(new_backend, *args, **kwargs)
        if not isinstance(new_backend, ProcessGroupPycomm):
            return group
        # The builder records the group shrunk's device map ("cpu:pycomm", ...) for its own
        # group, dropped here with that entry; shrink_group records it again for the group
        # returned. Without a map: every device pycomm was registered for.
        config = dist.distributed_c10d._world.pg_backend_config.pop(group, "") or BACKEND_NAME
        device_map = dist.distributed_c10d.BackendConfig(dist.Backend(config)).get_device_backend_map()
        devices = [torch.device(device) for device, name in device_map.items() if name == BACKEND_NAME]
        pycomm_group = _C.PycommProcessGroup(group.get_group_store(), group.rank(), group.size(), new_backend,
                                             devices)
        pycomm_group._set_group_name(group.group_name)
        pycomm_group._set_group_desc(group.group_desc)
        return pycomm_group

    return create_shrunk_group


if BACKEND_NAME not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True,
                                  devices=["cpu", "cuda"] if _C.has_cuda else ["cpu"])
    if hasattr(dist.distributed_c10d, "_create_shrunk_process_group"):  # a torch with shrink_group
        dist.distributed_c10d._create_shrunk_process_group = _shrunk_group_of(
            dist.distributed_c10d._create_shrunk_process_group)


def knobs():
    """Every environment knob as (name, default, meaning, same_on_every_rank)."""
    return [tuple(k) for k in _C.knobs()]


# ---- observability ----

def _host_backend(group):
    """The group's pycomm backend (which serves every device of a pycomm group), or None."""
    try:
        return direct.pycomm_backend(group, "cpu")
    except RuntimeError:  # the group has no backend for the host: not pycomm's
        return None


def _recorder(group):
    """What records the group's operations: its pycomm backend, or over a group of another
    backend the record of the layered operations on it."""
    group = direct.group_of(group)
    backend = _host_backend(group)
    return backend if backend is not None else layered.record_of(group).recorder


def stats(group=None):
    """This rank's counters of the group's operations: ``{"group", "rank", "size",
    "setup": {"transports", "chunk_bytes", "fallback"},
    "collectives": {collective: {algorithm: {"calls", "failures", "bytes", "time_s"}}},
    "last": <the last operation ended, as a flight-recorder entry, or None>}``. ``bytes``
    counts S as nccl-tests does (the whole array), ``time_s`` the time the operations ran
    (from their start on the group's thread to their end, queueing excluded). For a group
    of another backend, the same for the operations pycomm ran over it (the layered path,
    algorithms such as ``"layered-direct"`` and ``"layered-pairwise"``, timed from the call's
    start to its end; on CUDA tensors, to the end of enqueueing them), with ``"mover"``
    naming that backend."""
    group = direct.group_of(group)
    backend = _host_backend(group)
    return json.loads(backend._stats_json()) if backend is not None else layered.record_of(group).stats()


def flight_recorder(group=None):
    """This rank's flight recorder of the group: its last PYCOMM_FLIGHT_RECORDER operations,
    oldest first, each with its fingerprint (collective, seq, dtype, count, reduce op,
    root or tag, algorithm, compression, determinism), state (running, completed, failed),
    start time (``start_unix_us``) and ``duration_us`` (so far, when running). The same
    document is written to a file when an operation fails or times out."""
    return json.loads(_recorder(group)._flight_recorder_json())


def dump_flight_recorder(group=None, path=None):
    """Writes :func:`flight_recorder` as JSON to ``path`` (default: this rank's file in
    PYCOMM_FLIGHT_RECORDER_DIR) and returns the path."""
    return _recorder(group)._dump_flight_recorder(path or "")


# ---- compression codecs (the same block code the collectives run) ----

CODECS = _C.codecs  # ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2"), from the core's table


def _block(block):
    return _C.default_compression_block() if block is None else int(block)


def encode(tensor, codec, block=None, out=None):
    """The bytes ``codec`` puts on the wire for ``tensor`` (float32/float16/bfloat16, read
    flat) in blocks of ``block`` elements (default PYCOMM_COMPRESSION_BLOCK), each with an
    fp32 power-of-two scale: every element's code, then every block's scale, each array
    from a 16-byte boundary, zero-padded to a multiple of 16 bytes (code layout
    ``_C.CODE_LAYOUT``). Returns a 1-D uint8 tensor (``out`` if given)."""
    triton = kernels.triton_for(tensor)
    if triton is None:
        return _C.encode(tensor, codec, _block(block), out)
    flat, n = tensor.contiguous().view(-1), tensor.numel()
    if out is None:
        out = torch.empty(_C.encoded_size(codec, _block(block), n), dtype=torch.uint8, device=tensor.device)
    triton.fold(out, [flat], [_C.Form.Input], tensor.dtype, n, ReduceOp.SUM, 1, False, codec, _block(block),
                _C.Stage.Encoded)
    return out


def decode(encoded, codec, numel, dtype=torch.float32, block=None, out=None):
    """The values of ``encoded`` (from :func:`encode`) as a flat tensor of ``dtype``
    (``out`` if given)."""
    triton = kernels.triton_for(encoded)
    if triton is None:
        return _C.decode(encoded, codec, _block(block), int(numel), dtype, out)
    if out is None:
        out = torch.empty(int(numel), dtype=dtype, device=encoded.device)
    triton.fold(out, [encoded.contiguous()], [_C.Form.Encoded], dtype, int(numel), ReduceOp.SUM, 1, False, codec,
                _block(block), _C.Stage.Final)
    return out


def quantize(tensor, codec, block=None):
    """What compression does to ``tensor`` as one rank's contribution: decode(encode(t)),
    in the shape and dtype of ``tensor``. In a compressed all-reduce (ring, oneshot,
    twoshot, tree) every contribution is quantized exactly so, with blocks counted from
    the tensor's first element."""
    return decode(encode(tensor, codec, block), codec, tensor.numel(), tensor.dtype, block).view(tensor.shape)


def _compressed_sum(contributions, codec, algorithm="twoshot", block=None):
    """The SUM all-reduce of ``contributions`` (one float32 tensor per rank) as the
    compressed ring, twoshot and oneshot all-reduces compute it, bit for bit: each
    contribution quantized once, a float32 sum in rank order, and (except oneshot) the
    result quantized once more."""
    total = None
    for c in contributions:
        q = quantize(c.float(), codec, block)
        total = q if total is None else total + q
    return total if algorithm == "oneshot" else quantize(total, codec, block)


def exact_data_parallel(module, group=None, *, average=True, compression=None, broadcast_parameters=True):
    """Data parallelism whose step gradient is the same on any number of ranks: returns a
    :class:`pycomm.data_parallel.ExactDataParallel` that accumulates ``module``'s
    micro-batch gradients exactly; call its ``reduce_gradients()`` before the optimizer
    step. ``group``: any process group (None: the default one)."""
    from .data_parallel import ExactDataParallel

    return ExactDataParallel(module, group, average=average, compression=compression,
                             broadcast_parameters=broadcast_parameters)


def compression_error(tensor, codec, world_size=8, *, algorithm="twoshot", block=None, seed=0):
    """The error ``codec`` gives a SUM all-reduce of data like ``tensor``, to check before
    training whether a codec suits it.

    ``tensor`` is what one rank contributes (a gradient, say), or a list of
    ``world_size`` tensors, one per rank. From one tensor the other ranks' contributions
    are random permutations of its elements (``seed``): the same values, at independent
    positions. The all-reduce is computed as ``algorithm`` computes it (ring and twoshot
    alike; oneshot skips the second quantization; tree and hierarchical are close to
    twoshot) and compared with an exact float64 sum. Returns a dict: codec, world_size,
    rel_rms_error (of the compressed result), rel_rms_error_fp32 (of an uncompressed
    float32 all-reduce, for scale), max_abs_error, nonfinite (positions where the result
    is NaN or Inf but the exact sum is finite) and wire_ratio (bytes on the wire per
    uncompressed byte)."""
    if isinstance(tensor, (list, tuple)):
        contributions = [t.detach().reshape(-1) for t in tensor]
        world_size = len(contributions)
    else:
        flat = tensor.detach().reshape(-1)
        g = torch.Generator().manual_seed(seed)
        contributions = [flat] + [flat[torch.randperm(flat.numel(), generator=g)]
                                  for _ in range(world_size - 1)]
    exact = torch.stack([c.double() for c in contributions]).sum(0)
    fp32 = torch.stack([c.float() for c in contributions]).sum(0)
    got = _compressed_sum(contributions, codec, algorithm, block).double()
    finite = torch.isfinite(exact)
    norm = exact[finite].norm().item() or 1.0

    def rel(x):
        return (x[finite] - exact[finite]).norm().item() / norm

    first = contributions[0]
    return {"codec": codec, "world_size": world_size, "rel_rms_error": rel(got),
            "rel_rms_error_fp32": rel(fp32.double()),
            "max_abs_error": (got[finite] - exact[finite]).abs().max().item() if finite.any() else 0.0,
            "nonfinite": int((~torch.isfinite(got[finite])).sum()),
            "wire_ratio": encode(first.float(), codec, block).numel() / (first.numel() * first.element_size())}
