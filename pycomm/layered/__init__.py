"""The layered path: pycomm's all-reduce, reduce-scatter and all-gather over a group whose
backend is not pycomm (nccl, gloo, mpi, any registered backend).

That group, the *mover*, only moves bytes; pycomm reduces. The plan (``_C.layered_plan``,
csrc/runtime/layered_plan.h) picks the algorithm and the number of parts a large all-reduce is
pipelined in. The direct algorithm (``layered-direct``) is the native twoshot, with the
mover's collectives in place of pycomm's transports:

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

Over gloo, on host memory (``layered-pairwise``), the transfers of steps 2 and 4, and of
the reduce-scatter and the all-gather, are point-to-point sends between every pair of
ranks, all at once (``_Call.pairwise``), from and into the call's own memory where they
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
caller overlaps the call with its own work (see call._Call.run). CUDA
tensors are folded by kernels enqueued on the caller's current stream, and the mover's
collectives are called blocking (``async_op=False``), which for NCCL orders them on the
current stream without a host synchronization; nothing here waits on the host. So on
CUDA the stamps are compared on the device (``torch._assert_async``): a disagreement
stops the process with a device-side assertion rather than a DistBackendError.

Layout, one job per module, none importing a module listed after it:

* ``mover``      the mover's name and all-gather, which host each of its ranks is on, the
                 cost of its links.
* ``folds``      the kernels that fold a call's terms on its device, and how many terms
                 one of their calls takes.
* ``record``     what a rank keeps of a group's layered calls (``record_of``): counters
                 and flight recorder, options, hosts, lane, scratch buffers.
* ``call``       one operation (``_Call``): options, plan, the agreement (step 0), the
                 mover's collectives and pairwise sends and their failures, folds,
                 buffers; ``LayeredWork``.
* ``algorithms`` steps 1 to 4, the hierarchical all-reduce and the pipeline of parts,
                 and the entry points ``all_reduce``, ``reduce_scatter_tensor`` and
                 ``all_gather_into_tensor``.
"""
from .algorithms import Form, Stage, all_gather_into_tensor, all_reduce, reduce_scatter_tensor
from .folds import PARTIAL_DTYPES, kernels_for
from .record import record_of

# What the rest of pycomm uses (the direct API and its stats, the Triton kernels).
__all__ = ["all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "record_of", "kernels_for",
           "PARTIAL_DTYPES", "Form", "Stage"]
