"""Time every collective of a profiled cell on this rank (``%%mlxdist --profile``).

MLX is lazy: a collective is *issued* when its function is called and *runs* when its
output is evaluated, usually much later and fused with other work. Timing the call
would time nothing; timing the evaluation would mix in all the compute before it. So
in a profiled cell the tracker's wrapper hands each collective to
:meth:`Recorder.timed`, which

1. evaluates the collective's inputs (``t_issue`` -> ``t_ready``: the compute this
   rank had to do before it could take part),
2. issues the collective and evaluates its output at once (``t_ready`` -> ``t_done``:
   waiting for the other ranks, then moving the data).

What this costs, and why it is off by default: every collective becomes a
synchronisation point where it is issued, so compute and communication no longer
overlap (MLX could otherwise schedule independent work around a collective, and a
graph evaluated in one piece can be faster than in slices). A profiled step is
therefore never faster, and can be slower, than the same step unprofiled; the
timeline shows where the time goes in the profiled run, not a measurement of the
unprofiled one. Collectives issued inside ``mx.compile`` or ``mx.vmap`` cannot be
evaluated where they are issued; they are recorded as *untimed* (their issue time
only) and never shown as durations. Like the tracker, the recorder sees the
collectives called through ``mx.distributed`` from Python (user code, ``mlx.nn``'s
layers and ``sum_gradients``' backward); one MLX issues from C++ is not seen.

Times are this rank's wall clock (``time.time_ns`` at the cell's start) advanced by
``time.perf_counter_ns``: durations are monotonic, and the notebook aligns ranks'
clocks with offsets it estimates from :func:`clock_ns` round trips.

With the recorder off (``Tracker.recorder is None``, every unprofiled cell) the
wrapper pays one attribute test. :func:`recording` times a window inside a call rather
than a whole cell (``gradsync`` times the synchronising step it runs this way).
:func:`probe_bandwidth` measures what this backend moves for a small ``all_sum``, the
reference the notebook compares collectives with.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..results import CollectiveRecord
    from .tracker import Tracker

#: events kept per rank and cell; later ones are counted in ``dropped``, not kept
MAX_EVENTS = 50_000
#: bytes of the bandwidth probe's ``all_sum`` (below ring's 1 MB cliff, see shared notes)
PROBE_BYTES = 256 << 10
#: timed repeats of the probe, after one warm-up
PROBE_REPEATS = 3


class Recorder:
    """The timed collectives of one profiled cell on this rank.

    The tracker calls :meth:`timed` for each collective while the recorder is
    installed (``tracker.recorder``); :mod:`.cells` installs it at the cell's start
    (:meth:`begin`) and publishes :meth:`finish`'s plain data at its end.
    """

    def __init__(self, rank: int, size: int, backend: str = "") -> None:
        import mlx.core as mx  # on the rank only: the notebook imports this module too

        self._mx = mx
        self.rank = rank
        self.size = size
        self.backend = backend
        self.cell = 0
        self.events: list[dict[str, Any]] = []
        self.dropped = 0
        self._wall0 = 0
        self._perf0 = 0
        self.start_ns = 0
        self._end_ns: int | None = None

    def begin(self, cell: int) -> None:
        """Start recording ``cell``: its start time is now."""
        self.cell = cell
        self.events = []
        self.dropped = 0
        self._wall0 = time.time_ns()
        self._perf0 = time.perf_counter_ns()
        self.start_ns = self._wall0
        self._end_ns = None

    def end(self) -> None:
        """Stop the clock: :meth:`finish` reports now as the end (default: its own call)."""
        self._end_ns = self.now_ns()

    def now_ns(self) -> int:
        """This rank's wall clock at the cell's start, advanced by the monotonic clock."""
        return self._wall0 + time.perf_counter_ns() - self._perf0

    def timed(
        self,
        rec: CollectiveRecord,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        world: bool,
    ) -> Any:
        """Evaluate the inputs, then issue ``fn(*args, **kwargs)`` and evaluate it,
        recording the three times; returns the collective's output."""
        mx = self._mx
        t_issue = self.now_ns()
        inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, mx.array)]
        try:
            if inputs:
                mx.eval(*inputs)
        except (RuntimeError, ValueError) as e:
            if not _in_transform(e):
                raise
            # a tracer of mx.compile / mx.vmap: it runs inside the compiled call, so
            # only its issue is known; never present that as a duration
            self._add(rec, world, t_issue, t_issue, t_issue, timed=False)
            return fn(*args, **kwargs)
        t_ready = self.now_ns()
        out = fn(*args, **kwargs)
        mx.eval(out)
        self._add(rec, world, t_issue, t_ready, self.now_ns(), timed=True)
        return out

    def _add(
        self, rec: CollectiveRecord, world: bool, t_issue: int, t_ready: int, t_done: int,
        *, timed: bool,
    ) -> None:
        if len(self.events) >= MAX_EVENTS:
            self.dropped += 1
            return
        self.events.append(
            {
                "index": rec.index,
                "op": rec.op,
                "shape": list(rec.shape),
                "dtype": rec.dtype,
                "peer": rec.peer,
                "nbytes": rec.nbytes,
                "world": world,
                "check": rec.check,
                "timed": timed,
                "t_issue": t_issue,
                "t_ready": t_ready,
                "t_done": t_done,
            }
        )

    def finish(self, status: str) -> dict[str, Any]:
        """The cell's record as plain data (what the rank publishes)."""
        return {
            "rank": self.rank,
            "size": self.size,
            "backend": self.backend,
            "cell": self.cell,
            "status": status,
            "start_ns": self.start_ns,
            "end_ns": self.now_ns() if self._end_ns is None else self._end_ns,
            "events": self.events,
            "dropped": self.dropped,
        }


