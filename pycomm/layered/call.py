"""One layered call: its options (decided by the native path's rules), its plan, the
ranks' agreement on it (stamps), the mover's collectives started and waited for with
their failures wrapped, the call's folds and buffers, its record, and the LayeredWork an
asynchronous call returns; CPU calls run on the group's lane from its first asynchronous
one on."""
from __future__ import annotations

import zlib
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from .. import _C
from .folds import PARTIAL_DTYPES, _triton_fold, kernels_for, terms_per_fold
from .mover import _ALL_GATHER, _PAIRWISE_MOVERS
from .record import record_of


class LayeredWork:
    """What an asynchronous layered call returns; ``get_future()`` yields ``[result]``
    like a pycomm Work's. On CUDA tensors it is complete on return (the steps were enqueued
    on the current stream); on CPU tensors once the group's lane ran the call (see
    _Call.run), and wait() raises the call's error."""

    def __init__(self, future, call):
        self.compression, self.determinism = call.codec, call.determinism
        self._call, self._future = call, future

    @property
    def algorithm(self):
        """What runs the call, e.g. "layered-direct over gloo": planned as it starts."""
        return self._call.algorithm

    def wait(self, timeout=None):
        self._future.wait()
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
# A stamp: this marker, then the fields of _Call.stamp, each an int64 (see _code).
_STAMP_MARK = 0x70634C53
_STAMP_FIELDS = ("sequence number", "collective", "count", "dtype", "reduce op", "compression", "block",
                 "determinism", "algorithm")


def _code(value):
    """A stamp field as an int64: integers as they are, names by their CRC-32."""
    return value if isinstance(value, int) else zlib.crc32(value.encode())


