"""The backend table and the ``--backends`` spec syntax.

A spec is ``[label=]kind[:mover][:key=value[:key=value...]]``, comma-separated in
``--backends`` (``:mover`` for ``pycomm-over`` only, where it is required):

    pycomm,gloo                         the default: pycomm against gloo
    gloo,gloo2=gloo                     gloo against itself (a noise floor for the ratios)
    pycomm,ring=pycomm:algorithm=ring   pycomm's default selection against forced ring
    gloo,layered=pycomm-over:gloo       gloo's own all-reduce against pycomm's layered path
                                        over a gloo group
    gloo,fp8=pycomm-over:gloo:compression=fp8_e4m3,exact=pycomm-over:gloo:deterministic=exact
    off=pycomm,n1=pycomm:verify=1       pycomm verifying every call (PYCOMM_VERIFY=1) against not

Each spec becomes its own process group (``dist.new_group(backend=kind)``) in the same
ranks, next to the gloo default group that the harness uses for its own barriers and
timing reductions. Without per-call options a backend is called through
``torch.distributed`` (what users call); with them through the module's direct API
(``pycomm.all_reduce(t, ..., algorithm=...)``), which takes the same arguments plus the
options and exists for all-reduce, reduce-scatter and all-gather only. Group options
(pycomm: ``verify``) are settings of the group itself, given at its creation
(``pg_options=pycomm.Options(verify=1)``), and leave the calls as they are.

``pycomm-over:MOVER`` is pycomm's layered path (pycomm/layered/): its group is a group
of the mover's backend (``dist.new_group(backend="gloo")`` for ``pycomm-over:gloo``; the
mover is a kind of this table with a torch backend other than pycomm, and its device is
the mover's), and every call goes through pycomm's direct API on that group, options or
not (``pycomm.all_reduce(t, op, group=<the gloo group>, compression=...,
deterministic=...)``): pycomm's algorithms run with the mover moving bytes only
(all_to_all_single, all-gather), the layered plan choosing among them. Its options are
``algorithm`` (auto, twoshot: the direct variants, hierarchical; another family runs the
plan's choice), ``compression`` and ``deterministic``. Listed next to the mover
itself (``gloo,layered=pycomm-over:gloo``), the ratios are the layered path's cost
against the mover's own collective in the same processes. The layered calls complete
before they return, so in b2b mode they do not overlap one another.

``mpi`` is not a torch.distributed backend: it calls mpi4py on the tensors' memory (on a
duplicate of MPI_COMM_WORLD), so its ranks must be started by mpirun
(``--launcher mpirun``, chosen automatically). ``nccl`` needs CUDA devices; each rank uses
``cuda:<local rank % device count>``.

``deepspeed`` is DeepSpeed's shared-memory all-reduce on its CPU accelerator
(``deepspeed.comm.inference_all_reduce``; requirements-bench.txt installs DeepSpeed, whose
op is built on first use): all-reduce SUM of float32, bfloat16 and float16, in place, all
ranks on one host, blocking. DeepSpeed falls back to ``dist.all_reduce`` without a word
where its op cannot run (ranks on several hosts, a CPU without AVX2, or AVX-512BW for
16-bit data); the bench refuses to start then, so that a row named deepspeed is always
its shared-memory path.

``copy`` is no collective: each rank copies the call's bytes into a buffer of its own, on
one thread (numpy's copy), all ranks at once. Listed beside an all-reduce it is the
memory's yardstick: at 2 ranks, where busbw is S / t, its xbase is pycomm's busbw over
the bandwidth of a single-threaded copy of the same bytes in the same run. Its results
are not checked (n/a) and its busbw is its own bytes over time at any world size.

Adding a backend is one :class:`BackendKind` row; :func:`unsupported` tells, before
anything starts, which (collective, placement, dtype) a row cannot run.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from .. import _C
from .config import BackendSpec

# Per-call option values the pycomm direct API accepts (docs/design.md, 'Public surface'), from the
# core's tables.
PYCOMM_OPTIONS = {
    "algorithm": _C.algorithms,
    "compression": ("none",) + _C.codecs,
    "deterministic": _C.determinism_levels,
}


# Options of the pycomm group itself (pycomm.Options, given as pg_options when it is made):
# each takes a non-negative integer.
PYCOMM_GROUP_OPTIONS = ("verify",)


# Direct-API options that select what the torch.distributed path does by default (when
# the PYCOMM_* environment is unset): a direct backend with only these measures dispatch.
PYCOMM_NEUTRAL = {("algorithm", "auto"), ("compression", "none"), ("deterministic", "0")}


# pycomm's direct API: torch.distributed function -> the module's function with options.
PYCOMM_DIRECT = {"all_reduce": "all_reduce", "reduce_scatter_single": "reduce_scatter_tensor",
                 "all_gather_single": "all_gather_into_tensor"}


@dataclass(frozen=True)
class BackendKind:
    name: str                     # what --backends names
    device: str                   # where its tensors live ("cuda": one device per local rank)
    dist_backend: Optional[str] = None  # dist.new_group(backend=...); None: not a torch backend
    module: Optional[str] = None  # imported in the rank before the group is created
    options: Tuple[str, ...] = () # per-call options, passed to module's direct API
    group_options: Tuple[str, ...] = ()  # settings of its group, module.Options(...) at creation
    neutral: frozenset = frozenset()  # options that keep the default behaviour
    launcher: Optional[str] = None    # the launcher its ranks need (None: any)
    direct: Optional[Dict[str, str]] = None  # with options: torch.distributed name -> module's
    dtypes: Optional[Tuple[str, ...]] = None  # None: every dtype of config.DTYPES
    no_in_place: Tuple[str, ...] = ()         # calls it cannot run in place
    # Kinds it runs over (spec ``kind:MOVER``, required): the group and device are the
    # mover's, every call goes through ``direct``. (): a backend of its own.
    movers: Tuple[str, ...] = ()
    calls: Optional[Tuple[str, ...]] = None   # the torch.distributed functions it has (None: all)
    ops: Optional[Tuple[str, ...]] = None     # the reductions it has (None: all)
    install: str = "pip install -r requirements-bench.txt"  # how to get its module
    collective: bool = True   # False: a local yardstick (copy), neither checked nor given a busbw factor


BACKENDS: Dict[str, BackendKind] = {k.name: k for k in (
    BackendKind("gloo", "cpu", "gloo"),
    BackendKind("pycomm", "cpu", "pycomm", module="pycomm", options=tuple(PYCOMM_OPTIONS),
                group_options=PYCOMM_GROUP_OPTIONS, neutral=frozenset(PYCOMM_NEUTRAL), direct=PYCOMM_DIRECT),
    # MPI_IN_PLACE leaves a reduce-scatter's result at the start of the buffer, not at the
    # rank's chunk where torch's in-place form expects it.
    BackendKind("mpi", "cpu", module="mpi4py", launcher="mpirun",
                dtypes=("float32", "int32"), no_in_place=("reduce_scatter_single",)),
    BackendKind("nccl", "cuda", "nccl"),
    # pycomm's layered path: its algorithms over a group of the mover's backend, on the
    # mover's device (device_of), hence no device of its own.
    BackendKind("pycomm-over", "", module="pycomm", options=tuple(PYCOMM_OPTIONS),
                direct=PYCOMM_DIRECT, movers=("gloo", "nccl")),
    BackendKind("deepspeed", "cpu", module="deepspeed", dtypes=("float32", "bfloat16", "float16"),
                calls=("all_reduce",), ops=("sum",),
                install="pip install --no-deps -r requirements-deepspeed.txt, as make bench-peers does"),
    BackendKind("copy", "cpu", calls=("all_reduce",), collective=False),
)}

DEFAULT_BACKENDS = "pycomm,gloo"


def parse_backends(text: str) -> List[BackendSpec]:
    """Parse ``--backends``; raises ValueError with a helpful message."""
    specs: List[BackendSpec] = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        head, *opt_items = item.split(":")
        label, _, kind = head.rpartition("=")
        label = label or kind
        if kind not in BACKENDS:
            raise ValueError("unknown backend %r in %r (have: %s)"
                             % (kind, item, ", ".join(BACKENDS)))
        if not re.fullmatch(r"[A-Za-z0-9_.+-]+", label):
            raise ValueError("bad label %r in %r (letters, digits, _ . + -)" % (label, item))
        movers, mover = BACKENDS[kind].movers, None
        if movers:
            if not opt_items or "=" in opt_items[0]:
                raise ValueError("backend %r needs the backend that moves its bytes after it, "
                                 "e.g. %s:%s (movers: %s)" % (kind, kind, movers[0], ", ".join(movers)))
            mover = opt_items.pop(0)
            if mover not in movers:
                raise ValueError("backend %r cannot run over %r in %r (movers: %s)"
                                 % (kind, mover, item, ", ".join(movers)))
        options = []
        takes = BACKENDS[kind].options + BACKENDS[kind].group_options
        for opt in opt_items:
            key, eq, value = opt.partition("=")
            if not eq or key not in takes:
                raise ValueError("backend %r takes no option %r (options: %s)"
                                 % (kind, opt, ", ".join(takes) or "none"))
            allowed = PYCOMM_OPTIONS.get(key) if BACKENDS[kind].module == "pycomm" else None
            if allowed and value not in allowed:
                raise ValueError("%s=%r: expected one of %s" % (key, value, ", ".join(allowed)))
            if key in BACKENDS[kind].group_options and not value.isdigit():
                raise ValueError("%s=%r: expected a non-negative integer" % (key, value))
            options.append((key, value))
        specs.append(BackendSpec(label, kind, tuple(options), mover))
    if not specs:
        raise ValueError("--backends names no backend")
    labels = [s.label for s in specs]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise ValueError("backend labels must be unique, %s repeated: name the copies, "
                         "e.g. gloo,gloo2=gloo" % ", ".join(dup))
    return specs


def call_options(spec: BackendSpec) -> Dict[str, str]:
    """``spec``'s per-call options (its others are its group's)."""
    return {k: v for k, v in spec.options if k in BACKENDS[spec.kind].options}


def through_direct(spec: BackendSpec) -> bool:
    """Whether ``spec``'s calls go through its module's direct API (per-call options given,
    or a kind that always does: pycomm-over)."""
    return bool(call_options(spec)) or bool(BACKENDS[spec.kind].movers)


def lossy_labels(specs: List[BackendSpec]) -> List[str]:
    """Labels of the backends whose options compress (``compression`` other than none): the
    check's integer sums can come back rounded under them (fp8_e4m3 keeps 4 significant
    bits: 17 is not a code at 3 ranks and up), which does not fail the run."""
    return [s.label for s in specs if dict(s.options).get("compression", "none") != "none"]


def device_of(spec: BackendSpec) -> str:
    """Where ``spec``'s tensors live ("cuda": one device per local rank): its kind's
    device, or its mover's."""
    return BACKENDS[spec.mover or spec.kind].device


