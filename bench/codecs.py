"""Throughput of the compression codecs against memcpy on this machine (one core).

    .venv/bin/python bench/codecs.py [--size 64M] [--repeats 7] [--path NAME] [--json out.json]

For each codec and input dtype: encode (tensor -> wire bytes), decode (wire bytes ->
tensor) and, as the peer, torch's copy of the same input tensor (memcpy bandwidth), each
into a preallocated output, timed alternately; medians over --repeats. Throughput is GB/s
of input (the uncompressed side) for all three, so codec / memcpy says how close a codec
pass is to moving the data once. Encode reads the input and writes 1/4 to 1/2 of it;
decode the reverse; memcpy reads and writes it all. --path runs the CPU codecs' path of
that name (pycomm._C.cpu_codec_paths(): scalar, avx2, avx512) instead of the best this
CPU has; the header names the path.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

import pycomm

PAIRS = [("fp16", torch.float32), ("bf16", torch.float32), ("fp8_e4m3", torch.float32),
         ("fp8_e5m2", torch.float32), ("fp8_e4m3", torch.bfloat16), ("fp8_e5m2", torch.bfloat16)]


def parse_size(text):
    units = {"K": 10, "M": 20, "G": 30}
    text = text.strip().upper()
    return int(text[:-1]) << units[text[-1]] if text[-1] in units else int(text)


def seconds(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=parse_size, default=parse_size("64M"), help="input bytes (default 64M)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--path", choices=pycomm._C.cpu_codec_paths(), help="the CPU codecs' path (default: the best)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.path:
        pycomm._C.cpu_codec_path(args.path)
    path = pycomm._C.cpu_codec_path()
    rows = []
    print("codec throughput, %d MiB of input, median of %d, GB/s of input (one core, %s path)"
          % (args.size >> 20, args.repeats, path))
    print("%-9s %-9s %10s %10s %10s %9s %9s" % ("codec", "input", "encode", "decode", "memcpy",
                                                "enc/copy", "dec/copy"))
    for codec, dtype in PAIRS:
        n = args.size // torch.tensor([], dtype=dtype).element_size()
        x = torch.randn(n).to(dtype)
        copy = torch.empty_like(x)
        wire = pycomm.encode(x, codec)
        back = torch.empty_like(x)
        pycomm.decode(wire, codec, n, dtype, out=back)  # warm every buffer
        copy.copy_(x)
        times = {"encode": [], "decode": [], "memcpy": []}
        for _ in range(args.repeats):
            times["encode"].append(seconds(lambda: pycomm.encode(x, codec, out=wire)))
            times["decode"].append(seconds(lambda: pycomm.decode(wire, codec, n, dtype, out=back)))
            times["memcpy"].append(seconds(lambda: copy.copy_(x)))
        gbps = {k: args.size / statistics.median(v) / 1e9 for k, v in times.items()}
        row = {"codec": codec, "dtype": str(dtype).replace("torch.", ""), "input_bytes": args.size,
               "wire_bytes": wire.numel(), "GBps": gbps,
               "encode_over_memcpy": gbps["encode"] / gbps["memcpy"],
               "decode_over_memcpy": gbps["decode"] / gbps["memcpy"], "times_s": times}
        rows.append(row)
        print("%-9s %-9s %10.2f %10.2f %10.2f %9.2f %9.2f" % (
            codec, row["dtype"], gbps["encode"], gbps["decode"], gbps["memcpy"],
            row["encode_over_memcpy"], row["decode_over_memcpy"]))
    if args.json:
        env = {"python": sys.version.split()[0], "torch": torch.__version__, "host": platform.node(),
               "cpus": os.cpu_count(), "machine": platform.machine(), "path": path}
        with open(args.json, "w") as f:
            json.dump({"env": env, "results": rows}, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
