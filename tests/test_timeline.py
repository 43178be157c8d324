"""Per-rank timelines of profiled cells, their statistics and Chrome trace export.

Three layers: the pure timeline logic on hand-made rank records (waits, the rank
everyone waited for, statistics, bandwidth, the trace validated against the
trace-event format); the rank-side recorder in this process on a real MLX group of
one (the tracker wrapping ``mx.distributed``); and real 2-rank sessions through
``Session.run(code, profile=True)``, skipped until the session exposes it.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mlx_nbdist import Session
from mlx_nbdist.errors import NotStartedError
from mlx_nbdist.session.profile import Profiles
from mlx_nbdist.timelines import (
    ClockOffset,
    NoProfileError,
    SegmentKind,
    build,
    estimate_offset,
    to_chrome_trace,
    write_trace,
)

NS = 1_000_000_000
T0 = 1_700_000_000 * NS  # a wall-clock origin, as ranks publish it


# ------------------------------------------------------------------- hand-made records


def event(op: str, ready: float, done: float, *, index: int, nbytes: int = 1 << 20,
          peer: int | None = None, timed: bool = True, shape: tuple[int, ...] = (262144,),
          world: bool = True, clock: float = 0.0) -> dict[str, Any]:
    """One recorded collective; times in seconds after T0 on the notebook's clock,
    shifted by the rank's ``clock`` offset (what its own clock read)."""
    return {
        "index": index, "op": op, "shape": list(shape), "dtype": "float32", "peer": peer,
        "nbytes": nbytes, "world": world, "check": False, "timed": timed,
        "t_issue": T0 + int((ready - 0.001 + clock) * NS),
        "t_ready": T0 + int((ready + clock) * NS), "t_done": T0 + int((done + clock) * NS),
    }


def record(rank: int, cell: int, start: float, end: float, events: list[dict[str, Any]],
           clock: float = 0.0, size: int = 2) -> dict[str, Any]:
    return {"rank": rank, "size": size, "backend": "ring", "cell": cell, "status": "ok",
            "start_ns": T0 + int((start + clock) * NS), "end_ns": T0 + int((end + clock) * NS),
            "events": events, "dropped": 0}


def unbalanced_cell(cell: int = 1, base: float = 0.0, clock1: float = 0.0) -> dict[int, Any]:
    """Rank 1 computes 0.3 s longer before an all_sum of 1 MiB that then takes 10 ms."""
    b = base
    return {
        0: record(0, cell, b, b + 0.4, [event("all_sum", b + 0.05, b + 0.36, index=1)]),
        1: record(1, cell, b, b + 0.4,
                  [event("all_sum", b + 0.35, b + 0.36, index=1, clock=clock1)], clock=clock1),
    }


# ------------------------------------------------------------- a trace-event validator

