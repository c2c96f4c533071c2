"""Fails when a source file imports or includes a layer above its own, or pycomm/ has an
import cycle.

Usage: check_layers.py [--root DIR] --cpp LAYER... --python LAYER... (each list lowest
first; the Makefile states both orders, LAYERS and PY_LAYERS). Prints each offending
include or import as file:line.

C++: a file in csrc/<layer>/ may include headers of its own layer and of the layers before
it in the list; every include of a pycomm header names its directory ("core/types.h").

Python: a layer of pycomm/ is a module or package directly under it (``kernels`` is
pycomm/kernels/ and everything in it, ``_C`` the extension), ``__init__`` the package's own
pycomm/__init__.py; modules of one layer are joined by commas (``fsdp,hooks``). A module
may import its own layer and the layers before it. Every import counts, at the top of a
file or inside a function (a deferred import still makes the dependency): ``import
pycomm.x``, ``from pycomm.x import y``, ``from . import y``, ``from ..x import y``. No
chain of imports between pycomm's modules may lead back to where it started, within a
layer too (importing ``pycomm.a.b`` runs pycomm/__init__.py and pycomm/a/__init__.py first,
as for every module: that is not counted as an import of them).
"""
import argparse
import ast
import pathlib
import re
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
PACKAGE = "pycomm"
INIT = "__init__"


def check_cpp(root, layers):
    """The includes under root/csrc/ that go against ``layers`` (lowest first)."""
    csrc = root / "csrc"
    rank = {layer: i for i, layer in enumerate(layers)}
    problems = []
    for path in sorted(p for p in csrc.rglob("*") if p.suffix in (".h", ".cc", ".cu", ".cuh")):
        layer = path.relative_to(csrc).parts[0]
        if layer not in rank:
            problems.append("%s: csrc/%s/ is not a layer (%s)" % (path.relative_to(root), layer, " < ".join(layers)))
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            target = m.group(1).split("/")[0] if "/" in m.group(1) else None
            where = "%s:%d: #include \"%s\"" % (path.relative_to(root), number, m.group(1))
            if target is None:
                problems.append(where + ": name the header's layer (e.g. \"core/types.h\")")
            elif target not in rank:
                problems.append(where + ": %s is not a layer" % target)
            elif rank[target] > rank[layer]:
                problems.append(where + ": %s includes %s, a layer above it" % (layer, target))
    return problems


def _modules(package_dir):
    """{module name: (path, whether it is a package's __init__.py)} of every .py file."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        is_init = parts[-1] == INIT
        if is_init:
            parts.pop()
        out[".".join(parts)] = (path, is_init)
    return out


def _imports(tree, module, is_init, known):
    """(line, text, target module) of each import of a pycomm module in ``tree``. ``from X
    import y`` imports X.y where that is a module (``known``, or the extension pycomm._C),
    else X itself."""
    package = module if is_init else module.rpartition(".")[0]

    def resolved(base, name):
        sub = base + "." + name
        return sub if sub in known or sub == PACKAGE + "._C" else base

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    yield node.lineno, "import " + alias.name, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                if node.level - 1 >= len(base):
                    continue  # beyond the top package: Python refuses it anyway
                base = ".".join(base[:len(base) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base != PACKAGE and not base.startswith(PACKAGE + "."):
                continue
            text = "from %s%s import %s" % ("." * node.level, node.module or "",
                                            ", ".join(a.name for a in node.names))
            for target in sorted({resolved(base, alias.name) for alias in node.names}):
                yield node.lineno, text, target


def _layer_of(module):
    parts = module.split(".")
    return INIT if len(parts) == 1 else parts[1]


def check_python(root, layers):
    """The imports in root/pycomm/ that go against ``layers`` (lowest first, a layer's
    modules joined by commas), and its import cycles."""
    rank = {name: i for i, layer in enumerate(layers) for name in layer.split(",")}
    order = " < ".join(layers)
    modules = _modules(root / PACKAGE)
    problems, edges = [], {}
    for module, (path, is_init) in modules.items():
        where = path.relative_to(root)
        layer = _layer_of(module)
        if layer not in rank:
            problems.append("%s: %s is not a layer (%s)" % (where, layer, order))
            continue
        tree = ast.parse(path.read_text(), str(path))
        for line, text, target in _imports(tree, module, is_init, modules):
            edges.setdefault(module, {}).setdefault(target, (where, line, text))
            above = _layer_of(target)
            if above not in rank:
                problems.append("%s:%d: %s: %s is not a layer (%s)" % (where, line, text, above, order))
            elif rank[above] > rank[layer]:
                problems.append("%s:%d: %s: %s imports %s, a layer above it (%s)" % (where, line, text, layer, above,
                                                                                    order))
    for cycle in _cycles(edges):
        steps = ["%s:%d: %s" % edges[a][b] for a, b in zip(cycle, cycle[1:] + cycle[:1])]
        problems.append("import cycle %s: %s" % (" -> ".join(cycle + cycle[:1]), "; ".join(steps)))
    return problems


def _cycles(edges):
    """One cycle of each strongly connected component of more than one module (or a module
    that imports itself), as the list of its modules in import order."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):  # Tarjan's algorithm; the graph is small, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, ()):
                found.append(_cycle_in(v, component, edges))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _cycle_in(start, component, edges):
    """A path from ``start`` back to it within ``component`` (breadth first: a shortest one)."""
    previous, frontier = {}, [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(edges.get(v, ())):
                if w not in component:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return path[::-1]
                if w not in previous:
                    previous[w] = v
                    following.append(w)
        frontier = following
    return [start]


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=pathlib.Path, default=pathlib.Path(__file__).resolve().parent.parent,
                        help="the repository's root (default: this checkout)")
    parser.add_argument("--cpp", nargs="+", required=True, metavar="LAYER", help="csrc/'s layers, lowest first")
    parser.add_argument("--python", nargs="+", required=True, metavar="LAYER", help="pycomm/'s layers, lowest first")
    args = parser.parse_args(argv)
    failed = 0
    for language, problems, layers, what in [("C++", check_cpp(args.root, args.cpp), args.cpp, "include"),
                                             ("Python", check_python(args.root, args.python), args.python, "import")]:
        for p in problems:
            print(p, file=sys.stderr)
        if problems:
            print("layer-check: %d %ss go against the %s layer order %s, or form a cycle"
                  % (len(problems), what, language, " < ".join(layers)), file=sys.stderr)
            failed = 1
        else:
            print("layer-check: every %s %s follows %s" % (language, what, " < ".join(layers)))
    return failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
