"""Live output (issue #13): every rank's output reaches the front end while the cell
runs, grouped by rank, in the order written, with displays updated in place.

Through ``Session.run(on_output=...)`` on real engines, and through a real kernel
(jupyter_client) running the ``%%mlxdist`` magic, whose iopub messages are timed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from jupyter_client.manager import KernelManager

from mlx_nbdist import Session
from mlx_nbdist.streams import Kind, OutputEvent, RankStream, apply_carriage_returns

from .conftest import strip_ansi

# -- the output area model ------------------------------------------------------------


def test_carriage_returns_rewrite_the_line() -> None:
    assert apply_carriage_returns("10%\r50%\r100%\n") == "100%\n"
    assert apply_carriage_returns("a\r\nb\n") == "a\nb\n"
    assert apply_carriage_returns("x\ny 1\ry 2") == "x\ny 2"


def test_a_progress_line_split_over_messages_keeps_its_last_state() -> None:
    area = RankStream(0)
    for text in ("step 2\r", "step 3\r", "\n"):
        area.apply(OutputEvent(0, Kind.STDOUT, text=text))
    assert area.text() == "step 3\n"


def test_area_keeps_order_updates_displays_and_clears() -> None:
    area = RankStream(0)
    area.apply(OutputEvent(0, Kind.STDOUT, text="a\n"))
    area.apply(OutputEvent(0, Kind.STDERR, text="b\n"))
    area.apply(OutputEvent(0, Kind.STDOUT, text="c\n"))
    assert [i.kind for i in area.items] == [Kind.STDOUT, Kind.STDERR, Kind.STDOUT]
    area.apply(OutputEvent(0, Kind.DISPLAY, data={"text/plain": "v1"}, display_id="d"))
    area.apply(OutputEvent(0, Kind.UPDATE, data={"text/plain": "v2"}, display_id="d"))
    assert area.text() == "a\nb\nc\nv2\n"
    area.apply(OutputEvent(0, Kind.CLEAR, wait=True))
    assert area.text() == "a\nb\nc\nv2\n"  # wait=True: cleared by the next output
    area.apply(OutputEvent(0, Kind.STDOUT, text="new\n"))
    assert area.text() == "new\n"
    area.apply(OutputEvent(0, Kind.CLEAR))
    assert area.items == []


# -- Session.run(on_output=...) on real engines ------------------------------------------


def test_live_view_throttle_shows_a_held_back_update_when_its_interval_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An area not rendered within its interval updates at once; a second update
    within it is held back and shown by the first flush() after the interval. The
    interval grows with the number of areas (a total rate for the front end)."""
    from mlx_nbdist.viz import live

    shown: list[tuple[int, str]] = []

    class Handle:
        def __init__(self, rank: int) -> None:
            self.rank = rank

        def update(self, bundle: dict[str, str], raw: bool = False) -> None:
            shown.append((self.rank, bundle["text/plain"]))

    view = live.LiveOutput([0, 1], headers=False)
    monkeypatch.setattr(view, "_ensure_handles",
                        lambda upto: [view._handles.setdefault(r, Handle(r))
                                      for r in range(upto + 1)])
    now = [100.0]
    monkeypatch.setattr(live.time, "monotonic", lambda: now[0])
    view(OutputEvent(0, Kind.STDOUT, text="a\n"))
    assert shown == [(0, "a")]  # at once
    assert view._interval(0) == pytest.approx(2 / live.MAX_TOTAL_UPDATES_PER_SECOND)
    now[0] += 0.01
    view(OutputEvent(0, Kind.STDOUT, text="b\n"))
    view.flush()
    assert shown == [(0, "a")]  # held back
    now[0] += view._interval(0)
    view.flush()
    assert shown == [(0, "a"), (0, "a\nb")]
    wide = live.LiveOutput(list(range(8)))
    wide._handles = dict.fromkeys(range(8))
    assert wide._interval(0) == pytest.approx(8 / live.MAX_TOTAL_UPDATES_PER_SECOND)
    assert live.LiveOutput([0])._interval(0) == pytest.approx(1 / live.MAX_UPDATES_PER_SECOND)


