"""What an open dashboard costs: the round trip of a trivial ``%%mlxdist`` cell and a
tensor-parallel step (bench/tp_step.py's Megatron MLP, 2 ranks), with the dashboard
open (polling every 0.5 s, its default, in the kernel) and closed.

A jupyter_client front end runs a ``python3`` kernel with a 2-rank session (the
harness of bench/live_output.py); time = execute_request to execute_reply at the front
end. Short blocks of cells alternate closed / open (32 blocks) so drift hits both
alike; besides the ratio of the pooled medians, each open block is compared with the
closed block before it (the ratio of their medians), and the median of those paired
ratios is the estimate, with a 90 % interval from resampling the pairs: 1 % of a
13 ms round trip is 0.13 ms, less than this machine's drift between two blocks.

So the dashboard's own work is measured too, three ways, over the time it was open:
the CPU time its polling thread spent in refreshes (``time.thread_time``), the
wall-clock time it spent in them (waits for the GIL or a core included), and the
kernel process's CPU time per second, open against closed (every thread: the
widgets' messages leave through the kernel's iopub thread; opening and closing the
dashboard left out). A refresh takes from a
cell what it runs while the cell's thread or the ranks want the GIL or a core: at
most its CPU time, so the CPU share bounds what it costs a cell much longer than one
refresh. The wall share counts the waits too, while the cell's thread runs: an
upper bound of that bound.
"""

from __future__ import annotations

import json
import statistics

from common import paired, stats
from live_output import Frontend
from tp_step import SETUP as TP_SETUP

RANKS = 2
BLOCKS = 32
PER_BLOCK = {"round trip": 16, "tp step": 3}
CELLS = {"round trip": "%%mlxdist\npass", "tp step": "%%mlxdist\nstep()"}
# a block starts (after the dashboard opened): the kernel's wall clock and CPU time
MARK = "import time as _t\n_opened, _cpu0 = _t.perf_counter(), _t.process_time()"
OPEN = """
import time as _t
from mlx_nbdist.viz.dashboard import dashboard as _dash
_d = _dash()
_spent, _refresh = [0.0, 0.0], _d.refresh
def _timed_refresh():  # the polling thread's time in refreshes: wall clock, its CPU
    t, c = _t.perf_counter(), _t.thread_time()
    try:
        return _refresh()
    finally:
        _spent[0] += _t.perf_counter() - t
        _spent[1] += _t.thread_time() - c
_d.refresh = _timed_refresh
""" + MARK
# a block ends (before the dashboard closes): wall, the kernel's CPU, and (open) the
# refreshes' wall and CPU
END = "print(_t.perf_counter() - _opened, _t.process_time() - _cpu0)"
CLOSE = ("_took = _t.perf_counter() - _opened, _t.process_time() - _cpu0\n"
         "_d.close()\nprint(*_took, *_spent)")


def main() -> dict:
    fe = Frontend()
    try:
        fe.run_ok(f"%load_ext mlx_nbdist\n%mlxdist start -n {RANKS}")
        fe.run_ok("%%mlxdist\n" + TP_SETUP + "\nstep()")
        # blocks[what][b]: the times of block b (even: closed, odd: open)
        blocks: dict[str, list[list[float]]] = {what: [] for what in CELLS}
        spent = spent_cpu = wall = 0.0
        kernel_cpu: dict[bool, list[float]] = {False: [0.0, 0.0], True: [0.0, 0.0]}
        for b in range(BLOCKS):
            opened = b % 2 == 1
            fe.run_ok(OPEN if opened else MARK)
            for what, code in CELLS.items():
                block = []
                for _ in range(PER_BLOCK[what]):
                    took, reply = fe.execute(code)
                    if reply["content"]["status"] != "ok":
                        raise RuntimeError(f"{code!r} failed: {reply['content']}")
                    block.append(took)
                blocks[what].append(block)
            took, cpu, *used = map(float, fe.run_ok(CLOSE if opened else END).split())
            kernel_cpu[opened][0] += cpu
            kernel_cpu[opened][1] += took
            if opened:
                spent, spent_cpu, wall = spent + used[0], spent_cpu + used[1], wall + took
        fe.run_ok("%mlxdist stop")
    finally:
        fe.close()
    out = {what: summarise(bs) for what, bs in blocks.items()}
    for row in out.values():
        row["refresh time share"] = spent / wall
        row["refresh cpu share"] = spent_cpu / wall
        # the kernel's CPU (cores busy) open minus closed
        row["kernel cpu open - closed"] = (kernel_cpu[True][0] / kernel_cpu[True][1]
                                           - kernel_cpu[False][0] / kernel_cpu[False][1])
    return out


def summarise(blocks: list[list[float]]) -> dict:
    """Pooled medians of the closed (even) and open (odd) blocks, and the paired
    estimate: the median over pairs of open block median / closed block median."""
    closed = [t for b in blocks[0::2] for t in b]
    opened = [t for b in blocks[1::2] for t in b]
    pairs = [
        statistics.median(o) / statistics.median(c)
        for c, o in zip(blocks[0::2], blocks[1::2], strict=True)
    ]
    c, o = stats(closed), stats(opened)
    return {"closed": c, "open": o, "pooled ratio": o["median"] / c["median"], **paired(pairs)}


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
