"""What a rank keeps of the layered calls on one group, from one call to the next: their
record (counters, flight recorder and log lines), the options of each kind of call, the
mover's hosts, the lane of its calls on CPU tensors and their scratch buffers."""
from __future__ import annotations

import itertools
import json

import torch

from .. import _C
from .mover import _hosts, mover_name


# The most bytes of buffers a group's layered calls keep from call to call (see _Scratch).
_SCRATCH_BYTES = 256 << 20


class _Scratch:
    """Byte buffers of a group's layered calls on host memory, kept from one call to the
    next: a fresh buffer costs the first touch of its pages, about 0.4 ms per MiB on this
    project's machines, as much as the mover takes to carry it. A group's calls run one at
    a time, so the buffer of a (role, part) serves one step of one part of the running
    call. At most _SCRATCH_BYTES are kept; larger needs are allocated per call, as are
    device buffers (torch's caching allocator keeps those)."""

    def __init__(self):
        self.kept, self.total = {}, 0

    def get(self, role, part, nbytes, device):
        if device.type != "cpu":
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        held = self.kept.get((role, part))
        if held is None or held.numel() < nbytes:
            grown = self.total + nbytes - (0 if held is None else held.numel())
            if grown > _SCRATCH_BYTES:
                return torch.empty(nbytes, dtype=torch.uint8)
            held, self.total = torch.empty(nbytes, dtype=torch.uint8), grown
            self.kept[(role, part)] = held
        return held[:nbytes]

    def drop(self):
        """Lets the buffers go (after a failed call, whose transfers may still be writing)."""
        self.kept, self.total = {}, 0


class _GroupRecord:
    """What this rank keeps of the layered calls on one group: their record (counters,
    flight recorder and log lines, kept as a pycomm group keeps its own), options, hosts
    and lane."""

    def __init__(self, group, mover):
        self.name, self.rank, self.size, self.mover = group.group_name, group.rank(), group.size(), mover
        self.seq = itertools.count(1)
        self.recorder = _C.LayeredRecorder(self.name, self.rank, self.size, mover)
        self.options = {}  # the options of each kind of call, read from the environment once
        self.lane = None  # the thread of its calls on CPU tensors, from the first asynchronous one
        self.hosts = None  # _Hosts, found at the group's first call
        self.scratch = _Scratch()

    def hosts_of(self, group, device):
        """_hosts of the group, found as the first steps of its first call on every rank
        (before that call's own collectives, wherever it runs)."""
        if self.hosts is None:
            self.hosts = _hosts(group, device)
        return self.hosts

    def stats(self):
        """A pycomm group's ``stats()``, with ``"mover"`` naming the group's backend and,
        once measured (a group across hosts), ``"mover_links"``: the (latency_us,
        bytes_per_us) of its links ``"within"`` a host and ``"across"`` hosts that the
        plans price."""
        stats = dict(json.loads(self.recorder._stats_json()), mover=self.mover)
        if self.hosts is not None and self.hosts.host_team is not None:
            stats["mover_links"] = {"within": self.hosts.within, "across": self.hosts.across}
        return stats


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
