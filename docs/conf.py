"""Sphinx configuration of the mlx_nbdist site (MyST Markdown pages, MyST-NB notebooks).

Build: ``make docs`` (``sphinx-build -W --keep-going -b html docs docs/_build/html``).
The tutorials are ``notebooks/*.ipynb``, copied into ``docs/tutorials`` (git-ignored)
when the build starts, so that links between pages resolve. They are rendered with
the outputs stored in them (the figures) unless ``MLX_NBDIST_DOCS_EXECUTE`` is
``cache`` (execute, reusing results of unchanged notebooks) or ``force`` (execute
all): executing starts real 2-rank sessions, about two to three minutes in all.
"""

from __future__ import annotations

import filecmp
import os
import shutil
import sys
from importlib.util import find_spec
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mlx_nbdist  # noqa: E402


def _copy_tutorials() -> None:
    """notebooks/*.ipynb -> docs/tutorials/ (only what changed, so rebuilds stay incremental)."""
    here = Path(__file__).resolve().parent / "tutorials"
    wanted = {p.name: p for p in (ROOT / "notebooks").glob("[0-9][0-9]-*.ipynb")}
    for stale in here.glob("*.ipynb"):
        if stale.name not in wanted:
            stale.unlink()
    for name, src in wanted.items():
        dst = here / name
        if dst.is_symlink() or not dst.exists() or not filecmp.cmp(src, dst, shallow=False):
            dst.unlink(missing_ok=True)
            shutil.copy2(src, dst)


_copy_tutorials()

project = "mlx_nbdist"
author = "mlx_nbdist developers"
copyright = "mlx_nbdist developers"  # noqa: A001 - Sphinx's name
release = version = mlx_nbdist.__version__

extensions = [
    "myst_nb",  # Markdown pages (MyST) and notebooks
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # Google-style docstrings
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "**/.ipynb_checkpoints", "README*"]
root_doc = "index"

# -- MyST ---------------------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3  # links such as failure-modes.md#security

# -- notebooks ----------------------------------------------------------------------
nb_execution_mode = os.environ.get("MLX_NBDIST_DOCS_EXECUTE", "off")
nb_execution_timeout = 300
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_merge_streams = True
nb_kernel_rgx_aliases = {".*": "python3"}

# -- API reference --------------------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# -- HTML -----------------------------------------------------------------------------
html_title = f"mlx_nbdist {version}"
html_theme = "furo" if find_spec("furo") else "alabaster"
html_static_path: list[str] = []
html_show_sourcelink = False