class _Call:
    """One layered operation: its options (decided by the native path's rules), the
    mover's collectives with their failures wrapped, and its record, stats and log line.
    Its steps (:meth:`run`) begin with the ranks' agreement on it (:meth:`agree`)."""

    def __init__(self, collective, group, like, op, nbytes, algorithm, compression, deterministic, count):
        self.group, self.dtype, self.op = group, like.dtype, op
        self.record = record_of(group, like.device)
        key = (collective, like.dtype, _op_name(op), algorithm or "", compression or "", deterministic or "")
        options = self.record.options.get(key)
        if options is None:
            options = self.record.options[key] = _C.layered_options(collective, like.dtype, op, algorithm or "",
                                                                    compression or "", deterministic or "")
        self.options, self.count, self.nbytes = options, count, nbytes
        self.codec, self.block, self.determinism = options.codec, options.block, options.determinism
        self.exact = options.determinism == "exact"
        self.kernel = kernels_for(like.device)
        self.terms_per_fold = terms_per_fold(self.kernel, like.device)
        self.rank, self.size = self.record.rank, self.record.size
        if self.exact and self.terms_per_fold and self.size > self.terms_per_fold and like.dtype.is_floating_point \
                and _C.reduction(op, like.dtype)[0] in ("sum", "avg", "premul_sum"):
            self.kernel = _triton_fold(f"exact mode folds every rank's terms in one kernel, pycomm's CUDA kernels take "
                                       f"at most {self.terms_per_fold}, and this group has {self.size} ranks")
            self.terms_per_fold = None
        self.algorithm = f"layered over {self.record.mover}"  # until planned (see begin)
        self.collective, self.seq = collective, next(self.record.seq)
        self.plan = self.id = None
        # The block matters only under a codec, as natively.
        self.stamp = (self.seq, collective, count, str(like.dtype).split(".")[-1], _op_name(op), self.codec,
                      self.block if self.codec != "none" else 0, self.determinism, options.algorithm)
        self.device = like.device

    def begin(self):
        """The plan (where it runs: the hosts of the mover's ranks are found by the group's
        first call, as its first collectives) and the start of the record."""
        try:
            hosts = self.record.hosts_of(self.group, self.device)
        except Exception as e:
            self.fail("finding the mover's hosts", e)
        self.host_team, self.column_team = hosts.host_team, hosts.column_team
        self.plan = _C.layered_plan(self.collective, self.dtype, self.count, self.options, hosts.host_of, hosts.within,
                                    hosts.across, hosts.core_share, self.device.type == "cuda",
                                    self.record.mover in _PAIRWISE_MOVERS)
        self.algorithm = f"{self.plan.variant} over {self.record.mover}"
        self.id = self.record.recorder.begin(self.collective, self.seq, self.dtype, self.count, self.op, self.options,
                                             self.plan, self.nbytes, self.device.index if self.device.type == "cuda"
                                             else -1)

    def run(self, steps, result, async_op):
        """Runs the agreement, then ``steps``; returns a LayeredWork for ``async_op``, else
        None. On CUDA tensors at once (the steps only enqueue work on the stream); on CPU
        tensors on the group's *lane*, a thread of its own from the group's first
        asynchronous call on: the caller goes on (DDP and FSDP overlap the reduction with
        backward) and the lane makes the calls one after the other, in the order they were
        made, so that every rank starts the mover's collectives in the same order. From
        then on a call without ``async_op`` waits for its turn on the lane too. While a
        call is on the lane, the mover group must not be used directly: the order of its
        collectives would then differ between ranks."""
        def whole():
            try:
                self.begin()
                self.agree()
                steps()
            except BaseException as e:  # ended already where the mover failed or ranks disagreed
                self.record.scratch.drop()
                self.end(f"pycomm: {self.describe()} failed on rank {self.rank}: {e}")
                raise
            self.end()

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

    def agree(self):
        """Step 0: every rank's stamp, gathered and compared with this rank's."""
        device = self.device
        mine = torch.tensor([_STAMP_MARK, *map(_code, self.stamp)], dtype=torch.int64,
                            pin_memory=device.type == "cuda").to(device, non_blocking=True)
        everyone = torch.empty(self.size * mine.numel(), dtype=torch.int64, device=device)
        self.wait(self.move(_ALL_GATHER, everyone, mine))
        everyone = everyone.view(self.size, -1)
        if device.type == "cuda":  # no host synchronization: see the package's docstring
            torch._assert_async((everyone == mine).all(), "pycomm: ranks called different layered collectives or "
                                                          "arguments (stamps differ)")
            return
        for peer, theirs in enumerate(everyone.tolist()):
            if theirs[0] != _STAMP_MARK:
                self.disagree(f"rank {peer} sent something else than a stamp: it is in another operation")
            for field, value, code in zip(_STAMP_FIELDS, self.stamp, theirs[1:]):
                if _code(value) != code:
                    self.disagree(f"rank {peer} called it with {field} {_decoded(code, value)} where this rank has "
                                  f"{value}")

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

    def pairwise(self, sends, receives):
        """Starts the mover's point-to-point transfers: ``sends`` and ``receives`` are
        (peer, byte tensor) pairs that match the peers' receives and sends (every rank
        knows every length once the stamps agree); empty ones are left out on both sides.
        :meth:`wait` for them."""
        ops = [dist.P2POp(dist.irecv, t, group=self.group, tag=_PAIRWISE_TAG, group_peer=p) for p, t in receives
               if t.numel()]
        ops += [dist.P2POp(dist.isend, t, group=self.group, tag=_PAIRWISE_TAG, group_peer=p) for p, t in sends
                if t.numel()]
        try:
            return "pairwise sends", _AllOf(dist.batch_isend_irecv(ops) if ops else [])
        except Exception as e:
            self.fail("pairwise sends", e)

    def wait(self, moving):
        """Waits for what :meth:`move` or :meth:`pairwise` started; its failure fails this operation.
        (For NCCL, the current stream waits, not the host.)"""
        what, work = moving
        try:
            work.wait()
        except Exception as e:
            self.fail(what, e)

    def fail(self, what, error):
        message = f"pycomm: {self.describe()} failed on rank {self.rank}: {what}: {error}"
        raise dist.DistBackendError(self.end(message)) from error

    def buffer(self, role, part, nbytes, zero_from=None):
        """A byte buffer of the group's scratch for ``role`` in part ``part`` of this call;
        zeroed from byte ``zero_from`` on, where given (padding that travels)."""
        b = self.record.scratch.get(role, part, nbytes, self.device)
        if zero_from is not None:
            b[zero_from:].zero_()
        return b

    def fold(self, out, terms, forms, count, stage, op=None, dtype=None, codec=None):
        """The call's fold (its dtype, operator and codec, unless given) of ``count``
        elements: ``_C.fold``'s contract."""
        if not count:
            return
        op, dtype, codec = self.op if op is None else op, dtype or self.dtype, codec or self.codec
        while self.terms_per_fold and len(terms) > self.terms_per_fold:  # in slices: see terms_per_fold
            partial = torch.empty(count, dtype=PARTIAL_DTYPES.get(dtype, dtype), device=out.device)
            self.kernel(partial, terms[:self.terms_per_fold], forms[:self.terms_per_fold], dtype, count, op,
                        self.size, self.exact, codec, self.block, _C.Stage.Partial)
            terms = [partial, *terms[self.terms_per_fold:]]
            forms = [_C.Form.Partial, *forms[self.terms_per_fold:]]
        self.kernel(out, terms, forms, dtype, count, op, self.size, self.exact, codec, self.block, stage)

    def end(self, failure=None):
        """Ends the operation's record; returns ``failure`` with where the flight recorder
        was written, if it was."""
        if self.id is None:  # ended already
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


def _op_name(op):
    return str(getattr(op, "op", op)).rsplit(".", 1)[-1]


def _decoded(code, like):
    """A peer's stamp field for a message: an integer field as it is; a name by the
    names this rank knows for that field."""
    if isinstance(like, int):
        return code
    names = ["allreduce", "reduce_scatter", "allgather", "none", *_C.algorithms, *_C.codecs, *_C.determinism_levels,
             *(str(d).split(".")[-1] for d in vars(torch).values() if isinstance(d, torch.dtype)),
             *dist.ReduceOp.RedOpType.__members__]
    return next((name for name in names if _code(name) == code), f"(unknown, code {code})")
