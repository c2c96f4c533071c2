"""Inputs every rank can regenerate, exact expected results, and comparisons.

Imported only inside ranks (it imports torch), never by _harness at module level.

Inputs are generated from (seed, rank, tag), so any rank can rebuild every other rank's
contribution and compute the exact expected result locally. Value ranges are chosen per
(dtype, op) so that every partial result is exactly representable in the dtype: then any
summation order and any intermediate precision gives the same bits, and a mismatch is a
bug, not rounding.
"""

import zlib

import torch
import torch.distributed as dist

from _harness import is_gloo

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16,
          torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool]
FLOATING = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

# PREMUL_SUM factor: a power of two, so x * factor and the sum stay exact.
PREMUL_FACTOR = 0.5

REDUCE_OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM"]

# Elements per rank used by every collective; 1001 is odd and not divisible by 2, 3 or 4,
# 65537 crosses 2^16 (a likely chunk/packet/algorithm boundary).
COUNTS = [0, 1, 7, 1001, 65537]

# Shape used for the 1001-element case, so that multi-dimensional tensors are covered too.
SHAPES = {1001: (7, 11, 13)}


def dname(dtype):
    return str(dtype).replace("torch.", "")


def seed_of(label):
    """A seed every rank derives identically from a case label."""
    return zlib.crc32(label.encode())


def ops_for(dtype):
    """Reduction ops to test for dtype.

    AVG is tested on floating types only: torch documents no integer AVG semantics
    (gloo rejects it), so an integer rule would be an invention of this suite.
    PREMUL_SUM is floating only (a float factor); gloo does not implement it.
    """
    if dtype in FLOATING:
        ops = ["SUM", "AVG", "PRODUCT", "MIN", "MAX"]
        if not is_gloo():
            ops.append("PREMUL_SUM")
        return ops
    return ["SUM", "PRODUCT", "MIN", "MAX"]


def red_op(name):
    if name == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(PREMUL_FACTOR)
    return getattr(dist.ReduceOp, name)


def _gen(seed, rank, tag):
    return torch.Generator().manual_seed((seed * 1000003 + rank * 7919 + tag) % (2 ** 63))


def value_range(dtype, op, ws):
    """Inclusive integer range for inputs of (dtype, op) such that results stay exact.

    SUM/AVG/PREMUL_SUM: |sum| over ws <= 4 ranks stays within the exactly representable
    integers (int8 <= 124, fp16 <= 256 < 2048, bf16 <= 128 < 256, int64 up to 2^61 to
    catch accumulation through double). PRODUCT: |x| <= 2, so |product| <= 16.
    MIN/MAX: wide range (signedness and width bugs show up), exact after the cast.
    """
    assert ws <= 4, "ranges are sized for at most 4 ranks"
    if dtype == torch.bool:
        return 0, 1
    if op in ("MIN", "MAX"):
        if dtype in FLOATING:
            return -1000, 1000
        info = torch.iinfo(dtype)
        return info.min, info.max
    if op == "PRODUCT":
        return (1, 2) if dtype == torch.uint8 else (-2, 2)
    return {
        torch.float32: (-2 ** 20, 2 ** 20), torch.float64: (-2 ** 48, 2 ** 48),
        torch.float16: (-64, 64), torch.bfloat16: (-32, 32),
        torch.int8: (-31, 31), torch.uint8: (0, 63),
        torch.int32: (-2 ** 28, 2 ** 28), torch.int64: (-2 ** 59, 2 ** 59),
    }[dtype]


def int_valued(seed, rank, shape, dtype, op, ws, tag=0):
    """Integer-valued input of `dtype` for reduction `op` (see value_range)."""
    if isinstance(shape, int):
        shape = (shape,)
    lo, hi = value_range(dtype, op, ws)
    g = _gen(seed, rank, tag)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if hi - lo >= 2 ** 63 - 1:  # full int64 range: randint cannot take hi+1
        return torch.randint(-2 ** 63, 2 ** 63 - 1, shape, generator=g, dtype=torch.int64)
    return torch.randint(lo, hi + 1, shape, generator=g, dtype=torch.int64).to(dtype)


def payload(seed, rank, shape, dtype, tag=0):
    """Input for data-movement collectives: every bit pattern matters, no arithmetic.

    Floats are Gaussian (all mantissa bytes busy), integers span the full range.
    """
    if isinstance(shape, int):
        shape = (shape,)
    g = _gen(seed, rank, tag)
    if dtype in FLOATING:
        return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
    return int_valued(seed, rank, shape, dtype, "MAX", 4, tag)


