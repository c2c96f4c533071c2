"""DDP communication hooks: compressed gradient all-reduce with error feedback, and
deterministic gradient all-reduce.

Both work on any DDP process group: a pycomm group, or one of another backend (nccl,
gloo, ...), which then only moves the bytes of pycomm's reduction (pycomm.layered).

Usage::

    from pycomm.hooks import CompressionState, compressed_allreduce_hook

    ddp = DistributedDataParallel(model)          # default group, backend "pycomm"
    state = CompressionState("fp8_e4m3", group=ddp.process_group, model=model)
    ddp.register_comm_hook(state, compressed_allreduce_hook)

or, the same in one line, ``state = register_compression_hook(ddp, "fp8_e4m3")``.

What the hook does with each gradient bucket:

* It averages the bucket over the group with ``pycomm.all_reduce(..., op=AVG,
  compression=codec)``: every rank's contribution is quantized exactly as
  ``pycomm.quantize(g, codec)``, reduced in fp32, and the result is quantized once more.
  The averaged gradient is written back into ``bucket.buffer()``, which is what the
  returned future yields, so DDP hands it to the optimizer as usual.
* Compression applies where the wire applies it: float32 buckets (any codec) and
  float16/bfloat16 buckets (fp8 codecs only). Every other bucket -- float64, integers, a
  16-bit bucket with a 16-bit codec -- is averaged uncompressed (``compression="none"``)
  and keeps no residual.
* **Error feedback** (on by default): the hook sends ``g = gradient + residual`` and keeps
  ``residual = g - quantize(g, codec)``, the part of this rank's contribution that the
  codec dropped, to add to the same bucket's gradient at the next step. What is dropped
  at one step is thus sent later instead of being lost, so the summed update over many
  steps follows the uncompressed one. It compensates only *this rank's* quantization:
  the second rounding of the reduced result (the same on every rank) is not fed back.
  Residuals are kept in float32, one per bucket, keyed by ``bucket.index()`` and tagged
  with the bucket's layout (which parameters it holds, by name when the state knows the
  model, else by shape). When buckets change layout -- DDP rebuilds them after its first
  step, and a fresh DDP starts from its initial layout after a checkpoint is restored --
  each residual is cut into its parameters' pieces and follows them into their new
  buckets. A piece that cannot be placed (its parameter is gone, or parameters are told
  apart by shape only and share one) is dropped, i.e. counted as zero: that loses one
  step's quantization error, and never adds one parameter's error to another's gradient.
  Non-finite gradients leave a zero residual at their positions, so one overflowing step
  does not poison the following ones.

Error feedback assumes that the wire quantizes each rank's contribution, as the ring,
tree, oneshot and twoshot all-reduces do. The hierarchical all-reduce instead quantizes
each node's exact partial sum: there the residuals do not match what was lost, and feed
back noise of the codec's size instead of correcting the error. With several ranks per
node, give the state an ``algorithm`` (e.g. ``"ring"``) when error feedback matters.

Checkpointing: residuals are per rank (every rank quantizes its own gradient), so save
``state.state_dict()`` on *every* rank next to the model and optimizer, and restore with
``state.load_state_dict(d)`` before training resumes. The dict holds the codec, the
error-feedback flag and cloned residuals with their layouts (tensors, strings, ints and
tuples: ``torch.save`` and ``torch.load(weights_only=True)`` take it). Restoring without
the residuals (or calling ``reset()``) is harmless: it forgets one step's quantization
error. Call ``reset()`` too when the gradients change meaning, e.g. when a loss scaler
changes its scale. The process group and algorithm are not saved.
"""

import torch
import torch.distributed as dist

import pycomm
from pycomm import _C, kernels

__all__ = ["CompressionState", "compressed_allreduce_hook", "register_compression_hook",
           "DeterministicState", "deterministic_allreduce_hook", "register_deterministic_hook"]

def _check_codec(codec):
    if codec not in pycomm.CODECS:
        raise ValueError("pycomm.hooks: unknown codec %r (valid codecs: %s)"
                         % (codec, ", ".join(pycomm.CODECS)))
    return codec


