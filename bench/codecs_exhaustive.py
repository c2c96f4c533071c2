"""Every float32 bit pattern through each vectorized CPU codec path, against the scalar path.

    .venv/bin/python bench/codecs_exhaustive.py [--codecs fp16,bf16,fp8_e4m3,fp8_e5m2]
        [--chunk 16M] [--out FILE]

The scalar path is the codecs' specification (csrc/device/cpu_codecs.h); every vectorized
path this CPU runs (pycomm._C.cpu_codec_paths()) must write its bits. All 2^32 float32
patterns, in blocks of 256 (the default block), in two layouts:

* sorted: the patterns in order. A block's neighbours share an exponent, so its scale
  brings them near the code's largest values; block maxima run over every exponent.
* anchored: each block is the codec's target (its scale is then 1; 1.0 for bf16) followed
  by 255 patterns, so that every value up to the target is converted unscaled: every
  rounding tie and subnormal of the code. Larger values set their block's scale instead.

For each chunk and path: the encoding (scales and codes), its decode to float32, and the
quantized values (a fold of one input to float32: decode(encode(x)) without the records,
the kernel the folds use) must be the scalar path's, bit for bit. Then every bfloat16 and
float16 input, encoded and decoded back to its dtype. Prints the commit, the machine and one
line per codec, layout and path; exits 1 on any difference.
"""

import argparse
import os
import platform
import subprocess
import sys
import time

import torch

import pycomm
from pycomm import _C

CODECS = ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2"]
TARGET = {"fp16": 65504.0, "bf16": 1.0, "fp8_e4m3": 416.0, "fp8_e5m2": 57344.0}
BLOCK = 256


def parse_size(text):
    units = {"K": 10, "M": 20, "G": 30}
    text = text.strip().upper()
    return int(text[:-1]) << units[text[-1]] if text[-1] in units else int(text)


def commit():
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "-C", here, "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + (" (dirty)" if dirty else "")


def machine():
    """Host, CPU model (name, family and model numbers), CPUs, architecture."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    cpu = "%s (family %s, model %s)" % (info.get("model name", "unknown CPU"), info.get("cpu family", "?"),
                                        info.get("model", "?"))
    return "%s, %s, %d CPUs, %s" % (platform.node(), cpu, os.cpu_count(), platform.machine())


def on_path(path, fn):
    previous = _C.cpu_codec_path()
    _C.cpu_codec_path(path)
    try:
        return fn()
    finally:
        _C.cpu_codec_path(previous)


def outputs(x, codec, into):
    """The encoding of x, its decode to x's dtype, and x quantized by a fold, as bits,
    written into the tensors of `into` (filled on first use, reused while the sizes hold)."""
    n = x.numel()
    sizes = {"encode": (_C.encoded_size(codec, BLOCK, n), torch.uint8), "decode": (n, x.dtype),
             "quantize": (n, x.dtype)}
    for what, (size, dtype) in sizes.items():
        if what not in into or into[what].numel() != size or into[what].dtype != dtype:
            into[what] = torch.empty(size, dtype=dtype)
    pycomm.encode(x, codec, BLOCK, out=into["encode"])
    pycomm.decode(into["encode"], codec, n, x.dtype, BLOCK, out=into["decode"])
    _C.fold(into["quantize"], [x], [_C.Form.Input], x.dtype, n, torch.distributed.ReduceOp.SUM, 1, False, codec,
            BLOCK, _C.Stage.Final)
    bits = torch.int32 if x.dtype == torch.float32 else torch.int16  # compared as integers: NaNs too
    return {what: t if t.dtype == torch.uint8 else t.view(bits) for what, t in into.items()}


def differences(got, expected):
    """Elements (bytes of an encoding) that differ, per output, and the first's offset."""
    out = {}
    for what, e in expected.items():
        if not torch.equal(got[what], e):
            bad = torch.nonzero(got[what] != e)
            out[what] = (bad.numel(), int(bad[0]))
    return out


def layout(codec, name, start, count):
    """Patterns start .. start + count - 1 (as int32, then float32) in the layout's blocks."""
    bits = torch.arange(start, start + count, dtype=torch.int32).view(torch.float32)
    if name == "sorted":
        return bits
    rows = (count + BLOCK - 2) // (BLOCK - 1)
    padded = torch.cat([bits, torch.zeros(rows * (BLOCK - 1) - count)]).reshape(rows, BLOCK - 1)
    anchors = torch.full((rows, 1), TARGET[codec])
    return torch.cat([anchors, padded], dim=1).reshape(-1)[: count + rows]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--codecs", default=",".join(CODECS))
    ap.add_argument("--chunk", type=parse_size, default=parse_size("16M"), help="patterns per step (default 16M)")
    ap.add_argument("--out", help="also write the report here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    paths = _C.cpu_codec_paths()
    lines = []

    def say(line):
        print(line, flush=True)
        lines.append(line)

    say("every float32 bit pattern, each CPU codec path against the scalar path, blocks of %d" % BLOCK)
    say("commit %s; %s; torch %s; paths %s" % (commit(), machine(), torch.__version__, ", ".join(paths)))
    if len(paths) < 2:
        say("this CPU runs the scalar path only: nothing to compare")
        return 0
    say("%-9s %-9s %-7s %11s %8s  %s" % ("codec", "layout", "path", "patterns", "seconds", "differences"))
    failed = False

    def row(codec, name, path, patterns, seconds, found):
        report = "; ".join("%s: %d elements or bytes, the first in the step from pattern 0x%08x, at %d"
                           % (what, bad, where[0], where[1]) for what, (bad, where) in found.items())
        say("%-9s %-9s %-7s %11d %8s  %s" % (codec, name, path, patterns, seconds, report or "none"))
        return bool(found)

    buffers = {path: {} for path in paths}
    for codec in args.codecs.split(","):
        for name in ("sorted", "anchored"):
            found = {p: {} for p in paths[1:]}
            began = time.time()
            for start in range(-2**31, 2**31, args.chunk):
                x = layout(codec, name, start, min(args.chunk, 2**31 - start))
                expected = on_path("scalar", lambda: outputs(x, codec, buffers["scalar"]))
                for path in paths[1:]:
                    got = on_path(path, lambda: outputs(x, codec, buffers[path]))
                    for what, (bad, first) in differences(got, expected).items():
                        total, where = found[path].get(what, (0, (start & 0xFFFFFFFF, first)))
                        found[path][what] = (total + bad, where)
            seconds = "%.0f" % (time.time() - began)
            for path in paths[1:]:
                failed |= row(codec, name, path, 1 << 32, seconds, found[path])
        for dtype in (torch.bfloat16, torch.float16):
            x = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
            expected = on_path("scalar", lambda: outputs(x, codec, {}))
            for path in paths[1:]:
                found = {what: (bad, (0, first)) for what, (bad, first)
                         in differences(on_path(path, lambda: outputs(x, codec, {})), expected).items()}
                failed |= row(codec, str(dtype).replace("torch.", ""), path, 1 << 16, "-", found)
    say("result: %s" % ("DIFFERENCES FOUND" if failed else "every path wrote the scalar path's bits"))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
