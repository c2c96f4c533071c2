"""The index of recorded results: ``bench/results/INDEX.md``, one row per result file (its
path, the command that made it, the commit, the date and the machine), torch-free.

The values come from the files themselves: a ``pycomm.bench`` JSON document's ``command``,
``git``, ``date_utc`` and ``host``, the header of a text or Markdown report, a GPU check's
``versions`` and ``device``; a file that records none of them takes what a JSON file of
the same name beside it (the same run's document) records. What no file records is
"not recorded": the index never guesses a commit.

The bench's writers (``pycomm.bench.writers``) update the row of every file they write
under ``bench/results``; other files are indexed with

    python -m pycomm.bench.index FILE...     # (re)read these files' rows; rows of files gone are dropped
    python -m pycomm.bench.index --all       # every row read again from its file
    python -m pycomm.bench.index --check     # exit 1 if the index does not list exactly the files present
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Dict, Iterable, List, Optional

INDEX_NAME = "INDEX.md"
# The results folder's own documents, not results.
NOT_INDEXED = ("INDEX.md", "SUMMARY.md")
NOT_RECORDED = "not recorded"
FIELDS = ("command", "commit", "date", "machine")
DEFAULT_ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "bench", "results")

HEADER = """# Index of recorded results

One row per result file under `bench/results/`: the command that wrote it, the commit it
ran at, the date and the machine, as the file itself records them (or the JSON document
of the same run beside it). "not recorded" means the file does not say; nothing here is
guessed. [SUMMARY.md](SUMMARY.md) says what the numbers show.

The bench's writers keep this table current for the files they write; after writing
others, `python -m pycomm.bench.index FILE...` (or `--all`) updates it, and `--check`
tells whether it lists exactly the files present (`tests/test_readme.py` checks that).

| path | command | commit | date | machine |
| --- | --- | --- | --- | --- |
"""
_ROW = re.compile(r"^\| \[([^\]]+)\]\([^)]*\) \| (.*) \| (.*) \| (.*) \| (.*) \|$")


def results_root(path: str) -> Optional[str]:
    """The ``bench/results`` folder that holds ``path``, or None when it is not in one."""
    d = os.path.dirname(os.path.abspath(path))
    while True:
        if os.path.basename(d) == "results" and os.path.basename(os.path.dirname(d)) == "bench":
            return d
        parent = os.path.dirname(d)
        if parent == d:
            return None
        d = parent


def present(root: str = DEFAULT_ROOT) -> List[str]:
    """Every result file under ``root``, relative to it, sorted."""
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        for f in files:
            rel = os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/")
            if rel in NOT_INDEXED or f.startswith(".") or f.endswith((".tmp", ".part")):
                continue
            out.append(rel)
    return sorted(out)


def _short(commit: str) -> str:
    return commit[:7] if re.fullmatch(r"[0-9a-f]{7,40}", commit) else commit


def _host(host) -> Optional[str]:
    if isinstance(host, dict):
        name = host.get("hostname") or host.get("host")
        cpus = host.get("cpu_count") or host.get("cpus")
        return ", ".join(x for x in (name, "%s cpus" % cpus if cpus else None) if x) or None
    return host if isinstance(host, str) and host else None


def _from_json(path: str) -> Dict[str, str]:
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return {}
    return _from_doc(doc)


def _from_doc(doc) -> Dict[str, str]:
    """What a JSON document records of its run."""
    if not isinstance(doc, dict):
        return {}
    out = {}
    if isinstance(doc.get("command"), str):
        out["command"] = doc["command"]
    git, versions, env = doc.get("git"), doc.get("versions"), doc.get("env")
    if isinstance(git, dict) and git.get("commit"):
        out["commit"] = _short(git["commit"]) + (" (dirty)" if git.get("dirty") else "")
    elif isinstance(versions, dict) and versions.get("commit"):
        out["commit"] = _short(versions["commit"])
    for key in ("date_utc", "date"):
        if isinstance(doc.get(key), str):
            out["date"] = doc[key]
            break
    if isinstance(doc.get("host"), dict):
        out["machine"] = _host(doc["host"])
    elif isinstance(versions, dict) and (doc.get("device") or versions.get("gpu")):
        cpus = versions.get("cpus")
        out["machine"] = "%s%s" % (doc.get("device") or versions["gpu"],
                                   ", %s cpus" % cpus if cpus else "")
    elif isinstance(env, dict):
        name = env.get("device") or env.get("host")
        cpus = env.get("cpus")
        if name:
            out["machine"] = "%s%s" % (name, ", %s cpus" % cpus if cpus else "")
    return {k: v for k, v in out.items() if v}


def _from_jsonl(path: str) -> Dict[str, str]:
    try:
        with open(path) as f:
            first = json.loads(f.readline())
    except (OSError, ValueError):
        return {}
    env = first.get("env") if isinstance(first, dict) else None
    return _from_doc(env)


def _from_text(path: str) -> Dict[str, str]:
    """A report's header: the ``pycomm.bench`` text and Markdown reports, the GPU check's
    Markdown report, and the first lines of the other scripts' text output."""
    try:
        with open(path, errors="replace") as f:
            head = [f.readline().rstrip("\n") for _ in range(20)]
    except OSError:
        return {}
    out = {}
    for i, line in enumerate(head):
        m = re.match(r"# command\s*: (.+)$", line)
        if m:
            out.setdefault("command", m.group(1).strip())
        m = re.match(r"# host\s*: (.+)$", line)
        if m:
            out.setdefault("machine", ", ".join(m.group(1).split(";")[0].split(", ")[:2]))
        m = re.match(r"\| date \(UTC\) \| (.+) \|$", line)
        if m:
            out.setdefault("date", m.group(1))
        m = re.match(r"\| git \| ([0-9a-f]{7,40})( \(dirty\))? \|$", line)
        if m:
            out.setdefault("commit", _short(m.group(1)) + (m.group(2) or ""))
        m = re.match(r"\| host \| (.+) \|$", line)
        if m:
            out.setdefault("machine", ", ".join(m.group(1).split(", ")[:2]))
        m = re.match(r"`([^`]+)` at commit ([0-9a-f]{7,40}), ([^,]+),", line)
        if m:  # the GPU check's report
            out.setdefault("command", m.group(1))
            out.setdefault("commit", _short(m.group(2)))
            out.setdefault("date", m.group(3))
        if i == 0:
            m = re.match(r"commit ([0-9a-f]{7,40})\b", line)
            if m:
                out.setdefault("commit", _short(m.group(1)))
            m = re.match(r"# ((?:python|\.venv/bin/python|torchrun|mpirun) .+?)"
                         r"(?: \(.*\)|,? with .*| on .*|;.*)?$", line)
            if m:
                out.setdefault("command", m.group(1))
        if i < 3:
            m = re.match(r"# GPU check: (.+)$", line) or re.match(r"# (NVIDIA [^,]+),", line)
            if m:
                out.setdefault("machine", m.group(1))
            if i == 2 and re.match(r"`[^`]+`$", line) and head[0].startswith("# pycomm.bench"):
                out.setdefault("command", line.strip("`"))
    return out


