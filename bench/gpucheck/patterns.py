"""The measuring step patterns: every float32 bit pattern (all 2^32) through each codec on
the GPU, with pycomm's CUDA kernels and with its Triton kernels, against the CPU ops: the
encoding's bytes, its decode and the fold's quantization, bit for bit (NaNs compared as
integers), in both of bench/codecs_exhaustive.py's layouts (the patterns in order; each
block anchored by the codec's target, so that every value up to it converts unscaled);
and every bfloat16 and float16 pattern as input. The CPU ops are the reference: their
vectorized paths write their scalar path's bits on every pattern (codecs_exhaustive.py).
A spawned process per codec, each with its share of the cores for the CPU's side; the
CPU's outputs are moved to the GPU and compared there. Returns and saves as steps.py says.
"""
import multiprocessing
import os
import time

CHUNK = 1 << 26  # patterns per step: 256 MiB of float32
# A dry run's sample (Triton's interpreter is slow): runs of DRY_SPAN patterns from negative
# numbers, negative NaNs, zeros and subnormals, float32's largest numbers, and NaNs.
DRY_SPAN = 1 << 9
DRY_STARTS = (-2**31, -2**11, 0, 0x7F7FF800 - 2**11, 2**31 - DRY_SPAN)


def step_patterns(dry, save):
    from pycomm import _C

    codecs = list(_C.codecs)
    rows, began = [], time.time()
    with multiprocessing.get_context("spawn").Pool(len(codecs)) as pool:
        for codec_rows in pool.imap_unordered(_codec_patterns, [(codec, dry, len(codecs)) for codec in codecs]):
            rows += codec_rows
            save({"rows": rows, "verdict": "running"})
    expected = len(DRY_STARTS) * DRY_SPAN if dry else 1 << 32
    short = [r for r in rows if r["input"] == "float32" and r["patterns"] < expected]
    wrong = [r for r in rows if r["differences"]]
    verdict = ("FAIL: %d sets with other bits than the CPU's" % len(wrong) if wrong else
               "FAIL: %d sets not covered" % len(short) if short else "pass")
    return {"rows": rows, "seconds": time.time() - began, "verdict": verdict}


def _codec_patterns(job):
    """One codec's rows: (input, layout, kernels) -> patterns, seconds, differences."""
    codec, dry, workers = job
    import torch

    from codecs_exhaustive import BLOCK, differences, layout, outputs
    from gpucheck.common import torch_device
    from gpucheck.steps import _kernel_sets
    from pycomm import _C

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    device = torch_device(dry)
    kernel_sets = _kernel_sets()

    def on_device(fold, x, into):
        """outputs() of codecs_exhaustive.py by a kernel set, on the device."""
        n, sum_ = x.numel(), torch.distributed.ReduceOp.SUM
        sizes = {"encode": (_C.encoded_size(codec, BLOCK, n), torch.uint8), "decode": (n, x.dtype),
                 "quantize": (n, x.dtype)}
        for what, (size, dtype) in sizes.items():
            if what not in into or into[what].numel() != size or into[what].dtype != dtype:
                into[what] = torch.empty(size, dtype=dtype, device=device)
        Form, Stage = _C.Form, _C.Stage
        fold(into["encode"], [x], [Form.Input], x.dtype, n, sum_, 1, False, codec, BLOCK, Stage.Encoded)
        fold(into["decode"], [into["encode"]], [Form.Encoded], x.dtype, n, sum_, 1, False, codec, BLOCK, Stage.Final)
        fold(into["quantize"], [x], [Form.Input], x.dtype, n, sum_, 1, False, codec, BLOCK, Stage.Final)
        bits = torch.int32 if x.dtype == torch.float32 else torch.int16
        return {what: t if t.dtype == torch.uint8 else t.view(bits) for what, t in into.items()}

    def sets():
        """(input, layout, chunks): a chunk is (its first pattern, its patterns, x on the CPU)."""
        if dry:
            ranges = [(s, DRY_SPAN) for s in DRY_STARTS]
        else:
            ranges = [(s, min(CHUNK, 2**31 - s)) for s in range(-2**31, 2**31, CHUNK)]
        for name in ("sorted", "anchored"):
            yield "float32", name, ((s, n, layout(codec, name, s, n)) for s, n in ranges)
        for dtype in (torch.bfloat16, torch.float16):
            x = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
            x = x[:4 * DRY_SPAN] if dry else x
            yield str(dtype).replace("torch.", ""), "every pattern", [(-2**15, x.numel(), x)]

    rows, cpu_buffers, device_buffers = [], {}, {k: {} for k in kernel_sets}
    for input_name, layout_name, chunks in sets():
        found = {k: {} for k in kernel_sets}
        patterns, began = 0, time.time()
        for start, count, x in chunks:
            expected = {what: t.to(device) for what, t in outputs(x, codec, cpu_buffers).items()}
            x_device = x.to(device)
            for kernels, fold in kernel_sets.items():
                for what, (bad, first) in differences(on_device(fold, x_device, device_buffers[kernels]),
                                                      expected).items():
                    total, where = found[kernels].get(what, (0, "pattern 0x%08x + %d" % (start & 0xFFFFFFFF, first)))
                    found[kernels][what] = (total + bad, where)
            patterns += count
        seconds = time.time() - began
        for kernels in kernel_sets:
            rows.append({"codec": codec, "input": input_name, "layout": layout_name, "kernels": kernels,
                         "patterns": patterns, "seconds": seconds, "differences": found[kernels]})
    return rows
