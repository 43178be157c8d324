"""The dashboard in a real browser: JupyterLab on loopback, driven by headless Chromium.

A notebook starts a 2-rank session, shows ``%mlxdist dashboard`` and runs a cell
that takes a while on the ranks (with a progress bar). Playwright (for Python,
``executable_path`` pointing at Debian's ``chromium``: no browser download) opens it
and checks that two rank rows render, that a rank's state turns ``busy`` while the
cell runs and that the progress bars show; it saves a screenshot
(``reports/browser/dashboard-busy.png``), then clicks the dashboard's Interrupt
button *during* the cell and checks that the cell ends interrupted (the button's
clicks reach the kernel through a subshell, see ``viz/dashboard.py``).

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

CELLS = [
    "%load_ext mlx_nbdist\n%mlxdist start -n 2",
    "%mlxdist dashboard --interval 0.3",
    "%%mlxdist --timeout 120\n"
    "import time\n"
    "from mlx_nbdist.engine.progress import progress\n"
    "for i in progress(range(400), desc='steps'):\n"
    "    time.sleep(0.1)",
    "%mlxdist stop",
]


def _notebook(path: Path) -> None:
    nb = {
        "cells": [
            {"cell_type": "code", "metadata": {}, "source": src, "outputs": [],
             "execution_count": None}
            for src in CELLS
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


def test_dashboard_in_jupyterlab(tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    work = tmp_path / "nb"
    work.mkdir()
    _notebook(work / "dashboard.ipynb")
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
                page = browser.new_page(viewport={"width": 1500, "height": 1100})
                page.set_default_timeout(60_000)
                page.goto(f"{base}/lab/tree/dashboard.ipynb?token={token}")
                page.wait_for_function(
                    "() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                    " && window.jupyterapp.shell.currentWidget.sessionContext"
                    " && window.jupyterapp.shell.currentWidget.sessionContext.session"
                    " && window.jupyterapp.shell.currentWidget.sessionContext.session.kernel",
                    timeout=90_000,
                )
                # (not awaited: the command's promise resolves when every cell has run)
                page.evaluate(
                    "() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }"
                )
                # two rank rows render (the session starts, the dashboard shows)
                rows = page.locator(".mlxdist-rank-row")
                rows.nth(1).wait_for(state="visible", timeout=90_000)
                assert rows.count() == 2
                header = page.locator(".mlxdist-session").first.inner_text()
                assert "backend ring" in header and "2 ranks" in header

                # the long cell runs: both ranks turn busy, the progress bars show
                busy = page.locator('.mlxdist-badge[data-state="busy"]')
                busy.nth(1).wait_for(state="visible", timeout=60_000)
                page.locator(".jp-OutputArea .mlxdist-bar").nth(1).wait_for(timeout=30_000)
                # let the bars move a little (20 of 400 steps) for the screenshot
                page.wait_for_function(
                    "() => Array.from(document.querySelectorAll('.mlxdist-dashboard .mlxdist-bar'))"
                    ".filter(e => { const m = e.innerText.match(/(\\d+)\\/400/);"
                    " return m && +m[1] >= 20; }).length >= 2",
                    timeout=30_000,
                )
                texts = [rows.nth(i).inner_text() for i in range(2)]
                assert all("busy" in t and "cell" in t for t in texts), texts
                SHOT_DIR.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(SHOT_DIR / "dashboard-busy.png"), full_page=True)

                # Interrupt, clicked while the cell runs, ends it (via the subshell)
                page.locator(".mlxdist-interrupt").first.click()
                out = page.locator(".jp-Cell").nth(2).locator(".jp-OutputArea")
                page.wait_for_function(
                    "(el) => /CellInterrupted|interrupted/i.test(el.innerText)",
                    arg=out.element_handle(),
                    timeout=40_000,
                )
                page.locator(".mlxdist-badge[data-state='busy']").first.wait_for(
                    state="detached", timeout=20_000
                )
                page.screenshot(path=str(SHOT_DIR / "dashboard-interrupted.png"), full_page=True)

                # stop the session from the notebook (run-all stopped at the error)
                page.evaluate(
                    "() => { const nb = window.jupyterapp.shell.currentWidget.content;"
                    " nb.activeCellIndex = 3;"
                    " window.jupyterapp.commands.execute('notebook:run-cell'); }"
                )
                page.locator(".jp-Cell").nth(3).locator(".jp-OutputArea").get_by_text(
                    "stopped"
                ).first.wait_for(timeout=30_000)
                page.locator('.mlxdist-session[data-state="stopped"]').first.wait_for(
                    timeout=20_000
                )
            except BaseException:
                SHOT_DIR.mkdir(parents=True, exist_ok=True)
                try:
                    page.screenshot(path=str(SHOT_DIR / "failure.png"), full_page=True)
                except Exception:  # noqa: BLE001 - the original error matters
                    pass
                raise
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
