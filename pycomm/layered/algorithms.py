"""The layered path's algorithms over the mover, as the package's docstring states them:
segments and their exchange, the direct and the hierarchical all-reduce in parts run as
a pipeline, reduce-scatter and all-gather. Each entry point makes the operation's Call
and runs its steps through it. What every call of a kind shares (segments, buffers and
the views of them) is its layout's, made at the kind's first call; a codec's step runs
over every segment at once (fold_segments: one kernel launch on a device). A one-shot
call's data travels in the opening all-gather of its agreement (stamps.py)."""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from .. import _C
from .call import Call
from .layout import ONESHOT, PAIRWISE, STAMP_BYTES
from .mover import _ALL_GATHER
from .stamps import opening

Form, Stage = _C.Form, _C.Stage
SUM = dist.ReduceOp.SUM


def _bytes(t):
    return t.view(torch.uint8)


def _dense(t):
    """A contiguous flat view of ``t``, or of a copy of it (written back by ``_settle``)."""
    return (t if t.is_contiguous() else t.contiguous()).view(-1)


def _settle(t, flat):
    if flat.data_ptr() != t.data_ptr() or not t.is_contiguous():
        t.copy_(flat.view(t.shape))


def _pieces(buffer, sizes):
    """``buffer`` cut into consecutive pieces of ``sizes`` elements."""
    offsets = [0, *itertools.accumulate(sizes)]
    return [buffer[offsets[i]:offsets[i + 1]] for i in range(len(sizes))]


def _message(call, nbytes):
    """The first ``nbytes`` of this rank's message in the opening all-gather after its
    stamp: where a one-shot call puts its data."""
    return call.layout.remember(("message", nbytes),
                                lambda: opening(call.record, call.device).sent[STAMP_BYTES:STAMP_BYTES + nbytes])


def _gathered(call, offset, nbytes):
    """Every rank's data of a one-shot call, ``nbytes`` from ``offset`` of its message's
    data: row p rank p's (this rank's own too)."""
    return opening(call.record, call.device).received[:, STAMP_BYTES + offset:STAMP_BYTES + offset + nbytes]


def _oneshot_terms(call, mine, offset, nbytes):
    """A one-shot fold's n terms, in rank order, and their forms: every other rank's data
    as it came (``_gathered``), this rank's own ``mine``, its input (quantized as it is
    loaded, under a codec)."""
    layout, r = call.layout, call.rank
    rows, forms = layout.remember(("oneshot", offset, nbytes), lambda: (
        list(_gathered(call, offset, nbytes)),
        [Form.Input if p == r or not layout.coded else Form.Encoded for p in range(call.size)]))
    terms = list(rows)
    terms[r] = mine
    return terms, forms


def _stage_input(call, flat):
    """An all-reduce's or all-gather's input as one-shot data: raw, or encoded."""
    layout = call.layout
    data = _message(call, layout.wire(flat.numel()))
    if layout.coded:
        call.fold(data, [flat], [Form.Input], flat.numel(), Stage.Encoded)
    else:
        data.copy_(_bytes(flat))


def _exchange(call, flat, segments, part=0):
    """Step 2, started: segment s of ``flat`` (``segments``: count, parts, unit) goes to
    rank s, by the mover's all-to-all or pairwise (see the plan). Returns the mover's
    pending transfers and this rank's n contributions to its own segment, in rank order,
    with their forms, readable once they are waited for. Raw segments travel as their
    bytes (the all-to-all takes one buffer, this rank's own segment included); encoded
    ones are encoded here, all at once, into slots of the longest's encoded size, this
    rank's own kept as its input (quantized as it is loaded)."""
    layout, n, r = call.layout, call.size, call.rank
    begins = layout.segments(*segments)
    received, pieces, forms = layout.remember(("received", part), lambda: _received(call, begins, part))
    terms = list(pieces)
    terms[r] = flat[begins[r]:begins[r + 1]]
    pairwise = layout.variant == PAIRWISE
    if layout.coded:
        width = received.numel() // n
        send = call.buffer("sent", part, n * width)
        call.fold_segments(flat, send, segments, r, width, Stage.Encoded)
        if pairwise:
            outgoing = [send[s * width:s * width + layout.wire(begins[s + 1] - begins[s])] for s in range(n)]
            return call.pairwise([(s, outgoing[s]) for s in range(n) if s != r],
                                 [(p, pieces[p]) for p in range(n) if p != r]), terms, forms
        return call.move("all_to_all_single", received, send), terms, forms
    lengths = [(begins[s + 1] - begins[s]) * layout.element_bytes for s in range(n)]
    if pairwise:
        return call.pairwise([(s, _bytes(flat[begins[s]:begins[s + 1]])) for s in range(n) if s != r],
                             [(p, pieces[p]) for p in range(n) if p != r]), terms, forms
    return call.move("all_to_all_single", received, _bytes(flat), [lengths[r]] * n, lengths), terms, forms