def _compressed_on_wire(dtype, codec):
    """Whether an all-reduce of ``dtype`` with ``codec`` is compressed (the core's rule:
    where the codec is narrower than floating data)."""
    return _C.applied_compression("allreduce", dtype, codec) != "none"


class CompressionState:
    """The state of :func:`compressed_allreduce_hook`.

    codec: one of ``pycomm.CODECS``. error_feedback: keep and feed back residuals.
    group: the process group to reduce over, which must be the DDP model's (None: the
    default group). model: the module whose parameter names identify the parameters in
    a bucket's layout (without it, parameters are identified by shape, and parameters
    that share a shape cannot follow a layout change). algorithm: passed on to
    ``pycomm.all_reduce`` (None: the group's choice). ``residuals`` maps a bucket index
    to this rank's float32 residual for that bucket (only with error feedback).
    """

    def __init__(self, codec="fp8_e4m3", error_feedback=True, group=None, model=None,
                 algorithm=None):
        self.codec = _check_codec(codec)
        self.error_feedback = bool(error_feedback)
        self.group = group
        self.algorithm = algorithm
        self._names = {} if model is None else {id(p): n for n, p in model.named_parameters()}
        self.residuals = {}     # bucket index -> float32 residual, flat
        self._layouts = {}      # bucket index -> ((parameter key, numel), ...)
        self._fresh = set()     # indices written during the current step
        self._loose = {}        # parameter key -> residual, while buckets change layout

    def __repr__(self):
        return "CompressionState(codec=%r, error_feedback=%r, %d residual(s))" % (
            self.codec, self.error_feedback, len(self.residuals))

    def reset(self):
        """Forget every residual (the next step sends the plain gradients)."""
        self.residuals.clear()
        self._layouts.clear()
        self._fresh.clear()
        self._loose.clear()

    def state_dict(self):
        """Codec, error-feedback flag, and a clone of each residual with its bucket's
        layout, for a checkpoint (per rank)."""
        return {"codec": self.codec,
                "error_feedback": self.error_feedback,
                "residuals": {i: r.detach().clone() for i, r in self.residuals.items()},
                "layouts": dict(self._layouts)}

    def load_state_dict(self, state_dict):
        """Restore what :meth:`state_dict` returned (codec and flag included); the
        residuals are cloned."""
        codec = _check_codec(state_dict["codec"])
        error_feedback = bool(state_dict["error_feedback"])
        residuals = state_dict.get("residuals", {})
        layouts = state_dict.get("layouts", {})
        if residuals and not error_feedback:
            raise ValueError("pycomm.hooks: residuals given with error_feedback off")
        self.reset()
        self.codec, self.error_feedback = codec, error_feedback
        for i, r in residuals.items():
            self.residuals[int(i)] = r.detach().to(torch.float32, copy=True).flatten()
            self._layouts[int(i)] = tuple((k, int(n)) for k, n in layouts.get(i, ()))

    def _layout(self, bucket):
        return tuple((self._names.get(id(p), tuple(p.shape)), p.numel())
                     for p in bucket.parameters())

    def _take_residual(self, index, layout, numel):
        """This bucket's residual from the previous step, or None. A residual kept for
        a bucket of another layout is cut into its parameters' pieces, which go to the
        buckets that hold those parameters now (a piece whose key is ambiguous is
        dropped, as is the residual of a parameter that is no longer there)."""
        r = self.residuals.get(index)
        if r is not None and self._layouts.get(index) == layout and r.numel() == numel:
            del self.residuals[index], self._layouts[index]
            return r
        for i in [i for i in self.residuals if i not in self._fresh]:
            r, lay = self.residuals.pop(i), self._layouts.pop(i, ())
            if sum(n for _, n in lay) != r.numel():
                continue
            for (key, _), piece in zip(lay, r.split([n for _, n in lay])):
                # A key seen twice (parameters told apart by shape only) is ambiguous.
                self._loose[key] = None if key in self._loose else piece
        pieces = [self._loose.pop(key, None) for key, _ in layout]
        if all(p is None for p in pieces) or sum(n for _, n in layout) != numel:
            return None
        return torch.cat([p if p is not None and p.numel() == n else torch.zeros(n)
                          for p, (_, n) in zip(pieces, layout)])

    def _keep_residual(self, index, layout, residual, last):
        self.residuals[index], self._layouts[index] = residual, layout
        self._fresh.add(index)
        if last:  # the step's last bucket: what was not claimed is stale
            self._fresh.clear()
            self._loose.clear()


