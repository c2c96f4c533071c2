"""The benchmark harness (python -m pycomm.bench) and bench/compare.py, on tiny sweeps.

Each run is a subprocess on 2 ranks with -n 2 -w 1 -r 2 and a deadline (the harness kills
its ranks on --timeout; subprocess.run's timeout is the backstop). Timings are never
asserted, only the shape of the outputs and the verdicts computed from them.
"""

import copy
import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("pycomm")

from pycomm._launch import free_port  # noqa: E402
from pycomm.bench import main as bench_main  # noqa: E402
from pycomm.bench.collectives import COLLECTIVES  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["-n", "2", "-w", "1", "-r", "2", "--timeout", "90", "-q"]
COLUMNS = {"collective", "inplace", "bytes", "count", "dtype", "op", "mode", "time_us",
           "algbw", "busbw", "busbw_factor", "per_repeat_us", "p50_us", "p99_us", "wrong",
           "relerr", "hash", "ranks_match", "repeats_match", "baseline", "x_baseline",
           "x_baseline_paired"}


def run(args, env=None, timeout=120):
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))


def bench(*args, env=None):
    return run([sys.executable, "-m", "pycomm.bench", "--np", "2"] + TINY + list(args), env)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """Every collective, both placements, blocking mode, gloo as the baseline, --out."""
    out = tmp_path_factory.mktemp("bench") / "out"
    proc = bench("--collective", "all", "-b", "64", "-e", "128", "--mode", "blocking",
                 "--backends", "pycomm,gloo", "--baseline", "gloo", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "run.json") as f:
        doc = json.load(f)
    return proc, out, doc


def test_busbw_factors_are_nccl_tests():
    n = 4
    assert {name: c.busbw_factor(n) for name, c in COLLECTIVES.items()} == {
        "all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n,
        "all_gather": (n - 1) / n, "broadcast": 1.0, "all_to_all": (n - 1) / n}


def test_sizes_round_to_whole_chunks():
    # 100 B of float32 is 25 elements; split over 4 ranks, 24 (6 per rank) are used.
    assert COLLECTIVES["all_reduce"].elements(100, "float32", 4) == (25, 25)
    assert COLLECTIVES["reduce_scatter"].elements(100, "float32", 4) == (24, 6)
    assert COLLECTIVES["all_to_all"].elements(100, "bfloat16", 4) == (48, 12)


def test_sweep_json_has_every_column(sweep):
    _, _, doc = sweep
    results = doc["results"]
    assert doc["config"]["nranks"] == 2 and doc["subject"] == "gloo"
    placements = {(r["collective"], r["inplace"]) for r in results}
    assert placements == {("all_reduce", True), ("reduce_scatter", True),
                          ("reduce_scatter", False), ("all_gather", True),
                          ("all_gather", False), ("broadcast", True), ("all_to_all", False)}
    for r in results:
        assert COLUMNS <= set(r), COLUMNS - set(r)
        coll = COLLECTIVES[r["collective"]]
        assert r["busbw_factor"] == coll.busbw_factor(2)
        assert r["busbw"] == pytest.approx(r["algbw"] * r["busbw_factor"])
        assert r["wrong"] == 0
        assert 0 <= r["relerr"] < 1e-6
        assert re.fullmatch(r"[0-9a-f]{8}", r["hash"])
        assert r["repeats_match"] is True
        assert r["ranks_match"] is (True if coll.replicated else None)
        assert r["p50_us"] > 0 and r["p99_us"] >= r["p50_us"]
        assert len(r["call_s"]) == 2 and all(len(calls) == 2 for calls in r["call_s"])
        if r["backend"] == "gloo":
            assert r["x_baseline"] == 1.0
        else:
            assert r["x_baseline"] == pytest.approx(r["time_us"] / next(
                g["time_us"] for g in results if g["backend"] == "gloo" and all(
                    g[k] == r[k] for k in ("collective", "inplace", "dtype", "op", "bytes"))))
    # Both backends compute the same exact reductions on the same Gaussian data.
    hashes = {}
    for r in results:
        hashes.setdefault((r["collective"], r["inplace"], r["bytes"]), set()).add(r["hash"])
    assert all(len(h) == 1 for h in hashes.values())


