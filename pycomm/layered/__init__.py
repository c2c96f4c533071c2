"""The layered path: pycomm's all-reduce, reduce-scatter and all-gather over a group whose
backend is not pycomm (nccl, gloo, mpi, any registered backend).

That group, the *mover*, only moves bytes; pycomm reduces. The plan (``_C.layered_plan``,
csrc/runtime/layered_plan.h) picks the algorithm and the number of parts a large all-reduce is
pipelined in. The direct algorithm (``layered-direct``) is the native twoshot, with the
mover's collectives in place of pycomm's transports:

0. Agreement (stamps.py): every call opens with one all-gather of the same size whatever
   the call, each rank's message its stamp of the call (sequence number, collective,
   count, dtype, reduction, codec, block, determinism mode, requested algorithm),
   compared before anything else moves (on a device, by a kernel): ranks that disagree
   fail the call, naming the field and both values, as the native path does, instead of
   folding what does not belong together.
1. Segments: the buffer is cut over the ranks as the native path cuts it
   (``_C.segment_begins``; whole codec blocks under a codec, so blocks start at multiples
   of the block in the tensor).
2. Reduce-scatter: one ``all_to_all_single`` of byte payloads sends segment s of every
   rank's input to rank s, raw (the input's own bytes) or encoded (codec blocks from the
   segment's first element, this rank's contribution quantized once; every segment by one
   ``_C.fold_segments``).
3. Fold: rank s reduces the n contributions of its segment in logical rank order, or
   exactly (exact mode), and under a codec encodes the result once more
   (``_C.fold``, i.e. ``DeviceOps::reduce_terms``: the function every native algorithm
   reduces with).
4. All-gather (all-reduce only): one ``all_gather_into_tensor`` of the (encoded) results,
   each padded to the longest segment; every rank then decodes every segment, its own too.

A call whose whole data fits in the opening's message after the stamp runs in one shot
(``layered-oneshot``): the data travels in step 0's all-gather, and each rank folds every
element from every rank's contribution (its own segment's, for a reduce-scatter), as the
owner of the element's segment folds it in step 3: the same bits, and no collective more.

Over gloo, on host memory (``layered-pairwise``), the transfers of steps 2 and 4, and of
the reduce-scatter and the all-gather, are point-to-point sends between every pair of
ranks, all at once (``Call.pairwise``), from and into the call's own memory where they
can: gloo's all-to-all copies this rank's own segment, and its all-gather runs its ring
one step after another.

Across several hosts with equal rank counts (ranks numbered host by host) an all-reduce
in mode 0 may run as the native hierarchical one (``layered-hierarchical``, see
algorithms._hierarchical_part): within each host an all-to-all of the shards and the
local fold, across hosts the direct algorithm on the host partials among the ranks of
one local index (subgroups of the mover made at the group's first call), within the
host an all-gather; only a share of 1/L of the bytes crosses the link between hosts.
The direct algorithm may gather its results through the same subgroups, across hosts
then within them (``layered-direct+host-gather``): the same bytes, fewer of them on the
link.

The mover never reduces, so its algorithm, channel count or protocol cannot change a bit:
for the same inputs, world size and options the result equals the native path's (its
twoshot, or its hierarchical for layered-hierarchical; in deterministic modes every
algorithm's). Levels: D0-D3 in mode 1
(a fixed fold order over logical ranks, whatever the mover does), D0-D5 in exact mode
(the exact sum depends only on the multiset of contributions).

Devices and streams: CPU tensors are folded by the CPU ops, on the calling thread, or on
the group's lane (a thread of its own) from its first asynchronous call on, so that the
caller overlaps the call with its own work (see call.Call.run). CUDA tensors are folded
by kernels enqueued on the caller's current stream, and the mover's collectives are
waited for with ``Work.wait()``, which for NCCL makes the current stream wait, not the
host: nothing here waits on the host, nothing is copied from it, and every buffer is
kept from one call to the next, so that a CUDA graph can capture a call made once
before. So on CUDA the stamps are compared on the device, and a disagreement is raised
by the rank's next layered call on the group, or wait() of one of its works.

Layout, one job per module, none importing a module listed after it; the kernels that
fold a call's terms, run a codec's step over every segment and write and judge stamps on
its device come from ``pycomm.kernels``, below this package:

* ``mover``      the mover's name and all-gather, which host each of its ranks is on, the
                 cost of its links.
* ``record``     what a rank keeps of a group's layered calls (``record_of``): counters
                 and flight recorder, the knobs (read once), options, layouts, hosts, lane.
* ``layout``     what every call of one kind shares, made at its first call: plan,
                 kernels, stamp, segments, scratch buffers.
* ``stamps``     the agreement (step 0): the opening all-gather and the comparison.
* ``call``       one operation (``Call``): its layout, the mover's collectives and
                 pairwise sends and their failures, folds; ``LayeredWork``.
* ``algorithms`` steps 1 to 4, the one-shot, the hierarchical all-reduce and the
                 pipeline of parts, and the entry points ``all_reduce``,
                 ``reduce_scatter_tensor`` and ``all_gather_into_tensor``.
"""
from .algorithms import Form, Stage, all_gather_into_tensor, all_reduce, reduce_scatter_tensor
from .record import record_of

# What the rest of pycomm uses (the direct API and its stats).
__all__ = ["all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "record_of", "Form", "Stage"]