def random_float(seed, rank, shape, dtype, op, tag=0):
    """Random (non-integer) floats for comparisons against gloo. PRODUCT uses values
    near 1 so that the product stays in a sane range."""
    if isinstance(shape, int):
        shape = (shape,)
    g = _gen(seed, rank, tag)
    x = torch.randn(shape, generator=g, dtype=torch.float32)
    if op == "PRODUCT":
        x = 1.0 + 0.25 * x
    else:
        x = 2.0 * x
    return x.to(dtype)


def reduce_exact(inputs, dtype, op, ws):
    """Exact reduction of the per-rank inputs (list indexed by rank)."""
    if dtype == torch.bool:
        s = torch.stack(inputs)
        # SUM/MAX are logical OR, PRODUCT/MIN logical AND (what gloo and NCCL do).
        return s.any(0) if op in ("SUM", "MAX") else s.all(0)
    wide = torch.float64 if dtype in FLOATING else torch.int64
    s = torch.stack([t.to(wide) for t in inputs])
    if op == "SUM":
        r = s.sum(0)
    elif op == "AVG":
        r = s.sum(0) / ws
    elif op == "PREMUL_SUM":
        r = s.sum(0) * PREMUL_FACTOR
    elif op == "PRODUCT":
        r = s.prod(0)
    elif op == "MIN":
        r = s.amin(0)
    elif op == "MAX":
        r = s.amax(0)
    else:
        raise ValueError(op)
    return r.to(dtype)


def _describe_mismatch(got, exp, bad):
    idx = bad.nonzero()[0].tolist() if bad.dim() else []
    flat_bad = bad.reshape(-1).nonzero().reshape(-1)
    i = flat_bad[0].item()
    return ("%d of %d elements differ; first at index %s: got %r expected %r"
            % (flat_bad.numel(), bad.numel(), tuple(idx),
               got.reshape(-1)[i].item(), exp.reshape(-1)[i].item()))


def check_equal(got, exp):
    """[] if got equals exp exactly (shape, dtype, values), else one message."""
    if got.dtype != exp.dtype:
        return ["dtype %s, expected %s" % (got.dtype, exp.dtype)]
    if got.shape != exp.shape:
        return ["shape %s, expected %s" % (tuple(got.shape), tuple(exp.shape))]
    if torch.equal(got, exp):
        return []
    return [_describe_mismatch(got, exp, got != exp)]


def check_close(got, exp, tol):
    """[] if |got - exp| <= tol elementwise (tol: tensor or float), else one message."""
    if got.shape != exp.shape or got.dtype != exp.dtype:
        return check_equal(got, exp)
    if got.numel() == 0:
        return []
    diff = (got.double() - exp.double()).abs()
    bad = ~(diff <= tol)
    if not bad.any():
        return []
    return [_describe_mismatch(got, exp, bad) + " (max |diff| %.3g)" % diff.max().item()]


def check_avg(got, exp_exact):
    """AVG of integer-valued inputs: the only rounding is the final division (or a
    multiplication by 1/ws), so allow one ulp of the result."""
    eps = torch.finfo(got.dtype).eps
    tol = eps * exp_exact.double().abs() + torch.finfo(got.dtype).tiny
    return check_close(got, exp_exact, tol)


# Relative tolerance on the result when comparing float reductions with gloo. On top of it,
# an absolute term bounds summation-order differences: each backend's sum of ws values is
# within (ws-1)*eps/2*sum_i|x_i| of the exact sum (plus a final rounding), so two backends
# differ by at most ws*eps*sum_i|x_i|; we allow 2x that. For PRODUCT the same argument
# gives a relative bound of about ws*eps, also doubled. MIN/MAX involve no rounding and
# must be bit-identical.
RTOL_VS_GLOO = {torch.float32: 1e-5, torch.float64: 1e-12,
                torch.float16: 2e-3, torch.bfloat16: 1e-2}


def tolerance_vs_gloo(dtype, op, ws, inputs, ref):
    """Elementwise tolerance for a float reduction `op` over `inputs` with result `ref`."""
    if op in ("MIN", "MAX"):
        return 0.0
    eps = torch.finfo(dtype).eps
    ref_abs = ref.double().abs()
    if op == "PRODUCT":
        return (RTOL_VS_GLOO[dtype] + 2 * ws * eps) * ref_abs
    abs_sum = torch.stack([t.double().abs() for t in inputs]).sum(0)
    if op == "AVG":
        abs_sum = abs_sum / ws
    elif op == "PREMUL_SUM":
        abs_sum = abs_sum * PREMUL_FACTOR
    return RTOL_VS_GLOO[dtype] * ref_abs + 2 * ws * eps * abs_sum
