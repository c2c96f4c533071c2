"""The layered path's algorithms over the mover, as the package's docstring states them:
segments and their exchange, the direct and the hierarchical all-reduce in parts run as
a pipeline, reduce-scatter and all-gather. Each entry point makes the operation's _Call
and runs its steps through it."""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from .. import _C
from .call import _Call
from .folds import PARTIAL_DTYPES
from .mover import _ALL_GATHER

Form, Stage = _C.Form, _C.Stage
PAIRWISE = "layered-pairwise"  # the direct algorithm with every transfer a pairwise send (see the plan)


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


def _exchange(call, flat, begins, element_bytes, part=0):
    """Step 2, started: segment s of ``flat`` goes to rank s, by the mover's all-to-all or
    pairwise (see the plan). Returns the mover's pending transfers and this rank's n
    contributions to its own segment, in rank order, with their forms, readable once they
    are waited for. Raw segments travel as their bytes (the all-to-all takes one buffer,
    this rank's own segment included); encoded ones are encoded here, this rank's own
    kept as its input (quantized as it is loaded)."""
    n, r = call.size, call.rank
    pairwise = call.plan.variant == PAIRWISE
    lengths = [begins[s + 1] - begins[s] for s in range(n)]
    mine = flat[begins[r]:begins[r + 1]]
    if call.codec == "none":
        if pairwise:
            recv = call.buffer("received", part, (n - 1) * lengths[r] * element_bytes)
            others = iter(_pieces(recv, [lengths[r] * element_bytes] * (n - 1)))
            pieces = [None if p == r else next(others) for p in range(n)]
            moving = call.pairwise([(s, _bytes(flat[begins[s]:begins[s + 1]])) for s in range(n) if s != r],
                                   [(p, pieces[p]) for p in range(n) if p != r])
        else:
            recv = call.buffer("received", part, n * lengths[r] * element_bytes)
            moving = call.move("all_to_all_single", recv, _bytes(flat), [lengths[r] * element_bytes] * n,
                               [length * element_bytes for length in lengths])
            pieces = _pieces(recv, [lengths[r] * element_bytes] * n)
        return moving, [mine if p == r else pieces[p] for p in range(n)], [Form.Input] * n
    encoded = [_C.encoded_size(call.codec, call.block, length) for length in lengths]
    outgoing = [0 if s == r else _slot(encoded[s]) for s in range(n)]
    send = call.buffer("sent", part, sum(outgoing))
    sent = _pieces(send, outgoing)
    for s, piece in enumerate(sent):
        if s != r:
            call.fold(piece[:encoded[s]], [flat[begins[s]:begins[s + 1]]], [Form.Input], lengths[s], Stage.Encoded)
            piece[encoded[s]:].zero_()
    incoming = [0 if p == r else _slot(encoded[r]) for p in range(n)]
    recv = call.buffer("received", part, sum(incoming))
    received = _pieces(recv, incoming)
    if pairwise:
        moving = call.pairwise([(s, sent[s]) for s in range(n) if s != r], [(p, received[p]) for p in range(n) if p != r])
    else:
        moving = call.move("all_to_all_single", recv, send, incoming, outgoing)
    return (moving, [mine if p == r else received[p][:encoded[r]] for p in range(n)],
            [Form.Input if p == r else Form.Encoded for p in range(n)])


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
    call = _Call("allreduce", group, flat, op, flat.numel() * flat.element_size(), algorithm, compression,
                 deterministic, flat.numel())
    return call.run(lambda: _all_reduce(call, tensor, flat), tensor, async_op)


def _all_reduce(call, tensor, flat):
    if flat.numel() == 0:
        return
    _pipelined((_hierarchical_parts if call.plan.variant == "layered-hierarchical" else _direct_parts)(call, flat))
    _settle(tensor, flat)


def _wire(call, element_bytes):
    """The unit segments are cut in (whole codec blocks, coded) and the bytes of m
    elements of ``element_bytes`` each on the wire."""
    if call.codec == "none":
        return 1, lambda m: m * element_bytes
    return call.block, lambda m: _C.encoded_size(call.codec, call.block, m)