#: from the Trace Event Format document (docs.google.com/document/d/1CvAClvFfyA5R-PhYU
#: mn5OOQtYMH4h6I0nSsKchNAySU): every phase it defines
SPEC_PHASES = set("BEXiICbneSTpFstfPNODMVvRc()")
SPEC_METADATA = {"process_name", "process_labels", "process_sort_index", "thread_name",
                 "thread_sort_index"}


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def trace_problems(doc: Any) -> list[str]:
    """What makes ``doc`` not a valid JSON-object-format trace (empty: valid)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        return ["not a JSON object with a traceEvents list"]
    out = []
    if doc.get("displayTimeUnit", "ms") not in ("ms", "ns"):
        out.append(f"displayTimeUnit {doc['displayTimeUnit']!r} is not ms or ns")
    try:
        json.dumps(doc, allow_nan=False)
    except ValueError as e:
        out.append(f"not strict JSON: {e}")
    complete: dict[tuple[int, int], list[tuple[float, float, str]]] = {}
    for i, e in enumerate(doc["traceEvents"]):
        missing = [k for k in ("name", "ph", "ts", "pid", "tid") if k not in e]
        if missing:
            out.append(f"event {i}: missing {missing}")
            continue
        if not isinstance(e["name"], str) or e["ph"] not in SPEC_PHASES:
            out.append(f"event {i}: bad name or phase {e['ph']!r}")
        if not _number(e["ts"]) or not isinstance(e["pid"], int) or not isinstance(e["tid"], int):
            out.append(f"event {i}: ts must be a number, pid and tid integers")
        if "args" in e and not isinstance(e["args"], dict):
            out.append(f"event {i}: args must be an object")
        if e["ph"] == "X":
            if not _number(e.get("dur")) or e["dur"] < 0:
                out.append(f"event {i}: a complete event needs dur >= 0")
            else:
                complete.setdefault((e["pid"], e["tid"]), []).append(
                    (e["ts"], e["ts"] + e["dur"], e["name"]))
        if e["ph"] in "iI" and e.get("s", "t") not in ("g", "p", "t"):
            out.append(f"event {i}: instant scope {e.get('s')!r} is not g, p or t")
        if e["ph"] == "M":
            if e["name"] not in SPEC_METADATA:
                out.append(f"event {i}: unknown metadata {e['name']!r}")
            key = "name" if e["name"].endswith(("_name", "_labels")) else "sort_index"
            if key not in e.get("args", {}):
                out.append(f"event {i}: metadata {e['name']} needs args.{key}")
    # complete events on one thread must nest (a slice inside another, or after it)
    for (pid, tid), spans in complete.items():
        stack: list[tuple[float, float, str]] = []
        for s, t, name in sorted(spans, key=lambda x: (x[0], -x[1])):
            while stack and s >= stack[-1][1] - 1e-3:
                stack.pop()
            if stack and t > stack[-1][1] + 1e-2:
                out.append(f"pid {pid} tid {tid}: {name!r} [{s}, {t}] overlaps "
                           f"{stack[-1][2]!r} ending at {stack[-1][1]}")
            stack.append((s, t, name))
    return out


def test_the_validator_finds_bad_traces() -> None:
    good = {"traceEvents": [{"name": "a", "ph": "X", "ts": 0, "dur": 5, "pid": 0, "tid": 0}]}
    assert trace_problems(good) == []
    bad = {"displayTimeUnit": "s", "traceEvents": [
        {"name": "a", "ph": "X", "ts": 0, "pid": 0, "tid": 0},
        {"name": "b", "ph": "Q", "ts": "1", "pid": 0, "tid": 0},
        {"name": "thread_name", "ph": "M", "ts": 0, "pid": 0, "tid": 0, "args": {}},
        {"name": "c", "ph": "X", "ts": 0, "dur": 10, "pid": 1, "tid": 0},
        {"name": "d", "ph": "X", "ts": 5, "dur": 10, "pid": 1, "tid": 0},
        {"ph": "X", "ts": 0, "dur": 1, "pid": 0, "tid": 0},
    ]}
    found = "\n".join(trace_problems(bad))
    for what in ("displayTimeUnit", "needs dur", "phase 'Q'", "args.name", "overlaps",
                 "missing ['name']"):
        assert what in found, (what, found)


# ------------------------------------------------------------------------- pure logic


def test_the_late_rank_is_waited_for_and_the_other_waits() -> None:
    tl = build([unbalanced_cell()], probe_gbps=0.2, backend="ring")
    assert tl.waited_for == 1 and tl.slowest == 1
    (c,) = tl.collectives
    assert c.waited_for == 1 and c.waits[0] == pytest.approx(0.3, abs=1e-6) and c.waits[1] == 0
    assert tl.wait[0] == pytest.approx(0.3, abs=1e-6) and tl.wait[1] == 0
    kinds0 = [s.kind for s in tl.lanes[0]]
    assert kinds0 == [SegmentKind.COMPUTE, SegmentKind.WAIT, SegmentKind.COLLECTIVE,
                      SegmentKind.COMPUTE]
    wait = tl.lanes[0][1]
    assert (wait.op, wait.waited_for, wait.nbytes) == ("all_sum", 1, 1 << 20)
    assert [s.kind for s in tl.lanes[1]] == [SegmentKind.COMPUTE, SegmentKind.COLLECTIVE,
                                            SegmentKind.COMPUTE]
    assert tl.compute[1] == pytest.approx(0.39, abs=1e-6)
    assert tl.compute[0] == pytest.approx(0.09, abs=1e-6)


def test_statistics_per_op_and_rank_and_the_bandwidth() -> None:
    tl = build([unbalanced_cell()], probe_gbps=0.2, backend="ring")
    st = tl.stats
    all_ranks, r0, r1 = st.of("all_sum"), st.of("all_sum", 0), st.of("all_sum", 1)
    assert all_ranks is not None and r0 is not None and r1 is not None
    assert (r0.count, r0.nbytes) == (1, 1 << 20)
    assert r0.time == pytest.approx(0.31, abs=1e-6) and r0.wait == pytest.approx(0.3, abs=1e-6)
    assert r1.time == pytest.approx(0.01, abs=1e-6) and r1.wait == 0
    # 1 MiB moved in the 10 ms after the last arrival: 0.105 GB/s, about half the probe
    assert r0.gbps == pytest.approx((1 << 20) / 0.01 / 1e9, rel=1e-3)
    assert r0.ratio == pytest.approx(r0.gbps / 0.2)
    assert r0.share == pytest.approx(0.31 / 0.4, abs=1e-6)
    assert all_ranks.share == pytest.approx((0.31 + 0.01) / 2 / 0.4, abs=1e-6)
    text = st.table()
    assert "all_sum" in text and "probe 0.2 GB/s" in text and "52%" in text


def test_the_summary_says_where_the_time_went() -> None:
    line = build([unbalanced_cell(cell=7)], probe_gbps=0.2, backend="ring").summary()
    assert line.startswith("cell 7: 40% all_sum at 0.105 GB/s on ring (probe: 0.2 GB/s)"), line
    assert "waiting, mostly for rank 1" in line and "slowest rank 1" in line


def test_a_rank_that_sent_no_record_is_named_not_left_out_silently() -> None:
    """A user trial: a profiled cell whose rank 0 was ended drew rank 1's lane alone,
    and nothing said rank 0 was missing."""
    cell = {1: {**unbalanced_cell(cell=7)[1], "absent": [0]}}
    tl = build([cell], backend="ring")
    assert tl.ranks == [1] and tl.absent == {7: [0]}
    assert tl.summary().endswith(
        "no timeline from rank 0 in cell 7: its cell did not finish (it failed, or was "
        "ended or interrupted)"), tl.summary()
    assert "no timeline" not in build([unbalanced_cell(cell=7)]).summary()


def test_several_cells_are_concatenated_with_idle_between() -> None:
    tl = build([unbalanced_cell(3, 0.0), unbalanced_cell(4, 1.0)], backend="ring")
    assert tl.cells == [3, 4]
    idle = [s for s in tl.lanes[0] if s.kind == SegmentKind.IDLE]
    assert len(idle) == 1 and (idle[0].start, idle[0].end) == pytest.approx((0.4, 1.0))
    assert len(tl.collectives) == 2 and tl.wait[0] == pytest.approx(0.6, abs=1e-6)
    assert tl.stats.of("all_sum", 0).count == 2
    assert "cells 3, 4" in tl.summary()


def test_clock_offsets_align_ranks() -> None:
    # rank 1's clock runs 5 s ahead of the notebook's: unaligned, it would look late
    skewed = unbalanced_cell(clock1=5.0)
    tl = build([skewed], offsets={1: ClockOffset(5.0, 1e-5)}, backend="ring")
    assert tl.waited_for == 1 and tl.wait[0] == pytest.approx(0.3, abs=1e-6)
    assert tl.spans[1][0][1] == pytest.approx(0.0, abs=1e-6)
    wrong = build([skewed], backend="ring")  # why offsets matter: rank 1 starts 5 s late
    assert wrong.spans[1][0][1] == pytest.approx(5.0, abs=1e-6)
    assert wrong.stats.of("all_sum", 0).gbps is None  # the data seems to move before it may


def test_waits_within_the_clock_uncertainty_are_nobodys() -> None:
    cell = {
        0: record(0, 1, 0, 0.1, [event("all_sum", 0.05, 0.06, index=1)]),
        1: record(1, 1, 0, 0.1, [event("all_sum", 0.052, 0.06, index=1)]),
    }
    assert build([cell]).waited_for == 1  # 2 ms on one machine's clock is real
    unsure = build([cell], offsets={1: ClockOffset(0.0, 0.005)})
    assert unsure.waited_for is None and "clocks aligned to ±5 ms" in unsure.summary()


def test_estimate_offset_uses_the_shortest_round_trip() -> None:
    samples = [(0, 5_000_000_000 + 9_000_000, 20_000_000),  # 20 ms round trip
               (100_000_000, 5_100_000_000 + 1_000_000, 102_000_000)]  # 2 ms
    off = estimate_offset(samples)
    assert off.offset == pytest.approx(5.0, abs=1e-9) and off.uncertainty == pytest.approx(1e-3)
    with pytest.raises(ValueError, match="at least one"):
        estimate_offset([])
    with pytest.raises(ValueError, match="replied before it was sent"):
        estimate_offset([(10, 5, 9)])


def test_send_and_recv_pair_up() -> None:
    cell = {
        0: record(0, 1, 0, 0.5, [event("send", 0.4, 0.41, index=1, peer=1)]),
        1: record(1, 1, 0, 0.5, [event("recv", 0.1, 0.41, index=1, peer=0)]),
    }
    tl = build([cell])
    assert tl.waited_for == 0 and tl.wait[1] == pytest.approx(0.3, abs=1e-6)
    assert [s.kind for s in tl.lanes[1]][:3] == [SegmentKind.COMPUTE, SegmentKind.WAIT,
                                                 SegmentKind.RECV]
    assert tl.stats.of("send", 0).count == 1 and tl.stats.of("recv", 1).count == 1


def test_untimed_collectives_are_instants_not_durations() -> None:
    ev = event("all_sum", 0.1, 0.1, index=1, timed=False)
    cell = {0: record(0, 1, 0, 0.2, [ev]), 1: record(1, 1, 0, 0.2, [dict(ev)])}
    tl = build([cell])
    marks = [s for s in tl.lanes[0] if s.kind == SegmentKind.UNTIMED]
    assert len(marks) == 1 and marks[0].duration == 0
    # each rank issued the same one: counted once for the group, as group collectives are
    assert tl.collectives == [] and tl.stats.rows == [] and tl.untimed == 1
    assert "not timed" in tl.summary()
    doc = to_chrome_trace(tl)
    instants = [e for e in doc["traceEvents"] if e["ph"] == "i"]
    assert len(instants) == 2 and trace_problems(doc) == []


def test_a_send_over_before_its_receiver_came_waited_for_nobody() -> None:
    # the ring buffers a small send: rank 0's send is done at 0.11 s, rank 1 only
    # posts its recv at 0.4 s; neither waited for the other
    cell = {
        0: record(0, 1, 0, 0.5, [event("send", 0.1, 0.11, index=1, peer=1)]),
        1: record(1, 1, 0, 0.5, [event("recv", 0.4, 0.41, index=1, peer=0)]),
    }
    tl = build([cell])
    assert [s.kind for s in tl.lanes[0]] == [SegmentKind.COMPUTE, SegmentKind.SEND,
                                             SegmentKind.COMPUTE]
    assert tl.waited_for is None and tl.wait == {0: 0.0, 1: 0.0}
    send = tl.stats.of("send", 0)
    assert send.wait == 0 and send.transfer == pytest.approx(0.01, abs=1e-6) and send.gbps


def test_messages_are_summed_over_ranks_in_the_groups_row() -> None:
    # every message is one rank's own (a group collective is every rank's): rank 0
    # sends 24 B twice and receives 8 B; rank 1 receives both and sends the 8 B
    def msg(op: str, t: float, index: int, nbytes: int, peer: int) -> dict[str, Any]:
        return event(op, t, t + 0.01, index=index, nbytes=nbytes, peer=peer, shape=(nbytes // 4,))

    cell = {
        0: record(0, 1, 0, 1, [msg("send", 0.1, 1, 24, 1), msg("send", 0.2, 2, 24, 1),
                               msg("recv", 0.3, 3, 8, 1)]),
        1: record(1, 1, 0, 1, [msg("recv", 0.1, 1, 24, 0), msg("recv", 0.2, 2, 24, 0),
                               msg("send", 0.3, 3, 8, 0)]),
    }
    st = build([cell]).stats
    assert (st.of("send").count, st.of("send").nbytes) == (3, 56)
    assert (st.of("recv").count, st.of("recv").nbytes) == (3, 56)
    assert (st.of("send", 0).count, st.of("send", 1).count) == (2, 1)
    # a pipeline step where each rank sends and receives one message: per rank, one each
    from mlx_nbdist.viz.gradsync import step_lines

    ring = {0: record(0, 1, 0, 1, [msg("send", 0.1, 1, 8, 1), msg("recv", 0.2, 2, 8, 1)]),
            1: record(1, 1, 0, 1, [msg("recv", 0.1, 1, 8, 0), msg("send", 0.2, 2, 8, 0)])}
    (line,) = step_lines(build([ring]).stats, [0, 1])
    assert line.startswith("this step (each rank): 1 recv, 8 B") and "; 1 send, 8 B" in line
    # a group collective stays any rank's count
    cell = {r: record(r, 1, 0, 1, [event("all_sum", 0.1, 0.2, index=1, nbytes=16)])
            for r in (0, 1)}
    assert (build([cell]).stats.of("all_sum").count, build([cell]).stats.of("all_sum").nbytes
            ) == (1, 16)


def test_a_collective_no_other_rank_issued_is_waiting_not_a_transfer() -> None:
    # rank 0 raised before its all_sum; rank 1 waited in it until a drain's zeros
    # released it 2.1 s later: no bandwidth to show for that
    cell = {
        0: record(0, 1, 0, 0.05, []),
        1: record(1, 1, 0, 2.3, [event("all_sum", 0.1, 2.2, index=1, nbytes=24, shape=(6,))]),
    }
    tl = build([cell])
    (row,) = [r for r in tl.stats.rows if r.rank is None]
    assert row.count == 1 and row.gbps is None and row.transfer == 0
    assert row.wait == pytest.approx(2.1, abs=1e-6)
    kinds = [(s.kind, s.waited_for) for s in tl.lanes[1]]
    assert (SegmentKind.WAIT, None) in kinds and SegmentKind.COLLECTIVE not in [k for k, _ in kinds]
    assert "GB/s" not in tl.summary().split(";")[0], tl.summary()
    assert "did not match in this cell" in tl.summary() and "waiting, mostly" not in tl.summary()
    assert tl.wait == {0: 0.0, 1: 0.0}  # nobody came late: it met nobody
    doc = to_chrome_trace(tl)
    assert trace_problems(doc) == []
    assert any(e["name"] == "wait all_sum: not matched by the other ranks in this cell"
               for e in doc["traceEvents"])


def test_a_late_rank_and_an_unmatched_collective_are_told_apart() -> None:
    # rank 1 comes 0.1 s late to the first all_sum; then rank 1 waits 2 s in a second
    # one rank 0 never issued: the late arrival is 0.1 s of waiting, not 2.1 s
    cell = {
        0: record(0, 1, 0, 2.5, [event("all_sum", 0.1, 0.21, index=1)]),
        1: record(1, 1, 0, 2.5, [event("all_sum", 0.2, 0.21, index=1),
                                 event("all_sum", 0.3, 2.3, index=2)]),
    }
    tl = build([cell])
    assert tl.waited_for == 1 and tl.wait[0] == pytest.approx(0.1, abs=1e-6)
    assert tl.wait[1] == 0
    parts = tl.summary().split("; ")
    assert parts[1].startswith("2% waiting, mostly for rank 1"), parts
    assert parts[2].startswith("40% in collectives the other ranks did not match"), parts


def test_mismatched_collectives_are_not_paired() -> None:
    cell = {
        0: record(0, 1, 0, 1, [event("all_sum", 0.1, 0.2, index=1),
                               event("all_gather", 0.3, 0.4, index=2)]),
        1: record(1, 1, 0, 1, [event("all_sum", 0.1, 0.2, index=1),
                               event("all_max", 0.6, 0.7, index=2)]),
    }
    assert len(build([cell]).collectives) == 1


def test_bad_input_is_named() -> None:
    with pytest.raises(NoProfileError, match="--profile"):
        build([])
    corrupt = unbalanced_cell()
    corrupt[0]["events"][0]["t_done"] = corrupt[0]["events"][0]["t_ready"] - 1
    with pytest.raises(ValueError, match="rank 0: collective #1 .*t_done < t_ready"):
        build([corrupt])
    with pytest.raises(NoProfileError):
        to_chrome_trace([])


def named(cell: dict[int, Any], name: str) -> dict[int, Any]:
    """The records of a cell with the name the session gives them (``In [7]``)."""
    return {r: {**p, "name": name} for r, p in cell.items()}


def test_cells_are_labelled_as_the_user_sees_them(tmp_path: Path) -> None:
    from mlx_nbdist.viz import format_timeline, timeline_figure

    tl = build([named(unbalanced_cell(19, 0.0), "In [7]"), unbalanced_cell(20, 1.0)],
               probe_gbps=0.2, backend="ring")
    assert tl.names == {19: "In [7]"}
    assert (tl.label(19), tl.label(20)) == ("In [7]", "cell 20")
    assert tl.summary().startswith("In [7], cell 20: "), tl.summary()
    text = format_timeline(tl)
    assert "collectives of In [7], cell 20 on ring" in text and "cells 19" not in text
    labels = {t.get_gid(): t.get_text().strip() for t in timeline_figure(tl).axes[0].texts}
    assert labels == {"cell:19": "In [7]", "cell:20": "cell 20"}
    doc = to_chrome_trace(tl)
    assert trace_problems(doc) == []
    spans = [(e["pid"], e["name"], e["args"]["cell"]) for e in doc["traceEvents"]
             if e.get("cat") == "cell"]
    assert sorted(spans) == [(0, "In [7]", 19), (0, "cell 20", 20), (1, "In [7]", 19),
                             (1, "cell 20", 20)]
    assert doc["otherData"]["cell_names"] == {"19": "In [7]", "20": "cell 20"}
    one = build([named(unbalanced_cell(19), "In [7]")], probe_gbps=0.2, backend="ring")
    assert one.summary().startswith("In [7]: 40% all_sum"), one.summary()
    many = build([named(unbalanced_cell(c, c - 1.0), f"In [{c}]") for c in range(1, 6)])
    assert many.summary().startswith("In [1] ... In [5] (5 cells): ")


def test_a_step_in_one_line_per_op_and_rank() -> None:
    from mlx_nbdist.viz.gradsync import step_lines

    st = build([unbalanced_cell()], probe_gbps=0.2, backend="ring").stats
    assert st.line(0) == "1 all_sum, 1.0 MiB, 310 ms, 0.105 GB/s (0.52x probe)"
    assert st.line(1) == "1 all_sum, 1.0 MiB, 10 ms, 0.105 GB/s (0.52x probe)"
    assert st.line() == "1 all_sum, 1.0 MiB, 160 ms, 0.105 GB/s (0.52x probe)"
    assert step_lines(st, [0, 1]) == [f"this step (each rank): {st.line()}"]
    assert step_lines(None, [0, 1]) == []
    uneven = {0: record(0, 1, 0, 1, [event("all_sum", 0.1, 0.2, index=1),
                                     event("all_sum", 0.3, 0.4, index=2)]),
              1: record(1, 1, 0, 1, [event("all_sum", 0.1, 0.2, index=1)])}
    st = build([uneven], backend="ring").stats
    assert step_lines(st, [0, 1]) == [f"this step on rank {r}: {st.line(r)}" for r in (0, 1)]
    # rank 0's second all_sum met no peer: issued and waited in, but nothing moved
    assert st.line(0).startswith("2 all_sum, 1.0 MiB, 200 ms") and "probe" not in st.line(0)
    ev = event("all_sum", 0.1, 0.1, index=1, timed=False)
    st = build([{0: record(0, 1, 0, 0.2, [ev]), 1: record(1, 1, 0, 0.2, [dict(ev)])}]).stats
    assert st.line() == "1 issued inside mx.compile/vmap (not timed)"
    assert build([{0: record(0, 1, 0, 0.2, [])}]).stats.line() == "no collective"


def test_chrome_trace_is_valid_and_aligned(tmp_path: Path) -> None:
    tls = [build([unbalanced_cell(1, 0.0), unbalanced_cell(2, 1.0)], probe_gbps=0.2,
                 backend="ring"),
           build([unbalanced_cell(5, 3.0)], backend="ring")]
    doc = to_chrome_trace(tls)
    assert trace_problems(doc) == []
    names = {(e["pid"], e["args"]["name"]) for e in doc["traceEvents"]
             if e["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1")}
    waits = [e for e in doc["traceEvents"] if e.get("cat") == "wait"]
    assert len(waits) == 3 and all(e["pid"] == 0 and e["args"]["waited_for"] == 1
                                   for e in waits)
    assert waits[0]["dur"] == pytest.approx(0.3e6, abs=1)
    assert waits[0]["args"]["op"] == "all_sum" and waits[0]["args"]["bytes"] == 1 << 20
    cell5 = [e for e in doc["traceEvents"] if e["name"] == "cell 5"]
    assert [e["ts"] for e in cell5] == [pytest.approx(3e6)] * 2  # second timeline, one clock
    path = write_trace(tls, tmp_path / "run.json")
    assert trace_problems(json.loads(path.read_text())) == []
    with pytest.raises(IsADirectoryError, match="give a file name"):
        write_trace(tls, tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        write_trace(tls, tmp_path / "nowhere" / "run.json")


def test_the_figure_marks_the_waited_for_and_slowest_rank(tmp_path: Path) -> None:
    from mlx_nbdist.viz import format_timeline, timeline_figure

    tl = build([unbalanced_cell(1, 0.0), unbalanced_cell(2, 0.6)], probe_gbps=0.2,
               backend="ring")
    fig = timeline_figure(tl)
    gids = {a.get_gid() for ax in fig.axes for a in [*ax.collections, *ax.lines]}
    assert {"compute:r0", "wait:r0", "collective:r1", "idle:r1", "waited-for:r1",
            "slowest:r1"} <= gids
    out = tmp_path / "timeline.png"
    fig.savefig(out, dpi=60)
    assert out.stat().st_size > 5000
    text = format_timeline(tl)
    assert "rank 0:" in text and "waiting 600 ms" in text and "all_sum" in text


def test_profiles_say_what_to_do_on_bad_input() -> None:
    fake = SimpleNamespace(state="ready", session_id="s1", backend="ring", places={})
    p = Profiles(fake)  # type: ignore[arg-type]
    with pytest.raises(NoProfileError, match=r"%%mlxdist --profile.*recorder is off"):
        p.timeline()
    p.cells.append(unbalanced_cell())
    assert p.timeline().waited_for == 1
    for k in (0, 2, "1", True):
        with pytest.raises(ValueError, match="k must be a whole number from 1 to 1"):
            p.timeline(k)
    fake.session_id = "s2"  # restarted: new engines, the old records are gone
    with pytest.raises(NoProfileError):
        p.stats()
    fake.state = "stopped"
    with pytest.raises(NotStartedError, match="start one"):
        p.timeline()


# ------------------------------------------------ the recorder on a group of one


def _heavy(mx: Any) -> Any:
    a = mx.random.normal((384, 384), key=mx.random.key(0))
    for _ in range(12):
        a = (a @ a) / 384
    return a


def test_recorder_times_the_compute_before_a_collective(tracked: Any) -> None:
    from mlx_nbdist.engine.profile import Recorder

    mx, tracker, world = tracked.mx, tracked.tracker, tracked.world
    t0 = time.perf_counter()
    mx.eval(_heavy(mx))
    alone = time.perf_counter() - t0
    rec = Recorder(world.rank(), world.size(), "ring")
    rec.begin(3)
    tracker.recorder = rec
    try:
        y = mx.distributed.all_sum(_heavy(mx), group=world)
        z = mx.distributed.all_gather(y[:4], group=world)
    finally:
        tracker.recorder = None
    data = rec.finish("ok")
    assert data["cell"] == 3 and data["start_ns"] <= data["end_ns"]
    evs = data["events"]
    assert [e["op"] for e in evs] == ["all_sum", "all_gather"]
    assert all(e["timed"] and e["t_issue"] <= e["t_ready"] <= e["t_done"] for e in evs)
    assert evs[0]["t_done"] <= evs[1]["t_issue"]
    assert all(data["start_ns"] <= e["t_issue"] and e["t_done"] <= data["end_ns"] for e in evs)
    # the matmuls ran between issue and ready: the compute before the collective
    assert (evs[0]["t_ready"] - evs[0]["t_issue"]) / 1e9 > 0.5 * alone
    assert evs[0]["nbytes"] == 384 * 384 * 4 and evs[1]["shape"] == [4, 384]
    assert z.shape == (4, 384)
    json.dumps(data)  # plain data: it travels as published data


def test_recorder_off_adds_nothing_and_keeps_mlx_lazy(tracked: Any) -> None:
    from mlx_nbdist.engine.profile import Recorder

    mx, tracker, world = tracked.mx, tracked.tracker, tracked.world
    rec = Recorder(0, 1)
    rec.begin(1)
    assert tracker.recorder is None
    x = _heavy(mx)
    t0 = time.perf_counter()
    y = mx.distributed.all_sum(x, group=world)
    issued = time.perf_counter() - t0
    t0 = time.perf_counter()
    mx.eval(y)
    ran = time.perf_counter() - t0
    assert rec.events == [] and issued < 0.2 * ran  # issued, not run, by the call
    assert tracker.cell_count == 1  # still recorded by the tracker


def test_recording_times_a_window_and_puts_the_recorder_back(tracked: Any) -> None:
    from mlx_nbdist.engine.profile import Recorder, recording

    mx, tracker, world = tracked.mx, tracked.tracker, tracked.world
    outer = Recorder(0, 1)
    tracker.recorder = outer
    rec = Recorder(0, 1, "ring")
    rec.cell = 9
    try:
        mx.eval(mx.distributed.all_sum(mx.ones(4), group=world))  # before: not in the window
        with recording(rec, tracker):
            assert tracker.recorder is rec
            y = mx.distributed.all_sum(_heavy(mx), group=world)
        assert tracker.recorder is outer
        time.sleep(0.05)
        mx.eval(mx.distributed.all_sum(y, group=world))  # after: not in the window either
    finally:
        tracker.recorder = None
    data = rec.finish("ok")
    assert data["cell"] == 9 and [e["op"] for e in data["events"]] == ["all_sum"]
    assert data["events"][0]["nbytes"] == 384 * 384 * 4
    # the window ended when the block did, not when finish() was called
    assert (time.time_ns() - data["end_ns"]) / 1e9 > 0.04
    assert data["events"][0]["t_done"] <= data["end_ns"]
    assert len(outer.events) == 2  # the recorder before it saw the rest


def test_collectives_inside_compile_are_untimed(tracked: Any) -> None:
    from mlx_nbdist.engine.profile import Recorder

    mx, tracker, world = tracked.mx, tracked.tracker, tracked.world
    f = mx.compile(lambda x: mx.distributed.all_sum(x * 2, group=world))
    rec = Recorder(0, 1)
    rec.begin(1)
    tracker.recorder = rec
    try:
        out = f(mx.ones(4))
        mx.eval(out)
    finally:
        tracker.recorder = None
    assert out.tolist() == [2.0] * 4
    (ev,) = rec.events
    assert not ev["timed"] and ev["t_ready"] == ev["t_done"] == ev["t_issue"]


def test_collectives_of_mlx_nbdist_itself_are_left_out_of_the_totals(tracked: Any) -> None:
    mx, tracker, world = tracked.mx, tracked.tracker, tracked.world
    before = tracker.snapshot()
    mx.eval(mx.distributed.all_sum(mx.ones(4), group=world))
    with tracker.internal():  # a bandwidth probe, gradsync's comparison
        mx.eval(mx.distributed.all_sum(mx.ones(8), group=world))
    after = tracker.snapshot()
    assert after["collectives"] - before["collectives"] == 1
    assert after["bytes_moved"] - before["bytes_moved"] == 16
    # still recorded (a rank stuck in one shows where, and can be drained)
    assert [r["nbytes"] for r in after["recent"][-2:]] == [16, 32]


# ------------------------------------------------------- real engines (needs wiring)

needs_wiring = pytest.mark.skipif(
    not hasattr(Session, "timeline"),
    reason="Session.run(profile=True) / Session.timeline / trace are not wired into "
    "session/core.py yet (see the wiring notes of issue 17)",
)

UNBALANCED = """
import time
x = mx.ones((65536,))
if rank == 1:
    time.sleep(0.3)
