"""Memory over time in the dashboard (:mod:`mlx_nbdist.viz.memory`), from records
shaped as the ranks publish them; the real-engine check is in tests/test_dashboard.py."""

from __future__ import annotations

from mlx_nbdist.viz.memory import LOW_BYTES, MemoryHistory

GIB = 1 << 30


def record(t: float, rss: int, available: int, total: int = 24 * GIB) -> dict:
    return {"updated": t, "rss": rss, "active_memory": rss // 2, "peak_memory": rss,
            "host_memory": total, "host_available": available}


def test_history_keeps_new_samples_only_and_at_most_its_length():
    h = MemoryHistory(history=3)
    for t in (1.0, 2.0, 2.0, 3.0, 4.0):  # 2.0 twice: the same record read twice
        h.update({0: record(t, int(t) * GIB, 20 * GIB), 1: record(t, GIB, 20 * GIB)})
    assert [p.t for p in h.points[0]] == [2.0, 3.0, 4.0]
    v = h.values()
    assert v[0]["samples"] == 3 and v[0]["max_rss"] == 4 * GIB and v[0]["rss"] == 4 * GIB
    assert v[1]["low"] == "" and h.flags() == {}


def test_a_rank_whose_machine_runs_out_is_flagged_with_numbers():
    h = MemoryHistory()
    h.update({0: record(1.0, 2 * GIB, 10 * GIB), 1: record(1.0, 21 * GIB, 2 * GIB)})
    flags = h.flags()
    assert list(flags) == [1]
    assert "2.0 GiB free of 24.0 GiB" in flags[1] and "21.0 GiB (RSS)" in flags[1]
    html = h.html()
    assert "<svg" in html and "rank 1</b>: its machine has" in html
    # a small machine: the floor is LOW_BYTES, not 10 %
    small = MemoryHistory()
    small.update({0: record(1.0, GIB, LOW_BYTES - 1, total=2 * GIB)})
    assert 0 in small.flags()


def test_records_without_memory_are_skipped():
    h = MemoryHistory()
    h.update({0: {}, 1: {"updated": 1.0}})
    assert h.values() == {} and h.html() == ""
