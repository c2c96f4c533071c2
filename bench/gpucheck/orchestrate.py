"""The GPU check's orchestrator: runs the plan's steps in order as child processes, each in its
own process group with its own limit within the budget, interrupted before it is killed;
checks that a step leaves no shared-memory segment behind; rewrites the report after each."""
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time

from gpucheck import mps
from gpucheck.common import ROOT
from gpucheck.report import summary_markdown

INTERRUPT_GRACE_S = 15  # a step at its limit is interrupted this long before it is killed


def device_slug(name):
    """'h100' for 'NVIDIA H100 80GB HBM3', else the name in lower case and dashes; 'cpu'
    for no name."""
    name = name.replace("NVIDIA", "")
    model = re.search(r"\b([A-Za-z]+\d+[A-Za-z]?)\b", name)
    return model.group(1).lower() if model else (re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "cpu")


def run_child(step, argv, env, limit_s, log):
    """Runs argv in its own process group; kills the group at the limit or when it ends
    (a rank left behind must not outlive its step). Returns (rc or None, output)."""
    with tempfile.TemporaryFile() as out:
        try:
            proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        except OSError as e:
            return -1, "cannot start %s: %s\n" % (argv[0], e)
        try:
            rc = proc.wait(timeout=max(1.0, limit_s - INTERRUPT_GRACE_S))
        except subprocess.TimeoutExpired:
            rc = None
            # Interrupted first, pytest reports the failures it has seen and a measuring
            # step stops where it is (it has saved what it measured).
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=INTERRUPT_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        out.seek(0)
        text = out.read().decode(errors="replace")
    log.write("\n===== %s: %s (limit %.0f s)\n%s" % (step.name, " ".join(argv), limit_s, text))
    log.flush()
    return rc, text


def pytest_summary(text):
    lines = [l.strip("= ") for l in text.splitlines() if re.search(r"\b(passed|failed|error|skipped|no tests ran)\b", l)
             and re.search(r" in [\d.]+s", l)]
    return lines[-1] if lines else None


def gpu_name():
    """The first GPU's name as nvidia-smi gives it ('' without one): read without making a
    CUDA context in this process, which outlives every step."""
    if not shutil.which("nvidia-smi"):
        return ""
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                         text=True, timeout=30)
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""


def orchestrate(args, dry, steps):
    os.makedirs(args.out, exist_ok=True)
    start = time.monotonic()
    device = "" if dry else gpu_name()
    stem = os.path.join(args.out, "gpu-%s-check" % ("cpu-dry" if dry else device_slug(device)))
    report = {"dry": dry, "device": device, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "budget_s": args.budget,
              "command": ("GPU_CHECK_DRY=1 " if dry else "") + "python bench/gpu_check.py", "versions": {},
              "steps": [], "elapsed_s": 0.0}
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    if dry:
        env["TRITON_INTERPRET"] = "1"
    built = True
    asked = set(args.steps.split(",")) if args.steps else set()
    unknown = asked - {step.name for step in steps}
    if unknown:
        raise SystemExit("--steps: no step named %s" % ", ".join(sorted(unknown)))
    with open(stem + ".log", "w") as log:
        for step in steps:
            entry = {"name": step.name, "what": step.what, "limit_s": step.limit_s}
            report["steps"].append(entry)
            left = args.budget - (time.monotonic() - start)
            if asked and step.name not in asked and step.name != "build":
                entry["verdict"] = "not asked for (--steps)"
            elif step.needs_build and not built:
                entry["verdict"] = "skipped: the build failed"
            elif dry and step.name == "build":
                entry["verdict"] = "planned: " + " ".join(step.argv)
            elif step.optional and left < step.limit_s:
                entry["verdict"] = "skipped: %.0f s left of the budget, the step needs %.0f" % (left, step.limit_s)
            elif left < 5:
                entry["verdict"] = "skipped: the budget is spent"
            else:
                run_step(step, entry, min(step.limit_s, left), dict(env, **step.env), stem, log, dry)
                built = built and (step.name != "build" or entry["verdict"].startswith("pass"))
                if step.name == "versions" and entry.get("result"):
                    report["versions"] = entry["result"]["info"]
                print("[%5.0f s] %s: %s" % (time.monotonic() - start, step.name, entry["verdict"]), flush=True)
            report["elapsed_s"] = time.monotonic() - start
            with open(stem + ".md", "w") as f:
                f.write(summary_markdown(report))
            with open(stem + ".json", "w") as f:
                json.dump(report, f, indent=1, default=str)
    print("\n" + summary_markdown(report))
    return 1 if any(s["verdict"].startswith(("FAIL", "TIMEOUT")) for s in report["steps"]) else 0


def run_step(step, entry, limit, env, stem, log, dry):
    """Runs one step and fills its entry: seconds, the measuring step's result, verdict."""
    record = stem + ".%s.tmp.json" % step.name
    argv = step.argv + (["--record", record] if step.measures else [])
    t0 = time.monotonic()
    segments = shm_segments()
    with mps.daemon() if step.mps and not dry else contextlib.nullcontext("") as sharing:
        if sharing:
            entry["what"] += " [%s]" % sharing
        rc, text = run_child(step, argv, dict(env, **mps.MPS_ENV) if sharing == "MPS" else env, limit, log)
    mps.stop_mps()  # left running if the step was killed in it
    entry["seconds"] = time.monotonic() - t0
    settle = time.monotonic() + 2  # ranks unlink theirs as they exit
    while shm_segments() - segments and time.monotonic() < settle:
        time.sleep(0.1)
    leaked = sorted(shm_segments() - segments)
    if step.measures and os.path.exists(record):
        with open(record) as f:
            entry["result"] = json.load(f)
        os.remove(record)
    if rc is None:
        summary = pytest_summary(text)
        entry["verdict"] = "TIMEOUT after %.0f s" % limit + (": " + summary if summary else "")
    elif rc != 0:
        entry["verdict"] = "FAIL (exit %d): %s" % (
            rc, pytest_summary(text) or (text.strip().splitlines() or ["no output"])[-1][:300])
    elif step.measures:
        entry["verdict"] = entry.get("result", {}).get("verdict", "FAIL: the step recorded nothing")
    elif dry and step.name != "build":
        entry["verdict"] = "collected: " + (text.strip().splitlines() or ["nothing"])[-1]
    else:
        entry["verdict"] = "pass" + (": " + pytest_summary(text) if pytest_summary(text) else "")
    if leaked:  # the segments of its groups must all be gone when a step ends
        entry["verdict"] = "FAIL: left in /dev/shm: %s; %s" % (" ".join(leaked[:5]), entry["verdict"])


def shm_segments():
    return {n for n in os.listdir("/dev/shm") if n.startswith("pycomm")} if os.path.isdir("/dev/shm") else set()
