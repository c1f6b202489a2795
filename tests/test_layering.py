"""The package's import layering, read from the source (ast, every import: module level and
inside functions): no module imports from a layer above its own, no import cycle, and the few
edges the design forbids inside a layer's neighbours (drafters never build an engine, serve reads
the engine through its public API, the model never reaches the engine's cache module). The
checker is also run on made-up sources, so the test is seen to fail when the rules are broken."""

from __future__ import annotations

import ast
from pathlib import Path

import ddtree_rtc

PACKAGE = "ddtree_rtc"
ROOT = Path(ddtree_rtc.__file__).parent

# Data flows one way: a module may import from its own layer or a lower one (a higher number is a
# higher layer). The top-level name of a module picks its layer.
LAYERS = {
    "__init__": 0, "reference": 0, "rtc": 0,
    "kernels": 1, "parallel": 1,
    "backend": 2,
    "model": 3,
    "engine": 4,
    "speculative": 5,  # drafters: handed to the engine, which never imports them
    "pipeline": 6,
    "serve": 7, "bench": 7, "projection": 7, "testing": 7,
    "cli": 8,
}

# Edges that the layers allow but the design does not (importer prefix, imported prefix, why).
FORBIDDEN = (
    ("ddtree_rtc.speculative", "ddtree_rtc.engine.engine", "a drafter never builds or drives an engine"),
    ("ddtree_rtc.serve", "ddtree_rtc.engine.scheduler", "serve uses the engine's public API"),
    ("ddtree_rtc.serve", "ddtree_rtc.engine.runner", "serve uses the engine's public API"),
    ("ddtree_rtc.serve", "ddtree_rtc.engine.kv_cache", "serve uses the engine's public API"),
    ("ddtree_rtc.serve", "ddtree_rtc.engine.decode", "serve uses the engine's public API"),
    ("ddtree_rtc.serve.text", "ddtree_rtc.pipeline", "the tokenizer is the model's (model.tokenizer)"),
)


def module_name(path: Path, root: Path, package: str) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([package, *parts])


def imports_of(name: str, source: str, is_package: bool, modules: set[str]) -> set[str]:
    """Every module ``name`` imports, at any depth of its code: ``from a.b import c`` counts as
    a.b.c when that is a module, else a.b. Relative imports are resolved against ``name``."""
    out = set()
    here = name.split(".") if is_package else name.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.add(sub if sub in modules else target)
    return {m for m in out if m == PACKAGE or m.startswith(PACKAGE + ".")}


def layer_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else "__init__"
    if top not in LAYERS:
        raise AssertionError(f"{module}: its top-level name {top!r} has no layer in LAYERS")
    return LAYERS[top]


def check(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """Problems in ``sources`` (module name -> (source, is a package)): imports from a layer
    above, forbidden edges, and import cycles (each cycle named by its modules)."""
    modules = set(sources)
    graph = {m: imports_of(m, src, pkg, modules) for m, (src, pkg) in sources.items()}
    problems = []
    for m, deps in sorted(graph.items()):
        for d in sorted(deps):
            if layer_of(d) > layer_of(m):
                problems.append(f"{m} imports {d}, a higher layer")
            for importer, imported, why in FORBIDDEN:
                if (m == importer or m.startswith(importer + ".")) and (d == imported or d.startswith(imported + ".")):
                    problems.append(f"{m} imports {d}: {why}")
    problems += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    return problems


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (or a module importing
    itself), by Tarjan's algorithm; each as a sorted list."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def package_sources() -> dict[str, tuple[str, bool]]:
    return {module_name(p, ROOT, PACKAGE): (p.read_text(), p.name == "__init__.py")
            for p in sorted(ROOT.rglob("*.py"))}


def test_the_package_keeps_its_layers_and_has_no_cycle():
    sources = package_sources()
    assert "ddtree_rtc.engine.decode.round" in sources and "ddtree_rtc.cli" in sources
    assert check(sources) == []


def test_every_top_level_module_has_a_layer():
    tops = {m.split(".")[1] for m in package_sources() if "." in m}
    assert tops <= set(LAYERS), sorted(tops - set(LAYERS))


def test_the_checker_finds_an_upward_import_a_lazy_cycle_and_a_forbidden_edge():
    sources = {
        "ddtree_rtc": ("", True),
        "ddtree_rtc.engine": ("", True),
        "ddtree_rtc.engine.engine": ("from .runner import ModelRunner\n", False),
        "ddtree_rtc.engine.runner": ("def f():\n    from . import engine\n", False),  # lazy, and a cycle
        "ddtree_rtc.model": ("", True),
        "ddtree_rtc.model.dflash": ("def g():\n    from ..engine.kv_cache import PagedKVCache\n", False),
        "ddtree_rtc.engine.kv_cache": ("", False),
        "ddtree_rtc.speculative": ("", True),
        "ddtree_rtc.speculative.drafters": ("import ddtree_rtc.engine.engine\n", False),
    }
    problems = check(sources)
    assert "ddtree_rtc.model.dflash imports ddtree_rtc.engine.kv_cache, a higher layer" in problems
    assert "import cycle: ddtree_rtc.engine.engine -> ddtree_rtc.engine.runner" in problems
    assert ("ddtree_rtc.speculative.drafters imports ddtree_rtc.engine.engine: "
            "a drafter never builds or drives an engine") in problems
    assert len(problems) == 3, problems
