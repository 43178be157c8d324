"""Pulling a rank's slice to the notebook: its routes versus a pickled object.

``slices()`` of a local rank: the rank copies the slice into a shared-memory
segment of its pool that the notebook has mapped already (the notebook's array is
the segment), or where there is no ``/dev/shm`` the notebook copies it out of the
rank's memory (Linux ``process_vm_readv``); both timed, interleaved with memcpy of
the same bytes in the notebook (into new memory and into reused memory). A third series
pulls a size no segment fits, so each pull makes new segments (a first pull's cost). The
comparison returns the same array inside a dataclass, which ipyparallel pickles
in-band. memcpy of the same bytes is the physical limit. The pool route and memcpy
into new memory are measured again in ``ROUNDS - 1`` fresh sessions: their ratio is
reported per session and over all of them.
"""

from __future__ import annotations

import statistics

import numpy as np

from common import stats, time_it

import mlx_nbdist
from mlx_nbdist import Session
from mlx_nbdist.engine import rpc

MB = 64
REPS = 21
ROUNDS = 3  # sessions measuring the pool route against memcpy


def _pickled(name: str):  # runs on the ranks
    from mlx_nbdist.engine.rpc import slice_of
    from mlx_nbdist.results import TensorSlice

    meta, _info, data = slice_of(name, None)
    return TensorSlice(**{**meta, "data": data})  # one object: pickled in-band


_pickled.__module__ = "__main__"  # send by value: the ranks cannot import bench modules


def _pool_round(nbytes: int) -> tuple[list[float], list[float]]:
    """One session: the pool route and memcpy into new memory, interleaved."""
    with Session(2, timeout=300) as s:
        s.run(f"big = mx.ones(({nbytes // 4},), dtype=mx.float32) * rank\nmx.eval(big)")
        mlx_nbdist.slices("big", session=s)  # a first pull: the ranks make segments
        s.apply(rpc.settle)
        a = np.ones(2 * nbytes // 4, dtype=np.float32)
        pool, fresh = [], []
        for _ in range(REPS):
            pool.append(time_it(lambda: mlx_nbdist.slices("big", session=s)))
            fresh.append(time_it(a.copy))
        got = mlx_nbdist.slices("big", session=s)
        assert got[1].data.shape == (nbytes // 4,) and float(got[1].data[0]) == 1.0
    return pool, fresh


def main() -> dict:
    nbytes = MB * 2**20
    with Session(2, timeout=300) as s:
        s.run(f"big = mx.ones(({nbytes // 4},), dtype=mx.float32) * rank\nmx.eval(big)")
        mlx_nbdist.slices("big", session=s)  # a first pull: the ranks make segments
        s.apply(rpc.settle)
        routes = s.receiver.routes
        # memcpy of the same bytes, timed between the pulls (same moment, same load)
        a = np.ones(2 * nbytes // 4, dtype=np.float32)
        b = np.empty_like(a)
        np.copyto(b, a)
        pool, vm, mem, fresh = [], [], [], []
        for _ in range(REPS):  # the two routes and the two copies interleaved
            pool.append(time_it(lambda: mlx_nbdist.slices("big", session=s)))
            routes.remove("pool")  # the route taken where there is no /dev/shm
            vm.append(time_it(lambda: mlx_nbdist.slices("big", session=s)))
            routes.insert(0, "pool")
            mem.append(time_it(lambda: np.copyto(b, a)))
            fresh.append(time_it(a.copy))  # new memory: what any transfer of a new array pays
        # the first pull of a slice size: no segment fits, so the notebook reads rank
        # memory while each rank makes a segment in the background (for the next
        # pull). A larger array each time so that no segment fits, old ones dropped.
        s.run("from mlx_nbdist.engine import transfer\ntransfer.POOL_IDLE = 0")
        cold, cold_bytes = [], []
        for i in range(REPS):
            n = nbytes // 4 + (i + 1) * 2**18  # 1 MiB more each time
            s.run(f"big2 = mx.ones(({n},)) * rank\nmx.eval(big2)")
            cold.append(time_it(lambda: mlx_nbdist.slices("big2", session=s)))
            cold_bytes.append(2 * 4 * n)
            s.apply(rpc.settle)
        s.run("del big2\ntransfer.POOL_IDLE = 256 << 20")
        # after them: a 64 MB pickle slows whatever call comes next (measured: the
        # following pull takes twice as long), which would tax the interleaved routes
        pickled = [time_it(lambda: s.apply(_pickled, "big")) for _ in range(REPS)]
        got = mlx_nbdist.slices("big", session=s)
        assert got[1].data.shape == (nbytes // 4,) and float(got[1].data[0]) == 1.0
    # the pool route against memcpy again in fresh sessions: the ratio moves from one
    # session to the next (0.68x-0.91x seen), so it is reported per session and over all
    sessions = [(statistics.median(pool), statistics.median(fresh))]
    for _ in range(ROUNDS - 1):
        p, f = _pool_round(nbytes)
        sessions.append((statistics.median(p), statistics.median(f)))
        pool += p
        fresh += f
    total = 2 * nbytes  # both ranks' slices
    out = {}
    for name, samples, sizes in (("slices(), shared-memory pool", pool, None),
                                 ("slices(), read from the rank's memory", vm, None),
                                 ("slices(), first pull of a size", cold, cold_bytes),
                                 ("apply, pickled dataclass", pickled, None),
                                 ("numpy memcpy into a new array", fresh, None),
                                 ("numpy memcpy into a reused array", mem, None)):
        sizes = sizes or [total] * len(samples)
        rates = [b / t / 1e9 for b, t in zip(sizes, samples, strict=True)]
        out[name] = {**stats(samples), "GB/s": statistics.median(rates)}
    limit = out["numpy memcpy into a new array"]["GB/s"]
    for st in out.values():
        st["of memcpy"] = st["GB/s"] / limit
    out["slices(), shared-memory pool"]["by session"] = [
        {"median": p, "memcpy median": f, "of memcpy": f / p} for p, f in sessions]
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(main(), indent=1))
