"""Pulling a rank's slice to the notebook: its routes versus a pickled object.

``slices()`` copies a local rank's slice straight out of its memory (Linux
``process_vm_readv``), or where that is refused maps it from ``/dev/shm``; both are
timed, interleaved. The comparison returns the same array inside a dataclass, which
ipyparallel pickles in-band. memcpy of the same bytes is the physical limit.
"""

from __future__ import annotations

import time

import numpy as np

from common import stats, time_it

import mlx_nbdist
from mlx_nbdist import Session, models

MB = 64
REPS = 11


def _pickled(name: str):  # runs on the ranks
    from mlx_nbdist.engine.remote import slice_of
    from mlx_nbdist.results import TensorSlice

    meta, _info, data = slice_of(name, None)
    return TensorSlice(**{**meta, "data": data})  # one object: pickled in-band


_pickled.__module__ = "__main__"  # send by value: the ranks cannot import bench modules

def main() -> dict:
    nbytes = MB * 2**20
    with Session(2, timeout=300) as s:
        s.run(f"big = mx.ones(({nbytes // 4},), dtype=mx.float32) * rank\nmx.eval(big)")
        mlx_nbdist.slices("big", session=s)
        zero, shm = [], []
        for _ in range(REPS):  # the two routes interleaved
            zero.append(time_it(lambda: mlx_nbdist.slices("big", session=s)))
            models._NO_VM.add(s)  # the route taken where rank memory cannot be read
            shm.append(time_it(lambda: mlx_nbdist.slices("big", session=s)))
            models._NO_VM.discard(s)
        # after them: a 64 MB pickle slows whatever call comes next (measured: the
        # following pull takes twice as long), which would tax the interleaved routes
        pickled = [time_it(lambda: s.apply(_pickled, "big")) for _ in range(REPS)]
        got = mlx_nbdist.slices("big", session=s)
        assert got[1].data.shape == (nbytes // 4,) and float(got[1].data[0]) == 1.0
    a = np.ones(2 * nbytes // 4, dtype=np.float32)
    b = np.empty_like(a)
    np.copyto(b, a)
    mem, fresh = [], []
    for _ in range(REPS):
        t0 = time.perf_counter()
        np.copyto(b, a)
        mem.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        c = a.copy()  # into new memory: what any transfer of a new array must pay
        fresh.append(time.perf_counter() - t0)
        del c
    total = 2 * nbytes  # both ranks' slices
    out = {}
    for name, samples in (("slices(), read from the rank's memory", zero),
                          ("slices(), through /dev/shm", shm),
                          ("apply, pickled dataclass", pickled),
                          ("numpy memcpy into a new array", fresh),
                          ("numpy memcpy into a reused array", mem)):
        st = stats(samples)
        out[name] = {**st, "GB/s": total / st["median"] / 1e9}
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(main(), indent=1))