def _received(call, begins, part):
    """Where an exchange's contributions arrive: (its buffer, the n pieces of it in rank
    order, this rank's None, their forms)."""
    layout, n, r = call.layout, call.size, call.rank
    wire = layout.wire(begins[r + 1] - begins[r])
    width = layout.wire(begins[1] - begins[0]) if layout.coded else wire
    received = call.buffer("received", part, n * width)
    pieces = [None if p == r else received[p * width:p * width + wire] for p in range(n)]
    forms = [Form.Input if p == r or not layout.coded else Form.Encoded for p in range(n)]
    return received, pieces, forms


def _pipelined(parts):
    """Runs ``parts``, generators of one part's steps each (a step ends where the part
    yields, having started a collective of the mover's), in a diagonal: at each tick the
    next part takes its first step, then every earlier part still running its next one.
    So while the mover carries one part, this rank encodes, folds and decodes others,
    and every rank starts the mover's collectives in the same order."""
    running = []

    def tick():
        for p in list(running):
            if next(p, StopIteration) is StopIteration:
                running.remove(p)

    for part in parts:
        running.insert(0, part)
        tick()
    while running:
        tick()


def all_reduce(tensor, op, group, algorithm, compression, deterministic, async_op):
    flat = _dense(tensor)
    call = Call("allreduce", group, flat, op, flat.numel() * flat.element_size(), algorithm, compression,
                 deterministic, flat.numel())
    return call.run(lambda: _all_reduce(call, tensor, flat), tensor, async_op, lambda: _stage_input(call, flat))


def _direct_segments(call, count):
    """The direct algorithm's segments of ``count`` elements: (count, n, unit), the unit a
    codec block under a codec (blocks stay whole, starting where the tensor's do)."""
    return count, call.size, call.layout.block if call.layout.coded else 1


def _all_reduce(call, tensor, flat):
    layout, count = call.layout, flat.numel()
    if count == 0:
        return
    if layout.variant == ONESHOT:  # every element folded here from every rank's data (bits: as the owner's fold)
        terms, forms = _oneshot_terms(call, flat, 0, layout.wire(count))
        if layout.coded:  # the result quantized as the owner's encoding of it is, then decoded
            encoded = call.buffer("result", 0, layout.wire(count))
            call.fold(encoded, terms, forms, count, Stage.FinalEncoded)
            call.fold(flat, [encoded], [Form.Encoded], count, Stage.Final, op=SUM)
        else:
            call.fold(flat, terms, forms, count, Stage.Final)
    else:
        _pipelined((_hierarchical_parts if layout.variant == "layered-hierarchical" else _direct_parts)(call, flat))
    _settle(tensor, flat)


