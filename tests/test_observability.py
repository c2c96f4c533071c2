"""What pycomm tells about its own work: PYCOMM_DEBUG lines, pycomm.stats(), the choices a
Work carries, the flight recorder (on demand, and dumped when an operation times out) and
torch profiler ranges."""

import datetime
import json
import os
import re
import time

import pytest
import torch
import torch.distributed as dist

from _harness import capture_stderr, is_gloo, run_world

pytestmark = pytest.mark.skipif(is_gloo(), reason="pycomm's own observability")

# "pycomm: group '0': allreduce #3 (float32, sum, 1000 elements, ring): selected, 4000 B,
#  algorithm ring, compression none, determinism 0, 81.2 us"
INFO_LINE = re.compile(r"^pycomm: group '[^']*': (\w+) #(\d+) \((\w+), .*: (?:.*, )?(\d+) B, "
                       r"algorithm ([\w+-]+), compression (\w+), determinism (\w+), (\d+\.\d) us$")


def some_operations(rank, ws):
    """One of each kind, in a fixed order; returns what each should log."""
    import pycomm

    t = torch.ones(1000)
    dist.all_reduce(t)
    pycomm.all_reduce(t, algorithm="ring", compression="fp16")
    out = torch.empty(500)
    dist.reduce_scatter_tensor(out, t)
    dist.all_gather_into_tensor(t, out)
    dist.broadcast(torch.ones(10, dtype=torch.int32), src=0)
    dist.barrier()


def info_world(rank, ws):
    _, text = capture_stderr(lambda: some_operations(rank, ws))
    return [line for line in text.splitlines() if " #" in line]


def test_info_logs_one_line_per_operation_on_rank_0():
    lines = run_world(info_world, 2, env={"PYCOMM_DEBUG": "INFO"}, timeout=120)
    assert lines[1] == [], "rank 1 logs no operation at INFO: %s" % lines[1]
    parsed = []
    for line in lines[0]:
        m = INFO_LINE.match(line)
        assert m, "not an INFO operation line: %r" % line
        parsed.append(m.groups())
    got = [(op, int(seq), dtype, int(nbytes), algo, codec, det)
           for op, seq, dtype, nbytes, algo, codec, det, _ in parsed]
    assert got[0][:4] == ("allreduce", 1, "float32", 4000), got
    assert got[1] == ("allreduce", 2, "float32", 4000, "direct+ring", "fp16", "0"), got
    assert got[2][:4] == ("reduce_scatter", 3, "float32", 4000), got
    assert got[3][:4] == ("allgather", 4, "float32", 4000), got
    assert got[4] == ("broadcast", 5, "int32", 40, "chain", "none", "0"), got
    assert got[5][0] == "barrier" and got[5][4] == "dissemination", got
    assert len(got) == 6, got


def trace_world(rank, ws):
    _, text = capture_stderr(lambda: dist.all_reduce(torch.ones(1000)))
    return [line for line in text.splitlines() if "allreduce #1" in line]


def test_trace_logs_start_end_and_every_frame_on_every_rank():
    logs = run_world(trace_world, 2, env={"PYCOMM_DEBUG": "TRACE"}, timeout=120)
    for rank, lines in enumerate(logs):
        peer = 1 - rank
        assert any(line.endswith(": rank %d starts" % rank) for line in lines), lines
        assert any(": rank %d ends: " % rank in line and line.endswith(" us") for line in lines), lines
        sent = [line for line in lines if re.search(r": sent \d+ B to rank %d$" % peer, line)]
        received = [line for line in lines if re.search(r": received \d+ B from rank %d$" % peer, line)]
        assert sent and received, "rank %d logged no frame:\n%s" % (rank, "\n".join(lines))
        assert all(("rank %d: allreduce #1" % rank) in line for line in sent + received), lines


