"""The documentation site builds without a warning, and its pages say what they should.

The site (Sphinx with MyST Markdown and MyST-NB, ``docs/conf.py``) is built into a
temporary folder with ``-W``: any warning, a broken link between pages, a missing
page in the navigation, a docstring that does not parse, fails the test. The
tutorials are rendered from the stored notebooks (not executed here: the notebook
tests execute them).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

#: Pages the site must have, and text each must contain.
PAGES = {
    "index.html": ["Interactive distributed", "Where to start"],
    "install.html": ["Linux (CPU)", "macOS (Apple Silicon, Metal)", "CUDA"],
    "quickstart.html": ["%mlxdist start -n 2", "Tensor parallelism in four cells"],
    "magics.html": ["--check-collectives", "%mlxdist gradsync", "MLXDist.timeout"],
    "api.html": ["CellResult", "Session(n=2"],
    "reference.html": ["mlx_nbdist.Session", "CollectiveTimeout", "grad_sync",
                       "mlx_nbdist.script.load_checkpoint", "mlx_nbdist.script.init"],
    "checkpoints.html": ["Load, on any number of ranks", "save_checkpoint", "load_checkpoint"],
    "failure-modes.html": ["Drained", "Security", "unauthenticated TCP"],
    "performance.html": ["Performance"],
    "multi-host.html": ["hostfile", "Security"],
    "tutorials/index.html": ["Tutorials"],
    "tutorials/01-getting-started.html": ["Getting started", "all_gather"],
    "tutorials/02-tensor-parallelism.html": ["Megatron", "shard_inplace"],
    "tutorials/03-gradient-sync.html": ["average_gradients", "sum_gradients"],
    "tutorials/04-training-tp.html": ["value_and_grad", "single-process"],
    "tutorials/05-memory.html": ["fully_shard", "sum_scatter"],
    "tutorials/06-failures.html": ["CollectiveTimeout", "restart"],
    "tutorials/07-transformers.html": ["pipeline", "heads"],
    "tutorials/08-keep-your-work.html": ["Keep your work", "consolidate"],
}
#: Tutorials whose stored figures must appear as images on their page.
FIGURES = {"02-tensor-parallelism": 5, "03-gradient-sync": 3, "04-training-tp": 1, "05-memory": 3}


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.images: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "a" and a.get("href"):
            self.links.append(a["href"])  # type: ignore[arg-type]
        if tag == "img" and a.get("src"):
            self.images.append(a["src"])  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for module in ("sphinx", "myst_nb"):
        if not _importable(module):
            pytest.fail(f"{module} is not installed: pip install -e '.[docs]'")
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, MLX_NBDIST_DOCS_EXECUTE="off")
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", "-q",
         str(DOCS), str(out)],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
    )
    assert proc.returncode == 0, f"docs build failed:\n{proc.stdout}\n{proc.stderr}"
    assert "WARNING" not in proc.stderr, proc.stderr
    return out


def _importable(module: str) -> bool:
    from importlib.util import find_spec

    return find_spec(module) is not None


def _parse(page: Path) -> _Links:
    parser = _Links()
    parser.feed(page.read_text(encoding="utf-8"))
    return parser


@pytest.mark.timeout(600)
@pytest.mark.parametrize("page", sorted(PAGES))
def test_page_exists_and_says_what_it_should(site: Path, page: str) -> None:
    path = site / page
    assert path.exists(), f"no {page} in the site"
    html = path.read_text(encoding="utf-8")
    text = re.sub(r"<[^>]+>", "", html)
    for expected in PAGES[page]:
        assert expected in html or expected in text, f"{page}: no {expected!r}"


def test_every_docs_page_and_tutorial_is_in_the_site(site: Path) -> None:
    for md in DOCS.glob("*.md"):
        assert (site / f"{md.stem}.html").exists(), f"{md.name} is not built"
    for nb in (ROOT / "notebooks").glob("[0-9][0-9]-*.ipynb"):
        assert (site / "tutorials" / f"{nb.stem}.html").exists(), f"{nb.name} is not rendered"


def test_internal_links_and_images_resolve(site: Path) -> None:
    broken = []
    for page in site.rglob("*.html"):
        if "_modules" in page.parts:
            continue
        parsed = _parse(page)
        for ref in parsed.links + parsed.images:
            url = urlparse(ref)
            if url.scheme or ref.startswith(("#", "mailto:", "data:")):
                continue
            target = (page.parent / unquote(url.path)).resolve()
            if not target.exists():
                broken.append(f"{page.relative_to(site)} -> {ref}")
    assert not broken, "broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize("stem", sorted(FIGURES))
def test_tutorial_figures_are_on_their_page(site: Path, stem: str) -> None:
    images = [
        src for src in _parse(site / "tutorials" / f"{stem}.html").images
        if src.endswith(".png") or src.startswith("data:image/png")
    ]
    assert len(images) >= FIGURES[stem], f"{stem}: {len(images)} figures, want {FIGURES[stem]}"


def test_api_reference_comes_from_the_docstrings(site: Path) -> None:
    import mlx_nbdist

    html = (site / "reference.html").read_text(encoding="utf-8")
    first_line = mlx_nbdist.Session.run.__doc__.strip().splitlines()[0]
    words = re.sub(r"``?", "", first_line).split()[:6]
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", html))
    assert " ".join(words) in text, f"Session.run's docstring ({' '.join(words)!r}) not rendered"