def _direct_parts(call, flat):
    """The direct algorithm in ``call.plan.parts`` parts, each starting on a multiple of n
    codec blocks, so that every block of the tensor stays whole and each element is
    reduced exactly as without parts."""
    step = call.size * _wire(call, 1)[0]
    size = -(-flat.numel() // call.plan.parts // step) * step
    return (_direct_part(call, flat[start:start + size], i) for i, start in enumerate(range(0, flat.numel(), size)))


def _direct_part(call, part, index):
    n, r, es = call.size, call.rank, part.element_size()
    coded = call.codec != "none"
    unit, wire = _wire(call, es)
    begins = _C.segment_begins(part.numel(), n, unit)
    moving, terms, forms = _exchange(call, part, begins, es, index)  # steps 1 and 2
    yield
    # Steps 3 and 4: this rank's result (encoded under a codec) goes into a piece padded
    # to the longest segment's (segment 0's), the size every rank gives the all-gather.
    lengths = [begins[s + 1] - begins[s] for s in range(n)]
    width = _slot(wire(lengths[0])) if coded else wire(lengths[0])
    result = call.buffer("result", index, width)
    result[wire(lengths[r]):].zero_()
    call.wait(moving)
    call.fold(result[:wire(lengths[r])], terms, forms, lengths[r], Stage.FinalEncoded if coded else Stage.Final)
    if call.plan.variant == PAIRWISE:
        # Raw results straight into place; encoded ones into a block each, decoded below.
        received = call.buffer("gathered", index, n * width) if coded else None
        blocks = _pieces(received, [width] * n) if coded else [None] * n
        targets = [blocks[s][:wire(lengths[s])] if coded else _bytes(part[begins[s]:begins[s + 1]]) for s in range(n)]
        moving = call.pairwise([(s, result[:wire(lengths[r])]) for s in range(n) if s != r],
                               [(s, targets[s]) for s in range(n) if s != r])
        if coded:
            blocks[r] = result
        else:
            _bytes(part[begins[r]:begins[r + 1]]).copy_(result[:wire(lengths[r])])
            blocks = None
    elif call.plan.variant == "layered-direct+host-gather":
        # Across hosts among the ranks of this local index (rank h L + l is host h's
        # local rank l), then within the host: block l N + h of ``gathered`` is rank h L + l's.
        column = call.buffer("column", index, call.column_team.size() * width)
        moving = call.move(_ALL_GATHER, column, result, group=call.column_team)
        yield
        call.wait(moving)
        gathered = call.buffer("gathered", index, n * width)
        moving = call.move(_ALL_GATHER, gathered, column, group=call.host_team)
        hosts, per_host = call.column_team.size(), call.host_team.size()
        blocks = _pieces(gathered, [width] * n)
        blocks = [blocks[(s % per_host) * hosts + s // per_host] for s in range(n)]
    elif not coded and part.numel() == n * lengths[0]:  # equal segments: gathered straight into place
        moving, blocks = call.move(_ALL_GATHER, _bytes(part), result), None
    else:
        gathered = call.buffer("gathered", index, n * width)
        moving = call.move(_ALL_GATHER, gathered, result)
        blocks = _pieces(gathered, [width] * n)
    yield
    call.wait(moving)
    for s, block in enumerate(blocks or []):
        segment, length = part[begins[s]:begins[s + 1]], lengths[s]
        if coded:  # decoding alone: the result was finalized before it was encoded
            call.fold(segment, [block[:wire(length)]], [Form.Encoded], length, Stage.Final, op=dist.ReduceOp.SUM)
        elif length:
            _bytes(segment).copy_(block[:wire(length)])


def _hierarchical_parts(call, flat):
    """The hierarchical algorithm in ``call.plan.parts`` parts. As natively, local rank l
    of every host owns shard l (``segment_begins(count, L, 1)``), and codec blocks start
    at its first element; part p is the p-th run of q elements of every shard, q a
    multiple of the block, so every block stays whole."""
    shards = _C.segment_begins(flat.numel(), call.host_team.size(), 1)
    longest = shards[1] - shards[0]
    unit = _wire(call, 1)[0]
    q = -(-longest // call.plan.parts // unit) * unit
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
    host_team, column_team = call.host_team, call.column_team
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
    accumulation = PARTIAL_DTYPES.get(call.dtype, call.dtype)
    partial = call.buffer("partial", index, m * accumulation.itemsize).view(accumulation)
    call.fold(partial, [mine if l == local else next(received) for l in range(L)], [Form.Input] * L, m, Stage.Partial,
              codec="none")

    across = dict(op=dist.ReduceOp.SUM, dtype=partial.dtype)  # 2
    coded = call.codec != "none"
    unit, wire = _wire(call, partial.element_size())
    begins = _C.segment_begins(m, N, unit)
    segments = [partial[begins[j]:begins[j + 1]] for j in range(N)]
    seg_len = [s.numel() for s in segments]
    if coded:
        outgoing = [0 if j == host else _slot(wire(seg_len[j])) for j in range(N)]
        send = call.buffer("sent across", index, sum(outgoing))
        for j, out in enumerate(_pieces(send, outgoing)):
            if j != host:
                call.fold(out[:wire(seg_len[j])], [segments[j]], [Form.Input], seg_len[j], Stage.Encoded, **across)
                out[wire(seg_len[j]):].zero_()
        incoming = [0 if j == host else _slot(wire(seg_len[host])) for j in range(N)]
    else:  # the all-to-all's input is the whole partial, this rank's own segment included
        send, outgoing = _bytes(partial), [wire(n) for n in seg_len]
        incoming = [wire(seg_len[host])] * N
    recv = call.buffer("received across", index, sum(incoming))
    moving = call.move("all_to_all_single", recv, send, incoming, outgoing, group=column_team)
    yield
    call.wait(moving)
    width = _slot(wire(seg_len[0])) if coded else wire(seg_len[0])
    result = call.buffer("result", index, width, zero_from=wire(seg_len[host]))
    terms = [segments[host] if j == host else piece[:wire(seg_len[host])]
             for j, piece in enumerate(_pieces(recv, incoming))]
    forms = [Form.Input if j == host or not coded else Form.Encoded for j in range(N)]
    call.fold(result[:wire(seg_len[host])], terms, forms, seg_len[host], Stage.FinalEncoded if coded else Stage.Final,
              **across)
    gathered = call.buffer("gathered across", index, N * width)
    moving = call.move(_ALL_GATHER, gathered, result, group=column_team)
    yield
    call.wait(moving)
    for j, block in enumerate(_pieces(gathered, [width] * N)):
        if coded:
            call.fold(segments[j], [block[:wire(seg_len[j])]], [Form.Encoded], seg_len[j], Stage.Final, **across)
        elif seg_len[j]:
            _bytes(segments[j]).copy_(block[:wire(seg_len[j])])

    call.fold(mine, [partial], [Form.Partial], m, Stage.Final)  # 3: this rank's input there was folded in 1

    width = lengths[0] * es  # 4
    result = call.buffer("piece", index, width, zero_from=m * es)
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
    call = _Call("reduce_scatter", group, flat_in, op, flat_in.numel() * flat_in.element_size(), algorithm, compression,
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
        encoded = call.buffer("result", 0, _C.encoded_size(call.codec, call.block, count))
        call.fold(encoded, terms, forms, count, Stage.FinalEncoded)
        call.fold(out, [encoded], [Form.Encoded], count, Stage.Final, op=dist.ReduceOp.SUM)
    else:
        call.fold(out, terms, forms, count, Stage.Final)
    _settle(output, out)


def all_gather_into_tensor(output, input, group, algorithm, compression, deterministic, async_op):
    flat_in, out = _dense(input), _dense(output)
    n, count = group.size(), flat_in.numel()
    if output.dtype != input.dtype or out.numel() != n * count:
        raise ValueError(f"pycomm: allgather: the output holds {out.numel()} {output.dtype} elements; a group of "
                         f"{n} needs {n} x the input's {count} {input.dtype} elements")
    call = _Call("allgather", group, flat_in, dist.ReduceOp.SUM, out.numel() * out.element_size(), algorithm,
                 compression, deterministic, flat_in.numel())
    return call.run(lambda: _all_gather(call, output, out, flat_in), output, async_op)


def _all_gather(call, output, out, flat_in):
    n, r, count = call.size, call.rank, flat_in.numel()
    if count == 0:
        return
    pairwise = call.plan.variant == PAIRWISE
    if call.codec == "none":
        if pairwise:  # straight into place
            slots = _pieces(out, [count] * n)
            moving = call.pairwise([(s, _bytes(flat_in)) for s in range(n) if s != r],
                                   [(s, _bytes(slots[s])) for s in range(n) if s != r])
            slots[r].copy_(flat_in)
            call.wait(moving)
        else:
            call.wait(call.move(_ALL_GATHER, out, flat_in))
    else:
        size = _C.encoded_size(call.codec, call.block, count)
        mine = call.buffer("result", 0, _slot(size), zero_from=size)
        call.fold(mine[:size], [flat_in], [Form.Input], count, Stage.Encoded)
        gathered = call.buffer("gathered", 0, n * mine.numel())
        blocks = _pieces(gathered, [mine.numel()] * n)
        if pairwise:
            call.wait(call.pairwise([(s, mine[:size]) for s in range(n) if s != r],
                                    [(s, blocks[s][:size]) for s in range(n) if s != r]))
            blocks[r] = mine
        else:
            call.wait(call.move(_ALL_GATHER, gathered, mine))
        for s, block in enumerate(blocks):
            call.fold(out[s * count:(s + 1) * count], [block[:size]], [Form.Encoded], count, Stage.Final)
    _settle(output, out)
