"""The backend table and the ``--backends`` spec syntax.

A spec is ``[label=]kind[:key=value[:key=value...]]``, comma-separated in ``--backends``:

    pycomm,gloo                         the default: pycomm against gloo
    gloo,gloo2=gloo                     gloo against itself (a noise floor for the ratios)
    pycomm,ring=pycomm:algorithm=ring   pycomm's default selection against forced ring

Each spec becomes its own process group (``dist.new_group(backend=kind)``) in the same
ranks, next to the gloo default group that the harness uses for its own barriers and
timing reductions. Without options a backend is called through ``torch.distributed``
(what users call); with options through the module's direct API (``pycomm.all_reduce(t,
..., algorithm=...)``), which takes the same arguments plus the options.

``mpi`` is not a torch.distributed backend: it calls mpi4py on the tensor's memory
(``Allreduce``/``Iallreduce`` in place on a duplicate of MPI_COMM_WORLD), so its ranks must
be started by mpirun (``--launcher mpirun``, chosen automatically).

Adding a backend is one :class:`BackendKind` row (nccl comes later, with CUDA devices).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from .config import BackendSpec

# Per-call option values the pycomm direct API accepts (DESIGN.md section 3).
PYCOMM_OPTIONS = {
    "algorithm": ("auto", "ring", "tree", "hierarchical", "oneshot", "twoshot"),
    "compression": ("none", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2"),
    "deterministic": ("0", "1", "exact"),
}


# Direct-API options that select what the torch.distributed path does by default (when
# the PYCOMM_* environment is unset): a direct backend with only these measures dispatch.
PYCOMM_NEUTRAL = {("algorithm", "auto"), ("compression", "none"), ("deterministic", "0")}


@dataclass(frozen=True)
class BackendKind:
    name: str                     # what --backends names
    device: str                   # where its tensors live
    dist_backend: Optional[str] = None  # dist.new_group(backend=...); None: not a torch backend
    module: Optional[str] = None  # imported in the rank before the group is created
    options: Tuple[str, ...] = () # per-call options, passed to module's direct API
    neutral: frozenset = frozenset()  # options that keep the default behaviour
    launcher: Optional[str] = None    # the launcher its ranks need (None: any)


BACKENDS: Dict[str, BackendKind] = {k.name: k for k in (
    BackendKind("gloo", "cpu", "gloo"),
    BackendKind("pycomm", "cpu", "pycomm", module="pycomm", options=tuple(PYCOMM_OPTIONS),
                neutral=frozenset(PYCOMM_NEUTRAL)),
    BackendKind("mpi", "cpu", module="mpi4py", launcher="mpirun"),
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
        options = []
        for opt in opt_items:
            key, eq, value = opt.partition("=")
            if not eq or key not in BACKENDS[kind].options:
                raise ValueError("backend %r takes no option %r (options: %s)"
                                 % (kind, opt, ", ".join(BACKENDS[kind].options) or "none"))
            allowed = PYCOMM_OPTIONS.get(key) if kind == "pycomm" else None
            if allowed and value not in allowed:
                raise ValueError("%s=%r: expected one of %s" % (key, value, ", ".join(allowed)))
            options.append((key, value))
        specs.append(BackendSpec(label, kind, tuple(options)))
    if not specs:
        raise ValueError("--backends names no backend")
    labels = [s.label for s in specs]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise ValueError("backend labels must be unique, %s repeated: name the copies, "
                         "e.g. gloo,gloo2=gloo" % ", ".join(dup))
    return specs


def required_launcher(specs: List[BackendSpec]) -> Optional[str]:
    """The launcher the backends under test need, or None when any will do."""
    needs = {BACKENDS[s.kind].launcher for s in specs} - {None}
    return needs.pop() if needs else None


def dispatch_pairs(specs: List[BackendSpec]) -> List[Tuple[str, str]]:
    """(label through torch.distributed, label through the direct API) for each backend
    that is listed both ways, the direct one with neutral options only (e.g. ``pycomm`` and
    ``direct=pycomm:algorithm=auto``): their difference is torch.distributed's dispatch."""
    pairs = []
    for plain in (s for s in specs if not s.options and BACKENDS[s.kind].options):
        direct = next((s for s in specs if s.kind == plain.kind and s.options
                       and set(s.options) <= BACKENDS[s.kind].neutral), None)
        if direct is not None:
            pairs.append((plain.label, direct.label))
    return pairs


class Comm:
    """One backend's process group inside a rank, and how to call a collective on it."""

    def __init__(self, spec: BackendSpec, group, api, device: str):
        self.spec = spec
        self.label = spec.label
        self.group = group
        self.api = api            # torch.distributed, or the backend module (options)
        self.device = device
        self.options = dict(spec.options)

    def call(self, name: str, *tensors, async_op: bool = True, **kwargs):
        """``api.<name>(*tensors, group=..., async_op=..., **kwargs, **options)``."""
        return getattr(self.api, name)(*tensors, group=self.group, async_op=async_op,
                                       **kwargs, **self.options)

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
    it), reduced in place (MPI_IN_PLACE), so no copy is timed that torch backends skip."""

    def __init__(self, spec: BackendSpec, device: str):
        from mpi4py import MPI

        self.spec = spec
        self.label = spec.label
        self.device = device
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD.Dup()

    def call(self, name: str, tensor, op, async_op: bool = True):
        if name != "all_reduce":
            raise NotImplementedError("mpi backend: %s is not wired up" % name)
        MPI = self.MPI
        buf, mpi_op = tensor.numpy(), getattr(MPI, op.name)   # ReduceOp.SUM -> MPI.SUM
        if async_op:
            return _MpiWork(self.comm.Iallreduce(MPI.IN_PLACE, buf, op=mpi_op))
        self.comm.Allreduce(MPI.IN_PLACE, buf, op=mpi_op)
        return None

    def close(self) -> None:
        self.comm.Free()


def open_comm(spec: BackendSpec, timeout, world: int):
    """Create the group for ``spec`` (collective over all ranks: every rank must call this
    for the same specs in the same order). Runs inside a rank."""
    import importlib

    import torch.distributed as dist

    kind = BACKENDS[spec.kind]
    if kind.name == "mpi":
        comm = MpiComm(spec, kind.device)
        if comm.comm.Get_size() != world:
            raise RuntimeError("MPI_COMM_WORLD has %d ranks, the run %d: start the ranks with "
                               "--launcher mpirun" % (comm.comm.Get_size(), world))
        return comm
    module = importlib.import_module(kind.module) if kind.module else None  # registers it
    if kind.dist_backend not in dist.Backend.backend_list:
        raise RuntimeError("backend %r is not registered with torch.distributed%s"
                           % (kind.dist_backend, " (importing %r did not register it)"
                              % kind.module if kind.module else ""))
    group = dist.new_group(backend=kind.dist_backend, timeout=timeout)
    api = module if (spec.options and module is not None) else dist
    return Comm(spec, group, api, kind.device)