@contextmanager
def recording(recorder: Recorder, tracker: Tracker) -> Iterator[Recorder]:
    """Time the collectives issued in the block with ``recorder``: it is installed on
    ``tracker`` for the block (the one before is put back after), begins at the block's
    start (keeping its ``cell``) and ends at its end. For a window inside a call, such as
    the synchronising step of ``gradsync``; a profiled cell is recorded by :mod:`.cells`."""
    recorder.begin(recorder.cell)
    previous, tracker.recorder = tracker.recorder, recorder
    try:
        yield recorder
    finally:
        tracker.recorder = previous
        recorder.end()


def _in_transform(e: BaseException) -> bool:
    """MLX refuses to evaluate inside ``mx.compile`` / ``mx.vmap`` with this message."""
    text = str(e).lower()
    return "transform" in text or "compile" in text


def clock_ns() -> int:
    """This rank's wall clock in nanoseconds (the notebook's clock-offset samples)."""
    return time.time_ns()


def probe_bandwidth(
    nbytes: int = PROBE_BYTES, repeats: int = PROBE_REPEATS, group: Any = None
) -> dict[str, Any]:
    """Time a float32 ``all_sum`` of ``nbytes`` over the group: one warm-up (it also
    lines the ranks up), then ``repeats`` timed ones. Run it on every rank at once.

    Returns:
        ``rank``, ``nbytes``, ``seconds`` (each repeat), and ``gbps``: ``nbytes`` over
        the fastest repeat, in GB/s (what the backend can do when nothing else runs;
        on shared cores single repeats vary many-fold), ``None`` for a group of one.
    """
    import mlx.core as mx

    from . import state

    if nbytes < 4 or repeats < 1:
        raise ValueError(
            f"probe_bandwidth needs nbytes >= 4 and repeats >= 1, got {nbytes}, {repeats}"
        )
    st = state.current() if group is None else None
    group = st.world if st is not None else group
    x = mx.ones((nbytes // 4,), dtype=mx.float32)
    mx.eval(x)
    if group.size() == 1:
        return {"rank": group.rank(), "nbytes": nbytes, "seconds": [], "gbps": None}
    with state.own_collectives():  # not the user's: left out of the rank's totals
        mx.eval(mx.distributed.all_sum(x, group=group))
        seconds = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            mx.eval(mx.distributed.all_sum(x, group=group))
            seconds.append(time.perf_counter() - t0)
    best = min(seconds)
    return {
        "rank": group.rank(),
        "nbytes": 4 * (nbytes // 4),
        "seconds": seconds,
        "gbps": 4 * (nbytes // 4) / best / 1e9 if best > 0 else None,
    }
