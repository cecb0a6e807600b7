"""The package's shape is part of its design: folders by concept, imports that point one way, no circle, a private line.

The implementation lives in ``trainfold/_src/``, one folder per concept. Each
folder may import only the folders below it in ``LAYERS`` (and itself);
``errors`` and ``_version`` are leaves every module may use. Imports inside
functions and under ``TYPE_CHECKING`` count: a layer that needs a higher one
only for a type annotation still depends on it. What a user may import is
``trainfold``, ``trainfold.testing``, the command line and the pytest plugin;
everything else is private by its name, and the docs never send a reader there.
"""

import ast
import importlib
from pathlib import Path


PACKAGE = Path(__file__).resolve().parents[1] / "src" / "trainfold"
#: bottom to top; the package's top-level modules (the API, the command line, testing) sit above all of them
LAYERS = ("base", "backend", "distributed", "core", "checkpoint", "compose", "conformance")
LEAVES = ("trainfold.errors", "trainfold._version")
#: the modules a user may import (and the package's own entry points)
PUBLIC = {
    "trainfold",
    "trainfold.testing",
    "trainfold.cli",
    "trainfold.__main__",
    "trainfold.pytest_plugin",
    "trainfold.errors",
}


def _module(path: Path) -> str:
    parts = ["trainfold", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The trainfold modules ``path`` imports, anywhere in it (resolved to the module, not the name)."""
    module = _module(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("trainfold")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base.startswith("trainfold"):
                found |= {f"{base}.{a.name}" if _exists(f"{base}.{a.name}") else base for a in node.names}
    return found - {module}


def _exists(module: str) -> bool:
    rel = PACKAGE.parent.joinpath(*module.split("."))
    return rel.with_suffix(".py").exists() or (rel / "__init__.py").exists()


GRAPH = {_module(p): _imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.index(parts[2]) if len(parts) > 3 and parts[1] == "_src" and parts[2] in LAYERS else len(LAYERS)


def test_every_folder_imports_only_the_folders_below_it():
    upward = [
        f"{m} -> {t}"
        for m, targets in GRAPH.items()
        for t in targets
        if t not in LEAVES and t != "trainfold" and _layer(t) > _layer(m)
    ]
    assert upward == []


def test_nothing_inside_the_package_imports_the_package_itself():
    """``trainfold/__init__.py`` imports every public module: importing it from inside would close a circle."""
    assert [m for m, targets in GRAPH.items() if "trainfold" in targets and m != "trainfold"] == []


def test_no_import_circle():
    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for t in GRAPH.get(todo.pop(), ()):
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return seen

    assert [m for m in GRAPH if m in reach(m)] == []


def test_every_module_outside_the_public_ones_is_private_by_name():
    public_looking = [
        m for m in GRAPH if m not in PUBLIC and not any(part.startswith("_") for part in m.split(".")[1:])
    ]
    assert public_looking == []


def test_the_layers_are_the_folders_of_the_implementation():
    assert sorted(p.name for p in (PACKAGE / "_src").iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(
        LAYERS
    )


def test_the_docs_never_send_a_reader_into_the_implementation():
    docs = [PACKAGE.parents[1] / "README.md", *sorted((PACKAGE.parents[1] / "docs").rglob("*.md"))]
    assert [str(p.name) for p in docs if "trainfold._src" in p.read_text() or "trainfold/_src" in p.read_text()] == []


def test_public_names_are_listed_once():
    """``_WHERE`` is the one hand-written list of public names: ``__all__`` is made from it, and the imports under
    ``TYPE_CHECKING`` (what a type checker reads) name each of them once, from the module it names."""
    import trainfold

    tree = ast.parse(Path(trainfold.__file__).read_text())
    guarded = next(
        node for node in tree.body if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"
    )
    imported = [(alias.asname, node.module) for node in guarded.body for alias in node.names]

    assert sorted(imported) == sorted(trainfold._WHERE.items())
    assert all(alias.name == alias.asname for node in guarded.body for alias in node.names)
    assert trainfold.__all__ == ["__version__", *sorted(trainfold._WHERE)]
    assert all(
        getattr(trainfold, name) is getattr(importlib.import_module(module), name)
        for name, module in trainfold._WHERE.items()
    )
