"""What a rank keeps of the layered calls on one group, from one call to the next: their
record (counters, flight recorder and log lines), the knobs read once, the layout of each
kind of call (with its scratch buffers), the mover's hosts, and the lane of its calls on
CPU tensors."""
from __future__ import annotations

import collections
import itertools
import json

from .. import _C
from .mover import _hosts, mover_name


# The most bytes of scratch buffers a group's layouts keep, past which the least recently
# used ones are let go (see _Layouts).
_SCRATCH_BYTES = 256 << 20


class _Layouts:
    """A group's layouts (layout._Layout) by the key of their kind of call, most recently
    used last. A fresh buffer costs the first touch of its pages, about 0.4 ms per MiB on
    this project's machines, as much as the mover takes to carry it: buffers stay with
    their layout. Past _SCRATCH_BYTES of them, the least recently used layouts are let
    go, but the one in use and those a CUDA graph captured (``pinned``: the graph replays
    into their buffers)."""

    def __init__(self):
        self.kept, self.total = collections.OrderedDict(), 0

    def get(self, key, make):
        layout = self.kept.get(key)
        if layout is None:
            layout = self.kept[key] = make()
        else:
            self.kept.move_to_end(key)
        return layout

    def grew(self, layout, nbytes):
        """``layout`` took ``nbytes`` more of scratch: older layouts go past the limit."""
        self.total += nbytes
        for key, old in list(self.kept.items()):
            if self.total <= _SCRATCH_BYTES:
                break
            if old is not layout and not old.pinned:
                self.drop(key)

    def drop(self, key):
        """Lets a layout go (also after a failed call, whose transfers may still be writing
        into its buffers)."""
        layout = self.kept.pop(key, None)
        if layout is not None:
            self.total -= layout.scratch_bytes


class _GroupRecord:
    """What this rank keeps of the layered calls on one group: their record (counters,
    flight recorder and log lines, kept as a pycomm group keeps its own), the knobs
    (read once, here), options, layouts, hosts and lane."""

    def __init__(self, group, mover):
        self.name, self.rank, self.size, self.mover = group.group_name, group.rank(), group.size(), mover
        self.seq = itertools.count(1)
        self.config = _C.LayeredConfig()
        self.kernels = self.config.kernels()
        self.recorder = _C.LayeredRecorder(self.name, self.rank, self.size, mover, self.config)
        self.options = {}  # the options of each kind of call
        self.layouts = _Layouts()
        self.openings = {}  # by device: stamps._Opening, the buffers of every call's opening all-gather
        self.lane = None  # the thread of its calls on CPU tensors, from the first asynchronous one
        self.hosts = None  # _Hosts, found at the group's first call

    def hosts_of(self, group, device):
        """_hosts of the group, found as the first steps of its first call on every rank
        (before that call's own collectives, wherever it runs)."""
        if self.hosts is None:
            self.hosts = _hosts(group, device, self.config)
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
