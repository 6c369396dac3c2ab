"""docs/design.md's layers table is true: every import in spilld goes up the table, and none takes a private name."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "spilld"


def table() -> list[str]:
    """The rows of the layers table, top first: ``errors``, ``codecs``, ``daemon.listen``, ..."""
    doc = (ROOT / "docs" / "design.md").read_text()
    section = doc[doc.index("## Layers") : doc.index("## The data path")]
    names = re.findall(r"^\| `([^`]+)` \|", section, re.M)
    return [n.rstrip("/").removesuffix(".py").replace("/", ".") for n in names]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports(path: Path, mod: str | None = None) -> list[tuple[str, list[str], int]]:
    """(imported spilld module, names taken from it, line) for every import outside ``if TYPE_CHECKING:``."""
    mod = mod or module_name(path)
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out: list[tuple[str, list[str], int]] = []

    def visit(node: ast.AST) -> None:
        if _type_checking_only(node):
            return
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "spilld":
                names = [a.name for a in node.names]
                if node.module is None:  # "from . import x": x is a module (``__version__`` is the package's)
                    out.extend((f"{target}.{n}", [], node.lineno) for n in names if n != "__version__")
                else:
                    out.append((target, names, node.lineno))
        elif isinstance(node, ast.Import):
            out.extend((a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == "spilld")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return out


def row(module: str, rows: list[str]) -> int | None:
    """The most specific row that holds ``spilld.<module>`` (a module's own row, else its package's)."""
    parts = module.split(".")[1:]
    while parts:
        name = ".".join(parts)
        if name in rows:
            return rows.index(name)
        parts.pop()
    return None


def test_every_module_has_a_row() -> None:
    rows = table()
    missing = [
        module_name(p)
        for p in sorted(PKG.rglob("*.py"))
        if p.name not in ("__init__.py", "__main__.py") and row(module_name(p), rows) is None
    ]
    assert missing == []


def _exists(module: str) -> bool:
    path = ROOT.joinpath(*module.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def violations(files: list[tuple[Path, str]], rows: list[str]) -> list[str]:
    wrong: list[str] = []
    for path, me in files:
        mine = row(me, rows)
        for target, names, line in imports(path, me):
            if target == "spilld" or target.startswith(me + "."):  # the package; a package's face: its own modules
                continue
            theirs = row(target, rows)
            where = f"{me}:{line} imports {target}"
            if theirs is None:
                if _exists(target):  # a module not written yet fails at its import, not here
                    wrong.append(f"{where}, which has no row")
            elif mine is not None and theirs > mine:
                wrong.append(f"{where}, a row below {me}")
            private = [n for n in names if n.startswith("_") and n != "__version__"]
            if private:
                wrong.append(f"{where}'s private {private}")
    return wrong


def test_every_import_goes_up_the_table_and_takes_no_private_name() -> None:
    files = [(p, module_name(p)) for p in sorted(PKG.rglob("*.py"))]
    assert violations(files, table()) == []


def test_the_checker_sees_a_wrong_import(tmp_path: Path) -> None:
    """The negative control: an import down the table, a private name, a type-only import that is fine."""
    probe = tmp_path / "queue.py"
    probe.write_text(
        "from typing import TYPE_CHECKING\n"
        "from .store import _common_prefix\n"
        "from . import cli\n"
        "if TYPE_CHECKING:\n"
        "    from .daemon import Daemon\n"
    )
    got = violations([(probe, "spilld.queue")], table())
    assert got == [
        "spilld.queue:2 imports spilld.store, a row below spilld.queue",
        "spilld.queue:2 imports spilld.store's private ['_common_prefix']",
        "spilld.queue:3 imports spilld.cli, a row below spilld.queue",
    ]
