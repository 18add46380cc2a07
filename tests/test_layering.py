"""The layout is the diagram: no two modules import each other (directly or round a longer loop),
the runtime never imports the compiler, and docs/ARCHITECTURE.md's tree names every folder."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"qcompile": ROOT / "qcompile", "qruntime": ROOT / "runtime" / "qruntime"}


def _modules() -> dict[str, Path]:
    mods = {}
    for root in PACKAGES.values():
        for path in root.rglob("*.py"):
            parts = path.relative_to(root.parent).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of these packages it imports, anywhere in its body (lazy imports too)."""

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges = {}
    for name, path in mods.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets |= {known(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    package = package[: len(package) - node.level + 1]
                    base = ".".join([*package, base] if base else package)
                # `from pkg import sub` imports the submodule; `from mod import name` the module
                targets |= {
                    known(f"{base}.{a.name}") if f"{base}.{a.name}" in mods else known(base) for a in node.names
                }
        edges[name] = targets - {None, name}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
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
                    found.append(sorted(component))
    return found


def test_no_two_modules_import_each_other():
    loops = cycles(import_graph(_modules()))
    assert loops == [], f"modules importing each other (give the shared piece its own module): {loops}"


def test_cycle_finder_finds_a_planted_loop():
    """The check above is only as good as the finder: a loop of three and a mutual pair are found,
    a chain is not."""
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d"}, "f": {"a"}, "g": set()}
    assert sorted(cycles(edges)) == [["a", "b", "c"], ["d", "e"]]


def test_relative_and_lazy_imports_are_seen(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import one\n")
    (pkg / "sub" / "one.py").write_text("def f():\n    from ..two import g\n")
    (pkg / "two.py").write_text("from pkg.sub import one\n")
    mods = {"pkg": pkg / "__init__.py", "pkg.sub": pkg / "sub" / "__init__.py"}
    mods |= {"pkg.sub.one": pkg / "sub" / "one.py", "pkg.two": pkg / "two.py"}
    edges = import_graph(mods)
    assert edges["pkg.sub.one"] == {"pkg.two"} and edges["pkg.two"] == {"pkg.sub.one"}
    assert cycles(edges) == [["pkg.sub.one", "pkg.two"]]


def test_the_runtime_never_imports_the_compiler():
    edges = import_graph(_modules())
    wrong = {
        m: sorted(t for t in ts if t.startswith("qcompile")) for m, ts in edges.items() if m.startswith("qruntime")
    }
    assert {m: ts for m, ts in wrong.items() if ts} == {}


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_architecture_tree_names_every_folder(package):
    """docs/ARCHITECTURE.md starts with the folder tree: each folder of the package is on it."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    tree = text.split("```")[1]
    root = PACKAGES[package]
    folders = sorted(p.relative_to(root).as_posix() for p in root.iterdir() if (p / "__init__.py").is_file())
    missing = [f for f in folders if not re.search(rf"(^|[\s/]){re.escape(f)}/", tree, re.MULTILINE)]
    assert folders and missing == [], f"{package} folders missing from the tree in docs/ARCHITECTURE.md: {missing}"