def unsupported(spec: BackendSpec, call: str, in_place: bool, dtype: str, op: Optional[str] = None) -> Optional[str]:
    """Why ``spec`` cannot run the torch.distributed function ``call`` (in place or not) on
    ``dtype`` with the reduction ``op``, or None when it can."""
    kind = BACKENDS[spec.kind]
    if kind.calls is not None and call not in kind.calls:
        return "%s has only %s: drop %s" % (spec.kind, ", ".join(kind.calls), call)
    if kind.ops is not None and op not in (None, "none") and op not in kind.ops:
        return "%s reduces by %s only, not %s" % (spec.kind, ", ".join(kind.ops), op)
    if kind.movers and call not in kind.direct:
        return ("%s runs through pycomm's direct API, which has no %s (it has %s): drop that "
                "collective" % (spec.describe(), call, ", ".join(kind.direct.values())))
    if call_options(spec) and call not in kind.direct:
        return ("%s's options go through its direct API, which has no %s (it has %s): drop "
                "the options or that collective" % (spec.describe(), call,
                                                    ", ".join(kind.direct.values())))
    if kind.dtypes is not None and dtype not in kind.dtypes:
        return "%s has no %s (it has %s)" % (spec.kind, dtype, ", ".join(kind.dtypes))
    if in_place and call in kind.no_in_place:
        return "%s cannot run %s in place: use --inplace 0" % (spec.kind, call)
    return None


