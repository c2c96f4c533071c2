"""World-size-invariant data parallelism: the gradients of a step's micro-batches, on
however many ranks they were computed, summed exactly and rounded once.

Usage, in place of DistributedDataParallel::

    edp = pycomm.exact_data_parallel(model, group)      # group: any backend
    for inputs, targets in my_micro_batches:             # this rank's share of the step
        loss_fn(model(inputs), targets).backward()       # each gradient enters the accumulator
    edp.reduce_gradients()                               # .grad = the global mean, exactly
    optimizer.step(); optimizer.zero_grad()

Each parameter's gradient, as autograd finishes it for a micro-batch, is moved out of
``.grad`` into an order-free exact state (core/numerics.h, "Binned exact sums": an int8
bin index and two float64 bins per element). ``reduce_gradients`` merges the states of
every rank (the largest bin index by a MAX all-reduce, then the bins by a SUM all-reduce,
which adds integers held exactly in float64, so any backend's order gives the same bits)
and writes sum / (global number of micro-batches) to ``.grad``. The result depends only on
the multiset of micro-batch gradients: the same on 1, 2, 4 or 8 ranks (D5 for the step's
gradient), whatever the timing.

Under FSDP2 (``module`` holds modules made by ``fully_shard``) the accumulator works inside
each FSDP module's reduce-scatter instead: every micro-batch's unsharded gradient enters
that module's exact state and the reduce-scatter returns zeros, except in the backward
run inside ``edp.last_micro_batch()``, where the ranks' states are merged (MAX all-reduce,
align, SUM reduce-scatter) and each rank receives its shard of the exact mean::

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

import pycomm

from . import _C

__all__ = ["ExactDataParallel"]

_NO_BIN = -128  # a bin index below every bin: the state of an element with no term yet


class ExactDataParallel:
    """The exact gradient accumulator of ``module``'s parameters over ``group`` (None: the
    default group); see the module's docstring.

    ``average``: divide the sum by the global number of micro-batches (True) or not.
    ``compression``: a codec (e.g. ``"fp8_e4m3"``) for the cross-rank step: each rank's
    exact local sum, rounded once, is all-reduced by ``pycomm.all_reduce(...,
    compression=, deterministic="exact")`` instead of exchanging the exact states; the
    result is then identical across runs, timings, algorithms and topologies (D0-D4) but
    not across world sizes, since each rank's partial sum is quantized.
    ``broadcast_parameters``: copy rank 0's parameters and buffers to every rank now, as
    DistributedDataParallel does.

    Parameters must be dense float32, float16 or bfloat16 CPU tensors. Under FSDP2 (see
    the module's docstring) the reduce-scatters run on FSDP's own group, on two or more
    ranks, uncompressed, and parameters are FSDP's to broadcast.
    """

    def __init__(self, module, group=None, *, average=True, compression=None, broadcast_parameters=True):
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            raise ValueError("pycomm.exact_data_parallel replaces DistributedDataParallel's gradient reduction: "
                             "pass the module itself (ddp.module), not the DDP wrapper")
        if compression is not None and compression not in pycomm.CODECS:
            raise ValueError(f"pycomm.exact_data_parallel: compression={compression!r}; one of {pycomm.CODECS}")
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
        for p in self.params:
            if p.device.type != "cpu" or p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise ValueError(f"pycomm.exact_data_parallel: a parameter is {p.dtype} on {p.device}; the exact "
                                 "accumulator takes float32, float16 or bfloat16 parameters on the CPU")
        begins = [0]
        for p in self.params:
            begins.append(begins[-1] + p.numel())
        n = begins[-1]
        self._slices = [slice(b, e) for b, e in zip(begins, begins[1:])]
        self._index = torch.full((n,), _NO_BIN, dtype=torch.int8)
        # hi, lo, then this rank's number of micro-batches: one SUM all-reduce carries all.
        self._bins = torch.zeros(2 * n + 1, dtype=torch.float64)
        self._hi, self._lo = self._bins[:n], self._bins[n:2 * n]
        self._taken = [0] * len(self.params)
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
            s = self._slices[k]
            if self._taken[k] >= _C.binned_max_terms():
                raise RuntimeError(f"pycomm.exact_data_parallel: more than {_C.binned_max_terms()} micro-batches "
                                   "without reduce_gradients()")
            grad = param.grad
            if grad.is_sparse:
                grad = grad.to_dense()
            _C.add_to_bins(self._index[s], self._hi[s], self._lo[s], grad.contiguous().view(-1))
            self._taken[k] += 1
            param.grad = None
        return take

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
        """Collective over the group: writes to every parameter's ``.grad`` the exact sum of
        the gradients of every rank's micro-batches since the last call (divided by their
        global number where ``average``), rounded once, and empties the accumulator."""
        if self._sharded:
            for comm in self._comms:
                comm.check_merged()
            return
        n = self._index.numel()
        self._bins[2 * n] = self.micro_batches
        if self.compression is None:
            top = self._index.clone()
            self._all_reduce(top, dist.ReduceOp.MAX)
            _C.align_bins(self._index, self._hi, self._lo, top)
            self._all_reduce(self._bins, dist.ReduceOp.SUM)
            total = int(self._bins[2 * n].item())
            divisor = float(total) if self.average and total else 1.0
            for p, s in zip(self.params, self._slices):
                p.grad = torch.empty_like(p, memory_format=torch.contiguous_format)
                _C.value_of_bins(p.grad.view(-1), self._hi[s], self._lo[s], divisor)
        else:
            local = torch.empty(n, dtype=torch.float32)
            _C.value_of_bins(local, self._hi, self._lo, 1.0)
            count = self._bins[2 * n:]
            self._all_reduce(count, dist.ReduceOp.SUM)
            pycomm.all_reduce(local, dist.ReduceOp.SUM, self.group, compression=self.compression,
                              deterministic="exact")
            total = int(count.item())
            if self.average and total:
                local /= total
            for p, s in zip(self.params, self._slices):
                p.grad = local[s].view_as(p).to(p.dtype, copy=True)
        self._index.fill_(_NO_BIN)
        self._bins.zero_()
        self._taken = [0] * len(self.params)

    def remove(self):
        """Detaches the accumulator: gradients accumulate in ``.grad`` again (without
        FSDP; FSDP modules keep their reduce-scatter)."""
        for h in getattr(self, "_handles", []):
            h.remove()
        self._handles = []


def _on_pycomm(group, device):
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    return pycomm._pycomm_backend(group, device) is not None


# Collectives that only move bytes or add exactly: pycomm's, uncompressed, on a pycomm
# group (whatever PYCOMM_COMPRESSION says); the group's own backend otherwise.
def _exact_all_reduce(tensor, op, group):
    if _on_pycomm(group, tensor.device):
        pycomm.all_reduce(tensor, op, group, compression="none")
    else:
        dist.all_reduce(tensor, op, group=group)


def _exact_reduce_scatter(output, input, group):
    if _on_pycomm(group, input.device):
        pycomm.reduce_scatter_tensor(output, input, dist.ReduceOp.SUM, group, compression="none")
    else:
        dist.reduce_scatter_tensor(output, input, dist.ReduceOp.SUM, group=group)


def _fsdp_modules(module):
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


class _ExactReduceScatter(_FSDPReduceScatter):
    """One FSDP module's reduce-scatter under :class:`ExactDataParallel` (FSDP2's comm
    interface: ``allocate`` and a call with the output, the input laid out as FSDP chunks
    it, the group and the op, which is ignored: the result is the exact mean, or sum)."""

    def __init__(self, owner):
        self.owner = owner
        self.state, self.calls, self.merged = None, 0, True

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        flat = input_tensor.contiguous().view(-1)
        if self.state is None or self.state[0].numel() != flat.numel():
            self.state = (torch.full((flat.numel(),), _NO_BIN, dtype=torch.int8),
                          torch.zeros(flat.numel(), dtype=torch.float64), torch.zeros(flat.numel(), dtype=torch.float64))
        if self.calls >= _C.binned_max_terms():
            raise RuntimeError(f"pycomm.exact_data_parallel: more than {_C.binned_max_terms()} micro-batches in a step")
        _C.add_to_bins(*self.state, flat)
        self.calls += 1
        self.merged = False
        if not self.owner._finishing:
            output_tensor.zero_()  # FSDP adds it to the shard's gradient: nothing yet
            return None
        index, hi, lo = self.state
        top = index.clone()
        _exact_all_reduce(top, dist.ReduceOp.MAX, group)
        _C.align_bins(index, hi, lo, top)
        shard = output_tensor.numel()
        hi_shard = torch.empty(shard, dtype=torch.float64)
        lo_shard = torch.empty(shard, dtype=torch.float64)
        _exact_reduce_scatter(hi_shard, hi, group)
        _exact_reduce_scatter(lo_shard, lo, group)
        count = torch.tensor([float(self.calls)], dtype=torch.float64)
        _exact_all_reduce(count, dist.ReduceOp.SUM, group)
        total = count.item()
        divisor = total if self.owner.average else 1.0
        _C.value_of_bins(output_tensor.view(-1), hi_shard, lo_shard, divisor)
        self.state, self.calls, self.merged = None, 0, True
        return None

    def check_merged(self):
        if not self.merged:
            self.state, self.calls, self.merged = None, 0, True
            raise RuntimeError("pycomm.exact_data_parallel: under FSDP2 the step's last backward must run inside "
                               "edp.last_micro_batch(), where the ranks' gradients are merged")