y = mx.distributed.all_sum(x, group=world)
mx.eval(y)
"""


@needs_wiring
def test_timeline_before_any_profiled_cell_says_what_to_do(session2: Session) -> None:
    session2.run("x = 1")
    with pytest.raises(NoProfileError, match="--profile"):
        session2.timeline()


@needs_wiring
def test_a_rank_that_sleeps_is_waited_for(session2: Session, tmp_path: Path) -> None:
    r = session2.run(UNBALANCED, profile=True)
    assert r.ok
    tl = session2.timeline()
    assert tl.cells == [r.cell] and tl.waited_for == 1
    assert 0.25 < tl.wait[0] < 0.6 and tl.wait[1] < 0.05
    st = session2.comm_stats()
    assert st.of("all_sum", 0).count == 1 and st.probe_gbps and st.probe_gbps > 0
    path = session2.trace(tmp_path / "run.json")
    doc = json.loads(path.read_text())
    assert trace_problems(doc) == []
    assert {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"} == {
        "rank 0", "rank 1"}
    session2.run("y = mx.distributed.all_sum(mx.ones(4), group=world); mx.eval(y)")
    assert session2.timeline().cells == [r.cell]  # unprofiled cells add nothing
    session2.run(UNBALANCED, profile=True)
    assert session2.timeline(2).cells[0] == r.cell
    with pytest.raises(ValueError, match="k must be a whole number from 1 to 2"):
        session2.timeline(3)


@needs_wiring
def test_a_named_cell_is_labelled_with_its_name(session2: Session, tmp_path: Path) -> None:
    from mlx_nbdist.viz import format_timeline

    r = session2.run(UNBALANCED, profile=True, name="In [7]")
    tl = session2.timeline()
    assert tl.cells == [r.cell] and tl.label(r.cell) == "In [7]"
    assert tl.summary().startswith("In [7]: ") and f"cell {r.cell}" not in tl.summary()
    assert "collectives of In [7] on " in format_timeline(tl)
    doc = json.loads(session2.trace(tmp_path / "named.json").read_text())
    assert trace_problems(doc) == []
    assert {e["name"] for e in doc["traceEvents"] if e.get("cat") == "cell"} == {"In [7]"}


def test_timeline_of_a_stopped_session_says_what_to_do() -> None:
    s = Session(2)
    if not hasattr(s, "timeline"):
        pytest.skip("Session.timeline is not wired into session/core.py yet")
    with pytest.raises(NotStartedError, match="start one"):
        s.timeline()


def test_compaction_keeps_every_unevaluated_collective_and_drops_the_evaluated(
    tracked: Any,
) -> None:
    # a compaction by count checks only the older half of what a rank holds (the
    # newest are likely in a graph being built); nothing unevaluated may be dropped
    from mlx_nbdist.engine import tracker as tracker_module

    mx, tracker, world = tracked.mx, tracked.tracker, tracked.world
    first = mx.distributed.all_sum(mx.ones(3), group=world)  # never evaluated here
    first_seq = tracker.seq
    for i in range(5 * tracker_module.COMPACT_AT):
        y = mx.distributed.all_sum(mx.ones(3) * i, group=world)
        if i % 7:
            mx.eval(y)
    last_seq = tracker.seq
    lazy = {first_seq} | {first_seq + 1 + i for i in range(5 * tracker_module.COMPACT_AT)
                          if i % 7 == 0}
    assert len(tracker._held) <= 2 * tracker_module.COMPACT_AT + len(lazy)  # bounded
    settled = {rec.seq for rec in tracker.settle()}
    assert settled == lazy, (sorted(settled - lazy), sorted(lazy - settled))
    assert last_seq == first_seq + 5 * tracker_module.COMPACT_AT
    assert first.tolist() == [1.0, 1.0, 1.0] and not tracker.settle()


def test_outputs_that_run_a_little_late_are_let_go_and_never_run_ones_settled(
    tracked: Any,
) -> None:
    # mlx-lm's generate_step evaluates each step's outputs a step later (async_eval):
    # a compaction finds some unevaluated. Looked at once, they stay first and are not
    # looked at by every compaction (a prefill leaves two that never run in the cell);
    # but as they grow they are looked at again, so the held stay bounded
    mx, tracker, world = tracked.mx, tracked.tracker, tracked.world
    never = [mx.distributed.all_sum(mx.ones(3) * 7, group=world) for _ in range(2)]
    never_seqs = {tracker.seq - 1, tracker.seq}
    lag, n, in_flight, peak = 128, 40 * 128, [], 0
    for i in range(n):
        in_flight.append(mx.distributed.all_sum(mx.ones(3) * i, group=world))
        if len(in_flight) > lag:
            mx.eval(in_flight.pop(0))
        peak = max(peak, len(tracker._held))
    assert peak < 8 * lag, peak  # (they grew past 2,900 when never looked at again)
    settled = {rec.seq for rec in tracker.settle()}
    assert never_seqs <= settled and len(settled) == lag + 2, sorted(settled)[:5]
    assert [a.tolist() for a in never] == [[7.0, 7.0, 7.0]] * 2


def test_a_settle_while_another_thread_compacts_loses_no_collective(
    tracked: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a cell's threads may issue collectives: the one that reaches the compaction's
    # count looks at its snapshot of the held outputs outside the lock, and the cell's
    # end may settle them meanwhile. Every collective must still be settled once (one
    # lost runs in a later cell and pairs with another collective there)
    import threading

    from mlx_nbdist.engine import tracker as tracker_mod

    mx, tracker, world = tracked.mx, tracked.tracker, tracked.world
    looking, go_on = threading.Event(), threading.Event()
    real = tracker_mod._evaluated

    def slow_look(*arrays: Any) -> bool:
        if threading.current_thread().name == "compacting":
            looking.set()
            go_on.wait(10)
        return real(*arrays)

    monkeypatch.setattr(tracker_mod, "_evaluated", slow_look)
    # unevaluated, made here: MLX evaluates an array only in the thread that made it
    outs = [mx.distributed.all_sum(mx.ones(2) * i, group=world)
            for i in range(tracker_mod.COMPACT_AT - 1)]  # fmt: skip
    out_seqs = set(range(tracker.seq - len(outs) + 1, tracker.seq + 1))

    failed: list[BaseException] = []

    def last() -> None:  # the collective that starts a compaction, in another thread
        try:
            mx.eval(mx.distributed.all_sum(mx.ones(2), group=world))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            failed.append(e)

    a = threading.Thread(target=last, name="compacting")
    a.start()
    assert looking.wait(10)  # thread a is inside its compaction, the lock released
    threading.Timer(0.5, go_on.set).start()
    t0 = time.monotonic()
    settled = [[r.seq for r in tracker.settle()]]  # the cell's end
    assert time.monotonic() - t0 > 0.4  # it waited for the compaction
    late = mx.distributed.all_sum(mx.ones(2) * 100, group=world)
    late_seq = tracker.seq
    a.join(10)
    assert not a.is_alive() and not failed, failed
    settled.append([r.seq for r in tracker.settle()])
    seqs = [q for batch in settled for q in batch]
    assert len(seqs) == len(set(seqs)), f"a collective was settled twice: {settled}"
    assert late_seq in seqs, f"a collective issued meanwhile was lost: {settled}"
    # thread a evaluates its own right after its compaction, racing the cell's end: that
    # may find it unevaluated, then count it settled once a has evaluated it (an eval of
    # an evaluated array does nothing), or find it evaluated already
    theirs = max(out_seqs) + 1
    assert out_seqs | {late_seq} <= set(seqs) <= out_seqs | {late_seq, theirs}, settled
    assert late.tolist() == [100.0, 100.0]


def test_rank_totals_are_the_users_collectives_only(fresh2: Session) -> None:
    # the first profiled cell probes the bandwidth (4 all_sums of 256 KiB) and
    # --check-collectives gathers signatures: neither is the user's
    def totals() -> list[tuple[int, int]]:
        return [(st.collectives, st.bytes_moved) for st in fresh2.rank_states().values()]

    before = totals()
    fresh2.run("for n in (10, 1000):\n    mx.eval(mx.distributed.all_sum(mx.ones(n), "
               "group=world))", profile=True)
    fresh2.run("mx.eval(mx.distributed.all_sum(mx.ones(5), group=world))",
               check_collectives=True)
    want = [(c + 3, b + 4 * 1015) for c, b in before]
    deadline = time.monotonic() + 10
    while totals() != want and time.monotonic() < deadline:
        time.sleep(0.05)  # the ranks publish every 0.25 s
    time.sleep(0.6)  # and nothing more arrives later
    assert totals() == want
    assert fresh2.comm_stats().of("all_sum").count == 2