def required_launcher(specs: List[BackendSpec]) -> Optional[str]:
    """The launcher the backends under test need, or None when any will do."""
    needs = {BACKENDS[s.kind].launcher for s in specs} - {None}
    return needs.pop() if needs else None


def dispatch_pairs(specs: List[BackendSpec]) -> List[Tuple[str, str]]:
    """(label through torch.distributed, label through the direct API) for each backend
    that is listed both ways, the direct one with neutral options only (e.g. ``pycomm`` and
    ``direct=pycomm:algorithm=auto``): their difference is torch.distributed's dispatch."""
    pairs = []
    for plain in (s for s in specs if not s.options and not through_direct(s) and BACKENDS[s.kind].options):
        direct = next((s for s in specs if s.kind == plain.kind and s.options
                       and set(s.options) <= BACKENDS[s.kind].neutral), None)
        if direct is not None:
            pairs.append((plain.label, direct.label))
    return pairs


class Comm:
    """One backend's process group inside a rank, and how to call a collective on it."""

    def __init__(self, spec: BackendSpec, group, api, device: str, names: Dict[str, str]):
        self.spec = spec
        self.label = spec.label
        self.group = group
        self.api = api            # torch.distributed, or the backend module (options)
        self.device = device
        self.names = names        # torch.distributed name -> api's name
        self.options = call_options(spec)

    def call(self, name: str, *tensors, async_op: bool = True, **kwargs):
        """``api.<name>(*tensors, group=..., async_op=..., **kwargs, **options)``, ``name``
        being the torch.distributed function."""
        return getattr(self.api, self.names.get(name, name))(
            *tensors, group=self.group, async_op=async_op, **kwargs, **self.options)

    def synchronize(self) -> None:
        """Wait for the device: a finished CUDA Work only orders the current stream."""
        if self.device != "cpu":
            import torch

            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group(self.group)


