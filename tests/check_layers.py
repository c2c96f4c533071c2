"""Fails when a C++/CUDA source under csrc/ includes a header of a layer above its own.

Usage: check_layers.py LAYER... (lowest first). A file in csrc/<layer>/ may include headers
of its own layer and of the layers before it in the list; every include of a pycomm header
names its directory ("core/types.h"). Prints each offending include as file:line.
"""
import pathlib
import re
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def main(layers):
    root = pathlib.Path(__file__).resolve().parent.parent / "csrc"
    rank = {layer: i for i, layer in enumerate(layers)}
    problems = []
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".h", ".cc", ".cu", ".cuh")):
        layer = path.relative_to(root).parts[0]
        if layer not in rank:
            problems.append("%s: csrc/%s/ is not a layer (%s)" % (path, layer, " < ".join(layers)))
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            target = m.group(1).split("/")[0] if "/" in m.group(1) else None
            where = "%s:%d: #include \"%s\"" % (path.relative_to(root.parent), number, m.group(1))
            if target is None:
                problems.append(where + ": name the header's layer (e.g. \"core/types.h\")")
            elif target not in rank:
                problems.append(where + ": %s is not a layer" % target)
            elif rank[target] > rank[layer]:
                problems.append(where + ": %s includes %s, a layer above it" % (layer, target))
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print("layer-check: %d includes go against the layer order %s" % (len(problems), " < ".join(layers)),
              file=sys.stderr)
        return 1
    print("layer-check: every include follows %s" % " < ".join(layers))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