def test_sweep_json_lines_carry_the_environment(sweep):
    _, out, doc = sweep
    with open(out / "run.jsonl") as f:
        lines = [json.loads(line) for line in f]
    assert len(lines) == len(doc["results"])
    for line in lines:
        assert COLUMNS <= set(line)
        env = line["env"]
        assert env["world_size"] == 2 and env["launcher"] == "spawn"
        assert env["host"]["cpu_count"] >= 1 and "torch" in env["host"]["versions"]
        assert env["git"] is None or re.fullmatch(r"[0-9a-f]{40}", env["git"]["commit"])
        assert env["mode"]["name"] == "blocking"


def test_sweep_report_and_plots(sweep):
    proc, out, _ = sweep
    for name in ("busbw.png", "latency.png"):
        with open(out / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    report = (out / "report.md").read_text()
    assert "![busbw](busbw.png)" in report and "![latency](latency.png)" in report
    assert "| collective | size (B) |" in report and "## Comparison" in report
    for column in ("p50_us", "p99_us", "#wrong", "relerr", "hash", "ranks", "repeats", "xbase"):
        assert column in proc.stdout
    assert "# correctness: all results exact" in proc.stdout


def test_planted_error_is_counted_and_fails_the_run(tmp_path):
    path = tmp_path / "run.json"
    proc = bench("--sizes", "64", "--backends", "gloo", "--json", str(path),
                 env={"PYCOMM_BENCH_PLANT_ERROR": "1"})
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "WRONG" in proc.stdout
    assert json.loads(path.read_text())["results"][0]["wrong"] == 1


def test_torchrun_launcher_and_compression_error(tmp_path):
    path = tmp_path / "run.jsonl"
    proc = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-port", str(free_port()), "-m", "pycomm.bench", "--sizes", "1K",
                "--backends", "pycomm,c16=pycomm:compression=fp16", "--jsonl", str(path)]
               + TINY)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count("# backend: pycomm") == 1     # rank 0 reports, alone
    rows = {r["backend"]: r for r in map(json.loads, path.read_text().splitlines())}
    assert rows["pycomm"]["env"]["launcher"] == "torchrun"
    assert rows["pycomm"]["env"]["world_size"] == 2
    assert rows["pycomm"]["relerr"] < 1e-6 < rows["c16"]["relerr"] < 1e-2


@pytest.mark.parametrize("args, message", [
    (["--collective", "broadcast", "--backends", "x=pycomm:algorithm=ring"],
     "direct API, which has no broadcast"),
    (["--collective", "allreduce", "--inplace", "0"], "all_reduce has no out-of-place form"),
    (["--collective", "scan"], "unknown collective 'scan'"),
    (["--backends", "pycomm,gloo", "--baseline", "nccl"], "--baseline nccl is not a backend"),
    (["-d", "float64"], "not supported by the harness yet"),
    (["--backends", "gloo,pycomm-over"], "needs the backend that moves its bytes after it"),
    (["--backends", "l=pycomm-over:compression=fp16"], "e.g. pycomm-over:gloo"),
    (["--backends", "pycomm-over:mpi"], "cannot run over 'mpi'"),
    (["--backends", "pycomm-over:gloo:chunk=1"], "takes no option 'chunk=1'"),
    (["--backends", "pycomm-over:gloo:verify=1"], "takes no option 'verify=1'"),
    (["--backends", "pycomm:verify=-1"], "verify='-1': expected a non-negative integer"),
    (["--backends", "pycomm-over:gloo:compression=fp7"], "expected one of none, fp16"),
    (["--backends", "gloo,l=pycomm-over:gloo,l=pycomm-over:gloo:deterministic=1"],
     "l repeated"),
    (["--collective", "broadcast", "--backends", "gloo,l=pycomm-over:gloo"],
     "runs through pycomm's direct API, which has no broadcast"),
    (["--collective", "reduce_scatter", "--backends", "pycomm,deepspeed"], "deepspeed has only all_reduce"),
    (["--op", "max", "--backends", "pycomm,deepspeed"], "deepspeed reduces by sum only, not max"),
    (["-d", "int32", "--backends", "pycomm,deepspeed"], "deepspeed has no int32"),
])
def test_bad_flags_exit_64(args, message, capsys):
    assert bench_main(args) == 64
    assert message in capsys.readouterr().err


def test_a_missing_peer_module_says_how_to_install_it(capsys, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "deepspeed" else find_spec(name, *a))
    assert bench_main(["--backends", "pycomm,deepspeed"]) == 64
    assert "pip install --no-deps -r requirements-deepspeed.txt" in capsys.readouterr().err