def _error_feedback(buf, residual, codec):
    """buf += residual (g = gradient + residual in float32, sent as g in the bucket's
    dtype); returns the new residual g - quantize(buf), zero where not finite."""
    triton = kernels.triton_for(buf)
    if triton is not None:  # one fused pass over the bucket
        return triton.error_feedback(buf.view(-1), residual, codec, _C.default_compression_block())
    g = buf if buf.dtype == torch.float32 else buf.float()
    if residual is not None:
        g.add_(residual.view(g.shape))
    if g is not buf:
        buf.copy_(g)
    # What the wire adds for this rank: its contribution quantized, in float32 (a 16-bit
    # bucket's quantized values are not rounded back to 16 bits before they are summed).
    sent = pycomm.decode(pycomm.encode(buf, codec), codec, buf.numel(), torch.float32)
    return (g.flatten() - sent).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


def compressed_allreduce_hook(state: CompressionState,
                              bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over ``state.group`` with ``state.codec`` compression (and error
    feedback when ``state.error_feedback``); register with
    ``ddp.register_comm_hook(state, compressed_allreduce_hook)``."""
    buf = bucket.buffer()
    codec = state.codec if _compressed_on_wire(buf.dtype, state.codec) else "none"
    if codec != "none" and state.error_feedback:
        index, layout = bucket.index(), state._layout(bucket)
        state._keep_residual(index, layout, _error_feedback(buf, state._take_residual(index, layout, buf.numel()),
                                                            codec), bucket.is_last())
    work = pycomm.all_reduce(buf, dist.ReduceOp.AVG, group=state.group,
                             algorithm=state.algorithm, compression=codec, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def register_compression_hook(ddp_model, codec="fp8_e4m3", *, error_feedback=True,
                              algorithm=None):
    """Register :func:`compressed_allreduce_hook` on ``ddp_model`` (over the model's own
    process group, parameters named as in ``ddp_model.module``) and return its
    :class:`CompressionState`, e.g. for checkpointing."""
    state = CompressionState(codec, error_feedback, group=ddp_model.process_group,
                             model=ddp_model.module, algorithm=algorithm)
    ddp_model.register_comm_hook(state, compressed_allreduce_hook)
    return state


class DeterministicState:
    """The state of :func:`deterministic_allreduce_hook`: ``deterministic`` (True or 1:
    a fixed fold order, D0-D3; "exact": the exact sum, D0-D5) and the DDP model's
    ``group`` (None: the default group)."""

    def __init__(self, deterministic="exact", group=None):
        if deterministic not in (True, 1, "1", "exact"):
            raise ValueError("pycomm.hooks: deterministic must be True, 1 or 'exact', not %r" % (deterministic,))
        self.deterministic = deterministic
        self.group = group

    def __repr__(self):
        return "DeterministicState(deterministic=%r)" % (self.deterministic,)


def deterministic_allreduce_hook(state: DeterministicState,
                                 bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over ``state.group`` uncompressed, in pycomm's deterministic
    mode ``state.deterministic``; register with ``ddp.register_comm_hook(state,
    deterministic_allreduce_hook)``."""
    work = pycomm.all_reduce(bucket.buffer(), dist.ReduceOp.AVG, group=state.group, compression="none",
                             deterministic=state.deterministic, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def register_deterministic_hook(ddp_model, deterministic="exact"):
    """Register :func:`deterministic_allreduce_hook` on ``ddp_model`` (over the model's
    own process group) and return its :class:`DeterministicState`."""
    state = DeterministicState(deterministic, group=ddp_model.process_group)
    ddp_model.register_comm_hook(state, deterministic_allreduce_hook)
    return state
