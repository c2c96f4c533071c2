"""The documentation holds together: the knob table of docs/env.md lists exactly the knobs
the core declares, with their defaults and whether every rank must share them; every
relative link of the README, docs/, bench/README.md and bench/results/ leads to a file
(and a heading, for an anchor); every file of docs/ and bench/results/ is reachable from
the README; the README stays a first page; every PYCOMM_* name a document cites is
declared; bench/results/INDEX.md lists exactly the result files present. Reads files only:
no process, no network."""

import importlib.util
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
ENV = os.path.join(ROOT, "docs", "env.md")
RESULTS = os.path.join(ROOT, "bench", "results")
SKIP_DIRS = {".git", ".venv", "build", "__pycache__", "out", "node_modules"}


def _rel(path):
    return os.path.relpath(path, ROOT).replace(os.sep, "/")


def _markdown_files():
    files = [README, os.path.join(ROOT, "bench", "README.md")]
    for top in ("docs", os.path.join("bench", "results")):
        for d, dirs, names in os.walk(os.path.join(ROOT, top)):
            dirs.sort()
            files += [os.path.join(d, n) for n in sorted(names) if n.endswith(".md")]
    return files


def _without_code(text):
    """The text without fenced code blocks and inline code spans."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`]*`", "", text)


def _links(path):
    """Relative link targets of a Markdown file (images included), anchors kept."""
    with open(path, encoding="utf-8") as f:
        text = _without_code(f.read())
    out = []
    for target in re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:, ...
            continue
        out.append(target)
    return out


def _slugs(path):
    """GitHub's anchors for the headings of a Markdown file."""
    with open(path, encoding="utf-8") as f:
        text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", f.read(), flags=re.S | re.M)
    seen, slugs = {}, set()
    for heading in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", text, flags=re.M):
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        slugs.add(slug if n == 0 else "%s-%d" % (slug, n))
    return slugs


def _resolve(source, target):
    path, _, anchor = target.partition("#")
    full = os.path.normpath(os.path.join(os.path.dirname(source), path)) if path else source
    return full, anchor


def test_env_doc_lists_every_knob_with_its_default_and_agreement():
    pycomm = pytest.importorskip("pycomm")
    rows = {}
    for line in open(ENV, encoding="utf-8"):
        m = re.match(r"\| `(PYCOMM_[A-Z_]+)` \| (`([^`]*)`|\(empty\)) \| (same|any) \|", line)
        if m:
            rows[m.group(1)] = (m.group(3) or "", m.group(4) == "same")
    declared = {name: (default, same) for name, default, _, same in pycomm.knobs()}
    assert rows == declared


def test_every_relative_link_leads_to_a_file_and_heading():
    broken = []
    slugs = {}
    for source in _markdown_files():
        for target in _links(source):
            full, anchor = _resolve(source, target)
            if not os.path.exists(full):
                broken.append("%s: %s (no such file)" % (_rel(source), target))
            elif anchor and full.endswith(".md"):
                if full not in slugs:
                    slugs[full] = _slugs(full)
                if anchor not in slugs[full]:
                    broken.append("%s: %s (no such heading)" % (_rel(source), target))
    assert not broken, "\n".join(broken)


def test_every_doc_and_result_is_reachable_from_the_readme():
    reached, todo = set(), [README]
    while todo:
        path = todo.pop()
        if path in reached:
            continue
        reached.add(path)
        if path.endswith(".md") and os.path.isfile(path):
            todo += [_resolve(path, t)[0] for t in _links(path)]
    unreached = []
    for top in ("docs", os.path.join("bench", "results")):
        for d, _, names in os.walk(os.path.join(ROOT, top)):
            unreached += [_rel(os.path.join(d, n)) for n in names
                          if os.path.join(d, n) not in reached]
    assert not sorted(unreached), "not linked from the README, directly or through " \
        "other documents:\n" + "\n".join(sorted(unreached))


def test_readme_is_a_first_page():
    with open(README, encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) <= 250, "README.md has %d lines; details belong in docs/" % len(lines)


def test_every_pycomm_variable_a_document_cites_is_declared():
    # A knob is declared by the core (pycomm.knobs()); the other variables (build, tests,
    # benchmarks) are listed in env.md with the file that reads them, which must name them.
    pycomm = pytest.importorskip("pycomm")
    knobs = {name for name, _, _, _ in pycomm.knobs()}
    with open(ENV, encoding="utf-8") as f:
        env = f.read()
    others = dict(re.findall(r"^\| `(PYCOMM_[A-Z0-9_]+)` \| `([^`]+)` \| (?!same \||any \|)", env,
                             flags=re.M))
    problems = ["%s: a knob, listed as another variable" % k for k in sorted(knobs & set(others))]
    for name, reader in sorted(others.items()):
        with open(os.path.join(ROOT, reader), encoding="utf-8") as f:
            if name not in f.read():
                problems.append("%s: env.md says %s reads it, which does not name it" % (name, reader))
    for source in _markdown_files():
        with open(source, encoding="utf-8") as f:
            for name in sorted(set(re.findall(r"\bPYCOMM_[A-Z0-9_]*[A-Z0-9]\b", f.read()))):
                if name not in knobs and name not in others:
                    problems.append("%s cites %s, which is not declared" % (_rel(source), name))
    assert not problems, "\n".join(problems)


def test_no_file_names_a_design_contract_outside_docs():
    # The design is docs/design.md; no file may point anywhere else for it.
    name, doc = "DESIGN" + ".md", "design" + ".md"
    found = []
    for d, dirs, files in os.walk(ROOT):
        dirs[:] = [x for x in dirs if x not in SKIP_DIRS and not x.endswith(".egg-info")]
        for f in files:
            path = os.path.join(d, f)
            if os.path.getsize(path) > 4 << 20:
                continue
            try:
                with open(path, encoding="utf-8") as fh:
                    text = fh.read()
            except (UnicodeDecodeError, OSError):
                continue
            if name in text:
                found.append(_rel(path))
            for m in re.finditer(r"[\w./-]*" + re.escape(doc), text):
                if not (m.group(0).endswith("docs/" + doc) or m.group(0) == doc and _rel(d) == "docs"):
                    found.append("%s: %s" % (_rel(path), m.group(0)))
    assert not found, "\n".join(found)


def test_results_index_lists_exactly_the_files_present():
    spec = importlib.util.spec_from_file_location(
        "_results_index", os.path.join(ROOT, "pycomm", "bench", "index.py"))
    index = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(index)
    listed, present = set(index.read(RESULTS)), set(index.present(RESULTS))
    assert listed == present, ("run python -m pycomm.bench.index --all; not listed: %s; "
                               "listed, not present: %s" % (sorted(present - listed),
                                                           sorted(listed - present)))
