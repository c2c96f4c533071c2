"""The mover as the layered path sees it: its backend's name, the name of its all-gather,
whether its all-to-all gathers faster, and where its ranks are: which host each is on
(found once per group), the mover's subgroups of one host and of one local index, and
the cost of its links within and across hosts, measured through them."""
from __future__ import annotations

import hashlib
import os
import time
import typing

import torch
import torch.distributed as dist

from .. import _C


# torch 2.13 renamed all_gather_into_tensor (still there, deprecated) to all_gather_single.
_ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


def mover_name(group, device):
    """The name of the group's backend for ``device`` ("gloo", "nccl", ...)."""
    try:
        return group._get_backend(torch.device(device)).name()
    except (RuntimeError, AttributeError):
        return dist.get_backend(group)


# Movers whose point-to-point sends carry the direct algorithm's steps (on host memory)
# with fewer copies than their collectives: gloo's all-to-all copies this rank's own
# segment, and its all-gather runs its ring one unpipelined step after another. An exact
# all-reduce of 25 MiB of float32 at 3 ranks on this project's 2-core machines, in one
# run: 69 ms a call and 122 ms of CPU over the ranks pairwise, 100 ms and 169 ms through
# gloo's all-to-all and all-gather (gloo's own all-reduce: 42 ms and 73 ms).
_PAIRWISE_MOVERS = {"gloo"}


class _Hosts(typing.NamedTuple):
    """The mover group's ranks by host, as the layered plans see them (_hosts)."""
    host_of: list  # each rank's host, numbered in order of first appearance
    host_team: object  # the mover's subgroup of this rank's host (None: one host, or unequal ones)
    column_team: object  # of the ranks of this rank's local index, one per host, in host order
    within: tuple  # (latency_us, bytes_per_us) of the mover within a host, per rank ((0, 0): not measured)
    across: tuple  # of the link between hosts, per host
    core_share: float  # of a core each rank has, on the machine with the fewest per rank


def _digest(text):
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def _machine():
    """This process's machine: its kernel's boot, whose cores every process on it shares,
    whatever network namespace stands for its host."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


def _hosts(group, device, config):
    """Which host each rank of ``group`` is on (``config.hosts_of`` of every rank's host key,
    gathered once by the mover with its machine and count of usable cores), and, where a
    two-level algorithm could run (several hosts of L >= 2 ranks each, numbered host by
    host), the mover's subgroups of this rank's host and of its column, with the mover's
    links measured through them."""
    mine = [_digest(_C.host_key()), _digest(_machine()), len(os.sched_getaffinity(0))]
    everyone = torch.empty(len(mine) * group.size(), dtype=torch.int64, device=device)
    getattr(dist, _ALL_GATHER)(everyone, torch.tensor(mine, device=device), group=group)
    keys, machines, cores = everyone.view(-1, len(mine)).t().tolist()
    host_of = config.hosts_of([str(k) for k in keys])
    hosts = [[r for r, h in enumerate(host_of) if h == host] for host in range(max(host_of) + 1)]
    core_share = min(cores[r] / machines.count(machines[r]) for r in range(group.size()))
    if not _C.hosts_in_blocks(host_of):
        return _Hosts(host_of, None, None, (0.0, 0.0), (0.0, 0.0), core_share)
    ranks = dist.get_process_group_ranks(group)
    me = group.rank()
    local = hosts[host_of[me]].index(me)
    backend = dist.get_backend(group)
    host_team = dist.new_group([ranks[r] for r in hosts[host_of[me]]], backend=backend,
                               use_local_synchronization=True)
    column_team = dist.new_group([ranks[h[local]] for h in hosts], backend=backend, use_local_synchronization=True)
    return _Hosts(host_of, host_team, column_team, *_measure_links(group, host_team, column_team, device), core_share)


# What the mover's links are measured with: an all-to-all of this many bytes per peer,
# among the ranks of each host at once, then among the ranks of each local index at once
# (all of a host's ranks share its link).
_PROBE_BYTES = 1 << 20


def _measure_links(group, host_team, column_team, device):
    """(latency_us, bytes_per_us) of the mover within a host (per rank) and of the link
    between hosts (per host), the slowest rank's view, the same on every rank."""
    def timed(team, nbytes):
        send = torch.zeros(nbytes * team.size(), dtype=torch.uint8, device=device)
        recv = torch.empty_like(send)
        dist.barrier(group=group)
        start = time.perf_counter()
        dist.all_to_all_single(recv, send, group=team)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - start) * 1e6

    seen = []
    for team in (host_team, column_team):
        timed(team, _PROBE_BYTES)  # connections made, buffers touched
        seen += [timed(team, 1), timed(team, _PROBE_BYTES)]
    seen = torch.tensor(seen, dtype=torch.float64, device=device)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=group)
    within_latency, within_us, across_latency, across_us = seen.tolist()
    per_rank = (host_team.size() - 1) * _PROBE_BYTES
    per_host = host_team.size() * (column_team.size() - 1) * _PROBE_BYTES
    return ((within_latency, per_rank / max(within_us - within_latency, 1.0)),
            (across_latency, per_host / max(across_us - across_latency, 1.0)))
