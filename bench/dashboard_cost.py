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

So the dashboard's own work is measured too: the wall-clock time its polling thread
spent in refreshes (waits for the GIL or a core included) over the time it was open.
A refresh delays a cell only when the two overlap, and by at most its own length, so
the expected cost to a cell much longer than a refresh (about 1 ms) is at most that
share; a cell of length L pays at most share x (1 + refresh / L).
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
OPEN = """
import time as _t
from mlx_nbdist.viz.dashboard import dashboard as _dash
_d = _dash()
_spent, _opened, _refresh = [0.0], _t.perf_counter(), _d.refresh
def _timed_refresh():  # the polling thread's time in refreshes (wall clock)
    t = _t.perf_counter()
    try:
        return _refresh()
    finally:
        _spent[0] += _t.perf_counter() - t
_d.refresh = _timed_refresh
"""
CLOSE = "_d.close()\nprint(_spent[0], _t.perf_counter() - _opened)"


def main() -> dict:
    fe = Frontend()
    try:
        fe.run_ok(f"%load_ext mlx_nbdist\n%mlxdist start -n {RANKS}")
        fe.run_ok("%%mlxdist\n" + TP_SETUP + "\nstep()")
        # blocks[what][b]: the times of block b (even: closed, odd: open)
        blocks: dict[str, list[list[float]]] = {what: [] for what in CELLS}
        spent = wall = 0.0
        for b in range(BLOCKS):
            opened = b % 2 == 1
            if opened:
                fe.run_ok(OPEN)
            for what, code in CELLS.items():
                block = []
                for _ in range(PER_BLOCK[what]):
                    took, reply = fe.execute(code)
                    if reply["content"]["status"] != "ok":
                        raise RuntimeError(f"{code!r} failed: {reply['content']}")
                    block.append(took)
                blocks[what].append(block)
            if opened:
                used, open_for = map(float, fe.run_ok(CLOSE).split())
                spent, wall = spent + used, wall + open_for
        fe.run_ok("%mlxdist stop")
    finally:
        fe.close()
    out = {what: summarise(bs) for what, bs in blocks.items()}
    for row in out.values():
        row["refresh time share"] = spent / wall
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
