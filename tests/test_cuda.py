"""The CUDA path: kernels bit for bit equal to the CPU path, and every collective on CUDA
tensors, several ranks sharing one GPU (CUDA IPC), or staged through host memory.

Marked `cuda`; skipped without a GPU (or with a CPU-only torch). With a GPU:
* kernels: pycomm._C.reduce (the reduction kernel) and the codecs (encode, decode,
  quantize) on CUDA tensors give the CPU's bits, for every dtype and op, exact mode
  included, on data with subnormals, infinities and NaN;
* collectives on CUDA tensors (2 and 4 ranks on one GPU) give the right values, through
  torch.distributed and the direct API, for every collective, and on a group shrunk to
  its survivors;
* point-to-point on CUDA tensors runs over the host channels (p2p-via-host), between CUDA
  ranks and with a CPU rank, from a named or any source, strided, stream-ordered;
* the same all-reduce on CUDA and on CPU copies of the inputs, in the same processes,
  gives identical bits in both deterministic modes, with and without compression, for
  every algorithm; also with the CUDA frames staged through TCP and with 2 nodes of 2;
* stream semantics: inputs written by a slow kernel on the caller's stream are waited for;
* the flag-synchronized one-shot: small all-reduces of every kind of element, aligned or
  not, at and past its size limit, give the right values; a peer that sleeps through one
  is reported when the deadline passes, a peer that is killed within a liveness check;
* the layered path on CUDA tensors (NCCL moving at 1 rank, gloo at 2 and 4), with the CUDA
  and with the Triton kernels: the native CPU path's bits for every codec and both
  deterministic modes; ranks that disagree on a call, found on the device and raised by
  the next call.
"""

import pytest
import torch
import torch.distributed as dist

from _fault_checks import timed_all_reduce
from _harness import is_gloo, run_world

def _cuda_build():
    import pycomm

    return pycomm._C.has_cuda


pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(is_gloo(), reason="pycomm's CUDA path"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"),
    pytest.mark.skipif(torch.cuda.is_available() and not _cuda_build(), reason="pycomm built without CUDA"),
]

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.uint8, torch.int32, torch.int64]
CODECS = ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2"]
ALGORITHMS = ["ring", "tree", "oneshot", "twoshot", "hierarchical"]


def _same_bits(a, b):
    """Bit for bit, NaN for NaN: CUDA arithmetic returns its own canonical NaN where the CPU
    keeps an operand's, so a NaN's sign and payload are not part of the contract."""
    a, b = a.contiguous().cpu(), b.contiguous().cpu()
    if a.dtype.is_floating_point:
        nan = torch.isnan(a)
        if not torch.equal(nan, torch.isnan(b)):
            return False
        a, b = a.masked_fill(nan, 0), b.masked_fill(nan, 0)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _first_difference(a, b):
    """Where two tensors that are not _same_bits first differ: both values and their bits."""
    a, b = a.contiguous().cpu().view(-1), b.contiguous().cpu().view(-1)
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    differ = a.view(bits) != b.view(bits)
    if a.dtype.is_floating_point:  # as _same_bits: NaN for NaN
        differ &= ~(torch.isnan(a) & torch.isnan(b))
    i = int(differ.nonzero()[0])
    mask = (1 << 8 * a.element_size()) - 1
    return "element %d: %r (%#x) and %r (%#x)" % (i, a[i].item(), a.view(bits)[i].item() & mask,
                                                   b[i].item(), b.view(bits)[i].item() & mask)


def _data(n, dtype, seed, specials=True):
    g = torch.Generator().manual_seed(seed)
    if not dtype.is_floating_point:
        return torch.randint(-100 if dtype != torch.uint8 else 0, 100, (n,), generator=g).to(dtype)
    x = torch.randn(n, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-20, 20, (n,), generator=g))
    x = x.to(dtype)
    if specials and n > 64:
        x[3], x[10], x[11], x[40] = float("inf"), float("-inf"), float("nan"), torch.finfo(dtype).tiny / 4
        x[41] = torch.finfo(dtype).max
    return x


