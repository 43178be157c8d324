"""What the collective recorder costs: profile off versus on, side by side.

* Cell round trip: a trivial cell through ``Session.run`` unprofiled and profiled,
  interleaved on the same engines (a profiled cell also publishes its record).
* Tensor-parallel step (``tp_step.SETUP``: Megatron MLP 1024 -> 4096 -> 1024, batch
  64, 2 ranks): the step timed inside an unprofiled cell and inside a profiled one,
  alternating trials. Profiling evaluates every collective where it is issued, so
  compute and communication no longer overlap: the "on" column is that cost.
* The hook the recorder adds to every collective when it is off (one attribute test
  in the tracker's wrapper), timed in this process: with it, "off" cannot differ
  measurably from a tracker without the hook (a TP step issues a handful of
  collectives in hundreds of milliseconds).
* The tracker's whole wrapper per collective (record, order tag, hold, the held
  outputs' compactions and tag reads), timed in this process on a stand-in for a
  2-rank group's ``all_sum`` (MLX's own op, ``x * 2``): a decoded token's activations
  (1 x 1 x 512 float32) through the wrapper and straight to the stand-in, taking
  turns, a cell of 512 collectives each (evaluated 8 at a time, as a 4-layer decode
  step issues them), the same positions every cell (as cells that run again do).

Needs ``Session.run(..., profile=True)`` (issue 17's wiring in session/core.py).
"""

from __future__ import annotations

import inspect
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import stats, time_it  # noqa: E402
from tp_step import SETUP  # noqa: E402

from mlx_nbdist import Session  # noqa: E402


def hook_ns(calls: int = 1_000_000) -> float:
    """Nanoseconds per call of the recorder-off test, over an empty loop's."""

    class Holder:
        recorder = None

    t = Holder()

    def with_hook() -> None:
        for _ in range(calls):
            if t.recorder is None:
                pass

    def without() -> None:
        for _ in range(calls):
            pass

    best = min(time_it(with_hook) - time_it(without) for _ in range(5))
    return max(best, 0.0) / calls * 1e9


def wrapper_us(cells: int = 15, per_cell: int = 512) -> dict:
    """Microseconds per collective that the tracker's wrapper adds (wall, and CPU of
    the calling thread), over the stand-in called directly: medians over cells."""
    import statistics

    import mlx.core as mx

    from mlx_nbdist.engine.tracker import Tracker

    class Group:  # two ranks, as the wrapper sees them: it tags for a group of 2
        def size(self) -> int:
            return 2

    def stand_in(x, *, group=None, stream=None):  # type: ignore[no-untyped-def]
        return x * 2

    tracker = Tracker(Group(), 0, 2, backend="ring")
    tracker._orig["all_sum"] = stand_in  # what the wrapper calls, tagged
    wrapped = tracker._wrap("all_sum", stand_in)
    x = mx.ones((1, 1, 512))
    mx.eval(x)

    def cell(fn) -> tuple[float, float]:  # type: ignore[no-untyped-def]
        y, w0, c0 = x, time.perf_counter(), time.thread_time()
        for i in range(per_cell):
            y = fn(y) * 0.5
            if i % 8 == 7:
                mx.eval(y)
        mx.eval(y)
        return time.perf_counter() - w0, time.thread_time() - c0

    got: dict[str, list[tuple[float, float]]] = {"tracked": [], "direct": []}
    for c in range(cells + 1):
        for key, fn in (("tracked", wrapped), ("direct", stand_in))[:: 1 if c % 2 else -1]:
            tracker.begin_cell(c, None, False)
            t = cell(fn)
            tracker.settle()
            if c:  # the first: warm-up
                got[key].append(t)
    return {what: statistics.median(a[i] - b[i] for a, b in zip(got["tracked"], got["direct"],
                                                                 strict=True)) / per_cell * 1e6
            for i, what in enumerate(("wall", "cpu"))}


def _values(result) -> list[float]:  # type: ignore[no-untyped-def]
    return [float(v) for v in result.ranks[0].result_text.strip("[]").split(",")]


def measure(n: int = 2, runs: int = 100, trials: int = 5, reps: int = 4) -> dict:
    if "profile" not in inspect.signature(Session.run).parameters:
        raise SystemExit(
            "Session.run has no profile= argument yet: apply issue 17's wiring to "
            "mlx_nbdist/session/core.py first"
        )
    out: dict = {}
    with Session(n, timeout=600) as s:
        s.run("pass", profile=True)  # the first profiled cell probes clocks and bandwidth
        for _ in range(10):
            s.run("pass")
            s.run("pass", profile=True)
        rt: dict[str, list[float]] = {"off": [], "on": []}
        for _ in range(runs):
            rt["off"].append(time_it(lambda: s.run("pass")))
            rt["on"].append(time_it(lambda: s.run("pass", profile=True)))
        out["round trip"] = {k: stats(v) for k, v in rt.items()}
        out["round trip"]["on / off"] = (
            out["round trip"]["on"]["median"] / out["round trip"]["off"]["median"]
        )
        s.run(SETUP)
        steps: dict[str, list[float]] = {"off": [], "on": []}
        for _ in range(trials):
            for key, prof in (("off", False), ("on", True)):
                r = s.run(f"_t = timed(step, {reps})\n_t", profile=prof)
                steps[key] += _values(r)
        out["tp step"] = {k: stats(v) for k, v in steps.items()}
        out["tp step"]["on / off"] = (
            out["tp step"]["on"]["median"] / out["tp step"]["off"]["median"]
        )
        s.run("step()", profile=True)
        out["tp step"]["profiled summary"] = s.timeline().summary()
    out["recorder-off hook, ns per collective"] = hook_ns()
    out["wrapper, us per collective"] = wrapper_us()
    return out


def main() -> dict:
    t0 = time.perf_counter()
    out = {"2 ranks": measure(2)}
    out["seconds"] = time.perf_counter() - t0
    return out


if __name__ == "__main__":
    import json

    if sys.argv[1:] == ["--hook"]:  # runs without engines or wiring
        print(json.dumps({"recorder-off hook, ns per collective": hook_ns(),
                          "wrapper, us per collective": wrapper_us()}))
    else:
        print(json.dumps(main(), indent=1, default=str))
