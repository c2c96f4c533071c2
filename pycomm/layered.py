"""The layered path: pycomm's all-reduce, reduce-scatter and all-gather over a group whose
backend is not pycomm (nccl, gloo, mpi, any registered backend).

That group, the *mover*, only moves bytes; pycomm reduces. The algorithm is the native
direct one (twoshot), with the mover's collectives in place of pycomm's transports:

0. Agreement: one all-gather of every rank's stamp of the call (sequence number,
   collective, count, dtype, reduction, codec, block, determinism mode), of the same
   size whatever the call, compared before anything else moves: ranks that disagree
   fail the call on every rank, naming the field and both values, as the native path
   does, instead of folding what does not belong together.
1. Segments: the buffer is cut over the ranks as the native path cuts it
   (``_C.segment_begins``; whole codec blocks under a codec, so blocks start at multiples
   of the block in the tensor).
2. Reduce-scatter: one ``all_to_all_single`` of byte payloads sends segment s of every
   rank's input to rank s, raw (the input's own bytes) or encoded (codec blocks from the
   segment's first element, this rank's contribution quantized once).
3. Fold: rank s reduces the n contributions of its segment in logical rank order, or
   exactly (exact mode), and under a codec encodes the result once more
   (``_C.fold``, i.e. ``DeviceOps::reduce_terms``: the function every native algorithm
   reduces with).
4. All-gather (all-reduce only): one ``all_gather_into_tensor`` of the (encoded) results,
   each padded to the longest segment; every rank then decodes every segment, its own too.

The mover never reduces, so its algorithm, channel count or protocol cannot change a bit:
for the same inputs, world size and options the result equals the native path's (its
twoshot, at 2 ranks its ring too, and in deterministic modes every algorithm's). Levels: D0-D3 in mode 1
(a fixed fold order over logical ranks, whatever the mover does), D0-D5 in exact mode
(the exact sum depends only on the multiset of contributions).

Devices and streams: CPU tensors are folded by the CPU ops, on the calling thread, or on
the group's lane (a thread of its own) from its first asynchronous call on, so that the
caller overlaps the call with its own work (see _Call.run). CUDA
tensors are folded by kernels enqueued on the caller's current stream, and the mover's
collectives are called blocking (``async_op=False``), which for NCCL orders them on the
current stream without a host synchronization; nothing here waits on the host. So on
CUDA the stamps are compared on the device (``torch._assert_async``): a disagreement
stops the process with a device-side assertion rather than a DistBackendError.
"""
from __future__ import annotations

import itertools
import json
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from . import _C

Form, Stage = _C.Form, _C.Stage
ALGORITHM = "layered-direct"
# torch 2.13 renamed all_gather_into_tensor (still there, deprecated) to all_gather_single.
_ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


def mover_name(group, device):
    """The name of the group's backend for ``device`` ("gloo", "nccl", ...)."""
    try:
        return group._get_backend(torch.device(device)).name()
    except (RuntimeError, AttributeError):
        return dist.get_backend(group)


class LayeredWork:
    """What an asynchronous layered call returns; ``get_future()`` yields ``[result]``
    like a pycomm Work's. On CUDA tensors it is complete on return (the steps were enqueued
    on the current stream); on CPU tensors once the group's lane ran the call (see
    _Call.run), and wait() raises the call's error."""

    def __init__(self, future, call):
        self.algorithm, self.compression, self.determinism = call.algorithm, call.codec, call.determinism
        self._future = future

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


def kernels_for(device):
    """The fold (``_C.fold``'s contract) for tensors on ``device``: the CPU ops for CPU
    tensors; for CUDA tensors, pycomm's CUDA kernels or its Triton kernels as
    PYCOMM_KERNELS (auto, cuda, triton) says, auto taking the CUDA kernels where pycomm
    was built with them."""
    choice = _C.kernel_choice() if device.type == "cuda" else "cpu"
    if device.type != "cuda" or (choice == "cuda" or (choice == "auto" and _C.has_cuda)):
        if device.type == "cuda" and not _C.has_cuda:
            raise ValueError("pycomm: PYCOMM_KERNELS=cuda, and this pycomm was built without CUDA kernels")
        return _C.fold
    return _triton_fold("CUDA tensors need pycomm's CUDA build or its Triton kernels")