def metadata(path: str) -> Dict[str, str]:
    """The row of one result file: command, commit, date and machine, each as the file
    (or, failing that, the JSON document of the same run beside it) records it."""
    if path.endswith(".json"):
        found = _from_json(path)
    elif path.endswith(".jsonl"):
        found = _from_jsonl(path)
    elif path.endswith((".md", ".txt", ".log")):
        found = _from_text(path)
    else:
        found = {}
    stem = os.path.splitext(path)[0]
    sibling = stem + ".json"
    if sibling != path and os.path.exists(sibling) and any(k not in found for k in FIELDS):
        for k, v in _from_json(sibling).items():
            found.setdefault(k, v)
    return {k: found.get(k) or NOT_RECORDED for k in FIELDS}


def _cell(key: str, value: str) -> str:
    value = value.replace("|", "\\|").replace("\n", " ")
    if key == "command" and value != NOT_RECORDED:
        return "`%s`" % value.replace("`", "'")
    return value


def _uncell(value: str) -> str:
    value = value.strip()
    if value.startswith("`") and value.endswith("`") and len(value) >= 2:
        value = value[1:-1]
    return value.replace("\\|", "|")


def read(root: str = DEFAULT_ROOT) -> Dict[str, Dict[str, str]]:
    """The index's rows, by path relative to ``root``."""
    rows = {}
    try:
        with open(os.path.join(root, INDEX_NAME)) as f:
            for line in f:
                m = _ROW.match(line.rstrip("\n"))
                if m:
                    rows[m.group(1)] = {k: _uncell(v) for k, v in zip(FIELDS, m.groups()[1:])}
    except FileNotFoundError:
        pass
    return rows


def write(root: str, rows: Dict[str, Dict[str, str]]) -> None:
    lines = [HEADER]
    for rel in sorted(rows):
        lines.append("| [%s](%s) | %s |\n" % (rel, rel, " | ".join(
            _cell(k, rows[rel][k]) for k in FIELDS)))
    path = os.path.join(root, INDEX_NAME)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("".join(lines))
    os.replace(tmp, path)


def update(paths: Iterable[str], root: Optional[str] = None) -> Optional[str]:
    """Read again the rows of ``paths`` (files under one ``bench/results``), drop the rows
    of files that are gone, add the files not yet listed; returns the index's path (None
    when no path is under a results folder)."""
    paths = [os.path.abspath(p) for p in paths]
    if root is None:
        roots = {results_root(p) for p in paths} - {None}
        if not roots:
            return None
        root = roots.pop()
    rows = read(root)
    files = set(present(root))
    rows = {rel: row for rel, row in rows.items() if rel in files}
    for p in paths:
        rel = os.path.relpath(p, root).replace(os.sep, "/")
        if rel in files:
            rows[rel] = metadata(p)
    for rel in files - set(rows):
        rows[rel] = metadata(os.path.join(root, rel))
    write(root, rows)
    return os.path.join(root, INDEX_NAME)


def generate(root: str = DEFAULT_ROOT) -> str:
    """Every row read again from its file."""
    write(root, {rel: metadata(os.path.join(root, rel)) for rel in present(root)})
    return os.path.join(root, INDEX_NAME)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pycomm.bench.index", description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="result files whose rows to read again")
    ap.add_argument("--root", default=None, help="the results folder (default: the files', else %s)"
                    % os.path.relpath(DEFAULT_ROOT))
    ap.add_argument("--all", action="store_true", help="read every row again")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if the index does not list exactly the files present")
    args = ap.parse_args(argv)
    root = args.root or (results_root(args.files[0]) if args.files else None) or DEFAULT_ROOT
    if args.check:
        listed, files = set(read(root)), set(present(root))
        for rel in sorted(files - listed):
            print("not in the index: %s" % rel)
        for rel in sorted(listed - files):
            print("in the index, not present: %s" % rel)
        return 0 if listed == files else 1
    if args.all:
        print(generate(root))
    else:
        print(update(args.files, root))
    return 0


if __name__ == "__main__":
    sys.exit(main())
