"""A world of 16 ranks on a /dev/shm too small for the group's default rings, run as
``unshare -m sh -c 'mount -t tmpfs -o size=64m tmpfs /dev/shm && python tests/_shm_room.py'``
(see test_shm_room.py): the mount is private to that namespace, so its ranks (forked by
the harness inside it) see the small /dev/shm and nothing else does.

In one world, every group created on all 16 ranks:
* the default group, in the 64 MiB: smaller rings than configured;
* with /dev/shm then filled but for 1 MiB: TCP on loopback;
* the same with PYCOMM_TRANSPORT=shm: a clear error on every rank.
Each working group all-reduces 16 MiB (what crashed with SIGBUS when /dev/shm had no room
left) and small integers, exact in any order. Prints one JSON line: the ranks' results and
what /dev/shm holds afterwards."""

import json
import os
import sys

import torch
import torch.distributed as dist

SHM = "/dev/shm"
BALLAST = os.path.join(SHM, "ballast")
WORLD_SIZE = 16


def _all_reduce_right(group):
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    big = torch.full((4 << 20,), float(rank + 1))
    dist.all_reduce(big, group=group)
    small = torch.arange(1000, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(small, group=group)
    total = size * (size + 1) / 2
    return bool(torch.all(big == total)) and torch.equal(small, torch.arange(1000, dtype=torch.float32) * total)


def room_world(rank, world_size):
    import pycomm

    result = {"default": pycomm.stats()["setup"], "default_right": _all_reduce_right(None)}
    if rank == 0:  # leave 1 MiB: not even the smallest rings of 16 ranks fit
        stat = os.statvfs(SHM)
        fd = os.open(BALLAST, os.O_CREAT | os.O_WRONLY, 0o600)
        os.posix_fallocate(fd, 0, stat.f_bavail * stat.f_frsize - (1 << 20))
        os.close(fd)
    dist.barrier()
    tcp = dist.new_group(backend="pycomm")
    result["full"] = pycomm.stats(tcp)["setup"]
    result["full_right"] = _all_reduce_right(tcp)
    os.environ["PYCOMM_TRANSPORT"] = "shm"
    try:
        dist.new_group(backend="pycomm")
        result["forced"] = None
    except Exception as e:  # noqa: BLE001 (what it raises is what the test checks)
        result["forced"] = "%s: %s" % (type(e).__name__, e)
    del os.environ["PYCOMM_TRANSPORT"]
    dist.barrier()
    if rank == 0:
        os.unlink(BALLAST)
    return result


def main():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _shm_room  # the ranks find the world's function by its module's name
    from _harness import run_world

    results = run_world(_shm_room.room_world, WORLD_SIZE, timeout=float(sys.argv[1]) if len(sys.argv) > 1 else 240,
                        pg_timeout=60)
    print(json.dumps({"results": results, "left": sorted(os.listdir(SHM))}))


if __name__ == "__main__":
    main()
