"""The ranks' agreement on a call (step 0): every rank's stamp of it (its layout's words,
layout.STAMP_FIELDS, and its sequence number on the group), compared with every other's.
Ranks that disagree fail the call with a DistBackendError that names the field and both
values, as the native path does, instead of folding what does not belong together.

Every call on a group of two ranks or more opens with one all-gather of opening_bytes(n)
bytes from each rank, the same for every call of the group: its message is its stamp,
then, for a one-shot call (layout.ONESHOT: its whole data fits there), its data, which
no other transfer then carries. The stamps are compared

* on host memory, on the host, before any other transfer of the call: a disagreement
  fails the call on every rank at once;
* on device memory, on the device, so that nothing waits on the host and a CUDA graph can
  capture it all: this rank's stamp is written into the group's message by a kernel (its
  words the kernel's arguments: nothing is copied from the host), and a kernel compares
  the gathered stamps and writes a disagreement into page-locked host memory (the
  verdict), which this rank's next layered call on the group, or wait() of one of its
  works, raises (check).

Why a disagreement cannot hang or crash the mover: the mover must never be handed
transfers that differ between ranks (gloo's loop thread aborts the process on a message
longer than the receive posted for it; a transfer that is never matched waits until the
group's timeout). The opening is one collective of one size whatever the ranks called
(other collectives, counts, dtypes, codecs, modes), so it always matches, and after it
every rank holds every rank's stamp. On host memory every rank compares before starting
any transfer whose size depends on the call, so where ranks disagree each of them sees it
and fails the call with nothing of it pending on the mover, which stays usable. A one-shot
call has no transfer after the opening: even compared on a device, its disagreement
cannot reach the mover. Checking each kind of call once, and skipping the stamps of kinds
already agreed on, would not be safe: two ranks each calling a kind it had checked, but
not the same one, would skip the check together and hand the mover transfers that do not
match. On device memory the device compares after the host has enqueued the call's own
transfers: where a disagreement changes their sizes (a call too large for one shot), the
mover waits on transfers that never match until its own timeout (NCCL's watchdog) ends
them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import _C
from . import layout
from .layout import NUMBERS, STAMP_FIELDS, _code, opening_bytes

VERDICT_WORDS = _C.VERDICT_WORDS


class _Opening:
    """A group's opening on one device, kept for the group's life (a CUDA graph replays
    into it): this rank's message (``sent``: stamp, then a one-shot call's data), every
    rank's (``received``, row p rank p's), and the verdict (judge_stamps' words, in host
    memory, page-locked for a CUDA device, which writes it)."""

    def __init__(self, device, size):
        width = opening_bytes(size)
        self.sent = torch.zeros(width, dtype=torch.uint8, device=device)
        self.received = torch.zeros(size, width, dtype=torch.uint8, device=device)
        self.stamp = self.sent.view(torch.int64)[:len(STAMP_FIELDS)]  # this rank's
        self.stamps = self.received.view(torch.int64)  # row p: rank p's stamp, then its data
        self.verdict = torch.zeros(VERDICT_WORDS, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.found = self.verdict.numpy()  # read without a copy, whenever the host looks


def opening(record, device):
    """The group's opening on ``device``, made at its first call there."""
    held = record.openings.get(device)
    if held is None:
        held = record.openings[device] = _Opening(device, record.size)
    return held


def agree(call):
    """Step 0: the opening all-gather and the comparison (see the module's docstring); a
    one-shot call's data is in this rank's message already."""
    kind = call.layout
    if call.size == 1:
        return
    held = opening(call.record, kind.device)
    words = list(kind.stamp)
    words[1] = call.seq
    kind.kernels.write_stamp(held.stamp, words)
    call.wait(call.gather(held.received, held.sent))
    kind.kernels.judge_stamps(held.stamps, held.stamp, -1, held.verdict)
    if not kind.on_device and held.found[0]:
        words = held.verdict.tolist()
        held.verdict.zero_()  # the call fails on every rank, nothing of it pending: the group goes on
        call.disagree(_difference(words))


def check(record, device):
    """Raises the disagreement the device found in an earlier call on the group, if it
    found one. It stays: the calls after it ran on what did not belong together, and the
    mover may still hold their transfers. (On host memory the call that disagrees raises,
    and the verdict is cleared by the thread that ran it, maybe the lane: not read here.)"""
    if not layout.on_device(device):
        return
    held = record.openings.get(device)
    if held is not None and held.found[0]:
        words = held.verdict.tolist()
        raise dist.DistBackendError(
            f"pycomm: {_shown('collective', words[6])} #{words[5]} over {record.mover} on group '{record.name}' "
            f"failed on rank {record.rank}: {_difference(words)}: ranks called different collectives or arguments "
            "(compared on the device; raised at this rank's next layered call or wait on the group)")


def _difference(verdict):
    """What a verdict says, for a message."""
    _, peer, field, theirs, mine = verdict[:5]
    if field == 0:
        return f"rank {peer} sent something else than a stamp: it is in another operation"
    name = STAMP_FIELDS[field]
    return f"rank {peer} called it with {name} {_shown(name, theirs)} where this rank has {_shown(name, mine)}"


def _shown(field, code):
    """A stamp field's code as a message shows it: a number as it is, a name by the names
    pycomm knows for it."""
    if field in NUMBERS:
        return code
    names = ["allreduce", "reduce_scatter", "allgather", "none", *_C.algorithms, *_C.codecs, *_C.determinism_levels,
             *(str(d).split(".")[-1] for d in vars(torch).values() if isinstance(d, torch.dtype)),
             *dist.ReduceOp.RedOpType.__members__]
    return next((name for name in names if _code(name) == code), f"(unknown, code {code})")
