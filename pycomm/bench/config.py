"""The description of one benchmark run: plain data, picklable, torch-free.

The parent builds a :class:`Config` from the command line, validates it (so a typo fails
before any process is spawned) and hands it to every rank.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

# Element types the harness can fill and check exactly: name -> (torch attribute, bytes).
# Aliases map onto these names. Adding a dtype here is all
# the harness needs (the check pattern is exact for any dtype that holds small integers).
DTYPES: Dict[str, Tuple[str, int]] = {
    "float32": ("float32", 4),
    "float16": ("float16", 2),
    "bfloat16": ("bfloat16", 2),
    "int32": ("int32", 4),
}
DTYPE_ALIASES = {"float": "float32", "f32": "float32", "fp32": "float32",
                 "half": "float16", "fp16": "float16", "f16": "float16", "bf16": "bfloat16",
                 "int": "int32", "i32": "int32"}
# Names that parse but that the harness does not fill/check yet (clear error, not "unknown").
DTYPES_LATER = {"float64", "double", "int8", "uint8", "int64", "fp8_e4m3", "fp8_e5m2"}

# Reduction ops the harness can check exactly: name -> torch.distributed.ReduceOp attribute.
OPS: Dict[str, str] = {"sum": "SUM", "max": "MAX", "min": "MIN"}
OPS_LATER = {"prod", "avg", "premulsum"}

MODES = {
    "b2b": "back-to-back throughput: n calls issued with async_op=True, all waited at the "
           "end; time = (max over ranks of the loop time) / n",
    "blocking": "blocking latency: n calls, each waited before the next (async_op=False); "
                "time = (max over ranks of the loop time) / n; p50/p99 over every call "
                "(each timed alone, max over ranks)",
}

# --inplace values -> placements (True: in place), in the order they run.
PLACEMENTS = {"1": (True,), "0": (False,), "both": (True, False)}

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text: str) -> int:
    """'8' -> 8, '64M' -> 67108864, '1.5K' -> 1536, '4KiB'/'4KB' -> 4096 (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", text)
    if not m:
        raise ValueError("not a size: %r (use e.g. 8, 4K, 64M, 1G)" % (text,))
    value = float(m.group(1)) * _SUFFIX[m.group(2).upper()]
    if value != int(value):
        raise ValueError("size %r is not a whole number of bytes" % (text,))
    return int(value)


def format_bytes(n: int) -> str:
    """67108864 -> '64 MiB', 4096 -> '4 KiB', 12 -> '12 B'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return "%d %s" % (n // scale, unit)
    return "%d B" % n


def parse_size_list(text: str) -> List[int]:
    """'4K,1M,64M' -> [4096, 1048576, 67108864] (sorted, duplicates dropped)."""
    return sorted({parse_bytes(t) for t in text.split(",") if t.strip()})


def size_sweep(begin: int, end: int, factor: int, step: int) -> List[int]:
    """nccl-tests -b/-e/-f/-i: multiply by ``factor``, or add ``step`` when it is non-zero."""
    if begin < 0 or end < begin:
        raise ValueError("need 0 <= -b (%d) <= -e (%d)" % (begin, end))
    if step <= 0 and factor < 2:
        raise ValueError("-f must be >= 2 (or give -i STEP > 0)")
    sizes, s = [], begin
    while s <= end:
        sizes.append(s)
        if step > 0:
            s += step
        else:
            s = s * factor if s > 0 else 1
    return sizes


def canonical_dtype(name: str) -> str:
    key = name.strip().lower()
    key = DTYPE_ALIASES.get(key, key)
    if key in DTYPES:
        return key
    if key in DTYPES_LATER:
        raise ValueError("dtype %r is not supported by the harness yet (have: %s)"
                         % (name, ", ".join(DTYPES)))
    raise ValueError("unknown dtype %r (have: %s)" % (name, ", ".join(DTYPES)))


def canonical_op(name: str) -> str:
    key = name.strip().lower()
    if key in OPS:
        return key
    if key in OPS_LATER:
        raise ValueError("op %r is not supported by the harness yet (have: %s)"
                         % (name, ", ".join(OPS)))
    raise ValueError("unknown op %r (have: %s)" % (name, ", ".join(OPS)))


@dataclass(frozen=True)
class BackendSpec:
    """One backend under test: ``label`` names it in the output, ``kind`` picks the row of
    the backend table, ``options`` are per-call options (pycomm: algorithm, compression,
    deterministic) and options of its group (pycomm: verify), ``mover`` the kind whose group
    moves the bytes (pycomm-over only)."""
    label: str
    kind: str
    options: Tuple[Tuple[str, str], ...] = ()
    mover: Optional[str] = None

    def describe(self) -> str:
        opts = (":" + self.mover if self.mover else "") + "".join(":%s=%s" % kv for kv in self.options)
        if self.label == self.kind and not opts:
            return self.kind
        return "%s=%s%s" % (self.label, self.kind, opts)


@dataclass
class Config:
    collectives: List[str] = field(default_factory=lambda: ["all_reduce"])
    placements: Tuple[bool, ...] = (True, False)   # --inplace; each collective runs those it has
    nranks: int = 4
    sizes: List[int] = field(default_factory=list)
    dtypes: List[str] = field(default_factory=lambda: ["float32"])
    ops: List[str] = field(default_factory=lambda: ["sum"])
    backends: List[BackendSpec] = field(default_factory=list)
    iters: Optional[int] = None        # None: by size (see timing.iterations)
    warmup: Optional[int] = None       # None: by iterations
    iter_bytes: int = 32 << 20         # auto policy: about this many bytes per repeat
    max_iters: int = 100
    min_iters: int = 2
    repeats: int = 5
    check: bool = True
    mode: str = "b2b"
    launcher: str = "spawn"            # a key of launch.LAUNCHERS, or "torchrun"
    timeout_s: float = 900.0           # the whole run (parent deadline)
    pg_timeout_s: float = 300.0        # each process group's timeout (per collective)
    init: str = "file"
    seed: int = 0                      # Gaussian data of the relative-error/hash call
    baseline: str = ""                 # label the ratios are about ("": the first backend)
    json_path: Optional[str] = None
    jsonl_path: Optional[str] = None
    markdown_path: Optional[str] = None
    plot_dir: Optional[str] = None     # busbw.png and latency.png
    command: str = ""
    quiet: bool = False

    @property
    def subject(self) -> BackendSpec:
        """The backend the ratios are about: --baseline, else the first one listed."""
        return next((b for b in self.backends if b.label == self.baseline), self.backends[0])

    @property
    def peers(self) -> List[BackendSpec]:
        return [b for b in self.backends if b is not self.subject]