def _direct_parts(call, flat):
    """The direct algorithm in ``call.layout.parts`` parts, each starting on a multiple of
    n codec blocks, so that every block of the tensor stays whole and each element is
    reduced exactly as without parts."""
    step = call.size * _direct_segments(call, 0)[2]
    size = -(-flat.numel() // call.layout.parts // step) * step
    return (_direct_part(call, flat[start:start + size], i) for i, start in enumerate(range(0, flat.numel(), size)))


def _direct_part(call, part, index):
    layout, n, r = call.layout, call.size, call.rank
    coded, wire = layout.coded, layout.wire
    segments = _direct_segments(call, part.numel())
    begins = layout.segments(*segments)
    moving, terms, forms = _exchange(call, part, segments, index)  # steps 1 and 2
    yield
    # Steps 3 and 4: this rank's result (encoded under a codec) in a slot of the longest
    # segment's (segment 0's) size, the size every rank gives the all-gather.
    lengths = [begins[s + 1] - begins[s] for s in range(n)]
    width = wire(lengths[0])
    stage = Stage.FinalEncoded if coded else Stage.Final
    call.wait(moving)
    if layout.variant == PAIRWISE:
        # Every rank's result straight into its place: raw, into the tensor (over this
        # rank's own input, a term of the fold), encoded, into its slot, decoded below.
        gathered = call.buffer("gathered", index, n * width) if coded else None
        places = [gathered[s * width:s * width + wire(lengths[s])] if coded else
                  _bytes(part[begins[s]:begins[s + 1]]) for s in range(n)]
        call.fold(places[r] if coded else part[begins[r]:begins[r + 1]], terms, forms, lengths[r], stage)
        moving = call.pairwise([(s, places[r]) for s in range(n) if s != r],
                               [(s, places[s]) for s in range(n) if s != r])
    else:
        result = call.buffer("result", index, width)
        call.fold(result[:wire(lengths[r])], terms, forms, lengths[r], stage)
        if layout.variant == "layered-direct+host-gather":
            # Across hosts among the ranks of this local index (rank h L + l is host h's
            # local rank l), then within the host: slot l N + h of ``gathered`` is rank
            # h L + l's.
            column = call.buffer("column", index, layout.column_team.size() * width)
            moving = call.move(_ALL_GATHER, column, result, group=layout.column_team)
            yield
            call.wait(moving)
            gathered = call.buffer("gathered", index, n * width)
            moving = call.move(_ALL_GATHER, gathered, column, group=layout.host_team)
        elif not coded and part.numel() == n * lengths[0]:  # equal segments: gathered straight into place
            moving, gathered = call.move(_ALL_GATHER, _bytes(part), result), None
        else:
            gathered = call.buffer("gathered", index, n * width)
            moving = call.move(_ALL_GATHER, gathered, result)
    yield
    call.wait(moving)
    order = range(n)  # the slot of each rank's result in ``gathered``
    if layout.variant == "layered-direct+host-gather":
        hosts, per_host = layout.column_team.size(), layout.host_team.size()
        order = [(s % per_host) * hosts + s // per_host for s in range(n)]
        if coded:  # in rank order, for the codec's one step over every segment
            ranked = call.buffer("gathered in rank order", index, n * width)
            ranked.view(hosts, per_host, width).copy_(gathered.view(per_host, hosts, width).transpose(0, 1))
            gathered = ranked
    if coded:  # decoding alone: the results were finalized before they were encoded
        call.fold_segments(part, gathered, segments, -1, width, Stage.Final, op=SUM)
    elif gathered is not None and layout.variant != PAIRWISE:
        for s in range(n):
            if lengths[s]:
                _bytes(part[begins[s]:begins[s + 1]]).copy_(gathered[order[s] * width:order[s] * width +
                                                                      wire(lengths[s])])


def _hierarchical_parts(call, flat):
    """The hierarchical algorithm in ``call.layout.parts`` parts. As natively, local rank
    l of every host owns shard l (``segment_begins(count, L, 1)``), and codec blocks start
    at its first element; part p is the p-th run of q elements of every shard, q a
    multiple of the block, so every block stays whole."""
    layout = call.layout
    shards = layout.segments(flat.numel(), layout.host_team.size(), 1)
    longest = shards[1] - shards[0]
    unit = layout.block if layout.coded else 1
    q = -(-longest // layout.parts // unit) * unit
    return (_hierarchical_part(call, flat, shards, start, q, i) for i, start in enumerate(range(0, longest, q)))


def _hierarchical_part(call, flat, shards, start, q, index):
    """One part of the native hierarchical all-reduce (csrc/algorithms/hierarchical_
    allreduce.cc), with the same bits:
    1. within the host, piece l of every rank's input to local rank l (uncompressed), who
       folds the host's L contributions in local order into a partial (accumulation type);
    2. across hosts, among the ranks of this local index, the direct algorithm on the
       partials: segment j of each to host j's rank (encoded under a codec), folded there
       in host order (the operator alone: AVG divides at the end), the results gathered;
    3. the piece finalized (AVG divides by the world size) into the output;
    4. within the host, every piece gathered to every rank."""
    layout = call.layout
    host_team, column_team = layout.host_team, layout.column_team
    L, N, local, host = host_team.size(), column_team.size(), host_team.rank(), column_team.rank()
    es = flat.element_size()
    pieces = [(shards[l] + min(start, shards[l + 1] - shards[l]), shards[l] + min(start + q, shards[l + 1] - shards[l]))
              for l in range(L)]
    lengths = [b - a for a, b in pieces]
    m = lengths[local]
    mine = flat[pieces[local][0]:pieces[local][1]]

    others = [_bytes(flat[a:b]) for l, (a, b) in enumerate(pieces) if l != local]  # 1
    send = torch.cat(others, out=call.buffer("sent", index, sum(o.numel() for o in others)))
    recv = call.buffer("received", index, (L - 1) * m * es)
    moving = call.move("all_to_all_single", recv, send, [0 if l == local else m * es for l in range(L)],
                       [0 if l == local else lengths[l] * es for l in range(L)], group=host_team)
    yield
    call.wait(moving)
    received = iter(_pieces(recv, [m * es] * (L - 1)))
    accumulation = _C.partial_dtypes.get(layout.dtype, layout.dtype)
    partial = call.buffer("partial", index, m * accumulation.itemsize).view(accumulation)
    call.fold(partial, [mine if l == local else next(received) for l in range(L)], [Form.Input] * L, m, Stage.Partial,
              codec="none")

    across = dict(op=SUM, dtype=partial.dtype)  # 2
    coded = layout.coded
    segments = (m, N, layout.block if coded else 1)
    begins = layout.segments(*segments)
    seg_len = [begins[j + 1] - begins[j] for j in range(N)]
    wire = [layout.wire(n, partial.element_size()) for n in seg_len]
    width = wire[0]
    if coded:  # encoded all at once into slots of the longest's size, which travel whole
        send = call.buffer("sent across", index, N * width)
        call.fold_segments(partial, send, segments, host, width, Stage.Encoded, **across)
        recv = call.buffer("received across", index, N * width)
        moving = call.move("all_to_all_single", recv, send, group=column_team)
        incoming = [width] * N
    else:  # the all-to-all's input is the whole partial, this rank's own segment included
        incoming = [wire[host]] * N
        recv = call.buffer("received across", index, sum(incoming))
        moving = call.move("all_to_all_single", recv, _bytes(partial), incoming, wire, group=column_team)
    yield
    call.wait(moving)
    result = call.buffer("result across", index, width)
    terms = [partial[begins[host]:begins[host + 1]] if j == host else piece[:wire[host]]
             for j, piece in enumerate(_pieces(recv, incoming))]
    forms = [Form.Input if j == host or not coded else Form.Encoded for j in range(N)]
    call.fold(result[:wire[host]], terms, forms, seg_len[host], Stage.FinalEncoded if coded else Stage.Final, **across)
    gathered = call.buffer("gathered across", index, N * width)
    moving = call.move(_ALL_GATHER, gathered, result, group=column_team)
    yield
    call.wait(moving)
    if coded:
        call.fold_segments(partial, gathered, segments, -1, width, Stage.Final, **across)
    else:
        for j in range(N):
            if seg_len[j]:
                _bytes(partial[begins[j]:begins[j + 1]]).copy_(gathered[j * width:j * width + wire[j]])

    call.fold(mine, [partial], [Form.Partial], m, Stage.Final)  # 3: this rank's input there was folded in 1

    width = lengths[0] * es  # 4
    result = call.buffer("piece", index, width)
    result[:m * es].copy_(_bytes(mine))
    gathered = call.buffer("gathered", index, L * width)
    moving = call.move(_ALL_GATHER, gathered, result, group=host_team)
    yield
    call.wait(moving)
    for l, block in enumerate(_pieces(gathered, [width] * L)):
        if l != local and lengths[l]:
            _bytes(flat[pieces[l][0]:pieces[l][1]]).copy_(block[:lengths[l] * es])


def reduce_scatter_tensor(output, input, op, group, algorithm, compression, deterministic, async_op):
    flat_in, out = _dense(input), _dense(output)
    n, count = group.size(), out.numel()
    if output.dtype != input.dtype or flat_in.numel() != n * count:
        raise ValueError(f"pycomm: reduce_scatter: the input holds {flat_in.numel()} {input.dtype} elements; a group "
                         f"of {n} needs {n} x the output's {count} {output.dtype} elements")
    call = Call("reduce_scatter", group, flat_in, op, flat_in.numel() * flat_in.element_size(), algorithm, compression,
                 deterministic, flat_in.numel())
    return call.run(lambda: _reduce_scatter(call, output, out, flat_in), output, async_op,
                    lambda: _stage_segments(call, flat_in, count))


def _stage_segments(call, flat_in, count):
    """A reduce-scatter's input as one-shot data: raw, or each rank's segment encoded from
    its first element (as the direct algorithm's codec blocks start) into a slot."""
    layout = call.layout
    width = layout.wire(count)
    data = _message(call, call.size * width)
    if layout.coded:
        call.fold_segments(flat_in, data, (count * call.size, call.size, 1), -1, width, Stage.Encoded)
    else:
        data.copy_(_bytes(flat_in))


def _reduce_scatter(call, output, out, flat_in):
    layout, n, r, count = call.layout, call.size, call.rank, out.numel()
    if count == 0:
        return
    if layout.variant == ONESHOT:  # this rank's segment folded from every rank's data
        width = layout.wire(count)
        terms, forms = _oneshot_terms(call, flat_in[r * count:(r + 1) * count], r * width, layout.wire(count))
    else:  # blocks start at each rank's segment
        moving, terms, forms = _exchange(call, flat_in, (count * n, n, 1))
        call.wait(moving)
    if layout.coded and layout.determinism != "0":
        # Deterministic modes quantize the result once more, as the native reduce-scatter
        # does, so that a shard equals the matching slice of the all-reduce.
        encoded = call.buffer("result", 0, layout.wire(count))
        call.fold(encoded, terms, forms, count, Stage.FinalEncoded)
        call.fold(out, [encoded], [Form.Encoded], count, Stage.Final, op=SUM)
    else:
        call.fold(out, terms, forms, count, Stage.Final)
    _settle(output, out)


def all_gather_into_tensor(output, input, group, algorithm, compression, deterministic, async_op):
    flat_in, out = _dense(input), _dense(output)
    n, count = group.size(), flat_in.numel()
    if output.dtype != input.dtype or out.numel() != n * count:
        raise ValueError(f"pycomm: allgather: the output holds {out.numel()} {output.dtype} elements; a group of "
                         f"{n} needs {n} x the input's {count} {input.dtype} elements")
    call = Call("allgather", group, flat_in, SUM, out.numel() * out.element_size(), algorithm, compression,
                 deterministic, flat_in.numel())
    return call.run(lambda: _all_gather(call, output, out, flat_in), output, async_op,
                    lambda: _stage_input(call, flat_in))


def _all_gather(call, output, out, flat_in):
    layout, n, r, count = call.layout, call.size, call.rank, flat_in.numel()
    if count == 0:
        return
    size = layout.wire(count)
    if not layout.coded:
        if layout.variant == ONESHOT:  # every rank's input came in the opening, this rank's own too
            _bytes(out).view(n, size).copy_(_gathered(call, 0, size))
        elif layout.variant == PAIRWISE:  # straight into place
            slots = _pieces(_bytes(out), [size] * n)
            moving = call.pairwise([(s, _bytes(flat_in)) for s in range(n) if s != r],
                                   [(s, slots[s]) for s in range(n) if s != r])
            slots[r].copy_(_bytes(flat_in))
            call.wait(moving)
        else:
            call.wait(call.move(_ALL_GATHER, out, flat_in))
        _settle(output, out)
        return
    if layout.variant == ONESHOT:  # every rank's input came in the opening, encoded
        received = opening(call.record, call.device).received
        gathered, width = received.view(-1)[STAMP_BYTES:], received.shape[1]
    else:
        width = size
        gathered = call.buffer("gathered", 0, n * width)
        blocks = _pieces(gathered, [width] * n)
        if layout.variant == PAIRWISE:  # this rank's own encoded into its slot, the others' into theirs
            call.fold(blocks[r][:size], [flat_in], [Form.Input], count, Stage.Encoded)
            call.wait(call.pairwise([(s, blocks[r][:size]) for s in range(n) if s != r],
                                    [(s, blocks[s][:size]) for s in range(n) if s != r]))
        else:
            mine = call.buffer("result", 0, width)
            call.fold(mine[:size], [flat_in], [Form.Input], count, Stage.Encoded)
            call.wait(call.move(_ALL_GATHER, gathered, mine))
    call.fold_segments(out, gathered, (n * count, n, 1), -1, width, Stage.Final)
    _settle(output, out)
