"""The code references in docs/architecture.md exist: every `file:Symbol` names a file that exists and a class,
function, method or module-level name defined in it.

Plugin paths (``vllm_dsv4_mtp/...``, ``tests/...``, ``quant/...``) are relative to the repository; ``vllm/...``
paths to the installed vLLM package. The files are parsed with ``ast``, never imported, so this runs in well
under a second and does not need the platform a file is written for (``gfx950/draft.py`` imports ROCm code).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
REFERENCE = re.compile(r"`((?:vllm_dsv4_mtp|vllm|tests|quant)/[\w./-]+\.py):([A-Za-z_][\w.]*)`")


def references(text: str) -> list[tuple[str, str]]:
    """The ``(path, symbol)`` pairs of every `path.py:Symbol` in ``text``, in order, without repeats."""
    return list(dict.fromkeys(REFERENCE.findall(text)))


@functools.lru_cache(maxsize=1)
def _vllm_root() -> Path:
    """The directory that holds the installed ``vllm`` package (found without importing it)."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations, "vLLM is not installed: run `make setup`"
    return Path(list(spec.submodule_search_locations)[0]).parent


def resolve(path: str) -> Path:
    return (_vllm_root() if path.startswith("vllm/") else ROOT) / path


def _definitions(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Names a block of statements defines: classes, functions and assigned names, also inside ``if`` / ``try``."""
    found: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            found[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found[target.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found[node.target.id] = node
        elif isinstance(node, (ast.If, ast.Try)):
            blocks = [node.body, node.orelse] + (
                [node.finalbody] + [h.body for h in node.handlers] if isinstance(node, ast.Try) else []
            )
            for block in blocks:
                found.update(_definitions(block))
    return found


@functools.cache
def _parse(file: Path) -> ast.Module:
    return ast.parse(file.read_text(), str(file))


def problem(path: str, symbol: str) -> str | None:
    """Why `path:symbol` does not hold, or None when the file defines the symbol (``A.b``: ``b`` in class ``A``)."""
    file = resolve(path)
    if not file.is_file():
        return f"{path}: no such file ({file})"
    scope: ast.AST = _parse(file)
    walked = []
    for part in symbol.split("."):
        body = getattr(scope, "body", None)
        if not isinstance(scope, (ast.Module, ast.ClassDef)) or body is None:
            return f"{path}: {'.'.join(walked)} is not a class, so it defines no {part!r}"
        found = _definitions(body).get(part)
        if found is None:
            where = f"class {'.'.join(walked)}" if walked else "the module"
            return f"{path}: {where} defines no {part!r}"
        scope = found
        walked.append(part)
    return None


def test_architecture_page_names_enough_references():
    refs = references(ARCHITECTURE.read_text())
    assert len(refs) >= 60, f"only {len(refs)} `file:Symbol` references found: has the page's format changed?"
    assert any(p.startswith("vllm/") for p, _ in refs) and any(p.startswith("vllm_dsv4_mtp/") for p, _ in refs)


def test_every_reference_in_the_architecture_page_exists():
    bad = [msg for path, symbol in references(ARCHITECTURE.read_text()) if (msg := problem(path, symbol))]
    assert not bad, "docs/architecture.md names code that does not exist:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "ref",
    [
        "`vllm_dsv4_mtp/registration.py:register_everything`",  # a function the module does not define
        "`vllm_dsv4_mtp/attention/backend.py:DeepseekV4SparseAttention.read_row`",  # a method the class does not define
        "`vllm_dsv4_mtp/registration.py:DRAFT_ARCH.lower`",  # a name that is not a class
        "`vllm/v1/spec_decode/eagle.py:EagleProposer.propose`",  # inherited: defined in llm_base_proposer.py
        "`vllm/v1/spec_decode/mtp_proposer.py:MtpProposer`",  # no such vLLM file
        "`vllm_dsv4_mtp/model/mtp_v2.py:DeepSeekV4MTPModel`",  # no such plugin file
    ],
)
def test_a_made_up_reference_is_caught(ref):
    ((path, symbol),) = references(ref)
    assert problem(path, symbol) is not None


def test_real_references_of_each_kind_pass():
    for ref in [
        "`vllm_dsv4_mtp/registration.py:register_models`",  # function
        "`vllm_dsv4_mtp/attention/backend.py:DeepseekV4SparseAttention.write`",  # method
        "`vllm_dsv4_mtp/registration.py:DRAFT_ARCH`",  # module-level name
        "`vllm/v1/spec_decode/llm_base_proposer.py:SpecDecodeBaseProposer.propose`",
    ]:  # vLLM's
        ((path, symbol),) = references(ref)
        assert problem(path, symbol) is None, ref


def test_every_plugin_reference_in_the_other_pages_exists():
    """The README and every other page under docs/ name plugin code the same way; their ``vllm/...`` references
    may be to a release other than the installed one (docs/mi355.md reads 0.33 / 0.34), so only the plugin's own
    are checked here."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    refs = [
        (page.name, path, symbol)
        for page in pages
        if page != ARCHITECTURE
        for path, symbol in references(page.read_text())
        if not path.startswith("vllm/")
    ]
    assert len(refs) >= 3, refs  # docs/mi355.md alone names several
    bad = [f"{page}: {msg}" for page, path, symbol in refs if (msg := problem(path, symbol))]
    assert not bad, "pages name plugin code that does not exist:\n" + "\n".join(bad)
