"""What every call of one kind on a group has in common (its layout), derived at the kind's
first call and kept by the group's record: options, plan, kernels, stamp, the record's
description of it, its segments and its scratch buffers. A kind is a (collective, count,
dtype, reduction, options, device): the key of Call. A call's own work is then what
its tensors need: its stamp's sequence number, the mover's transfers and the folds."""
from __future__ import annotations

import zlib

import torch

from .. import _C
from ..kernels import kernels_for, terms_per_fold, triton_kernels
from .mover import _PAIRWISE_MOVERS

# The direct algorithm with every transfer a pairwise send, and the one-shot (see the plan).
PAIRWISE, ONESHOT = "layered-pairwise", "layered-oneshot"

# A stamp: int64 words, this marker, then the fields after it (each an int64, see _code).
STAMP_MARK = 0x70634C53
STAMP_FIELDS = ("stamp", "sequence number", "collective", "count", "dtype", "reduce op", "compression", "block",
                "code layout", "determinism", "algorithm")
NUMBERS = {"sequence number", "count", "block", "code layout"}  # the fields that are numbers; the others are names
# A stamp's bytes: a multiple of 16, so that data after it starts aligned for the kernels
# (the word after the fields, if any, stays zero).
STAMP_BYTES = -(-8 * len(STAMP_FIELDS) // 16) * 16
# The bytes the opening all-gather of a call gathers to every rank (stamps.py), in all.
OPENING_BUDGET = 64 << 10


def _code(value):
    """A stamp field as an int64: integers as they are, names by their CRC-32."""
    return value if isinstance(value, int) else zlib.crc32(value.encode())


def on_device(device):
    """Whether calls on ``device``'s tensors take the device path: kernels enqueued on the
    current stream, nothing waited for on the host, stamps compared on the device."""
    return device.type == "cuda"


def opening_bytes(size):
    """The bytes of each rank's message in the opening all-gather of a group of ``size``
    ranks: the same for every call, whatever it is (a function of the group alone), a
    multiple of 16."""
    return max(1 << 10, OPENING_BUDGET // size) // 16 * 16


class _Layout:
    """One kind of call on a group, as every call of it runs. Made inside the kind's first
    call (the group's first call finds the mover's hosts, with collectives), on every rank
    alike: the plan is a function of the call, the hosts and the measured links, all the
    same everywhere."""

    def __init__(self, record, group, collective, dtype, count, op, options, device, nbytes):
        self.record, self.dtype, self.device, self.element_bytes = record, dtype, device, dtype.itemsize
        self.scratch, self.scratch_bytes, self.pinned, self.memo = {}, 0, False, {}
        self.codec, self.block, self.determinism = options.codec, options.block, options.determinism
        self.coded, self.exact = self.codec != "none", self.determinism == "exact"
        self.on_device = on_device(device)
        self.kernels = kernels_for(device, record.kernels)
        self.terms_per_fold = terms_per_fold(self.kernels, device)
        if self.exact and self.terms_per_fold and record.size > self.terms_per_fold and dtype.is_floating_point \
                and _C.reduction(op, dtype)[0] in ("sum", "avg", "premul_sum"):
            self.kernels = triton_kernels(f"exact mode folds every rank's terms in one kernel, pycomm's CUDA kernels "
                                          f"take at most {self.terms_per_fold}, and this group has {record.size} ranks")
            self.terms_per_fold = None
        hosts = record.hosts_of(group, device)
        self.host_team, self.column_team = hosts.host_team, hosts.column_team
        plan = _C.layered_plan(collective, dtype, count, options, hosts.host_of, hosts.within, hosts.across,
                               hosts.core_share, self.on_device, record.mover in _PAIRWISE_MOVERS,
                               opening_bytes(record.size) - STAMP_BYTES)
        self.variant, self.parts = plan.variant, plan.parts
        self.algorithm = f"{self.variant} over {record.mover}"
        self.kind = record.recorder.kind(collective, dtype, count, op, options, plan, nbytes,
                                         device.index if device.type == "cuda" else -1)
        # The block and the code layout matter only under a codec, as natively; word 1, the
        # sequence number, is each call's.
        self.stamp = [_code(v) for v in (STAMP_MARK, 0, collective, count, str(dtype).split(".")[-1],
                                          _op_name(op), self.codec, self.block if self.coded else 0,
                                          _C.CODE_LAYOUT if self.coded else 0, self.determinism, options.algorithm)]

    def wire(self, count, element_bytes=None):
        """The bytes of ``count`` elements (of ``element_bytes`` each, the call's by default)
        on the wire: raw, or encoded (a multiple of _C.PIECE_ALIGN, so that encoded pieces
        laid end to end in a buffer all start aligned for the kernels)."""
        if self.coded:
            return _C.encoded_size(self.codec, self.block, count) if count else 0
        return count * (element_bytes or self.element_bytes)

    def segments(self, count, parts, unit):
        """``_C.segment_begins(count, parts, unit)``, computed once."""
        return self.remember(("segments", count, parts, unit), lambda: _C.segment_begins(count, parts, unit))

    def remember(self, key, make):
        """``make()``, made at the layout's first call and kept: what its calls share."""
        value = self.memo.get(key)
        if value is None:
            value = self.memo[key] = make()
        return value

    def buffer(self, role, part, nbytes):
        """The layout's byte buffer for ``role`` in part ``part``: made zeroed at its first
        call and kept (padding that travels is never written: it stays zero)."""
        b = self.scratch.get((role, part))
        if b is None:
            b = self.scratch[(role, part)] = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
            self.scratch_bytes += nbytes
            self.record.layouts.grew(self, nbytes)
        return b


def _op_name(op):
    return str(getattr(op, "op", op)).rsplit(".", 1)[-1]