class _MpiWork:
    """An MPI request with the ``wait()`` of a torch Work."""

    def __init__(self, request):
        self.request = request

    def wait(self):
        self.request.Wait()


class MpiComm:
    """MPI through mpi4py, on its own duplicate of MPI_COMM_WORLD, with the calling
    convention of :class:`Comm`. Buffers are the tensors' memory (``Tensor.numpy()`` shares
    it) and in-place calls use MPI_IN_PLACE, so no copy is timed that torch backends skip."""

    def __init__(self, spec: BackendSpec, device: str):
        from mpi4py import MPI

        self.spec = spec
        self.label = spec.label
        self.device = device
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD.Dup()

    def call(self, name: str, *tensors, async_op: bool = True, op=None, src=None):
        """The torch.distributed function ``name`` as the matching MPI call (``I...`` when
        ``async_op``). torch's in-place forms pass one buffer, or a view of the output as
        the input (all-gather): MPI spells both MPI_IN_PLACE."""
        MPI = self.MPI
        out, inp = tensors[0], tensors[-1]
        in_place = inp.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
        send = MPI.IN_PLACE if in_place else inp.numpy()
        method, args = {
            "all_reduce": ("Allreduce", (send, out.numpy())),
            "reduce_scatter_single": ("Reduce_scatter_block", (send, out.numpy())),
            "all_gather_single": ("Allgather", (send, out.numpy())),
            "all_to_all_single": ("Alltoall", (send, out.numpy())),
            "broadcast": ("Bcast", (out.numpy(), src)),
        }[name]
        if op is not None:
            args += (getattr(MPI, op.name),)        # ReduceOp.SUM -> MPI.SUM
        if async_op:
            return _MpiWork(getattr(self.comm, "I" + method.lower())(*args))
        getattr(self.comm, method)(*args)
        return None

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        self.comm.Free()


class _Done:
    """The Work of a call that finished before it returned."""

    def wait(self):
        return True


