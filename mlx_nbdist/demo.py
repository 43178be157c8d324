"""The main job of ``make demo``: a tensor-parallel MLP on N ranks, checked against
the unsharded model."""

from __future__ import annotations

import time

from .session import Session

MLP_CELL = """
import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_linear

mx.random.seed(0)                       # the same weights on every rank
full = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
x = mx.random.normal((8, 64), key=mx.random.key(1))
y_full = full(x)

tp = nn.Sequential(
    shard_linear(full.layers[0], "all-to-sharded", group=world),   # column parallel
    nn.ReLU(),
    shard_linear(full.layers[2], "sharded-to-all", group=world),   # row parallel: one all_sum
)
y_tp = tp(x)
err = mx.abs(y_tp - y_full).max().item()
print(f"rank {rank}/{size}: up.weight {tuple(tp.layers[0].weight.shape)} of "
      f"{tuple(full.layers[0].weight.shape)}, down.weight {tuple(tp.layers[2].weight.shape)}; "
      f"max |y_tp - y_full| = {err:.2e}")
assert err < 1e-5, f"rank {rank}: tensor-parallel output differs from the full model by {err}"
"""


def run_demo(n: int = 2) -> int:
    """Start ``n`` ranks, run the tensor-parallel MLP cell, print per rank, stop."""
    t0 = time.monotonic()
    with Session(n) as s:
        print(f"started {n} ranks ({s.backend} backend) in {time.monotonic() - t0:.1f} s")
        for r, info in s.ranks.items():
            print(f"  rank {r}: {info.device}, pid {info.pid}")
        result = s.run(MLP_CELL)
        for r, out in result.ranks.items():
            print(f"[rank {r}] {out.stdout.strip()}")
    print(f"demo ok: tensor-parallel MLP equals the unsharded model on {n} ranks")
    return 0
