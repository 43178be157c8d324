"""Tensor-parallel training step: Megatron MLP 1024 -> 4096 -> 1024, batch 64.

1 rank unsharded versus 2 and 4 ranks sharded with ``shard_linear``. Sessions of 1, 2
and 4 ranks take turns, one at a time, for ``ROUNDS`` rounds, so that the machine's
speed drifting during the run (a shared VM) reaches every setup alike; each round's 2-
and 4-rank step time over the 1-rank one is kept beside the ratio over all rounds.
Only one session is up at a time (idle sessions' heartbeats and monitors would take CPU
from the 2-rank steps, which use both cores, more than from the 1-rank ones), and none
keeps a spare (``spare=False``: its start would overlap the timed steps). The time spent in
collectives is measured with the same all_sum the step issues (one in the forward at
the sharded-to-all layer, one in the backward at the all-to-sharded layer, each of the
activation's size), timed alone on the same ranks.
"""

from __future__ import annotations

import statistics
import warnings

from common import stats

from mlx_nbdist import Session
from mlx_nbdist.session import OversubscribedWarning

SETUP = """
import time
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.nn.layers.distributed import shard_linear

mx.random.seed(0)
model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024))
if size > 1:
    model.layers[0] = shard_linear(model.layers[0], "all-to-sharded", group=world)
    model.layers[2] = shard_linear(model.layers[2], "sharded-to-all", group=world)
x = mx.random.normal((64, 1024), key=mx.random.key(1))
y = mx.random.normal((64, 1024), key=mx.random.key(2))
opt = optim.SGD(learning_rate=0.01)
loss_and_grad = nn.value_and_grad(model, lambda m, x, y: ((m(x) - y) ** 2).mean())

def step():
    loss, grads = loss_and_grad(model, x, y)
    opt.update(model, grads)
    mx.eval(model.parameters(), opt.state, loss)

def timed(fn, reps, warm=2):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return ts

act = mx.ones((64, 1024))
def one_allsum():
    mx.eval(mx.distributed.all_sum(act, group=world))
"""


SIZES = (1, 2, 4)
ROUNDS = 5  # sessions of each size, taking turns
STEPS = 3  # steps timed in each


def _times(s: Session, call: str) -> list[float]:
    """Rank 0's timings from ``call`` (a ``timed(...)`` expression) in a cell."""
    r = s.run(f"_t = {call}\n_t")
    return [float(v) for v in r.ranks[0].result_text.strip("[]").split(",")]


def _turn(n: int) -> tuple[list[float], list[float]]:
    """One session of ``n`` ranks: its step times and (``n > 1``) all_sum times."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OversubscribedWarning)  # 4 ranks on 2 cores
        s = Session(n, timeout=600, spare=False)
    with s:
        s.run(SETUP)
        steps = _times(s, f"timed(step, {STEPS})")
        coll = _times(s, f"timed(one_allsum, {STEPS * 6})") if n > 1 else []
    return steps, coll


def main() -> dict:
    steps: dict[int, list[float]] = {n: [] for n in SIZES}
    coll: dict[int, list[float]] = {n: [] for n in SIZES}
    by_round: dict[int, list[float]] = {n: [] for n in SIZES}
    for _ in range(ROUNDS):
        for n in SIZES:
            ts, cs = _turn(n)
            steps[n] += ts
            coll[n] += cs
            by_round[n].append(statistics.median(ts))
    rows = {}
    for n in SIZES:
        row: dict = {"step": stats(steps[n])}
        if n > 1:
            c = stats(coll[n])
            row["all_sum 256 KB"] = c
            row["collective share"] = 2 * c["median"] / row["step"]["median"]
            row["speed-up vs 1 rank"] = statistics.median(steps[1]) / row["step"]["median"]
            row["ratio by round"] = [a / b for a, b in zip(by_round[n], by_round[1], strict=True)]
        rows["1 rank, unsharded" if n == 1 else f"{n} ranks, Megatron"] = row
    return rows


if __name__ == "__main__":
    import json

    print(json.dumps(main(), indent=1))
