"""World-size-invariant data parallelism: the gradients of a step's micro-batches, on
however many ranks they were computed, summed in an order-free state and rounded once, so
that the step's gradient is reproducible: the same bits on 1, 2, 4 or 8 ranks.

Usage, in place of DistributedDataParallel::

    edp = pycomm.exact_data_parallel(model, group)      # group: any backend
    for inputs, targets in my_micro_batches:             # this rank's share of the step
        loss_fn(model(inputs), targets).backward()       # each gradient enters the accumulator
    edp.reduce_gradients()                               # .grad = the global mean, reproducibly
    optimizer.step(); optimizer.zero_grad()

Each parameter's gradient, as autograd finishes it for a micro-batch, is moved out of
``.grad`` and kept; every few micro-batches (and at ``reduce_gradients``) the kept ones
are added in one pass into an order-free state (core/numerics.h, "Binned exact sums": an
int8 bin index and two float64 bins per element). Each term enters truncated to the grid of 2^-32
of the element's largest term, and those truncated terms are added exactly: no order or
split changes a bit. ``reduce_gradients`` merges the states of every rank (the largest bin
index by a MAX all-reduce, then the bins by a SUM reduce-scatter into each rank's shard,
which adds integers held exactly in float64, so any backend's order gives the same bits),
and all-gathers sum / (global number of micro-batches), rounded once, into ``.grad``. The result depends only on the
multiset of micro-batch gradients: the same on 1, 2, 4 or 8 ranks (D5 for the step's
gradient), whatever the timing. Its error against the true sum: under 2^-32 of the
largest term per term, then one rounding. The bins add at most ``max_terms()`` terms
exactly: every rank's micro-batches together, checked on the merged count before a value
is written.

Under FSDP2 (``module`` holds modules made by ``fully_shard``) the accumulator works inside
each FSDP module's reduce-scatter instead, and keeps only this rank's shard of the state:
each micro-batch's unsharded gradient is binned into a state of that module alone, the
ranks' states are merged into the shards (the largest bin index by a MAX all-reduce of 1
byte per parameter, align, a SUM reduce-scatter of the two bins) and added to this rank's
shard state; the unsharded state is then dropped. The reduce-scatter returns zeros, except
in the backward run inside ``edp.last_micro_batch()``, where it returns this rank's shard
of the mean::

    for i, (inputs, targets) in enumerate(my_micro_batches):
        with edp.last_micro_batch() if i == len(my_micro_batches) - 1 else contextlib.nullcontext():
            loss_fn(model(inputs), targets).backward()
    edp.reduce_gradients()                               # checks; the merge already ran

(The same loop serves both: without FSDP, ``last_micro_batch()`` changes nothing.)
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _FSDPReduceScatter

from . import _C, direct
from .kernels import binned_ops

__all__ = ["ExactDataParallel"]

_NO_BIN = -128  # a bin index below every bin: the state of an element with no term yet
# Gradients kept per parameter before they are added into its state in one pass: the
# state (17 B per parameter) is then read and written once per _KEEP micro-batches, at
# the cost of up to _KEEP gradients held at once (4 B per parameter each, for float32).
_KEEP = 4


def max_terms():
    """How many terms (micro-batch gradients of every rank) a state adds exactly."""
    return _C.binned_max_terms()


class ExactDataParallel:
    """The reproducible gradient accumulator of ``module``'s parameters over ``group`` (None: the
    default group); see the module's docstring.

    ``average``: divide the sum by the global number of micro-batches (True) or not.
    ``compression``: a codec (e.g. ``"fp8_e4m3"``) for the cross-rank step: each rank's
    local binned sum, rounded once, is all-reduced by ``pycomm.all_reduce(...,
    compression=, deterministic="exact")`` instead of exchanging the states; the
    result is then identical across runs, timings, algorithms and topologies (D0-D4) but
    not across world sizes, since each rank's partial sum is quantized.
    ``broadcast_parameters``: copy rank 0's parameters and buffers to every rank now, as
    DistributedDataParallel does.

    Parameters must be dense float32, float16 or bfloat16 tensors, all on the CPU or all on
    one CUDA device (there the state's arithmetic runs as Triton kernels, with the CPU's
    bits; the collectives are the group's, which must take CUDA tensors). Under FSDP2 (see
    the module's docstring) the reduce-scatters run on FSDP's own group, on two or more
    ranks, uncompressed, and parameters are FSDP's to broadcast.
    """

    def __init__(self, module, group=None, *, average=True, compression=None, broadcast_parameters=True):
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            raise ValueError("pycomm.exact_data_parallel replaces DistributedDataParallel's gradient reduction: "
                             "pass the module itself (ddp.module), not the DDP wrapper")
        if compression is not None and compression not in _C.codecs:
            raise ValueError(f"pycomm.exact_data_parallel: compression={compression!r}; one of {_C.codecs}")
        self.module, self.group = module, group
        self.average, self.compression = average, compression
        self._finishing = False
        self._sharded = _fsdp_modules(module)
        if self._sharded:
            if compression is not None:
                raise ValueError("pycomm.exact_data_parallel: compression is not available under FSDP2")
            if dist.get_world_size(group) == 1:
                raise ValueError("pycomm.exact_data_parallel: FSDP2 does not call its reduce-scatter on one rank; "
                                 "there, use exact_data_parallel on the module without fully_shard")
            self._comms = [_ExactReduceScatter(self) for _ in self._sharded]
            for m, comm in zip(self._sharded, self._comms):
                m.set_custom_reduce_scatter(comm)
                m.set_gradient_divide_factor(1.0)  # the comm divides, by the global micro-batch count
            return
        self.params = [p for p in module.parameters() if p.requires_grad]
        device = self.params[0].device if self.params else torch.device("cpu")
        for p in self.params:
            if p.device != device or device.type not in ("cpu", "cuda") or \
                    p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise ValueError(f"pycomm.exact_data_parallel: a parameter is {p.dtype} on {p.device}; the "
                                 "accumulator takes float32, float16 or bfloat16 parameters, all on the CPU or all "
                                 "on one CUDA device")
        self._ops = binned_ops(device)
        begins = [0]
        for p in self.params:
            begins.append(begins[-1] + p.numel())
        n = begins[-1]
        self._slices = [slice(b, e) for b, e in zip(begins, begins[1:])]
        # The state, padded to whole shards of the group's ranks (the padding holds no term).
        self._ranks = dist.get_world_size(group)
        self._width = -(-n // self._ranks)
        padded = self._width * self._ranks
        self._index = torch.full((padded,), _NO_BIN, dtype=torch.int8, device=device)  # each step's first
        self._hi = torch.zeros(padded, dtype=torch.float64, device=device)  # term writes a parameter's state;
        self._lo = torch.zeros(padded, dtype=torch.float64, device=device)  # the padding stays empty
        # The merge's buffers, kept from step to step (new pages cost more than the copies):
        # the largest index over the ranks, this rank's shard of the merged bins and its
        # values; and the gathered values, which the .grad views share (reused only once
        # no tensor does).
        self._merged = (torch.empty(padded, dtype=torch.int8, device=device),
                        torch.empty(2, self._width, dtype=torch.float64, device=device),
                        torch.empty(self._width, dtype=torch.float32, device=device))
        self._values = None
        self._taken = [0] * len(self.params)
        self._kept = [[] for _ in self.params]  # each parameter's gradients not yet in its state
        if broadcast_parameters:
            self._broadcast_state()
        self._handles = [p.register_post_accumulate_grad_hook(self._take_hook(k)) for k, p in enumerate(self.params)]

    def _broadcast_state(self):
        source = dist.get_global_rank(self._group(), 0) if self.group is not None else 0
        with torch.no_grad():
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                dist.broadcast(t.data, source, group=self.group)

    def _group(self):
        return self.group if self.group is not None else dist.distributed_c10d._get_default_group()

    def _take_hook(self, k):
        def take(param):
            if self._taken[k] >= max_terms():
                raise RuntimeError(f"pycomm.exact_data_parallel: more than {max_terms()} micro-batches "
                                   "without reduce_gradients()")
            grad = param.grad
            param.grad = None
            self._kept[k].append((grad.to_dense() if grad.is_sparse else grad).contiguous().view(-1))
            self._taken[k] += 1
            if len(self._kept[k]) == _KEEP:
                self._fold(k)
        return take

    def _fold(self, k):
        """Adds parameter k's kept gradients into its state in one pass."""
        s, kept = self._slices[k], self._kept[k]
        self._ops.add_to_bins(self._index[s], self._hi[s], self._lo[s], kept, empty=self._taken[k] == len(kept))
        self._kept[k] = []

    @contextlib.contextmanager
    def last_micro_batch(self):
        """The backward run inside is this rank's last of the step: under FSDP2 its
        reduce-scatters merge every rank's states. Without FSDP it changes nothing."""
        self._finishing = True
        try:
            yield
        finally:
            self._finishing = False

    @property
    def micro_batches(self):
        """This rank's micro-batches since the last :meth:`reduce_gradients`: the most
        gradients any parameter received."""
        return max(self._taken, default=0)

    def _all_reduce(self, tensor, op):
        _exact_all_reduce(tensor, op, self.group)

    def reduce_gradients(self):
        """Collective over the group: writes to every parameter's ``.grad`` the binned sum
        of the gradients of every rank's micro-batches since the last call (divided by
        their global number where ``average``), rounded once, and empties the accumulator.
        More than ``max_terms()`` micro-batches over all ranks raise a RuntimeError on
        every rank, and no ``.grad`` is written."""
        if self._sharded:
            for comm in self._comms:
                comm.check_merged()
            return
        for k, s in enumerate(self._slices):
            if self._kept[k]:
                self._fold(k)
            if not self._taken[k]:  # no gradient this step: its state is the last step's
                self._index[s].fill_(_NO_BIN)
                self._hi[s].zero_()
                self._lo[s].zero_()
        count = torch.tensor([float(self.micro_batches)], dtype=torch.float64, device=self._hi.device)
        self._all_reduce(count, dist.ReduceOp.SUM)
        total = int(count.item())
        if self.compression is None:
            self._check_merged_terms(total)
            # The ranks' states aligned to the largest index, their bins added into each
            # rank's shard (reduce-scatter: the integers in the bins add exactly, in any
            # order), the shard's values, then the values gathered: 4 bytes per parameter
            # where the bins are 16.
            top, (hi, lo), mine = self._merged
            top.copy_(self._index)
            self._all_reduce(top, dist.ReduceOp.MAX)
            self._ops.align_bins(self._index, self._hi, self._lo, top)
            _exact_reduce_scatter(hi, self._hi, self.group)
            _exact_reduce_scatter(lo, self._lo, self.group)
            self._ops.value_of_bins(mine, hi, lo, float(total) if self.average and total else 1.0)
            if self._values is None or not _unshared(self._values):  # the last step's gradients are in use
                self._values = torch.empty(self._width * self._ranks, dtype=torch.float32, device=hi.device)
            values = self._values
            _exact_all_gather(values, mine, self.group)
        else:
            n = self._slices[-1].stop if self._slices else 0
            values = torch.empty(n, dtype=torch.float32, device=self._hi.device)
            self._ops.value_of_bins(values, self._hi[:n], self._lo[:n], 1.0)
            direct.all_reduce(values, dist.ReduceOp.SUM, self.group, compression=self.compression,
                              deterministic="exact")
            if self.average and total:
                values /= total
        # float32 values, each then rounded to a 16-bit parameter's type (as value_of_bins
        # rounds: to float32, then to the type).
        for p, s in zip(self.params, self._slices):
            p.grad = values[s].view_as(p) if p.dtype == torch.float32 else values[s].view_as(p).to(p.dtype)
        self._empty()

    def _empty(self):
        self._taken = [0] * len(self.params)  # the next terms overwrite the states (add_to_bins(empty=True))
        self._kept = [[] for _ in self.params]

    def _check_merged_terms(self, total):
        if total > max_terms():
            self._empty()
            raise RuntimeError(f"pycomm.exact_data_parallel: the ranks' states hold {total} micro-batch gradients "
                               f"together, more than the {max_terms()} they add exactly; no gradient was written "
                               "(call reduce_gradients() more often)")

    def remove(self):
        """Detaches the accumulator: gradients accumulate in ``.grad`` again (without
        FSDP; FSDP modules keep their reduce-scatter)."""
        for h in getattr(self, "_handles", []):
            h.remove()
        self._handles = []


def _unshared(tensor):
    """Whether no other tensor (a view of it included) shares ``tensor``'s memory: its
    storage is held by ``tensor`` and by the storage object asked here alone."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata) == 2


def _on_pycomm(group, device):
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    return direct.pycomm_backend(group, device) is not None


# Collectives that only move bytes or add exactly: pycomm's, uncompressed, on a pycomm
# group (whatever PYCOMM_COMPRESSION says); the group's own backend otherwise.
def _exact_all_reduce(tensor, op, group):
    if _on_pycomm(group, tensor.device):
        direct.all_reduce(tensor, op, group, compression="none")
    else:
        dist.all_reduce(tensor, op, group=group)


def _exact_all_gather(output, input, group):
    if _on_pycomm(group, input.device):
        direct.all_gather_into_tensor(output, input, group, compression="none")
    else:
        dist.all_gather_into_tensor(output, input, group=group)


def _exact_reduce_scatter(output, input, group):
    if _on_pycomm(group, input.device):
        direct.reduce_scatter_tensor(output, input, dist.ReduceOp.SUM, group, compression="none")
    else:
        dist.reduce_scatter_tensor(output, input, dist.ReduceOp.SUM, group=group)


def _fsdp_modules(module):
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


class _ExactReduceScatter(_FSDPReduceScatter):
    """One FSDP module's reduce-scatter under :class:`ExactDataParallel` (FSDP2's comm
    interface: ``allocate`` and a call with the output, the input laid out as FSDP chunks
    it, the group and the op, which is ignored: the result is the mean, or sum). Keeps this
    rank's shard of the module's state from micro-batch to micro-batch."""

    def __init__(self, owner):
        self.owner = owner
        self.shard, self.terms, self.merged = None, 0, True

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        ranks, width = dist.get_world_size(group), output_tensor.numel()
        terms = self.terms + ranks  # every rank's gradient of this micro-batch; all ranks count alike
        if terms > max_terms():
            self.shard, self.terms, self.merged = None, 0, True
            raise RuntimeError(f"pycomm.exact_data_parallel: {terms} micro-batch gradients over all ranks in a "
                               f"step, more than the {max_terms()} its state adds exactly")
        # This micro-batch's state, chunk r (FSDP's layout: rank r's shard) laid out as
        # [hi, lo] so that one reduce-scatter carries both bins.
        chunks = input_tensor.contiguous().view(ranks, width)
        ops, device = binned_ops(chunks.device), chunks.device
        index = torch.empty((ranks, width), dtype=torch.int8, device=device)
        bins = torch.empty(ranks, 2, width, dtype=torch.float64, device=device)
        for r in range(ranks):
            ops.add_to_bins(index[r], bins[r, 0], bins[r, 1], [chunks[r]], empty=True)
        top = index.clone()
        _exact_all_reduce(top, dist.ReduceOp.MAX, group)
        for r in range(ranks):
            ops.align_bins(index[r], bins[r, 0], bins[r, 1], top[r])
        mine = torch.empty(2, width, dtype=torch.float64, device=device)
        _exact_reduce_scatter(mine.view(-1), bins.view(-1), group)
        mine_index = top[dist.get_rank(group)].clone()
        del index, bins, top
        if self.shard is None:
            self.shard = (mine_index, mine[0], mine[1])
        else:
            ops.merge_bins(*self.shard, mine_index, mine[0], mine[1])
        self.terms, self.merged = terms, False
        if not self.owner._finishing:
            output_tensor.zero_()  # FSDP adds it to the shard's gradient: nothing yet
            return None
        divisor = float(terms) if self.owner.average else 1.0
        ops.value_of_bins(output_tensor.view(-1), self.shard[1], self.shard[2], divisor)
        self.shard, self.terms, self.merged = None, 0, True
        return None

    def check_merged(self):
        if not self.merged:
            self.shard, self.terms, self.merged = None, 0, True
            raise RuntimeError("pycomm.exact_data_parallel: under FSDP2 the step's last backward must run inside "
                               "edp.last_micro_batch(), where this rank's shard of the gradient is written")