class DeepSpeedComm:
    """DeepSpeed's shared-memory all-reduce (``deepspeed.comm.inference_all_reduce``) with
    the calling convention of :class:`Comm`: in place, SUM, finished when it returns. Its
    op names its shared memory after MASTER_ADDR and MASTER_PORT and runs only where
    LOCAL_SIZE equals the world size: both are set here (the port a number rank 0 draws,
    so that runs side by side do not meet), and the op's own check is repeated, so that a
    row named deepspeed is never its silent fallback to ``dist.all_reduce``."""

    def __init__(self, spec: BackendSpec, world: int):
        import os
        import random

        import torch
        import torch.distributed as dist

        self.spec, self.label, self.device = spec, spec.label, "cpu"
        token = [random.randrange(20000, 60000)]
        dist.broadcast_object_list(token, src=0)
        os.environ.update(DS_ACCELERATOR="cpu", LOCAL_SIZE=str(world), MASTER_PORT=str(token[0]),
                          MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"))
        import deepspeed
        import deepspeed.comm

        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
        backend = deepspeed.comm.comm.cdb
        level = getattr(backend, "shm_vector_kernel_level", 0)
        if getattr(backend, "shm_comm_op", None) is None or level < 1:
            raise RuntimeError("deepspeed's shared-memory all-reduce cannot run here (its op did not build, or this "
                               "CPU lacks AVX2): it would fall back to dist.all_reduce")
        self.sixteen_bit = level >= 2
        self.all_reduce = deepspeed.comm.inference_all_reduce
        self.torch = torch

    def call(self, name: str, tensor, async_op: bool = True, op=None):
        if tensor.dtype != self.torch.float32 and not self.sixteen_bit:
            raise RuntimeError("deepspeed's shared-memory all-reduce of 16-bit data needs AVX-512BW: it would fall "
                               "back to dist.all_reduce")
        self.all_reduce(tensor)
        return _Done() if async_op else None

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        pass


class CopyComm:
    """The ``copy`` row: a single-threaded copy of the call's bytes into a buffer kept
    from call to call (grown as sizes grow), with the calling convention of :class:`Comm`."""

    def __init__(self, spec: BackendSpec):
        import numpy
        import torch

        self.spec, self.label, self.device = spec, spec.label, "cpu"
        self.numpy, self.torch, self.buffer = numpy, torch, numpy.empty(0, dtype=numpy.uint8)

    def call(self, name: str, tensor, async_op: bool = True, op=None):
        source = tensor.view(-1).view(self.torch.uint8).numpy()
        if self.buffer.size < source.size:
            self.buffer = self.numpy.ones(source.size, dtype=self.numpy.uint8)  # touched: no first-touch cost timed
        self.numpy.copyto(self.buffer[:source.size], source)
        return _Done() if async_op else None

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        pass


def open_comm(spec: BackendSpec, timeout, world: int, local_rank: int):
    """Create the group for ``spec`` (collective over all ranks: every rank must call this
    for the same specs in the same order). Runs inside a rank."""
    import importlib

    import torch
    import torch.distributed as dist

    kind = BACKENDS[spec.kind]
    group_kind = BACKENDS[spec.mover] if spec.mover else kind   # whose group it is
    device = device_of(spec)
    if device == "cuda":
        device = "cuda:%d" % (local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if kind.name == "deepspeed":
        return DeepSpeedComm(spec, world)
    if kind.name == "copy":
        return CopyComm(spec)
    if kind.name == "mpi":
        comm = MpiComm(spec, device)
        if comm.comm.Get_size() != world:
            raise RuntimeError("MPI_COMM_WORLD has %d ranks, the run %d: start the ranks with "
                               "--launcher mpirun" % (comm.comm.Get_size(), world))
        return comm
    module = importlib.import_module(kind.module) if kind.module else None  # registers it
    if group_kind.dist_backend not in dist.Backend.backend_list:
        raise RuntimeError("backend %r is not registered with torch.distributed%s"
                           % (group_kind.dist_backend, " (importing %r did not register it)"
                              % kind.module if kind.module and group_kind is kind else ""))
    settings = {k: v for k, v in spec.options if k in kind.group_options}
    group = dist.new_group(backend=group_kind.dist_backend, timeout=timeout,
                           pg_options=module.Options(**settings) if settings else None)
    if through_direct(spec):
        return Comm(spec, group, module, device, kind.direct)
    return Comm(spec, group, dist, device, {})
