"""The dashboard in a real browser: JupyterLab on loopback, driven by headless Chromium.

A notebook starts a 2-rank session, shows ``%mlxdist dashboard`` and runs a cell
that takes a while on the ranks (with a progress bar). Playwright (for Python,
``executable_path`` pointing at Debian's ``chromium``: no browser download) opens it
and checks that two rank rows render, that a rank's state turns ``busy`` while the
cell runs and that the progress bars show; it saves a screenshot
(``reports/browser/dashboard-busy.png``), then clicks the dashboard's Interrupt
button *during* the cell and checks that the cell ends interrupted (the button's
clicks reach the kernel through a subshell, see ``viz/dashboard.py``).

A second notebook runs a ``%%mlxdist`` cell that prints a line on each rank, sleeps,
then prints another: the first line must be rendered in that rank's own output area
(``.mlx-nbdist-rank``) while the cell is still running, and at the end each rank's
area holds both of its lines and none of the other rank's
(``reports/browser/live-running.png``, ``reports/browser/live-output.png``).

JupyterLab and Chromium are started once for the module and shared by both tests
(each test opens its own notebook, so each has its own kernel and session).

Skipped, with the reason, only where Chromium (or the ``browser`` extra:
playwright, jupyterlab) is absent; ``make test`` installs them on Debian. Every
process it starts (JupyterLab, Chromium and what they start) is ended by PID.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
SHOT_DIR = ROOT / "reports" / "browser"


def _chromium() -> str | None:
    for path in ("/usr/lib/chromium/chromium", shutil.which("chromium"),
                 shutil.which("chromium-browser")):  # fmt: skip
        if path and os.access(path, os.X_OK):
            return path
    return None


CHROMIUM = _chromium()
try:
    import playwright.sync_api  # noqa: F401

    HAVE_PLAYWRIGHT = True
except ImportError:
    HAVE_PLAYWRIGHT = False
try:
    import jupyterlab  # noqa: F401

    HAVE_LAB = True
except ImportError:
    HAVE_LAB = False

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (Debian: apt-get install chromium; `make test` does it as root)"),
    pytest.mark.skipif(not HAVE_PLAYWRIGHT, reason="playwright is not installed (pip install -e '.[browser]')"),
    pytest.mark.skipif(not HAVE_LAB, reason="jupyterlab is not installed (pip install -e '.[browser]')"),
    pytest.mark.timeout(240),
]

DASHBOARD_CELLS = [
    "%load_ext mlx_nbdist\n%mlxdist start -n 2",
    "%mlxdist dashboard --interval 0.3",
    "%%mlxdist --timeout 120\n"
    "import time\n"
    "from mlx_nbdist.engine.progress import progress\n"
    "for i in progress(range(400), desc='steps'):\n"
    "    time.sleep(0.1)",
    "%mlxdist stop",
]

#: seconds the live cell sleeps between its two lines
LIVE_PAUSE = 8
LIVE_CELLS = [
    "%load_ext mlx_nbdist\n%mlxdist start -n 2",
    "%%mlxdist\n"
    "import time\n"
    "print(f'first line from rank {rank}', flush=True)\n"
    f"time.sleep({LIVE_PAUSE})\n"
    "print(f'second line from rank {rank}', flush=True)",
    "%mlxdist stop",
]


def _notebook(path: Path, cells: list[str]) -> None:
    nb = {
        "cells": [
            {"cell_type": "code", "metadata": {}, "source": src, "outputs": [],
             "execution_count": None}
            for src in cells
        ],  # fmt: skip
        "metadata": {
            "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    for i, c in enumerate(nb["cells"]):
        c["id"] = f"cell-{i}"
    path.write_text(json.dumps(nb))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if proc.poll() is not None:
            tail = log.read_text()[-3000:] if log.exists() else ""
            raise RuntimeError(f"JupyterLab exited with {proc.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"JupyterLab did not answer {url} within {timeout:g} s")


def _end_tree(pid: int, grace: float = 10.0) -> list[int]:
    """Terminate a process and everything it started; returns PIDs that needed KILL."""
    try:
        root = psutil.Process(pid)
    except psutil.Error:
        return []
    kids = root.children(recursive=True)
    try:
        root.terminate()
    except psutil.Error:
        pass
    _, alive = psutil.wait_procs([root], timeout=grace)
    # JupyterLab shuts its kernels down on SIGTERM; the kernel stops the session
    _, alive_kids = psutil.wait_procs(kids, timeout=grace)
    killed = []
    for p in [*alive, *alive_kids]:
        try:
            p.kill()
            killed.append(p.pid)
        except psutil.Error:
            pass
    return killed


class Lab:
    """A JupyterLab server on loopback and a headless Chromium, shared by the tests."""

    def __init__(self, work: Path, base: str, token: str, browser: object) -> None:
        self.work, self.base, self.token, self.browser = work, base, token, browser

    def open(self, name: str, cells: list[str]) -> tuple[object, object]:
        """A new page on a new notebook ``name`` made of ``cells``, its kernel started;
        returns the page and a locator of that notebook's panel (the workspace may also
        restore an earlier test's notebook, in a hidden tab: locate within the panel)."""
        _notebook(self.work / name, cells)
        page = self.browser.new_page(viewport={"width": 1500, "height": 1100})
        page.set_default_timeout(60_000)
        page.goto(f"{self.base}/lab/tree/{name}?token={self.token}")
        # this notebook's tab is the current one, and its kernel is up
        page.wait_for_function(
            "(name) => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
            " return w && w.context && w.context.path === name && w.sessionContext"
            " && w.sessionContext.session && w.sessionContext.session.kernel; }",
            arg=name,
            timeout=90_000,
        )
        panel = page.evaluate("() => window.jupyterapp.shell.currentWidget.id")
        return page, page.locator(f'[id="{panel}"]')


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    from playwright.sync_api import sync_playwright

    tmp_path = tmp_path_factory.mktemp("lab")
    work = tmp_path / "nb"
    work.mkdir()
    settings = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(
        os.environ,
        JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
        JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
        MPLBACKEND="Agg",
    )
    log = (tmp_path / "lab.log").open("w")
    lab = subprocess.Popen(
        [
            sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1",
            f"--port={port}", f"--ServerApp.root_dir={work}",
            f"--IdentityProvider.token={token}", "--LabApp.expose_app_in_browser=True",
            "--ServerApp.disable_check_xsrf=True", "--LabApp.news_url=",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabApp.extension_manager=readonly", "--allow-root",
            f"--LabApp.user_settings_dir={tmp_path / 'settings'}",
        ],  # fmt: skip
        cwd=work,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    browser_pids: list[int] = []
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_http(f"{base}/api/status?token={token}", lab, 60, tmp_path / "lab.log")
        with sync_playwright() as pw:
            browser = pw.chromium.launch(
                executable_path=CHROMIUM,
                headless=True,
                args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
            )
            browser_pids = [
                p.pid for p in psutil.Process().children(recursive=True)
                if "chrom" in p.name().lower()
            ]  # fmt: skip
            try:
                yield Lab(work, base, token, browser)
            finally:
                browser.close()
    finally:
        killed = _end_tree(lab.pid)
        for pid in browser_pids:
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        log.close()
    left = [p for p in psutil.Process().children(recursive=True) if p.pid in browser_pids]
    assert not left, f"browser processes left: {[p.pid for p in left]}"
    assert not killed, f"processes that ignored SIGTERM and were killed: {killed}"


@contextmanager
def _shot_on_failure(page: object, name: str) -> Iterator[None]:
    try:
        yield
    except BaseException:
        SHOT_DIR.mkdir(parents=True, exist_ok=True)
        try:
            page.screenshot(path=str(SHOT_DIR / name), full_page=True)
        except Exception:  # noqa: BLE001 - the original error matters
            pass
        raise
    finally:
        page.close()


def _run_all(page: object) -> None:
    # (not awaited: the command's promise resolves when every cell has run)
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")


def _run_cell(page: object, index: int) -> None:
    page.evaluate(
        "(i) => { const nb = window.jupyterapp.shell.currentWidget.content;"
        " nb.activeCellIndex = i;"
        " window.jupyterapp.commands.execute('notebook:run-cell'); }",
        index,
    )


def test_dashboard_in_jupyterlab(lab: Lab) -> None:
    page, nb = lab.open("dashboard.ipynb", DASHBOARD_CELLS)
    with _shot_on_failure(page, "failure.png"):
        _run_all(page)
        # two rank rows render (the session starts, the dashboard shows)
        rows = nb.locator(".mlxdist-rank-row")
        rows.nth(1).wait_for(state="visible", timeout=90_000)
        assert rows.count() == 2
        header = nb.locator(".mlxdist-session").first.inner_text()
        assert "backend ring" in header and "2 ranks" in header

        # the long cell runs: both ranks turn busy, the progress bars show
        busy = nb.locator('.mlxdist-badge[data-state="busy"]')
        busy.nth(1).wait_for(state="visible", timeout=60_000)
        nb.locator(".jp-OutputArea .mlxdist-bar").nth(1).wait_for(timeout=30_000)
        # let the bars move a little (20 of 400 steps) for the screenshot
        page.wait_for_function(
            "(nb) => Array.from(nb.querySelectorAll('.mlxdist-dashboard .mlxdist-bar'))"
            ".filter(e => { const m = e.innerText.match(/(\\d+)\\/400/);"
            " return m && +m[1] >= 20; }).length >= 2",
            arg=nb.element_handle(),
            timeout=30_000,
        )
        texts = [rows.nth(i).inner_text() for i in range(2)]
        assert all("busy" in t and "cell" in t for t in texts), texts
        SHOT_DIR.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOT_DIR / "dashboard-busy.png"), full_page=True)

        # Interrupt, clicked while the cell runs, ends it (via the subshell)
        nb.locator(".mlxdist-interrupt").first.click()
        out = nb.locator(".jp-Cell").nth(2).locator(".jp-OutputArea")
        page.wait_for_function(
            "(el) => /CellInterrupted|interrupted/i.test(el.innerText)",
            arg=out.element_handle(),
            timeout=40_000,
        )
        nb.locator(".mlxdist-badge[data-state='busy']").first.wait_for(
            state="detached", timeout=20_000
        )
        page.screenshot(path=str(SHOT_DIR / "dashboard-interrupted.png"), full_page=True)

        # stop the session from the notebook (run-all stopped at the error)
        _run_cell(page, 3)
        nb.locator(".jp-Cell").nth(3).locator(".jp-OutputArea").get_by_text(
            "stopped"
        ).first.wait_for(timeout=30_000)
        nb.locator('.mlxdist-session[data-state="stopped"]').first.wait_for(timeout=20_000)