def _op(name):
    return dist._make_nccl_premul_sum(0.375) if name == "PREMUL_SUM" else getattr(dist.ReduceOp, name)


@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
def test_reduce_kernel_matches_cpu(dtype):
    import pycomm

    ops = ["SUM", "AVG", "PREMUL_SUM", "PRODUCT", "MIN", "MAX"] if dtype.is_floating_point else \
        ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
    for k in (1, 2, 3, 8):
        for n in (1, 7, 4099, 100003):
            terms = [_data(n, dtype, 10 * k + j) for j in range(k)]
            for op in ops:
                if op == "AVG" and not dtype.is_floating_point:
                    continue
                for exact in ([False, True] if dtype.is_floating_point else [False]):
                    cpu = pycomm._C.reduce(terms, _op(op), 4, exact)
                    gpu = pycomm._C.reduce([t.cuda() for t in terms], _op(op), 4, exact)
                    assert _same_bits(cpu, gpu), (dtype, k, n, op, exact)
            # Unaligned starts take the one-element path of the kernel.
            cpu = pycomm._C.reduce([t[1:] for t in terms], dist.ReduceOp.SUM, 1, False)
            gpu = pycomm._C.reduce([t.cuda()[1:] for t in terms], dist.ReduceOp.SUM, 1, False)
            assert _same_bits(cpu, gpu), (dtype, k, n, "unaligned")


@pytest.mark.parametrize("codec", CODECS)
def test_codec_kernels_match_cpu(codec):
    import pycomm

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        if pycomm._C.encode(torch.zeros(16, dtype=dtype), codec, 16).numel() >= 16 * dtype.itemsize + 4:
            continue  # no saving: the collectives never use this pair
        # Aligned operands take the kernel's vector path; with block 16 the input starts
        # one element into its storage, which takes the per-element path.
        for block in (16, 256, 1024):
            for n in (5, 1000, 65537):
                x = _data(n + 1, dtype, n + block)
                if n > 100:
                    x[100:100 + block] = torch.finfo(dtype).max  # saturating block
                cut = (lambda t: t[1:]) if block == 16 else (lambda t: t[:n])
                x, x_gpu = cut(x), cut(x.cuda())
                enc_cpu = pycomm._C.encode(x, codec, block)
                enc_gpu = pycomm._C.encode(x_gpu, codec, block)
                assert _same_bits(enc_cpu, enc_gpu), (codec, dtype, block, n, "encode")
                dec_cpu = pycomm._C.decode(enc_cpu, codec, block, n, dtype)
                dec_gpu = pycomm._C.decode(enc_gpu, codec, block, n, dtype)
                assert _same_bits(dec_cpu, dec_gpu), (codec, dtype, block, n, "decode")
                assert _same_bits(pycomm.quantize(x, codec, block=block), pycomm.quantize(x_gpu, codec, block=block))