def _triton_fold(need):
    """The Triton kernels' fold; a ValueError that says ``need`` where triton is missing."""
    try:
        from . import triton_kernels
    except ImportError as e:
        raise ValueError(f"pycomm: {need}, and triton cannot be imported ({e}); install it, e.g. "
                         "pip install 'pycomm[triton]'") from e
    return triton_kernels.fold


# The type a fold's partial values are kept in (Stage.Partial): 16-bit floats accumulate in
# float32, bool in uint8, everything else in its own type.
PARTIAL_DTYPES = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.bool: torch.uint8}
# The most terms one launch of pycomm's CUDA kernels folds (their parameter holds 64).
CUDA_FOLD_TERMS = 64


def terms_per_fold(kernel, device):
    """The most terms one call of ``kernel`` folds on ``device`` (None: any number; the
    CPU ops and the Triton kernel, which loops over runs of terms). A fold of more runs in
    slices, each slice's accumulation handed to the next as a partial term: the same bits
    as one fold, since terms fold left in order and a partial holds the accumulation
    exactly. Exact mode rounds its sum once over every term, so it cannot be sliced: past
    this many ranks its folds run on the Triton kernel, which gives the same bits."""
    return CUDA_FOLD_TERMS if device.type == "cuda" and kernel is _C.fold else None


class _GroupRecord:
    """What this rank keeps of the layered calls on one group: their record (counters,
    flight recorder and log lines, kept as a pycomm group keeps its own), options and
    lane."""

    def __init__(self, group, mover):
        self.name, self.rank, self.size, self.mover = group.group_name, group.rank(), group.size(), mover
        self.seq = itertools.count(1)
        self.recorder = _C.LayeredRecorder(self.name, self.rank, self.size, mover)
        self.options = {}  # the options of each kind of call, read from the environment once
        self.lane = None  # the thread of its calls on CPU tensors, from the first asynchronous one

    def stats(self):
        """A pycomm group's ``stats()``, with ``"mover"`` naming the group's backend."""
        return dict(json.loads(self.recorder._stats_json()), mover=self.mover)


_records: dict[str, tuple[int, _GroupRecord]] = {}


def record_of(group, device="cpu"):
    """The record of ``group``'s layered calls (made at its first call). Kept by the
    group's name, and renewed when a new group object takes a name (the old one
    destroyed, its lane let go once idle), without holding the group alive."""
    held = _records.get(group.group_name)
    if held is None or held[0] != id(group):
        if held is not None and held[1].lane is not None:
            held[1].lane.shutdown(wait=False)
        held = _records[group.group_name] = (id(group), _GroupRecord(group, mover_name(group, device)))
    return held[1]


# A stamp: this marker, then the fields of _Call.stamp, each an int64 (see _code).
_STAMP_MARK = 0x70634C53
_STAMP_FIELDS = ("sequence number", "collective", "count", "dtype", "reduce op", "compression", "block",
                 "determinism")


def _code(value):
    """A stamp field as an int64: integers as they are, names by their CRC-32."""
    return value if isinstance(value, int) else zlib.crc32(value.encode())