#: What the live cell's output looks like now: per rank, the text of its area(s)
#: (``.mlx-nbdist-rank`` elements, one per rank when displays update in place), and
#: whether the cell still runs (its prompt shows ``[*]`` until the execution count).
_LIVE_STATE = """(cell) => {
    const areas = {};
    for (const el of cell.querySelectorAll('.jp-OutputArea .mlx-nbdist-rank')) {
        (areas[el.dataset.rank] = areas[el.dataset.rank] || []).push(el.innerText);
    }
    const prompt = cell.querySelector('.jp-InputPrompt').innerText;
    return {areas, prompt, running: prompt.includes('*'),
            output: cell.querySelector('.jp-OutputArea').innerText};
}"""


def test_live_output_per_rank_in_jupyterlab(lab: Lab) -> None:
    page, nb = lab.open("live.ipynb", LIVE_CELLS)
    with _shot_on_failure(page, "live-failure.png"):
        _run_all(page)
        cell = nb.locator(".jp-Cell").nth(1)
        # the first line shows in rank 0's area, and in rank 1's, while the cell sleeps
        seen = page.wait_for_function(
            f"""(cell) => {{
                const s = ({_LIVE_STATE})(cell);
                const a = s.areas;
                return a['0'] && a['1'] && a['0'].join().includes('first line from rank 0')
                    && a['1'].join().includes('first line from rank 1') ? s : null;
            }}""",
            arg=cell.element_handle(),
            timeout=90_000,
        ).json_value()
        t_seen = time.monotonic()
        assert seen["running"], f"the cell had already ended: {seen}"
        assert "second line" not in seen["output"], seen
        SHOT_DIR.mkdir(parents=True, exist_ok=True)
        cell.screenshot(path=str(SHOT_DIR / "live-running.png"))

        # the cell ends: its execution count replaces [*]
        page.wait_for_function(
            "(cell) => /\\[\\d+\\]/.test(cell.querySelector('.jp-InputPrompt').innerText)",
            arg=cell.element_handle(),
            timeout=60_000,
        )
        waited = time.monotonic() - t_seen
        # the first lines were on screen well before the end (the cell sleeps LIVE_PAUSE s)
        assert waited > LIVE_PAUSE / 3, f"the cell ended {waited:.1f} s after the first line"
        end = cell.evaluate(_LIVE_STATE)
        assert not end["running"], end
        for r, other in ((0, 1), (1, 0)):
            areas = end["areas"].get(str(r), [])
            assert len(areas) == 1, f"rank {r}: {len(areas)} areas (updates must be in place)"
            text = areas[0]
            assert text.splitlines()[0].strip() == f"[rank {r}]", text
            first, second = f"first line from rank {r}", f"second line from rank {r}"
            assert first in text and second in text, text
            assert text.index(first) < text.index(second), text
            assert f"from rank {other}" not in text, f"rank {other}'s lines in rank {r}'s area"
        # rank 0's area above rank 1's
        boxes = [cell.locator(f'.mlx-nbdist-rank[data-rank="{r}"]').bounding_box() for r in (0, 1)]
        assert boxes[0]["y"] + boxes[0]["height"] <= boxes[1]["y"] + 1, boxes
        cell.screenshot(path=str(SHOT_DIR / "live-output-cell.png"))

        # run-all goes on to %mlxdist stop
        nb.locator(".jp-Cell").nth(2).locator(".jp-OutputArea").get_by_text(
            "stopped"
        ).first.wait_for(timeout=30_000)
        page.screenshot(path=str(SHOT_DIR / "live-output.png"), full_page=True)