def every_collective(rank, ws):
    import pycomm

    dev = torch.device("cuda", 0)
    problems = []

    def check(name, got, want):
        if not torch.equal(got.cpu(), want.cpu()):
            problems.append("%s: got %s, want %s" % (name, got.cpu()[:6].tolist(), want.cpu()[:6].tolist()))

    n = 1 << 20
    base = torch.arange(n, dtype=torch.float32, device=dev) % 97
    total = sum(base * (r + 1) for r in range(ws))
    t = base * (rank + 1)
    dist.all_reduce(t)
    check("all_reduce", t, total)
    for algo in ALGORITHMS + [None]:
        t = base * (rank + 1)
        pycomm.all_reduce(t, algorithm=algo)
        check("all_reduce %s" % algo, t, total)
    small = torch.full((1000,), rank + 1.0, device=dev)
    w = dist.all_reduce(small, async_op=True)
    w.wait()
    check("all_reduce async small", small, torch.full((1000,), ws * (ws + 1) / 2, device=dev))
    out = torch.empty(n // ws, device=dev)
    dist.reduce_scatter_tensor(out, base * (rank + 1))
    check("reduce_scatter", out, total[rank * (n // ws):(rank + 1) * (n // ws)])
    gathered = torch.empty(ws * 1000, device=dev)
    dist.all_gather_into_tensor(gathered, torch.full((1000,), float(rank), device=dev))
    check("all_gather", gathered, torch.arange(ws, device=dev).repeat_interleave(1000).float())
    b = torch.full((777,), float(rank), device=dev)
    dist.broadcast(b, src=ws - 1)
    check("broadcast", b, torch.full((777,), ws - 1.0, device=dev))
    r = torch.full((333,), rank + 1.0, device=dev)
    dist.reduce(r, dst=0)
    if rank == 0:
        check("reduce", r, torch.full((333,), ws * (ws + 1) / 2, device=dev))
    a2a = torch.arange(ws * 4, dtype=torch.float32, device=dev) + 100 * rank
    out = torch.empty_like(a2a)
    dist.all_to_all_single(out, a2a)
    want = torch.cat([torch.arange(4, device=dev).float() + 4 * rank + 100 * src for src in range(ws)])
    check("all_to_all", out, want)
    lst = [torch.empty(5, device=dev) for _ in range(ws)]
    dist.all_gather(lst, torch.full((5,), float(rank), device=dev))
    check("all_gather list", torch.cat(lst), torch.arange(ws, device=dev).repeat_interleave(5).float())
    g = [torch.empty(3, device=dev) for _ in range(ws)] if rank == 0 else None
    dist.gather(torch.full((3,), float(rank), device=dev), g, dst=0)
    if rank == 0:
        check("gather", torch.cat(g), torch.arange(ws, device=dev).repeat_interleave(3).float())
    s = torch.empty(3, device=dev)
    dist.scatter(s, [torch.full((3,), float(i), device=dev) for i in range(ws)] if rank == 0 else None, src=0)
    check("scatter", s, torch.full((3,), float(rank), device=dev))
    if rank in (0, 1):
        p = torch.full((10,), 5.0, device=dev) if rank == 0 else torch.zeros(10, device=dev)
        (dist.send if rank == 0 else dist.recv)(p, 1 - rank)
        check("send/recv", p, torch.full((10,), 5.0, device=dev))
    dist.barrier()
    # Stream semantics: the input is written by a slow kernel on the caller's stream.
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.zeros(n, device=dev)
        torch.cuda._sleep(50_000_000)  # ~20+ ms of GPU time before the write below
        x.fill_(rank + 1.0)
        w = dist.all_reduce(x, async_op=True)
    w.wait()
    torch.cuda.current_stream().wait_stream(side)
    check("stream order", x, torch.full((n,), ws * (ws + 1) / 2, device=dev))
    return problems


@pytest.mark.parametrize("ws", [2, 4])
def test_every_collective_on_cuda(ws):
    for problems in run_world(every_collective, ws, timeout=240):
        assert not problems, problems


def shrink_on_cuda(rank, ws):
    """The last rank leaves; the others shrink the default group and all-reduce CUDA
    tensors on the new group, which serves CUDA as the old one did (torch registers a
    shrunk group's backend for the CPU alone; pycomm rebuilds the group)."""
    dev = torch.device("cuda", 0)
    t = torch.full((1000,), rank + 1.0, device=dev)
    dist.all_reduce(t)
    if rank == ws - 1:
        return []
    new = dist.shrink_group([ws - 1])
    x = torch.full((1 << 20,), rank + 1.0, device=dev)
    dist.all_reduce(x, group=new)
    want = (ws - 1) * ws / 2
    return [] if torch.equal(x.cpu(), torch.full((1 << 20,), want)) else [("shrunk", x[:4].tolist(), want)]


def test_shrink_group_on_cuda():
    for problems in run_world(shrink_on_cuda, 3, timeout=120):
        assert not problems, problems


def p2p_on_cuda(rank, ws):
    """Ranks 0 and 1 send and receive CUDA tensors, rank 2 CPU tensors: every pair both
    ways (several frames; a strided tensor sent and received), a recv from any source on
    CUDA memory, and an input written by a slow kernel on the caller's stream. The bits
    arrive as sent; Work.algorithm and pycomm.stats() name p2p-via-host on CUDA tensors,
    p2p on CPU tensors."""
    import pycomm

    dev = torch.device("cuda", 0) if rank < 2 else torch.device("cpu")
    label = "p2p-via-host" if rank < 2 else "p2p"
    n = 300_001  # more than the shared-memory slots hold: the sender waits for the receiver
    problems = []

    def message(src, tag):
        return (torch.arange(2 * n, dtype=torch.float32) % 251 + 1000 * src + tag).to(dev)

    def check(name, got, want, work):
        if not torch.equal(got.cpu(), want.cpu()):
            problems.append("%s: got %s, want %s" % (name, got.cpu()[:4].tolist(), want.cpu()[:4].tolist()))
        if work.algorithm != label:
            problems.append("%s: Work.algorithm %s, expected %s" % (name, work.algorithm, label))

    for src, dst in [(0, 1), (1, 0), (0, 2), (2, 0), (1, 2), (2, 1)]:
        name = "%d -> %d" % (src, dst)
        if rank == src:
            sent = message(src, 1)
            work = dist.isend(sent[::2], dst, tag=1)
            work.wait()
            check(name + " (sent)", sent, message(src, 1), work)
        elif rank == dst:
            got = torch.zeros(2 * n, device=dev)
            work = dist.irecv(got[::2], src, tag=1)
            work.wait()
            want = torch.zeros(2 * n, device=dev)
            want[::2] = message(src, 1)[::2]
            check(name, got, want, work)
    if rank == 0:
        sources = set()
        for _ in range(ws - 1):
            got = torch.empty(n, device=dev)
            work = dist.irecv(got, tag=5)
            work.wait()
            src = work._source_rank()
            sources.add(src)
            check("any source (from %d)" % src, got, message(src, 5)[:n], work)
        if sources != {1, 2}:
            problems.append("received from any source from %s" % sorted(sources))
    else:
        side = torch.cuda.Stream() if dev.type == "cuda" else None
        with torch.cuda.stream(side):
            sent = torch.zeros(n, device=dev)
            if side is not None:
                torch.cuda._sleep(50_000_000)  # ~20+ ms of GPU time before the write below
            sent.copy_(message(rank, 5)[:n])
            work = dist.isend(sent, 0, tag=5)
        work.wait()
        check("send to any source", sent, message(rank, 5)[:n], work)
    stats = pycomm.stats()["collectives"]
    for collective in ("send", "recv"):
        if set(stats.get(collective, {})) != {label}:
            problems.append("stats of %s: %s, expected only %s" % (collective, stats.get(collective), label))
    return problems


@pytest.mark.parametrize("env", [{}, {"PYCOMM_TRANSPORT": "tcp"}], ids=["shm", "tcp"])
def test_p2p_on_cuda_over_host_channels(env):
    for problems in run_world(p2p_on_cuda, 3, env=env, timeout=240):
        assert not problems, problems


def gpu_equals_cpu(rank, ws, cases):
    import pycomm

    problems = []
    for dtype, op, mode, codec in cases:
        x = _data(50021, dtype, 7 + rank, specials=op != "PRODUCT")
        if op == "PRODUCT":
            x = 1 + 0.01 * x.clamp(-1, 1)
        for algo in ALGORITHMS:
            cpu, gpu = x.clone(), x.cuda()
            pycomm.all_reduce(cpu, _op(op), algorithm=algo, deterministic=mode, compression=codec)
            pycomm.all_reduce(gpu, _op(op), algorithm=algo, deterministic=mode, compression=codec)
            if not _same_bits(cpu, gpu):
                problems.append("%s %s %s %s %s: GPU and CPU bits differ" % (dtype, op, mode, codec, algo))
    for mode in (True, "exact"):  # reduce-scatter and all-gather, compressed too
        for codec in (None, "fp8_e4m3"):
            x = _data(4096 * ws, torch.float32, 99 + rank)
            outs = []
            for dev in ("cpu", "cuda"):
                o = torch.empty(4096, device=dev)
                pycomm.reduce_scatter_tensor(o, x.to(dev), deterministic=mode, compression=codec)
                g = torch.empty(4096 * ws, device=dev)
                pycomm.all_gather_into_tensor(g, o, compression=codec)
                outs.append(g)
            if not _same_bits(*outs):
                problems.append("reduce_scatter + all_gather %s %s: GPU and CPU bits differ" % (mode, codec))
    return problems


# The cases by group, each a world of its own, so that the GPU check's workers share them
# out (one world of every case took 90 s beside the others).
BIT_CASES = {
    "float32": [(torch.float32, op, mode, None) for op in ("SUM", "AVG", "PREMUL_SUM", "PRODUCT")
                for mode in (True, "exact")],
    "half": [(dt, op, mode, None) for dt in (torch.float16, torch.bfloat16)
             for op in ("SUM", "AVG", "PREMUL_SUM", "PRODUCT") for mode in (True, "exact")],
    "codecs": [(torch.float32, "SUM", mode, c) for mode in (True, "exact") for c in CODECS] +
              [(torch.bfloat16, "SUM", "exact", "fp8_e4m3")],
}
FLAGS_262K = {"PYCOMM_CUDA_FLAGS": "always", "PYCOMM_CUDA_FLAG_BYTES": "262144"}
BIT_WORLDS = [
    # oneshot of 50021 elements: the flag-synchronized kernel
    *[pytest.param(2, FLAGS_262K, group, id="ws2-" + group) for group in BIT_CASES],
    *[pytest.param(4, FLAGS_262K, group, id="ws4-" + group) for group in BIT_CASES],
    pytest.param(8, FLAGS_262K, "float32", id="ws8-float32"),
    pytest.param(4, {"PYCOMM_RANKS_PER_NODE": "2"}, "float32", id="2x2-float32"),  # hierarchical, 2 nodes of 2
    # staged through TCP in small chunks; every pair staged through host memory on one host
    pytest.param(3, {"PYCOMM_TRANSPORT": "tcp", "PYCOMM_CUDA_CHUNK_BYTES": "65536"}, "float32", id="staged-tcp"),
    pytest.param(3, {"PYCOMM_CUDA_IPC": "off"}, "float32", id="staged-forced"),
]


@pytest.mark.parametrize("ws,env,group", BIT_WORLDS)
def test_gpu_bits_equal_cpu_bits(ws, env, group):
    for problems in run_world(gpu_equals_cpu, ws, args=(BIT_CASES[group],), env=env, timeout=400):
        assert not problems, problems


# The flag-synchronized one-shot (PYCOMM_CUDA_FLAG_BYTES, 64 MiB by default): all-reduces
# of at most that many bytes among ranks of one host run as one kernel per rank, pipelined
# through two slots of 64 pieces. By default only where the ranks' kernels run at once
# (MPS, or a GPU each); the tests' ranks may time-slice one GPU, where it is slow but must
# be just as right. Here small slots (pieces of 256 bytes), so that calls take many chunks
# and end in partly filled ones.
FLAG_BYTES = 262144
FLAGS_ALWAYS = {"PYCOMM_CUDA_FLAGS": "always", "PYCOMM_CUDA_FLAG_BYTES": str(FLAG_BYTES),
                "PYCOMM_CUDA_CHUNK_BYTES": "16384"}


def flag_allreduce(rank, ws):
    import os
    import tempfile

    import pycomm

    dev = torch.device("cuda", 0)
    problems = []
    # The group's first CUDA collective makes its device path; PYCOMM_DEBUG=INFO logs it.
    with tempfile.TemporaryFile() as log:
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            pycomm.all_reduce(torch.ones(4, device=dev))
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        log.seek(0)
        if b"flag-synchronized one-shot up to %d B" % FLAG_BYTES not in log.read():
            problems.append("the group has no flag-synchronized one-shot")
    for dtype in (torch.float32, torch.float16, torch.int64, torch.uint8):
        limit = FLAG_BYTES // dtype.itemsize
        for n in (1, 7, 1000, 20011, limit, limit + 1):  # limit + 1: host-driven
            for offset in (0, 1):  # 1: input and output not 16-byte aligned
                for repeat in range(3):  # chunks alternate between two slots, across calls too
                    base = torch.arange(n + offset, device=dev) % 13
                    t = (base + rank + repeat).to(dtype)[offset:]
                    want = (ws * base + ws * (ws - 1) // 2 + ws * repeat).to(dtype)[offset:]
                    pycomm.all_reduce(t)
                    if not torch.equal(t, want):
                        problems.append("%s n=%d offset %d call %d: wrong sum" % (dtype, n, offset, repeat))
    x = torch.full((1000,), rank + 1.0, device=dev)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    if not torch.equal(x, torch.full_like(x, float(ws))):
        problems.append("MAX: wrong result")
    return problems


@pytest.mark.parametrize("ws", [2, 4, 8])
def test_flag_allreduce_on_cuda(ws):
    for problems in run_world(flag_allreduce, ws, env=dict(FLAGS_ALWAYS, PYCOMM_DEBUG="INFO"), timeout=240):
        assert not problems, problems


FLAG_PG_TIMEOUT_S = 3


def flag_peer_fault(rank, ws, fault):
    """Rank 1 misses a flag-synchronized all-reduce, asleep or killed; rank 0 reports it.
    The all-reduce is enqueued on rank 0's stream and returns at once: its kernel gives up
    at the deadline (asleep) or when the team's watchdog sees rank 1 exit (killed), and the
    group's next call raises what it found. The short timeout is a subgroup's: the world's
    group is made with the harness's, since a loaded machine can start one rank's
    interpreter seconds after the other's."""
    import datetime
    import os
    import signal
    import time

    group = dist.new_group(timeout=datetime.timedelta(seconds=FLAG_PG_TIMEOUT_S))
    t = torch.ones(1000, device="cuda")
    dist.all_reduce(t, group=group)  # the team is up
    if rank == 1:
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(FLAG_PG_TIMEOUT_S + 5)
        return None
    started = time.monotonic()
    dist.all_reduce(t, group=group)
    torch.cuda.synchronize()
    result = timed_all_reduce(t, group=group)
    result["elapsed"] = time.monotonic() - started
    return result


@pytest.mark.parametrize("fault,words,bounds", [
    ("sleep", "timed out waiting for rank 1", (FLAG_PG_TIMEOUT_S - 0.5, FLAG_PG_TIMEOUT_S + 5)),
    ("kill", "rank 1 exited", (0, 2.0)),
])
def test_flag_allreduce_reports_a_missing_peer(fault, words, bounds):
    results = run_world(flag_peer_fault, 2, args=(fault,), env=FLAGS_ALWAYS, timeout=120,
                        expect_killed=(1,) if fault == "kill" else ())
    r = results[0]
    assert r["raised"], "all_reduce returned after %.1fs without its peer" % r["elapsed"]
    assert words in r["msg"], r["msg"]
    assert bounds[0] <= r["elapsed"] <= bounds[1], (r["elapsed"], r["msg"])


# The layered path on CUDA tensors: pycomm's kernels on the caller's stream, another
# backend moving the bytes. NCCL takes one rank per GPU, so it is the mover at world size
# 1; several ranks on the one GPU use gloo (which moves CUDA tensors) as the mover. The
# CUDA kernels and the Triton kernels (PYCOMM_KERNELS) must both give the native CPU bits.
LAYERED_CASES = [(dtype, codec, mode) for dtype in (torch.float32, torch.bfloat16)
                 for codec in (None, *CODECS) for mode in (True, "exact")]


def layered_on_cuda(rank, ws, mover):
    import pycomm

    torch.cuda.set_device(0)
    group = dist.new_group(backend=mover)
    problems = []
    for i, (dtype, codec, mode) in enumerate(LAYERED_CASES):
        for n in (1, 1001, 65537):
            x = _data(n, dtype, 100 * i + rank, specials=False)
            on_cpu, on_gpu = x.clone(), x.cuda()
            pycomm.all_reduce(on_cpu, compression=codec, deterministic=mode)  # native, host memory
            work = pycomm.all_reduce(on_gpu, group=group, compression=codec, deterministic=mode, async_op=True)
            if not work.algorithm.startswith(("layered-direct", "layered-oneshot")):
                problems.append(work.algorithm)
            if not _same_bits(on_gpu, on_cpu):
                problems.append("%s %s %s n=%d: CUDA layered != CPU native (%s)" % (dtype, codec, mode, n,
                                                                                 _first_difference(on_gpu, on_cpu)))
            rs_cpu = torch.empty(n, dtype=dtype)
            rs_gpu = torch.empty(n, dtype=dtype, device="cuda")
            big = torch.cat([x] * ws)
            pycomm.reduce_scatter_tensor(rs_cpu, big, compression=codec, deterministic=mode)
            pycomm.reduce_scatter_tensor(rs_gpu, big.cuda(), group=group, compression=codec, deterministic=mode)
            if not _same_bits(rs_gpu, rs_cpu):
                problems.append("%s %s %s n=%d: reduce-scatter differs (%s)" % (dtype, codec, mode, n,
                                                                             _first_difference(rs_gpu, rs_cpu)))
    return problems


@pytest.mark.parametrize("kernels", ["cuda", "triton"])
@pytest.mark.parametrize("ws,mover", [(1, "nccl"), (2, "gloo"), (4, "gloo")])
def test_layered_on_cuda_equals_native_cpu(ws, mover, kernels):
    if kernels == "triton":
        import triton  # noqa: F401 - pinned: its absence is a failure, not a skip
    for problems in run_world(layered_on_cuda, ws, args=(mover,), env={"PYCOMM_KERNELS": kernels}, timeout=400):
        assert not problems, problems


def layered_disagreement_on_cuda(rank, ws):
    """Ranks that disagree on a layered call on CUDA tensors (two fp8 codecs: one width,
    so the transfers match), in one shot and directly: the device compares the stamps,
    nothing waits on the host, and the rank's next call on the group raises (a group for
    each: a disagreement found on the device stays). Returns the messages."""
    import pycomm

    torch.cuda.set_device(0)
    messages = []
    for n in (1001, 1 << 16):
        group = dist.new_group(backend="gloo")
        t = torch.ones(n, device="cuda")
        pycomm.all_reduce(t, group=group, compression="fp8_e4m3" if rank == 0 else "fp8_e5m2")
        torch.cuda.synchronize()  # the verdict written
        try:
            pycomm.all_reduce(t, group=group)
            messages.append(None)
        except dist.DistBackendError as e:
            messages.append(str(e))
    return messages


@pytest.mark.parametrize("kernels", ["cuda", "triton"])
def test_layered_disagreement_on_cuda_raised_by_the_next_call(kernels):
    results = run_world(layered_disagreement_on_cuda, 2, env={"PYCOMM_KERNELS": kernels}, timeout=200)
    for rank, messages in enumerate(results):
        mine, theirs = ("fp8_e4m3", "fp8_e5m2") if rank == 0 else ("fp8_e5m2", "fp8_e4m3")
        for message in messages:
            assert message and f"rank {1 - rank} called it with compression {theirs} where this rank has {mine}" \
                in message and "compared on the device" in message, message