def test_nccl_needs_cuda(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert bench_main(["--backends", "nccl"]) == 64
    assert "backend nccl needs a CUDA device" in capsys.readouterr().err


def test_nccl_mover_needs_cuda(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert bench_main(["--backends", "gloo,l=pycomm-over:nccl"]) == 64
    assert "backend pycomm-over:nccl needs a CUDA device" in capsys.readouterr().err


def test_layered_specs_parse():
    from pycomm.bench.backends import device_of, dispatch_pairs, parse_backends, through_direct
    from pycomm.bench.config import BackendSpec

    specs = parse_backends("gloo,layered=pycomm-over:gloo,exact=pycomm-over:gloo:deterministic=exact,"
                           "fp8=pycomm-over:gloo:compression=fp8_e4m3:deterministic=1,pycomm-over:nccl")
    assert specs[1:] == [
        BackendSpec("layered", "pycomm-over", (), "gloo"),
        BackendSpec("exact", "pycomm-over", (("deterministic", "exact"),), "gloo"),
        BackendSpec("fp8", "pycomm-over", (("compression", "fp8_e4m3"), ("deterministic", "1")), "gloo"),
        BackendSpec("pycomm-over", "pycomm-over", (), "nccl")]
    assert [s.describe() for s in specs] == [
        "gloo", "layered=pycomm-over:gloo", "exact=pycomm-over:gloo:deterministic=exact",
        "fp8=pycomm-over:gloo:compression=fp8_e4m3:deterministic=1", "pycomm-over=pycomm-over:nccl"]
    assert [device_of(s) for s in specs] == ["cpu", "cpu", "cpu", "cpu", "cuda"]
    # Always the direct API, options or not; never one side of a dispatch pair.
    assert [through_direct(s) for s in specs] == [False, True, True, True, True]
    assert dispatch_pairs(parse_backends("pycomm,l=pycomm-over:gloo:compression=none")) == []


def test_group_options_leave_the_calls_to_torch_distributed():
    from pycomm.bench.backends import call_options, dispatch_pairs, parse_backends, through_direct, unsupported

    specs = parse_backends("pycomm,n1=pycomm:verify=1,d1=pycomm:verify=1:deterministic=1,direct=pycomm:algorithm=auto")
    assert [s.options for s in specs[1:3]] == [(("verify", "1"),), (("verify", "1"), ("deterministic", "1"))]
    assert [call_options(s) for s in specs] == [{}, {}, {"deterministic": "1"}, {"algorithm": "auto"}]
    assert [through_direct(s) for s in specs] == [False, False, True, True]
    assert unsupported(specs[1], "broadcast", True, "float32") is None
    assert dispatch_pairs(specs) == [("pycomm", "direct")]


def test_layered_rows_against_gloo_and_native(tmp_path):
    """gloo, pycomm's layered path over a gloo group (three ways) and the native path with
    the same options, in one run at 3 ranks: the layered results are right and, where the
    native path must give the same bits (exact mode; fp8 against native twoshot), they do.
    fp8 rounds some of the check's sums (beyond 16): counted apart, the run still passes."""
    path = tmp_path / "run.json"
    proc = bench("--np", "3", "--sizes", "3K", "--collective", "allreduce,reducescatter,allgather",
                 "--inplace", "1",
                 "--backends", "gloo,layered=pycomm-over:gloo,lexact=pycomm-over:gloo:deterministic=exact,"
                 "l8=pycomm-over:gloo:compression=fp8_e4m3,exact=pycomm:deterministic=exact,"
                 "n8=pycomm:algorithm=twoshot:compression=fp8_e4m3", "--json", str(path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "layered=pycomm-over:gloo, lexact=pycomm-over:gloo:deterministic=exact" in proc.stdout
    rows = {(r["backend"], r["collective"]): r for r in json.loads(path.read_text())["results"]}
    rounded = sum(r["wrong"] for (label, _), r in rows.items() if label in ("l8", "n8"))
    assert rounded > 0 and re.search(r"# correctness: all results exact but those of lossy "
                                     r"compression \(l8, n8\): %d elements rounded" % rounded, proc.stdout)
    for coll in ("all_reduce", "reduce_scatter", "all_gather"):
        for label in ("layered", "lexact", "l8"):
            r = rows[label, coll]
            assert (r["wrong"] == 0 or label == "l8") and r["repeats_match"] is True and r["time_us"] > 0
            assert r["x_baseline"] == pytest.approx(r["time_us"] / rows["gloo", coll]["time_us"])
        assert rows["layered", coll]["relerr"] < 1e-6 and rows["lexact", coll]["relerr"] < 1e-6
        assert 1e-3 < rows["l8", coll]["relerr"] < 6e-2
        assert rows["lexact", coll]["hash"] == rows["exact", coll]["hash"]
        assert rows["l8", coll]["hash"] == rows["n8", coll]["hash"]


def test_copy_row_is_the_memory_yardstick(tmp_path):
    """The copy row beside an all-reduce: timed like a backend, never checked (n/a), its
    busbw its own bytes over time (factor 1 at any world size)."""
    path = tmp_path / "run.json"
    proc = bench("--np", "3", "--sizes", "64K", "--mode", "blocking", "--backends", "pycomm,copy",
                 "--json", str(path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["backend"]: r for r in json.loads(path.read_text())["results"]}
    assert rows["pycomm"]["wrong"] == 0 and rows["pycomm"]["busbw_factor"] == pytest.approx(4 / 3)
    copy_row = rows["copy"]
    assert copy_row["wrong"] == -1 and copy_row["hash"] is None and copy_row["busbw_factor"] == 1.0
    assert copy_row["busbw"] == pytest.approx(copy_row["algbw"]) and copy_row["time_us"] > 0
    assert "# correctness: all results exact" in proc.stdout
    assert bench_main(["--collective", "reduce_scatter", "--backends", "pycomm,copy"]) == 64


def compare(old, new):
    return run([sys.executable, os.path.join(ROOT, "bench", "compare.py"), str(old), str(new)])


def test_compare_identical_runs_pass(sweep):
    _, out, _ = sweep
    proc = compare(out / "run.json", out / "run.jsonl")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 regressions" in proc.stdout and "REGRESSION" not in proc.stdout


def test_compare_flags_a_planted_regression(sweep, tmp_path):
    _, out, doc = sweep
    slower = copy.deepcopy(doc)
    row = slower["results"][0]
    # x4: more than any 2-repeat spread ((max - min) / median < 2) can excuse.
    row["time_us"] *= 4
    row["per_repeat_us"] = [t * 4 for t in row["per_repeat_us"]]
    path = tmp_path / "slower.json"
    path.write_text(json.dumps(slower))
    proc = compare(out / "run.json", path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    flagged = [line for line in proc.stdout.splitlines() if line.endswith("REGRESSION")]
    assert len(flagged) == 1 and row["collective"] in flagged[0]
    assert "1 regressions" in proc.stdout


def test_a_result_written_under_bench_results_lands_in_its_index(tmp_path):
    from pycomm.bench import index, writers
    results = tmp_path / "bench" / "results"
    doc = {"command": "python -m pycomm.bench --np 2 --json x.json", "date_utc": "2026-01-02T03:04:05Z",
           "git": {"commit": "0123456789abcdef0123456789abcdef01234567", "dirty": False},
           "host": {"hostname": "box", "cpu_count": 8}, "results": []}
    writers.write_json(str(results / "cpu" / "x.json"), doc)
    rows = index.read(str(results))
    assert rows == {"cpu/x.json": {"command": doc["command"], "commit": "0123456",
                                   "date": "2026-01-02T03:04:05Z", "machine": "box, 8 cpus"}}
    # A second file keeps the first row; what a file does not record is "not recorded",
    # or what the same run's JSON beside it records.
    (results / "cpu" / "x.txt").write_text("a table\n")
    (results / "cpu" / "y.txt").write_text("a table\n")
    writers.write_jsonl(str(results / "cpu" / "z.jsonl"), {}, [{"size": 4}])
    rows = index.read(str(results))
    assert set(rows) == {"cpu/x.json", "cpu/x.txt", "cpu/y.txt", "cpu/z.jsonl"}
    assert rows["cpu/x.txt"]["commit"] == "0123456"
    assert set(rows["cpu/y.txt"].values()) == {index.NOT_RECORDED}
    # A file gone loses its row at the next write; the index lists exactly the files present.
    (results / "cpu" / "y.txt").unlink()
    writers.write_json(str(results / "gpu" / "w.json"), {"results": []})
    assert set(index.read(str(results))) == set(index.present(str(results)))
    assert "[gpu/w.json](gpu/w.json)" in (results / "INDEX.md").read_text()
    # Outside a bench/results folder nothing is indexed.
    writers.write_json(str(tmp_path / "out" / "run.json"), doc)
    assert not (tmp_path / "out" / "INDEX.md").exists()
