"""Restart after an undrainable failure, to the first correct all_sum (2 ranks).

A cell in which rank 1's process exits (``os._exit``) leaves the session broken; the
clock runs from there: ``Session.restart()`` (what ``%mlxdist restart`` calls) and a
cell whose ``all_sum`` of ones must equal the number of ranks on every rank. By
default the restart forms the group on the session's spare engines (started while it
ran, see mlx_nbdist.session.spare); ``spare=False`` starts new engines. Against:
a bare ipyparallel cluster in the same state, ``Cluster.restart_engines`` (what a
``%%px`` user has), waiting for the new engines, then ``mx.distributed.init`` and the
same ``all_sum``; and a fresh ``%mlxdist start`` (for reference: a restart need not
start anything the session still has).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import psutil
from common import stats

from mlx_nbdist import Session, runtime
from mlx_nbdist.engine.rpc import free_ports
from mlx_nbdist.errors import CellError

N = 2
REPS = 5
DIE = "import os, time\nif rank == 1:\n    os._exit(3)\ntime.sleep(1)"
CHECK = "float(mx.distributed.all_sum(mx.ones(1), group=world).item())"


def _check(values: list[str]) -> None:
    if any(float(v) != float(N) for v in values):
        raise RuntimeError(f"all_sum of ones on {N} ranks gave {values}")


def _wait_spare(s: Session, timeout: float = 120.0) -> None:
    t_end = time.monotonic() + timeout
    while s.spare_state != "ready":
        if time.monotonic() > t_end:
            raise RuntimeError(f"the spare is still {s.spare_state!r} after {timeout:g} s")
        time.sleep(0.05)


def ours(reps: int, spare: bool = True) -> tuple[list[float], list[float]]:
    """(restart times, fresh start times) of one session. With ``spare``, each
    restart starts once the spare is up (a user reads the error first: the spare
    is ready 2-4 s after a start or restart here); without, every restart starts
    its engines."""
    restarts, starts = [], []
    s = Session(N, timeout=120, spare=spare)
    try:
        t0 = time.perf_counter()
        s.start()
        _check([s.run(CHECK).ranks[r].result_text for r in range(N)])
        starts.append(time.perf_counter() - t0)
        for _ in range(reps):
            if spare:
                _wait_spare(s)
            try:
                s.run(DIE, timeout=30)
            except CellError:
                pass
            if s.state != "broken":
                raise RuntimeError(f"the session is {s.state} after a rank died, not broken")
            t0 = time.perf_counter()
            s.restart()
            _check([s.run(CHECK).ranks[r].result_text for r in range(N)])
            restarts.append(time.perf_counter() - t0)
    finally:
        s.stop()
    return restarts, starts


def _init_and_sum(rc, ids: list[int]) -> None:  # noqa: ANN001 - an ipyparallel Client
    with tempfile.TemporaryDirectory() as d:
        host = runtime.write_ring_hostfile(
            Path(d) / "h.json", [[f"127.0.0.1:{p}"] for p in free_ports(["127.0.0.1"] * N)]
        )
        code = ("import os; os.environ['MLX_RANK']='%d'; os.environ['MLX_HOSTFILE']=%r\n"
                "import mlx.core as mx\ng = mx.distributed.init(backend='ring', strict=True)\n"
                "v = mx.distributed.all_sum(mx.ones(1), group=g).item()")
        ars = [rc[e].execute(code % (i, str(host)), block=False) for i, e in enumerate(ids)]
        for ar in ars:
            ar.get(timeout=120)
        _check([str(rc[e]["v"]) for e in ids])


def bare(reps: int) -> list[float]:
    import ipyparallel as ipp

    out = []
    c = ipp.Cluster(n=N, controller_ip="127.0.0.1", log_level=40)
    try:
        rc = c.start_and_connect_sync()
        rc.wait_for_engines(N)
        ids = sorted(rc.ids)
        _init_and_sum(rc, ids)
        for _ in range(reps):
            old = set(rc.ids)
            try:
                rc[ids[1]].execute("import os; os._exit(3)", block=False).get(timeout=30)
            except Exception:  # noqa: BLE001 - the engine died, as meant
                pass
            t0 = time.perf_counter()
            c.restart_engines_sync()
            t_end = time.monotonic() + 120
            while len(set(rc.ids) - old) < N:
                if time.monotonic() > t_end:
                    raise RuntimeError("ipyparallel's restarted engines did not register")
                time.sleep(0.05)
            ids = sorted(set(rc.ids) - old)
            _init_and_sum(rc, ids)
            out.append(time.perf_counter() - t0)
    finally:
        c.stop_cluster_sync()
    return out


def idle_cost(seconds: float = 10.0) -> float:
    """CPU an idle spare's processes (controller, schedulers, engines) use, in % of one
    core, over ``seconds`` of a session doing nothing."""
    s = Session(N, timeout=120, spare=True)
    try:
        s.start()
        _wait_spare(s)
        procs = [psutil.Process(pid) for pid, _ in s._spare.cluster.processes([])]  # noqa: SLF001
        before = [p.cpu_times() for p in procs]
        time.sleep(seconds)
        after = [p.cpu_times() for p in procs]
    finally:
        s.stop()
    used = sum(a.user + a.system - b.user - b.system for a, b in zip(after, before, strict=True))
    return 100.0 * used / seconds


def main(reps: int = REPS) -> dict:
    idle = idle_cost()
    restarts, starts = ours(reps)
    cold, more_starts = ours(reps, spare=False)
    bare_restarts = bare(reps)
    return {
        "Session.restart() after a rank died + first all_sum": stats(restarts),
        "the same, spare=False (new engines)": stats(cold),
        "ipyparallel restart_engines + init + all_sum": stats(bare_restarts),
        "fresh %mlxdist start + first all_sum": stats(starts + more_starts),
        "idle spare, % of one core": idle,
    }


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
