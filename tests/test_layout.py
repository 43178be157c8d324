"""The house rules of docs/contributing.md that a machine can check: the notebook's
import does not load MLX, and no module reaches into another module's privates."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mlx_nbdist"
#: the adapters over third-party privates: modules whose names start with ``_``
ADAPTERS = {p.stem for p in PACKAGE.rglob("_*.py") if not p.name.startswith("__")}


def test_importing_the_package_does_not_load_mlx() -> None:
    code = (
        "import sys, mlx_nbdist, mlx_nbdist.magics, mlx_nbdist.session\n"
        "print(sorted(m for m in sys.modules if m == 'mlx.core' or m.startswith('mlx.nn')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


def _privates_reached(path: Path) -> list[str]:
    """``mod._name`` on a module of this package imported under ``mod``, and
    ``from .mod import _name``."""
    tree = ast.parse(path.read_text())
    ours: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level == 0 and not mod.startswith("mlx_nbdist"):
                continue
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and alias.name not in ADAPTERS:
                    found.append(f"{path.name}:{node.lineno} from {mod} import {alias.name}")
                ours.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("mlx_nbdist"):
                    ours.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in ours
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append(f"{path.name}:{node.lineno} {node.value.id}.{node.attr}")
    return found


def test_no_module_reaches_another_modules_privates() -> None:
    found = [hit for p in sorted(PACKAGE.rglob("*.py")) for hit in _privates_reached(p)]
    assert found == []


def test_the_check_finds_a_private_reach(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("from . import magics\nfrom .engine.state import _STATE\nmagics._DASHBOARD\n")
    assert len(_privates_reached(bad)) == 2
