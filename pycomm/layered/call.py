"""One layered call: its kind's layout (options decided by the native path's rules, plan,
kernels, stamp, buffers: made at the kind's first call, then reused), the ranks'
agreement on it (stamps.py), the mover's collectives and pairwise sends started and
waited for with their failures wrapped, the call's folds, its record, and the
LayeredWork an asynchronous call returns; CPU calls run on the group's lane from its
first asynchronous one on."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from .. import _C
from . import stamps
from .layout import ONESHOT, _Layout
from .mover import _ALL_GATHER
from .record import record_of


class LayeredWork:
    """What an asynchronous layered call returns; ``get_future()`` yields ``[result]``
    like a pycomm Work's. On CUDA tensors it is complete on return (the steps were enqueued
    on the current stream); on CPU tensors once the group's lane ran the call (see
    Call.run), and wait() raises the call's error. On the device path wait() raises, too,
    a disagreement the device found in this or an earlier call on the group (stamps.py)."""

    def __init__(self, future, call):
        self.compression, self.determinism = call.options.codec, call.options.determinism
        self._call, self._future = call, future

    @property
    def algorithm(self):
        """What runs the call, e.g. "layered-direct over gloo": planned as it starts."""
        return self._call.algorithm

    def wait(self, timeout=None):
        self._future.wait()
        stamps.check(self._call.record, self._call.device)
        return True

    def is_completed(self):
        return self._future.done()

    def is_success(self):
        return self._future.done() and self.exception() is None

    def exception(self):
        if not self._future.done():
            return None
        try:
            self._future.value()
        except Exception as e:  # noqa: BLE001 - the call's error, whatever it is
            return e
        return None

    def result(self):
        return self._future.wait()

    def get_future(self):
        return self._future


# The tag of the layered path's point-to-point transfers on the mover (not 0, the default
# of a user's own).
_PAIRWISE_TAG = 0x70634C50


class Call:
    """One layered operation: its layout, the mover's transfers with their failures
    wrapped, and its record, stats and log line. Its steps (:meth:`run`) begin with the
    ranks' agreement on it (stamps.agree)."""

    def __init__(self, collective, group, like, op, nbytes, algorithm, compression, deterministic, count):
        self.group, self.collective, self.op, self.device = group, collective, op, like.device
        self.record = record_of(group, like.device)
        self.rank, self.size = self.record.rank, self.record.size
        self.key = (collective, count, like.dtype, getattr(op, "op", op), algorithm, compression, deterministic,
                    like.device)
        options_key = self.key[:1] + self.key[2:]
        self.options = self.record.options.get(options_key)
        if self.options is None:  # checked as the call is made, as natively: the dtype and the reduction
            self.options = self.record.options[options_key] = self.record.config.options(
                collective, like.dtype, op, algorithm or "", compression or "", deterministic or "")
        self.layout, self.nbytes, self.id = None, nbytes, None
        self.algorithm = f"layered over {self.record.mover}"  # until its layout is found (see begin)
        self.seq = next(self.record.seq)

    def begin(self):
        """The call's layout (made at its kind's first call: where it runs; the hosts of the
        mover's ranks are found by the group's first call, as its first collectives) and
        the start of its record."""
        record = self.record
        try:
            record.hosts_of(self.group, self.device)
        except Exception as e:
            self.fail("finding the mover's hosts", e)
        self.layout = record.layouts.get(self.key, lambda: _Layout(
            record, self.group, self.collective, self.key[2], self.key[1], self.op, self.options, self.device,
            self.nbytes))
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            self.layout.pinned = True  # a CUDA graph replays into its buffers: they stay
        self.algorithm = self.layout.algorithm
        self.id = record.recorder.begin(self.layout.kind, self.seq)

    def run(self, steps, result, async_op, stage):
        """Runs the agreement, then ``steps``; returns a LayeredWork for ``async_op``, else
        None. ``stage`` puts a one-shot call's data in this rank's message of the opening
        all-gather, the agreement's (stamps.py). On CUDA tensors at once (the steps
        only enqueue work on the stream); on CPU tensors on the group's *lane*, a thread of
        its own from the group's first asynchronous call on: the caller goes on (DDP and
        FSDP overlap the reduction with backward) and the lane makes the calls one after
        the other, in the order they were made, so that every rank starts the mover's
        collectives in the same order. From then on a call without ``async_op`` waits for
        its turn on the lane too. While a call is on the lane, the mover group must not be
        used directly: the order of its collectives would then differ between ranks."""
        def whole():
            try:
                self.begin()
                if self.layout.variant == ONESHOT:
                    stage()
                stamps.agree(self)
                steps()
            except BaseException as e:  # ended already where the mover failed or ranks disagreed
                self.record.layouts.drop(self.key)
                self.end(f"pycomm: {self.describe()} failed on rank {self.rank}: {e}")
                raise
            self.end()

        stamps.check(self.record, self.device)
        lane = self.record.lane
        if self.device.type == "cuda" or (lane is None and not async_op):
            whole()
            if not async_op:
                return None
            done = torch.futures.Future(devices=[result.device] if result.is_cuda else None)
            done.set_result([result])
            return LayeredWork(done, self)
        if lane is None:
            lane = self.record.lane = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pycomm-layered")
        future = torch.futures.Future()

        def on_lane():
            try:
                whole()
            except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
                future.set_exception(e)
                return
            future.set_result([result])

        lane.submit(on_lane)
        work = LayeredWork(future, self)
        if async_op:
            return work
        work.wait()
        return None

    def disagree(self, what):
        message = f"pycomm: {self.describe()} failed on rank {self.rank}: {what}: ranks called different " \
                  "collectives or arguments"
        raise dist.DistBackendError(self.end(message))

    def describe(self):
        return f"{self.collective} #{self.seq} ({self.algorithm}) on group '{self.record.name}'"

    def move(self, what, *args, group=None):
        """Starts the mover's collective ``what`` (asynchronously) on the mover, or on
        ``group``, one of its subgroups; :meth:`wait` for it."""
        try:
            return what, getattr(dist, what)(*args, group=group or self.group, async_op=True)
        except Exception as e:
            self.fail(what, e)

    def gather(self, output, input):
        """Starts the mover's all-gather of ``input``, the same size on every rank, into
        ``output`` (rank p's at row p): torch.distributed's all-gather without its Python
        checks, for the opening of every call (stamps.py). :meth:`wait` for it."""
        try:
            return _ALL_GATHER, self.group._allgather_base(output.view(-1), input)
        except Exception as e:
            self.fail(_ALL_GATHER, e)

    def pairwise(self, sends, receives):
        """Starts the mover's point-to-point transfers: ``sends`` and ``receives`` are
        (peer, byte tensor) pairs that match the peers' receives and sends (every rank
        knows every length once the stamps agree); empty ones are left out on both sides.
        :meth:`wait` for them."""
        try:
            works = [self.group.recv([t], p, _PAIRWISE_TAG) for p, t in receives if t.numel()]
            works += [self.group.send([t], p, _PAIRWISE_TAG) for p, t in sends if t.numel()]
        except Exception as e:
            self.fail("pairwise sends", e)
        return "pairwise sends", _AllOf(works)

    def wait(self, moving):
        """Waits for what :meth:`move` or :meth:`pairwise` started; its failure fails this
        operation. (For NCCL, the current stream waits, not the host.)"""
        what, work = moving
        try:
            work.wait()
        except Exception as e:
            self.fail(what, e)

    def fail(self, what, error):
        message = f"pycomm: {self.describe()} failed on rank {self.rank}: {what}: {error}"
        raise dist.DistBackendError(self.end(message)) from error

    def buffer(self, role, part, nbytes):
        """The layout's byte buffer for ``role`` in part ``part`` (kept from call to call)."""
        return self.layout.buffer(role, part, nbytes)

    def fold(self, out, terms, forms, count, stage, op=None, dtype=None, codec=None):
        """The call's fold (its dtype, operator and codec, unless given) of ``count``
        elements: ``_C.fold``'s contract."""
        if not count:
            return
        layout = self.layout
        op, dtype, codec = self.op if op is None else op, dtype or layout.dtype, codec or layout.codec
        fold, most = layout.kernels.fold, layout.terms_per_fold
        while most and len(terms) > most:  # in slices: see terms_per_fold
            partial = torch.empty(count, dtype=_C.partial_dtypes.get(dtype, dtype), device=out.device)
            fold(partial, terms[:most], forms[:most], dtype, count, op, self.size, layout.exact, codec, layout.block,
                 _C.Stage.Partial)
            terms, forms = [partial, *terms[most:]], [_C.Form.Partial, *forms[most:]]
        fold(out, terms, forms, dtype, count, op, self.size, layout.exact, codec, layout.block, stage)

    def fold_segments(self, plain, slots, segments, skip, slot_bytes, stage, op=None, dtype=None):
        """A codec's step over every segment at once: ``_C.fold_segments``' contract, of the
        segments (count, parts, unit) of ``plain``, in the call's dtype and operator unless
        given."""
        layout = self.layout
        layout.kernels.fold_segments(plain, slots, *segments, skip, slot_bytes, dtype or layout.dtype,
                                     self.op if op is None else op, self.size, layout.exact, layout.codec,
                                     layout.block, stage)

    def end(self, failure=None):
        """Ends the operation's record; returns ``failure`` with where the flight recorder
        was written, if it was."""
        if self.id is None:  # ended already, or never begun
            return failure
        ended, self.id = self.id, None
        if failure is None:
            self.record.recorder.completed(ended)
            return None
        written = self.record.recorder.failed(ended, failure)
        return f"{failure} (flight recorder: {written})" if written else failure


class _AllOf:
    """Works waited for as one."""

    def __init__(self, works):
        self.works = works

    def wait(self):
        for w in self.works:
            w.wait()
