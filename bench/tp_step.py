"""Tensor-parallel training step: Megatron MLP 1024 -> 4096 -> 1024, batch 64.

1 rank unsharded versus 2 and 4 ranks sharded with ``shard_linear``. The time spent in
collectives is measured with the same all_sum the step issues (one in the forward at
the sharded-to-all layer, one in the backward at the all-to-sharded layer, each of the
activation's size), timed alone on the same ranks.
"""

from __future__ import annotations

from common import stats

from mlx_nbdist import Session

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

def timed(fn, reps):
    fn(); fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return ts

act = mx.ones((64, 1024))
def one_allsum():
    mx.eval(mx.distributed.all_sum(act, group=world))
"""


def measure(n: int, reps: int = 6) -> dict:
    with Session(n, timeout=600) as s:
        s.run(SETUP)
        r = s.run(f"_t = timed(step, {reps})\n_t")
        steps = [float(v) for v in r.ranks[0].result_text.strip("[]").split(",")]
        coll = []
        if n > 1:
            r = s.run(f"_c = timed(one_allsum, {reps * 3})\n_c")
            coll = [float(v) for v in r.ranks[0].result_text.strip("[]").split(",")]
    st = stats(steps)
    out = {"step": st}
    if coll:
        c = stats(coll)
        out["all_sum 256 KB"] = c
        out["collective share"] = 2 * c["median"] / st["median"]
    return out


def main() -> dict:
    base = measure(1)
    rows = {"1 rank, unsharded": base}
    for n in (2, 4):
        row = measure(n)
        row["speed-up vs 1 rank"] = base["step"]["median"] / row["step"]["median"]
        rows[f"{n} ranks, Megatron"] = row
    return rows


if __name__ == "__main__":
    import json

    print(json.dumps(main(), indent=1))
