"""The import arrows of DESIGN.md, walked from the sources (every import, inside functions too):

    formats <- kernels <- nn <- quantize <- train <- faces (cli, demo, ...)        formats <- exporters <- faces
                                                                                  formats <- readers <- native, train, faces

with distill (losses, RL) and native (native 4-bit checkpoints) at the quantize level, and the leaf
utilities (exit codes, atomic directories, recipes, assets, CPU probing) importable by anyone. A new
arrow fails here, naming the file and the line."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEAF = {"exitcodes", "_fsutil", "_inputs", "_quiet", "_recipes", "_rdata", "assets", "cpu"}
FACES = {"faces", "__main__", "integrations", "api"}
CORE = {"formats": set(), "kernels": {"formats"}, "nn": {"formats", "kernels"},
        "quantize": {"formats", "kernels", "nn"}, "distill": {"formats", "kernels", "nn", "quantize"},
        "native": {"formats", "kernels", "nn", "quantize", "readers"}, "exporters": {"formats"},
        "readers": {"formats"},
        "train": {"formats", "kernels", "nn", "quantize", "distill", "native", "readers"}}


def allowed(src: str):
    if src in LEAF:
        return LEAF
    if src in CORE:
        return CORE[src] | LEAF
    if src in FACES:
        return set(CORE) | LEAF | FACES
    raise AssertionError(f"qatfactory.{src}: a module this test does not place; add it to a layer")


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] in ("exporters", "readers"):     # installed as qatfactory.exporters / qatfactory.readers
        parts = ["qatfactory", parts[0]] + parts[1:]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _files():
    for f in sorted((ROOT / "qatfactory").rglob("*.py")) + sorted((ROOT / "exporters").rglob("*.py")) + \
            sorted((ROOT / "readers").rglob("*.py")):
        rel = f.relative_to(ROOT).parts
        if "__pycache__" in rel or rel[:2] in (("qatfactory", "exporters"), ("qatfactory", "readers")):
            continue
        yield f


def imports():
    """(file, line, importing module, imported module) for every import of a qatfactory module."""
    for f in _files():
        mod = _module(f)
        pkg = mod if f.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for n in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(n, ast.Import):
                targets = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom) and n.level:
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - (n.level - 1)] + ([n.module] if n.module else []))
                targets = [base] if n.module else [f"{base}.{a.name}" for a in n.names]
            elif isinstance(n, ast.ImportFrom) and n.module:
                targets = [n.module]
            if isinstance(n, ast.ImportFrom) and n.module and targets:
                # `from pkg import name`: name may be a submodule of pkg (the layer arrows see pkg alone)
                targets += [f"{targets[0]}.{a.name}" for a in n.names]
            for t in targets:
                if t.split(".")[0] == "qatfactory":
                    yield f, n.lineno, mod, t


def arrows():
    for f, line, mod, t in imports():
        a, b = mod.split("."), t.split(".")
        src = "__main__" if f.name == "__main__.py" else a[1] if len(a) > 1 else None
        if src and len(b) > 1 and a[1] != b[1]:
            yield f.relative_to(ROOT), line, src, b[1]


def test_no_import_arrow_outside_the_design():
    bad = [f"{f}:{line}: {a} -> {b}" for f, line, a, b in arrows() if b not in allowed(a)]
    assert not bad, "imports against the design's arrows:\n" + "\n".join(bad)


def test_the_walk_sees_the_arrows_it_should():
    # a walker that finds nothing proves nothing
    seen = {(a, b) for _, _, a, b in arrows()}
    assert {("nn", "formats"), ("kernels", "formats"), ("quantize", "nn"), ("train", "quantize"),
            ("exporters", "formats"), ("readers", "formats"), ("native", "readers")} <= seen
    assert allowed("formats") == LEAF and "train" not in allowed("exporters")
    assert not {"nn", "quantize", "train", "exporters"} & allowed("readers") and "readers" not in allowed("exporters")


# the training performance levers (train/levers.py installs them) reach into the core through hooks the
# core offers (linear.WEIGHT_HOOK, fake_quant.set_step_rule, per-instance forwards); the core never imports them
LEVERS = ("qatfactory.nn.lowbit_batch", "qatfactory.nn.kquant_refresh", "qatfactory.nn.lean_act",
          "qatfactory.train.ds_step", "qatfactory.train.levers")
LEVER_USERS = set(LEVERS) | {"qatfactory.train.loop", "qatfactory.train.runtime"}


def test_the_core_does_not_import_the_training_levers():
    seen = [(f, line, mod, t) for f, line, mod, t in imports()
            if any(t == lv or t.startswith(lv + ".") for lv in LEVERS)]
    bad = [f"{f.relative_to(ROOT)}:{line}: {mod} -> {t}" for f, line, mod, t in seen if mod not in LEVER_USERS]
    assert not bad, "a core module imports a training lever:\n" + "\n".join(bad)
    assert any(mod == "qatfactory.train.levers" for _, _, mod, _ in seen)      # the walk sees the levers' own


# ----------------------------------------------------------------------------- no circle, inside a package too
def circles(edges):
    """The strongly connected components of more than one module (or a module importing itself)."""
    graph = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
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
            if len(comp) > 1 or v in graph[v]:
                out.append(sorted(comp))

    import sys
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 10_000))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(old)
    return out


def module_edges():
    """Module -> module edges of every import (function-local ones too), each target resolved to the
    deepest module of this tree it names (``from .methods import Method`` -> qatfactory.train.methods)."""
    known = {_module(f) for f in _files()}
    for f, line, mod, t in imports():
        parts = t.split(".")
        while parts and ".".join(parts) not in known:
            parts.pop()
        if parts and ".".join(parts) != mod:
            yield mod, ".".join(parts)


def test_no_import_circle_anywhere():
    found = circles(module_edges())
    assert not found, "import circles (a lazy import counts too):\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_circle_finder_finds_circles():
    # a finder that never finds one proves nothing: a 3-circle, a self-import, and a chain that is not one
    assert circles([("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]) == [["a", "b", "c"]]
    assert circles([("x", "x")]) == [["x"]] and circles([("p", "q"), ("q", "r")]) == []
    edges = set(module_edges())
    assert ("qatfactory.train.loop", "qatfactory.train.methods") in edges     # the walk resolves packages


# ----------------------------------------------------------------------------- benchmarks use the demo as users do
FACE_ONLY = ("qatfactory.faces.demo", "qatfactory.faces.demo_report")


def benchmark_demo_imports():
    """(file, line, module) for every import of the demo face in benchmarks/ (inside functions too):
    a benchmark runs the demo through its command line or uses the library pieces it is built from."""
    for f in sorted((ROOT / "benchmarks").rglob("*.py")):
        for n in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            names = []
            if isinstance(n, ast.Import):
                names = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
                names = [n.module] + [f"{n.module}.{a.name}" for a in n.names]
            for m in names:
                if any(m == x or m.startswith(x + ".") for x in FACE_ONLY):
                    yield f.relative_to(ROOT), n.lineno, m


def test_no_benchmark_imports_the_demo():
    bad = [f"{f}:{line}: imports {m}" for f, line, m in benchmark_demo_imports()]
    assert not bad, ("a benchmark imports the demo face (run `qatfactory demo ...` as a subprocess, or use "
                     "qatfactory.train.heldout / qatfactory.train.demo_recipe):\n" + "\n".join(bad))
    assert any(True for _ in (ROOT / "benchmarks").rglob("*.py"))     # the walk has files to look at