def stats_world(rank, ws, dump_path):
    import pycomm

    t = torch.ones(1000)
    for _ in range(3):
        dist.all_reduce(t)
    for _ in range(2):
        pycomm.all_reduce(t, algorithm="tree")
    choices = {}
    work = pycomm.all_reduce(torch.ones(1 << 18), algorithm="ring", compression="fp8_e4m3", async_op=True)
    work.wait()
    choices["direct"] = (work.algorithm, work.compression, work.determinism)
    work = pycomm.all_reduce(torch.ones(10, dtype=torch.int32), compression="fp16", deterministic=True,
                             async_op=True)
    work.wait()
    choices["int"] = (work.algorithm, work.compression, work.determinism)
    work = dist.broadcast(torch.ones(10), src=0, async_op=True)
    work.wait()
    choices["broadcast"] = (work.algorithm, work.compression, work.determinism)
    recorder = pycomm.flight_recorder()
    written = pycomm.dump_flight_recorder(path=dump_path % rank)
    with open(written) as f:
        dumped = json.load(f)
    return {"stats": pycomm.stats(), "choices": choices, "recorder": recorder, "dumped": dumped,
            "written": written}


def test_stats_work_choices_and_flight_recorder_on_demand(tmp_path):
    dump = str(tmp_path / "recorder-rank%d.json")
    results = run_world(stats_world, 2, args=(dump,), env={"PYCOMM_FLIGHT_RECORDER": "5"}, timeout=120)
    for rank, r in enumerate(results):
        s = r["stats"]
        assert (s["rank"], s["size"]) == (rank, 2), s
        allreduce = s["collectives"]["allreduce"]
        assert allreduce["tree"]["calls"] == 2 and allreduce["tree"]["bytes"] == 8000, allreduce
        assert sum(a["calls"] for a in allreduce.values()) == 7, allreduce
        assert all(a["failures"] == 0 and a["time_s"] > 0 for a in allreduce.values()), allreduce
        assert s["collectives"]["broadcast"]["chain"]["calls"] == 1, s
        assert s["last"]["collective"] == "broadcast" and s["last"]["state"] == "completed", s["last"]

        assert r["choices"]["direct"] == ("direct+ring", "fp8_e4m3", "0"), r["choices"]
        # Integers are never compressed; deterministic=True is level 1.
        assert r["choices"]["int"][1:] == ("none", "1"), r["choices"]
        assert r["choices"]["broadcast"] == ("chain", "none", "0"), r["choices"]

        entries = r["recorder"]["entries"]
        assert r["recorder"]["format"] == "pycomm.flight_recorder/1", r["recorder"]
        assert [e["id"] for e in entries] == [4, 5, 6, 7, 8], "the last 5 of 8 operations: %s" % entries
        assert [e["seq"] for e in entries] == [4, 5, 6, 7, 8], entries
        assert entries[2]["compression"] == "fp8_e4m3" and entries[2]["algorithm"] == "direct+ring", entries[2]
        assert entries[2]["bytes"] == 4 << 18 and entries[2]["count"] == 1 << 18, entries[2]
        assert all(e["state"] == "completed" and e["duration_us"] > 0 for e in entries), entries
        assert entries[-1]["root"] == 0 and entries[0]["reduce_op"] == "sum", entries
        assert r["written"] == dump % rank
        assert r["dumped"]["entries"] == entries and r["dumped"]["reason"] == "requested"


# Asked for as "ring", these run other shapes; each is named by what ran.
ASKED_AS_RING = [
    ("allreduce", dict(deterministic=True), "direct+ring"),       # direct reduce-scatter, ring all-gather
    ("allreduce", dict(deterministic="exact"), "direct+ring"),
    ("allreduce", dict(compression="fp16"), "direct+ring"),
    ("reduce_scatter", dict(deterministic=True), "direct"),      # contributions go straight to their owner
    ("reduce_scatter", dict(compression="fp8_e4m3"), "direct"),
    ("allreduce", dict(), "ring"),
    ("reduce_scatter", dict(), "ring"),
]


