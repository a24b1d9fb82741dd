#!/usr/bin/env python3
"""Fails when the runtime's top-level folders import each other in a cycle.

Each top-level module of runtime/src (a folder such as `export/`, or a file such as
`glob.rs`) is a node; `crate::<module>` in a file of another module is an edge. Comments
and doc comments are ignored, and so is test code (`tests.rs` files, and what follows a
top-level `#[cfg(test)]`): a test may build its inputs with a module above the one it tests
(`export`'s tests write a demo model). Prints the graph and every cycle, and exits 1 if
there is one.

    python3 scripts/check-layers.py [runtime/src]
"""
import re
import sys
from pathlib import Path

root = Path(sys.argv[1] if len(sys.argv) > 1 else "runtime/src")
nodes = {p.stem if p.is_file() else p.name for p in root.iterdir()
         if p.suffix == ".rs" or p.is_dir()}
nodes -= {"lib", "main"}
edges: dict[str, dict[str, str]] = {n: {} for n in nodes}
use_re = re.compile(r"\bcrate::(\w+)")
for f in sorted(root.rglob("*.rs")):
    rel = f.relative_to(root)
    src = rel.parts[0] if len(rel.parts) > 1 else rel.stem
    if src not in nodes or f.name == "tests.rs":
        continue
    for lineno, line in enumerate(f.read_text().splitlines(), 1):
        if line.startswith("#[cfg(test)]"):
            break
        code = line.split("//", 1)[0]
        for m in use_re.finditer(code):
            dst = m.group(1)
            if dst in nodes and dst != src:
                edges[src].setdefault(dst, f"{rel}:{lineno}")

# Cycles: Tarjan's strongly connected components.
index, low, stack, on, sccs, counter = {}, {}, [], set(), [], [0]
def strong(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in edges[v]:
        if w not in index:
            strong(w)
            low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        comp = []
        while True:
            w = stack.pop()
            on.discard(w)
            comp.append(w)
            if w == v:
                break
        sccs.append(sorted(comp))
sys.setrecursionlimit(10000)
for v in sorted(nodes):
    if v not in index:
        strong(v)

for v in sorted(nodes):
    if edges[v]:
        print(f"{v} -> {', '.join(sorted(edges[v]))}")
cycles = [c for c in sccs if len(c) > 1]
for c in cycles:
    print(f"\ncycle among {', '.join(c)}:")
    for a in c:
        for b in c:
            if b in edges[a]:
                print(f"  {a} -> {b}  ({edges[a][b]})")
if cycles:
    sys.exit(1)
print(f"\nno import cycles between the top-level modules of {root}")
