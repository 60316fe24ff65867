"""The library's dependency rules, read from the source (``ast``; nothing is imported):

- layers: a module imports only modules of its own group or of a lower layer (``LAYERS``, low to high);
  groups that share a layer are independent of each other;
- no import cycle between modules, function-level imports included (a lazy import that dodges a cycle
  is still the cycle);
- the library never imports ``bench`` (the benchmarks) or ``tests``, and no module defines a module-level
  ``__getattr__`` (lazy re-exports hide the dependency direction);
- pyproject's explicit ``packages`` list is every package folder (a new subpackage cannot be forgotten).

Optional heavy packages (torch, transformers, tokamax, ...) are outside the project and not checked.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# package -> its folder (pyproject's package-dir: data/ and parallelism/ install as moevlm_jax.*)
FOLDERS = {"moevlm_jax": ROOT / "moevlm_jax", "moevlm_jax.data": ROOT / "data",
           "moevlm_jax.parallelism": ROOT / "parallelism"}

# low -> high; each layer maps group names to the module prefixes in it (the longest prefix decides)
LAYERS: list[dict[str, tuple[str, ...]]] = [
    {"root": ("moevlm_jax",), "schema": ("moevlm_jax.schema",)},
    {"parallelism": ("moevlm_jax.parallelism",), "data": ("moevlm_jax.data",)},
    {"model": ("moevlm_jax.model",)},
    {"hf": ("moevlm_jax.hf",),
     # the train step and the training sections, below the run config that holds them
     "training step": ("moevlm_jax.training.config", "moevlm_jax.training.trainer", "moevlm_jax.training.optimizer",
                       "moevlm_jax.training.objective", "moevlm_jax.training.checkpoint",
                       "moevlm_jax.training.metrics", "moevlm_jax.training.distributed", "moevlm_jax.training.faults")},
    {"config": ("moevlm_jax.config",)},
    {"perf": ("moevlm_jax.perf",), "inference": ("moevlm_jax.inference",)},
    {"training run": ("moevlm_jax.training",)},  # a RunConfig end to end: capture, the loop and its parts
    {"tools": ("moevlm_jax.tools",)},
    {"plan": ("moevlm_jax.plan",)},
    {"entry points": ("moevlm_jax.train", "moevlm_jax.launch", "moevlm_jax.export", "moevlm_jax.generate")},
]
FORBIDDEN = ("bench", "tests")  # never imported by the library


def library_modules() -> dict[str, Path]:
    """Every library module name -> its file."""
    out = {}
    for package, folder in FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((package, *parts))
            if name.split(".")[:2] in (["moevlm_jax", "data"], ["moevlm_jax", "parallelism"]) and folder == FOLDERS[
                    "moevlm_jax"]:
                continue  # (no such folders inside moevlm_jax/)
            out[name] = path
    return out


MODULES = library_modules()


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    return skip


def imports(name: str, path: Path) -> Iterator[tuple[str, int]]:
    """(imported module, line) for every import in the file, at any depth, resolved to a module of the
    project where it names one (``from a import b`` is ``a.b`` when that is a module, else ``a``)."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_nodes(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield (full if full in MODULES else base), node.lineno


def project_edges() -> list[tuple[str, str, int]]:
    """(importer, imported, line) between library modules; the imported name trimmed to a module."""
    edges = []
    for name, path in MODULES.items():
        for target, line in imports(name, path):
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.append((name, target, line))
    return edges


def group_of(module: str) -> tuple[int, str]:
    """(layer index, group name) of a library module: the longest matching prefix."""
    best = (-1, -1, "")
    for index, layer in enumerate(LAYERS):
        for group, prefixes in layer.items():
            for prefix in prefixes:
                if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best[0]:
                    best = (len(prefix), index, group)
    if best[0] < 0:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS")
    if best[2] == "root" and module != "moevlm_jax":
        raise AssertionError(f"{module} is in no layer (only the package root matches 'moevlm_jax'): add it to LAYERS")
    return best[1], best[2]


def test_every_module_has_a_layer() -> None:
    for module in MODULES:
        group_of(module)


def test_layers_point_down() -> None:
    bad = []
    for src, dst, line in project_edges():
        (ls, gs), (ld, gd) = group_of(src), group_of(dst)
        if ld > ls or (ld == ls and gs != gd):
            bad.append(f"{MODULES[src].relative_to(ROOT)}:{line}: {src} ({gs}) imports {dst} ({gd})")
    assert not bad, "imports against the layering (low -> high: " + " | ".join(
        ", ".join(layer) for layer in LAYERS) + "):\n" + "\n".join(bad)


def test_no_import_cycles() -> None:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for src, dst, _ in project_edges():
        graph[src].add(dst)
    # Tarjan's strongly connected components, iteratively
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    cycles: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    assert not cycles, "import cycles (function-level imports included):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_library_never_imports_bench_or_tests() -> None:
    bad = [f"{MODULES[name].relative_to(ROOT)}:{line}: imports {target}"
           for name, path in MODULES.items() for target, line in imports(name, path)
           if target.split(".")[0] in FORBIDDEN]
    assert not bad, "\n".join(bad)


def test_no_module_level_getattr() -> None:
    bad = [str(path.relative_to(ROOT)) for path in MODULES.values()
           if any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in ast.parse(path.read_text()).body)]
    assert not bad, f"module-level __getattr__ (lazy re-exports) in {bad}"


def test_pyproject_lists_every_package() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    mapped = {package: ROOT / folder for package, folder in config["package-dir"].items()}
    found = set()
    for package, folder in {"moevlm_jax": ROOT / "moevlm_jax", **mapped}.items():
        for init in folder.rglob("__init__.py"):
            found.add(".".join((package, *init.parent.relative_to(folder).parts)))
    assert listed == found, f"pyproject packages: missing {sorted(found - listed)}, stale {sorted(listed - found)}"
    assert "bench" not in listed and not any(p.startswith("tests") for p in listed)


@pytest.mark.parametrize("module", ["moevlm_jax.config", "moevlm_jax.data", "moevlm_jax.plan"])
def test_packages_export_without_lazy_loading(module: str) -> None:
    """The package ``__init__`` files import what they export (no ``importlib`` indirection)."""
    path = MODULES[module]
    assert "importlib" not in path.read_text(), f"{path}: lazy exports"