class _Call:
    """One layered operation: its options (decided by the native path's rules), the
    mover's collectives with their failures wrapped, and its record, stats and log line.
    Its steps (:meth:`run`) begin with the ranks' agreement on it (:meth:`agree`)."""

    def __init__(self, collective, group, like, op, nbytes, compression, deterministic, count):
        self.group, self.dtype, self.op = group, like.dtype, op
        self.record = record_of(group, like.device)
        key = (collective, like.dtype, _op_name(op), compression or "", deterministic or "")
        options = self.record.options.get(key)
        if options is None:
            options = self.record.options[key] = _C.layered_options(collective, like.dtype, op, compression or "",
                                                                    deterministic or "")
        self.codec, self.block, self.determinism = options.codec, options.block, options.determinism
        self.exact = options.determinism == "exact"
        self.kernel = kernels_for(like.device)
        self.terms_per_fold = terms_per_fold(self.kernel, like.device)
        self.rank, self.size = self.record.rank, self.record.size
        if self.exact and self.terms_per_fold and self.size > self.terms_per_fold and like.dtype.is_floating_point \
                and _C.reduction(op, like.dtype)[0] in ("sum", "avg", "premul_sum"):
            why = (f"exact mode folds every rank's terms in one kernel, pycomm's CUDA kernels take at most "
                   f"{self.terms_per_fold}, and this group has {self.size} ranks")
            if PARTIAL_DTYPES.get(like.dtype, like.dtype) != torch.float32:
                raise ValueError(f"pycomm: {why}; the Triton kernel, which folds any number, has no exact mode for "
                                 f"{like.dtype} (it adds in 128-bit integers)")
            self.kernel = _triton_fold(why)
            self.terms_per_fold = None
        self.algorithm = f"{ALGORITHM} over {self.record.mover}"
        self.collective, self.seq = collective, next(self.record.seq)
        self.id = self.record.recorder.begin(collective, self.seq, like.dtype, count, op, self.codec, self.block,
                                             self.determinism, nbytes, like.device.index if like.is_cuda else -1)
        # The block matters only under a codec, as natively.
        self.stamp = (self.seq, collective, count, str(like.dtype).split(".")[-1], _op_name(op), self.codec,
                      self.block if self.codec != "none" else 0, self.determinism)
        self.device = like.device

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
                self.agree()
                steps()
            except BaseException as e:  # ended already where the mover failed or ranks disagreed
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
        if device.type == "cuda":  # no host synchronization: see the top
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

    def move(self, what, *args):
        """Starts the mover's collective ``what`` (asynchronously); :meth:`wait` for it."""
        try:
            return what, getattr(dist, what)(*args, group=self.group, async_op=True)
        except Exception as e:
            self.fail(what, e)

    def wait(self, moving):
        """Waits for a collective :meth:`move` started; its failure fails this operation.
        (For NCCL, the current stream waits, not the host.)"""
        what, work = moving
        try:
            work.wait()
        except Exception as e:
            self.fail(what, e)

    def fail(self, what, error):
        message = f"pycomm: {self.describe()} failed on rank {self.rank}: {what}: {error}"
        raise dist.DistBackendError(self.end(message)) from error

    def fold(self, out, terms, forms, count, stage, op=None):
        if not count:
            return
        op = self.op if op is None else op
        while self.terms_per_fold and len(terms) > self.terms_per_fold:  # in slices: see terms_per_fold
            partial = torch.empty(count, dtype=PARTIAL_DTYPES.get(self.dtype, self.dtype), device=out.device)
            self.kernel(partial, terms[:self.terms_per_fold], forms[:self.terms_per_fold], self.dtype, count, op,
                        self.size, self.exact, self.codec, self.block, _C.Stage.Partial)
            terms = [partial, *terms[self.terms_per_fold:]]
            forms = [_C.Form.Partial, *forms[self.terms_per_fold:]]
        self.kernel(out, terms, forms, self.dtype, count, op, self.size, self.exact, self.codec, self.block, stage)

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


def _op_name(op):
    return str(getattr(op, "op", op)).rsplit(".", 1)[-1]


def _decoded(code, like):
    """A peer's stamp field for a message: an integer field as it is; a name by the
    names this rank knows for that field."""
    if isinstance(like, int):
        return code
    names = ["allreduce", "reduce_scatter", "allgather", "none", *_C.codecs, *_C.determinism_levels,
             *(str(d).split(".")[-1] for d in vars(torch).values() if isinstance(d, torch.dtype)),
             *dist.ReduceOp.RedOpType.__members__]
    return next((name for name in names if _code(name) == code), f"(unknown, code {code})")


def _bytes(t):
    return t.view(torch.uint8)


def _dense(t):
    """A contiguous flat view of ``t``, or of a copy of it (written back by ``_settle``)."""
    return (t if t.is_contiguous() else t.contiguous()).view(-1)


def _settle(t, flat):
    if flat.data_ptr() != t.data_ptr() or not t.is_contiguous():
        t.copy_(flat.view(t.shape))