def labels_world(rank, ws):
    import pycomm

    def run():
        works = []
        for collective, options, _ in ASKED_AS_RING:
            if collective == "allreduce":
                work = pycomm.all_reduce(torch.ones(4096), algorithm="ring", async_op=True, **options)
            else:
                work = pycomm.reduce_scatter_tensor(torch.empty(4096), torch.ones(4096 * ws), algorithm="ring",
                                                    async_op=True, **options)
            work.wait()
            works.append(work.algorithm)
        return works

    works, text = capture_stderr(run)
    logged = [INFO_LINE.match(line).group(5) for line in text.splitlines() if INFO_LINE.match(line)]
    return {"works": works, "logged": logged, "stats": pycomm.stats()["collectives"]}


def test_labels_name_what_ran_not_what_was_asked():
    results = run_world(labels_world, 3, env={"PYCOMM_DEBUG": "INFO"}, timeout=120)
    want = [label for _, _, label in ASKED_AS_RING]
    for rank, r in enumerate(results):
        assert r["works"] == want, r["works"]
        counted = {}
        for collective, _, label in ASKED_AS_RING:
            counted.setdefault(collective, {}).setdefault(label, 0)
            counted[collective][label] += 1
        got = {c: {label: s["calls"] for label, s in algos.items()} for c, algos in r["stats"].items()}
        assert got == counted, got
    assert results[0]["logged"] == want, results[0]["logged"]


TIMEOUT_S = 2


def timeout_world(rank, ws):
    import pycomm

    g = dist.new_group(timeout=datetime.timedelta(seconds=TIMEOUT_S))
    t = torch.ones(100)
    dist.all_reduce(t, group=g)
    if rank == 1:
        time.sleep(TIMEOUT_S + 3)  # never joins the second all-reduce
        return None
    try:
        dist.all_reduce(t, group=g)
    except RuntimeError as e:
        message = str(e)
    else:
        return {"raised": False}
    m = re.search(r"\(flight recorder: (\S+\.json)\)", message)
    if not m:
        return {"raised": True, "message": message, "path": None}
    with open(m.group(1)) as f:
        dumped = json.load(f)
    os.unlink(m.group(1))
    return {"raised": True, "message": message, "path": m.group(1), "dumped": dumped,
            "stats": pycomm.stats(g)}


def test_timeout_dumps_the_flight_recorder(tmp_path):
    results = run_world(timeout_world, 2, env={"PYCOMM_FLIGHT_RECORDER_DIR": str(tmp_path)}, timeout=120)
    r = results[0]
    assert r["raised"], "the all-reduce without its peer returned"
    assert r["path"], "the error names no flight recorder file: %r" % r["message"]
    assert os.path.dirname(r["path"]) == str(tmp_path) and "-rank0-pid" in r["path"], r["path"]
    d = r["dumped"]
    assert (d["rank"], d["size"], d["capacity"]) == (0, 2, 64), d
    assert "timed out" in d["reason"], d["reason"]
    first, last = d["entries"]
    assert (first["seq"], first["state"]) == (1, "completed"), first
    assert (last["seq"], last["state"], last["collective"]) == (2, "failed", "allreduce"), last
    assert "timed out" in last["error"] and last["duration_us"] >= TIMEOUT_S * 1e6 * 0.9, last
    assert last["start_unix_us"] >= first["start_unix_us"], d
    assert r["stats"]["collectives"]["allreduce"][last["algorithm"]]["failures"] == 1, r["stats"]


def profiler_world(rank, ws):
    import pycomm
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        dist.all_reduce(torch.ones(16))                              # runs on the calling thread
        dist.all_reduce(torch.ones(1 << 20), async_op=True).wait()   # on the group's thread
        pycomm.all_reduce(torch.ones(1 << 20), algorithm="ring", async_op=True).wait()
        pycomm.all_reduce(torch.ones(16))                            # no Work at all
        dist.broadcast(torch.ones(16), src=0)
    return sorted({e.name for e in prof.events() if e.name.startswith("pycomm:")},
                  key=str), [e.name for e in prof.events()].count("pycomm:all_reduce")


def test_profiler_ranges_are_named_after_the_collective():
    for names, all_reduces in run_world(profiler_world, 2, timeout=120):
        assert names == ["pycomm:all_reduce", "pycomm:broadcast"], names
        assert all_reduces == 4, all_reduces