def test_an_area_kept_for_order_shows_its_failed_ranks_header(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 1 wrote, so an area was made above it for rank 0; rank 0 failed without a
    word: its area said nothing at all (the user trial), now its header and status."""
    from mlx_nbdist.viz import live

    shown: dict[int, str] = {}

    class Handle:
        def __init__(self, rank: int) -> None:
            self.rank = rank

        def update(self, bundle: dict[str, str], raw: bool = False) -> None:
            shown[self.rank] = bundle["text/plain"]

    view = live.LiveOutput([0, 1, 2])
    monkeypatch.setattr(view, "_ensure_handles",
                        lambda upto: [view._handles.setdefault(r, Handle(r))
                                      for r in range(upto + 1)])
    view(OutputEvent(1, Kind.STDOUT, text="one\n"))
    assert shown == {1: "[rank 1]\none"}
    view.status[0] = view.status[2] = "error"
    view.finish(None)
    assert shown == {0: "[rank 0] (error)", 1: "[rank 1]\none"}  # rank 2 had no area


def test_output_arrives_while_the_cell_runs_in_order(session2: Session) -> None:
    t0 = time.monotonic()
    events: list[tuple[float, OutputEvent]] = []
    code = (
        "import sys, time\n"
        "for i in range(4):\n"
        "    print(rank, 'out', i)\n"
        "    print(rank, 'err', i, file=sys.stderr)\n"
        "    time.sleep(0.5)\n"
    )
    r = session2.run(code, on_output=lambda ev: events.append((time.monotonic() - t0, ev)))
    end = time.monotonic() - t0
    assert end >= 2.0
    # when rank 0's first line is complete (a print is several writes, which the
    # stream's batching timer may send apart)
    first = next(
        t
        for n, (t, _) in enumerate(events)
        if "0 out 0\n" in "".join(ev.text for _, ev in events[: n + 1] if ev.rank == 0)
    )
    assert first < end - 1.0, (first, end)  # long before the cell ended
    for k in (0, 1):
        text = "".join(ev.text for _, ev in events if ev.rank == k)
        assert text == "".join(f"{k} out {i}\n{k} err {i}\n" for i in range(4))
        # the result keeps the area: stdout and stderr interleaved as written
        assert [i.kind for i in r.ranks[k].items] == [Kind.STDOUT, Kind.STDERR] * 4


# -- through a real kernel and the magic --------------------------------------------------


class Frontend:
    """A jupyter_client front end that keeps displays by id, as a notebook does."""

    def __init__(self) -> None:
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel()
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def run(self, code: str, timeout: float = 180) -> tuple[str, list[dict[str, Any]], list]:
        """(status, final outputs, [(seconds, msg_type, text/plain)] as they came)."""
        outputs: list[dict[str, Any]] = []
        by_id: dict[str, list[int]] = {}
        timeline: list[tuple[float, str, str]] = []
        t0 = time.monotonic()

        def hook(msg: dict[str, Any]) -> None:
            kind, content = msg["msg_type"], msg["content"]
            plain = ""
            if kind == "stream":
                plain = content["text"]
                outputs.append({"kind": kind, "text": plain})
            elif kind in ("display_data", "execute_result", "update_display_data"):
                plain = content["data"].get("text/plain", "")
                did = (content.get("transient") or {}).get("display_id")
                if kind == "update_display_data":
                    for i in by_id.get(did, []):
                        outputs[i]["data"] = content["data"]
                else:
                    by_id.setdefault(did, []).append(len(outputs))
                    outputs.append({"kind": kind, "data": content["data"]})
            elif kind == "error":
                plain = f"{content['ename']}: {content['evalue']}"
                outputs.append({"kind": kind, "text": plain})
            timeline.append((time.monotonic() - t0, kind, plain))

        reply = self.kc.execute_interactive(code, output_hook=hook, timeout=timeout)
        return reply["content"]["status"], outputs, timeline

    def close(self) -> None:
        try:
            self.kc.stop_channels()
        finally:
            self.km.shutdown_kernel(now=False)


def rank_areas(outputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The displays that hold something: the ranks' output areas, in order."""
    return [o for o in outputs if o["kind"] == "display_data" and o["data"].get("text/plain")]


def text_of(outputs: list[dict[str, Any]]) -> str:
    parts = []
    for o in outputs:
        if "text" in o:
            parts.append(o["text"])
        elif o["data"].get("text/plain"):
            parts.append(o["data"]["text/plain"] + "\n")
    return strip_ansi("".join(parts))


@pytest.fixture(scope="module")
def frontend() -> Iterator[Frontend]:
    fe = Frontend()
    status, outputs, _ = fe.run("%load_ext mlx_nbdist\n%mlxdist start -n 2")
    assert status == "ok", text_of(outputs)
    yield fe
    fe.run("%mlxdist stop")
    fe.close()


def test_magic_streams_each_rank_into_its_own_area(frontend: Frontend) -> None:
    code = (
        "%%mlxdist\nimport sys, time\n"
        "for i in range(4):\n"
        "    print(rank, 'loss', i)\n"
        "    time.sleep(0.5)\n"
        "print(rank, 'done', file=sys.stderr)\n"
    )
    status, outputs, timeline = frontend.run(code)
    assert status == "ok"
    end = timeline[-1][0]
    seen = [t for t, kind, plain in timeline if "0 loss 0" in plain]
    assert seen and seen[0] < end - 1.0, timeline  # shown while the cell ran
    areas = rank_areas(outputs)
    assert [a["data"]["text/plain"].splitlines()[0] for a in areas] == ["[rank 0]", "[rank 1]"]
    for k, area in enumerate(areas):
        lines = area["data"]["text/plain"].splitlines()[1:]
        assert lines == [f"{k} loss {i}" for i in range(4)] + [f"{k} done"]
        assert f"{k} done" in area["data"]["text/html"]


def test_display_updates_clear_output_and_figures_in_a_rank_area(frontend: Frontend) -> None:
    code = (
        "%%mlxdist --ranks 0\n"
        "from IPython.display import display, clear_output\n"
        "import matplotlib.pyplot as plt\n"
        "h = display('first', display_id=True)\n"
        "h.update('second')\n"
        "for i in range(3):\n"
        "    clear_output(wait=True)\n"
        "    fig, ax = plt.subplots(figsize=(2, 1))\n"
        "    ax.plot([0, i])\n"
        "    display(fig)\n"
        "    plt.close(fig)\n"
        "    print('frame', i)\n"
    )
    status, outputs, _ = frontend.run(code)
    assert status == "ok", text_of(outputs)
    areas = rank_areas(outputs)
    assert len(areas) == 1
    html = areas[0]["data"]["text/html"]
    assert html.count("<img") == 1 and "frame 2" in html and "frame 1" not in html
    assert "second" not in html  # cleared with the rest


def test_quiet_streams_every_rank_then_keeps_only_failing_ranks(frontend: Frontend) -> None:
    """As docs/magics.md says: every rank streams while the cell runs (the user trial
    saw nothing until the end: a rank that had not failed yet was hidden), and at the
    end only the areas of ranks that failed are kept."""
    status, outputs, timeline = frontend.run(
        "%%mlxdist --quiet\nimport time\nprint('hello', rank, flush=True)\ntime.sleep(1.5)\n"
        "if rank == 1:\n    raise ValueError('bad')"
    )
    assert status == "error"
    text = text_of(outputs)
    assert "hello 1" in text and "hello 0" not in text
    assert "ValueError: bad" in text
    end = timeline[-1][0]
    for k in (0, 1):
        seen = [t for t, _, plain in timeline if f"hello {k}" in plain]
        assert seen and seen[0] < end - 1.0, timeline  # shown while the cell ran


def test_many_tiny_prints_and_progress_lines_are_bounded_in_messages(frontend: Frontend) -> None:
    code = (
        "%%mlxdist\nimport sys\n"
        "for i in range(10000):\n    print(i)\n"
        "for p in range(0, 101, 10):\n    print(f'\\r{p}%', end='')\n"
        "print()\nprint('bad bytes:', b'\\xff\\xfe'.decode('utf-8', 'surrogateescape'))\n"
    )
    status, outputs, timeline = frontend.run(code)
    assert status == "ok", text_of(outputs)
    updates = [t for t in timeline if t[1] in ("display_data", "update_display_data")]
    assert len(updates) < 200  # not one message per print
    areas = rank_areas(outputs)
    for k, area in enumerate(areas):
        lines = area["data"]["text/plain"].splitlines()
        assert lines[0] == f"[rank {k}]"
        assert lines[1:10001] == [str(i) for i in range(10000)]
        assert lines[10001] == "100%"  # the progress line rewrote itself
        assert lines[10002].startswith("bad bytes:")