def _slot(nbytes):
    """Room for an encoded piece in a buffer of several: a multiple of 16 bytes, so that
    every piece starts aligned for the kernels (whose scales are read as float32)."""
    return -(-nbytes // 16) * 16


def _pieces(buffer, sizes):
    """``buffer`` cut into consecutive pieces of ``sizes`` elements."""
    offsets = [0, *itertools.accumulate(sizes)]
    return [buffer[offsets[i]:offsets[i + 1]] for i in range(len(sizes))]


def _exchange(call, flat, begins, element_bytes):
    """Step 2, started: segment s of ``flat`` goes to rank s. Returns the mover's pending
    all-to-all and this rank's n contributions to its own segment, in rank order, with
    their forms, readable once it is waited for. Raw segments travel as their bytes (this
    rank's own included, as the mover's all-to-all takes one buffer); encoded ones are
    encoded here, this rank's own kept as its input (quantized as it is loaded)."""
    n, r = call.size, call.rank
    lengths = [begins[s + 1] - begins[s] for s in range(n)]
    mine = flat[begins[r]:begins[r + 1]]
    if call.codec == "none":
        recv = torch.empty(n * lengths[r] * element_bytes, dtype=torch.uint8, device=flat.device)
        moving = call.move("all_to_all_single", recv, _bytes(flat), [lengths[r] * element_bytes] * n,
                           [length * element_bytes for length in lengths])
        pieces = _pieces(recv, [lengths[r] * element_bytes] * n)
        return moving, [mine if p == r else pieces[p] for p in range(n)], [Form.Input] * n
    encoded = [_C.encoded_size(call.codec, call.block, length) for length in lengths]
    outgoing = [0 if s == r else _slot(encoded[s]) for s in range(n)]
    send = torch.empty(sum(outgoing), dtype=torch.uint8, device=flat.device)
    for s, piece in enumerate(_pieces(send, outgoing)):
        if s != r:
            call.fold(piece[:encoded[s]], [flat[begins[s]:begins[s + 1]]], [Form.Input], lengths[s], Stage.Encoded)
    incoming = [0 if p == r else _slot(encoded[r]) for p in range(n)]
    recv = torch.empty(sum(incoming), dtype=torch.uint8, device=flat.device)
    moving = call.move("all_to_all_single", recv, send, incoming, outgoing)
    pieces = [piece[:encoded[r]] for piece in _pieces(recv, incoming)]
    return (moving, [mine if p == r else pieces[p] for p in range(n)],
            [Form.Input if p == r else Form.Encoded for p in range(n)])


# A large all-reduce runs as up to _MAX_PARTS parts of at least _PART_BYTES, pipelined:
# while the mover carries one part, this rank encodes the next and decodes the previous.
_PART_BYTES = 4 << 20
_MAX_PARTS = 8


def _parts(count, unit, element_bytes):
    """[start, stop) of each part: whole multiples of ``unit`` elements but the last."""
    parts = max(1, min(_MAX_PARTS, count * element_bytes // _PART_BYTES))
    size = -(-count // parts // unit) * unit
    return [(start, min(count, start + size)) for start in range(0, count, size)]


def all_reduce(tensor, op, group, compression, deterministic, async_op):
    flat = _dense(tensor)
    call = _Call("allreduce", group, flat, op, flat.numel() * flat.element_size(), compression, deterministic,
                 flat.numel())
    return call.run(lambda: _all_reduce(call, tensor, flat), tensor, async_op)


def _all_reduce(call, tensor, flat):
    n, r, es, count = call.size, call.rank, flat.element_size(), flat.numel()
    if count == 0:
        return
    coded = call.codec != "none"
    unit = call.block if coded else 1
    piece = (lambda m: _C.encoded_size(call.codec, call.block, m)) if coded else (lambda m: m * es)

    def scatter(start, stop):  # steps 1 and 2 of a part: its segments (whole codec blocks)
        part = flat[start:stop]
        begins = _C.segment_begins(part.numel(), n, unit)
        return (part, begins) + _exchange(call, part, begins, es)

    def fold_and_gather(part, begins, moving, terms, forms):  # steps 3 and 4, started
        lengths = [begins[s + 1] - begins[s] for s in range(n)]
        # This rank's result (encoded under a codec) goes into a piece padded to the
        # longest segment's (segment 0's), the size every rank gives the all-gather.
        width = _slot(piece(lengths[0])) if coded else piece(lengths[0])
        result = torch.zeros(width, dtype=torch.uint8, device=part.device)
        call.wait(moving)
        call.fold(result[:piece(lengths[r])], terms, forms, lengths[r], Stage.FinalEncoded if coded else Stage.Final)
        if not coded and part.numel() == n * lengths[0]:  # equal segments: gathered straight into place
            return part, begins, call.move(_ALL_GATHER, _bytes(part), result), None, width
        gathered = torch.empty(n * width, dtype=torch.uint8, device=part.device)
        return part, begins, call.move(_ALL_GATHER, gathered, result), gathered, width

    def unpack(part, begins, moving, gathered, width):
        call.wait(moving)
        if gathered is None:
            return
        for s, block in enumerate(_pieces(gathered, [width] * n)):
            segment, length = part[begins[s]:begins[s + 1]], begins[s + 1] - begins[s]
            if coded:  # decoding alone: the result was finalized before it was encoded
                call.fold(segment, [block[:piece(length)]], [Form.Encoded], length, Stage.Final, op=dist.ReduceOp.SUM)
            elif length:
                _bytes(segment).copy_(block[:piece(length)])

    # Parts start on multiples of n codec blocks, so every block of the tensor stays whole
    # and each element is reduced exactly as without parts.
    # Every rank starts the mover's collectives in the same order: part i's all-to-all,
    # then part i-1's all-gather.
    to_fold = to_unpack = None
    for bounds in _parts(count, n * unit, es) + [None, None]:
        scattered = scatter(*bounds) if bounds is not None else None
        gathering = fold_and_gather(*to_fold) if to_fold is not None else None
        if to_unpack is not None:
            unpack(*to_unpack)
        to_fold, to_unpack = scattered, gathering
    _settle(tensor, flat)


def reduce_scatter_tensor(output, input, op, group, compression, deterministic, async_op):
    flat_in, out = _dense(input), _dense(output)
    n, count = group.size(), out.numel()
    if output.dtype != input.dtype or flat_in.numel() != n * count:
        raise ValueError(f"pycomm: reduce_scatter: the input holds {flat_in.numel()} {input.dtype} elements; a group "
                         f"of {n} needs {n} x the output's {count} {output.dtype} elements")
    call = _Call("reduce_scatter", group, flat_in, op, flat_in.numel() * flat_in.element_size(), compression,
                 deterministic, flat_in.numel())
    return call.run(lambda: _reduce_scatter(call, output, out, flat_in), output, async_op)


def _reduce_scatter(call, output, out, flat_in):
    n, count = call.size, out.numel()
    if count == 0:
        return
    begins = _C.segment_begins(count * n, n, 1)  # blocks start at each rank's segment
    moving, terms, forms = _exchange(call, flat_in, begins, flat_in.element_size())
    call.wait(moving)
    if call.codec != "none" and call.determinism != "0":
        # Deterministic modes quantize the result once more, as the native reduce-scatter
        # does, so that a shard equals the matching slice of the all-reduce.
        encoded = torch.empty(_C.encoded_size(call.codec, call.block, count), dtype=torch.uint8, device=out.device)
        call.fold(encoded, terms, forms, count, Stage.FinalEncoded)
        call.fold(out, [encoded], [Form.Encoded], count, Stage.Final, op=dist.ReduceOp.SUM)
    else:
        call.fold(out, terms, forms, count, Stage.Final)
    _settle(output, out)


def all_gather_into_tensor(output, input, group, compression, deterministic, async_op):
    flat_in, out = _dense(input), _dense(output)
    n, count = group.size(), flat_in.numel()
    if output.dtype != input.dtype or out.numel() != n * count:
        raise ValueError(f"pycomm: allgather: the output holds {out.numel()} {output.dtype} elements; a group of "
                         f"{n} needs {n} x the input's {count} {input.dtype} elements")
    call = _Call("allgather", group, flat_in, dist.ReduceOp.SUM, out.numel() * out.element_size(), compression,
                 deterministic, flat_in.numel())
    return call.run(lambda: _all_gather(call, output, out, flat_in), output, async_op)


def _all_gather(call, output, out, flat_in):
    n, count = call.size, flat_in.numel()
    if count == 0:
        return
    if call.codec == "none":
        call.wait(call.move(_ALL_GATHER, out, flat_in))
    else:
        size = _C.encoded_size(call.codec, call.block, count)
        mine = torch.zeros(_slot(size), dtype=torch.uint8, device=out.device)
        call.fold(mine[:size], [flat_in], [Form.Input], count, Stage.Encoded)
        gathered = torch.empty(n * mine.numel(), dtype=torch.uint8, device=out.device)
        call.wait(call.move(_ALL_GATHER, gathered, mine))
        for s, block in enumerate(_pieces(gathered, [mine.numel()] * n)):
            call.fold(out[s * count:(s + 1) * count], [block[:size]], [Form.Encoded], count, Stage.Final)
    _settle(output, out)
