"""Both launch paths, 2 and 4 ranks (4 oversubscribed on 2 cores)."""

from __future__ import annotations

import sys
import warnings

import pytest

from mlx_nbdist import CellError, Session, SetupError
from mlx_nbdist.results import DRAINED, ERROR
from mlx_nbdist.session import OversubscribedWarning

from .conftest import session_pids, wait_gone

COLLECTIVES = """
s = mx.distributed.all_sum(mx.ones(2) * (rank + 1), group=world)
g = mx.distributed.all_gather(mx.array([rank]), group=world)
mx.eval(s, g)  # every rank must run its collectives in the same order
nxt, prv = (rank + 1) % size, (rank - 1) % size
if rank % 2 == 0:
    mx.eval(mx.distributed.send(mx.array([rank * 100]), nxt, group=world))
    r = mx.distributed.recv((1,), mx.int32, prv, group=world)
else:
    r = mx.distributed.recv((1,), mx.int32, prv, group=world)
    mx.eval(r)
    mx.eval(mx.distributed.send(mx.array([rank * 100]), nxt, group=world))
print(s.tolist(), g.tolist(), r.item())
"""


def check_collectives(s: Session) -> None:
    n = s.n
    res = s.run(COLLECTIVES, timeout=120)
    total = float(sum(range(1, n + 1)))
    for k in range(n):
        assert res.stdout(k).strip() == f"{[total, total]} {list(range(n))} {((k - 1) % n) * 100}"


@pytest.mark.parametrize("backend", ["ring", "mpi"])
def test_four_ranks_oversubscribed(backend: str) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = Session(4, backend=backend, timeout=120)
        s.start()
    try:
        assert any(issubclass(w.category, OversubscribedWarning) for w in caught)
        assert sorted(s.ranks) == [0, 1, 2, 3]
        check_collectives(s)
    finally:
        pids = session_pids(s)
        s.stop()
    assert wait_gone(pids, timeout=15) == []


def test_mpi_two_ranks_with_mpi4py_and_failure_drain() -> None:
    s = Session(2, backend="mpi", timeout=60).start()
    try:
        assert s.launcher == "mpi"
        check_collectives(s)
        r = s.run("from mpi4py import MPI\nprint(MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())")
        assert [r.stdout(k).split() for k in (0, 1)] == [["0", "2"], ["1", "2"]]
        with pytest.raises(CellError) as info:
            s.run("if rank == 0:\n    raise ValueError('x')\nmx.eval(mx.distributed.all_sum(mx.ones(2), group=world))")
        assert info.value.result.ranks[0].status == ERROR
        assert info.value.result.ranks[1].status == DRAINED
        assert s.state == "ready"
        check_collectives(s)
    finally:
        pids = session_pids(s)
        s.stop()
    assert wait_gone(pids, timeout=15) == []


def test_missing_mpirun_names_the_package(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SetupError, match=r"pip install 'mlx_nbdist\[mpi\]'"):
        Session(2, launcher="mpi").start()


def test_mpi_backend_needs_mpi_launcher() -> None:
    with pytest.raises(SetupError, match="--backend mpi needs --launcher mpi"):
        Session(2, backend="mpi", launcher="local").start()
