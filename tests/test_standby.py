"""Engines started ahead at ``%load_ext`` (mlx_nbdist.session.standby): the first start
forms its group on them when they fit, else ends them and starts its own. Real
engines, a real MLX group."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import mlx_nbdist
from mlx_nbdist import Session, SetupError
from mlx_nbdist.session import standby

from .conftest import NEW_SETTING, session_pids, started_anew, wait_gone

pytestmark = pytest.mark.timeout(240)


def _until(done: Callable[[], bool], timeout: float = 90.0) -> None:
    t_end = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < t_end, f"not within {timeout:g} s: {done}"
        time.sleep(0.05)


@pytest.fixture
def on(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Engines ahead allowed (conftest turns them off); none left after the test."""
    monkeypatch.setenv(standby.ENV, "1")
    try:
        yield
    finally:
        left = standby.engine_pids()
        standby.discard()
        assert not wait_gone(left), "the standby's engines outlived discard()"


def _ready_pids() -> list[int]:
    _until(lambda: standby.state() == "ready")
    pids = standby.engine_pids()
    assert pids
    return pids


def test_load_ext_starts_engines_that_the_first_start_forms_its_group_on(on: None) -> None:
    from IPython.core.interactiveshell import InteractiveShell

    mlx_nbdist.load_ipython_extension(InteractiveShell.instance())  # what %load_ext calls
    assert standby.state() in ("starting", "ready")
    ahead = _ready_pids()
    said: list[str] = []
    s = Session(2, timeout=60)
    try:
        s.start(said.append)
        assert any("already started" in m for m in said), said
        assert {info.pid for info in s.ranks.values()} == set(ahead), (s.ranks, ahead)
        assert standby.state() == "none"  # taken: the next start launches its own
        r = s.run("float(mx.distributed.all_sum(mx.ones(1) * (rank + 1), group=world).item())")
        assert [r.ranks[k].result_text for k in (0, 1)] == ["3.0", "3.0"]
        pids = session_pids(s)
    finally:
        s.stop()
    assert not wait_gone(pids), "the session's processes outlived stop"


def test_a_start_of_another_size_ends_them_and_starts_its_own(on: None) -> None:
    assert standby.prewarm(1)
    ahead = _ready_pids()
    said: list[str] = []
    s = Session(2, timeout=60, spare=False)
    try:
        s.start(said.append)
        why = "the engines started ahead were for 1 local rank (ring): ending them, starting new ones"
        assert why in said and s.notes == [why], (said, s.notes)
        assert not set(ahead) & {info.pid for info in s.ranks.values()}
        r = s.run("float(mx.distributed.all_sum(mx.ones(1), group=world).item())")
        assert [r.ranks[k].result_text for k in (0, 1)] == ["2.0", "2.0"]
    finally:
        s.stop()
    assert not wait_gone(ahead), "the engines started for 1 rank outlived the start of 2"


def test_engines_started_before_the_environment_changed_are_not_used(
    on: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert standby.prewarm(1)
    ahead = _ready_pids()
    monkeypatch.setenv(NEW_SETTING, "after")  # e.g. OMP_NUM_THREADS in a cell
    said: list[str] = []
    s = Session(1, timeout=60, spare=False)
    try:
        s.start(said.append)
        started_anew(s, said, "the engines started ahead", ahead)
    finally:
        s.stop()
    assert not wait_gone(ahead)


def test_a_notebook_shows_why_they_were_not_used_and_status_shows_them(
    on: None, tmp_path: Path
) -> None:
    """Through a real kernel: the reason outlives the progress line it was shown on."""
    nbformat = pytest.importorskip("nbformat")
    from .test_notebooks import execute

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            "%load_ext mlx_nbdist\nimport time, os\n"
            "from mlx_nbdist.session import standby\n"
            "while standby.state() == 'starting':\n    time.sleep(0.05)\n"
            "%mlxdist status"
        ),
        nbformat.v4.new_code_cell(f"os.environ[{NEW_SETTING!r}] = 'after'\n%mlxdist start -n 2"),
        nbformat.v4.new_code_cell(f"%%mlxdist\nimport os\nprint(os.environ[{NEW_SETTING!r}])"),
        nbformat.v4.new_code_cell("%mlxdist stop"),
    ]
    path = tmp_path / "ahead.ipynb"
    nbformat.write(nb, path)
    done, _, _ = execute(path)
    texts = [
        "".join(o.get("text", "") + o.get("data", {}).get("text/plain", "") for o in c.outputs)
        for c in done.cells
    ]
    assert "engines started ahead for 2 ranks (ring): ready" in texts[0], texts[0]
    assert (
        f"note: the engines started ahead are not usable (the environment ({NEW_SETTING}) "
        "changed since they started): starting new ones" in texts[1]
    ), texts[1]
    assert texts[2].count("after") == 2, texts[2]  # each rank sees the new setting


def test_none_when_turned_off_or_asked_for_a_bad_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(standby.ENV, "0")
    assert not standby.prewarm(2)
    assert standby.state() == "none" and standby.engine_pids() == []
    assert not standby.enabled({standby.ENV: "off"}) and standby.enabled({})
    with pytest.raises(SetupError, match="-n must be a whole number of ranks >= 1, got 0"):
        standby.prewarm(0)
    with pytest.raises(SetupError, match="unknown backend 'tcp'"):
        standby.prewarm(2, "tcp")
