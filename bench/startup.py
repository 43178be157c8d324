"""Start-up: %mlxdist start to the first collective, versus a bare ipyparallel cluster
plus ``mx.distributed.init``, versus ``mlx.launch`` of an empty script."""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import mlx_launch, stats

from mlx_nbdist import Session, runtime
from mlx_nbdist.session import standby
from mlx_nbdist.session.spare import SpareState
from mlx_nbdist.engine.rpc import free_ports

REPS = 3
#: the rows of a start on engines started at %load_ext (see :func:`ahead`)
AHEAD = "%mlxdist start on engines started at %load_ext + first all_sum"
AT_ONCE = "%load_ext and %mlxdist start back to back + first all_sum"


def ours(n: int, t0: float | None = None, said: list[str] | None = None) -> float:
    t0 = time.perf_counter() if t0 is None else t0
    s = Session(n).start(None if said is None else said.append)
    s.run("mx.eval(mx.distributed.all_sum(mx.ones(1), group=world))")
    t = time.perf_counter() - t0
    s.stop()
    return t


def ahead(n: int, wait: bool) -> float:
    """A start on the engines ``%load_ext`` started (:func:`mlx_nbdist.prewarm`):
    ``wait``, they came up while the user read the notebook, and only the start is
    timed; else the two back to back (Run All), timed together."""
    t0 = time.perf_counter()
    assert standby.prewarm(n), "engines ahead are off (MLX_NBDIST_PREWARM)"
    if wait:
        while standby.state() == SpareState.STARTING:
            time.sleep(0.01)
        assert standby.state() == SpareState.READY, standby.state()
        t0 = time.perf_counter()
    said: list[str] = []
    t = ours(n, t0, said)
    # timed on them, not on a start that gave them up
    assert standby.state() == SpareState.NONE and any("already started" in m for m in said), said
    return t


def bare(n: int, failed: list[str]) -> float:
    """A bare ipyparallel cluster whose engines join a ring; a run whose group did not
    form (a port picked for a rank taken before it bound it: MLX's "Couldn't bind
    socket", the others then wait in accept forever) goes in ``failed`` and is run
    again."""
    import ipyparallel as ipp

    for _ in range(3):
        t0 = time.perf_counter()
        c = ipp.Cluster(n=n, controller_ip="127.0.0.1", log_level=40)
        rc = None
        try:
            rc = c.start_and_connect_sync()
            rc.wait_for_engines(n)
            with tempfile.TemporaryDirectory() as d:
                host = runtime.write_ring_hostfile(
                    Path(d) / "h.json",
                    [[f"127.0.0.1:{p}"] for p in free_ports(["127.0.0.1"] * n)],
                )
                ars = [
                    rc[e].execute(
                        "import os; os.environ['MLX_RANK']='%d'; os.environ['MLX_HOSTFILE']=%r\n"
                        "import mlx.core as mx\ng = mx.distributed.init(backend='ring', "
                        "strict=True)\nmx.eval(mx.distributed.all_sum(mx.ones(1), group=g))"
                        % (i, str(host)),
                        block=False,
                    )
                    for i, e in enumerate(sorted(rc.ids))
                ]
                for ar in ars:
                    ar.get(timeout=60)
            return time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - counted, and run again
            failed.append(f"{type(e).__name__}: {e}")
        finally:
            if rc is not None:
                rc.close()
            c.stop_cluster_sync()
    raise RuntimeError(f"the bare cluster's group did not form in 3 runs: {failed[-3:]}")


#: what MLX's ring prints (``MLX_RING_VERBOSE=1``) when a rank's first connection
#: was refused (its peer not listening yet) and it sleeps before the next try
RING_RETRY = "waiting 1000 ms"


def launched(n: int, failed: list[str], retried: list[bool]) -> float:
    """``mlx.launch`` of the empty script; runs in which not every rank printed go in
    ``failed`` (and are run again, see :func:`common.mlx_launch`); ``retried`` gets,
    per run, whether MLX's ring slept 1 s in a connection retry."""
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "empty.py"
        script.write_text(
            "import mlx.core as mx\ng = mx.distributed.init(backend='ring', strict=True)\n"
            "mx.eval(mx.distributed.all_sum(mx.ones(1), group=g))\nprint('DONE', flush=True)\n"
        )
        _, elapsed, err = mlx_launch(n, [sys.executable, str(script)],
                                     ok=lambda out: out.count("DONE") == n, failed=failed,
                                     env={"MLX_RING_VERBOSE": "1"})
        retried.append(RING_RETRY in err)
        return elapsed


def main() -> dict:
    out = {}
    for n in (2, 4):
        row = {}
        failed: list[str] = []
        retried: list[bool] = []
        bare_failed: list[str] = []
        for name, fn in (("%mlxdist start + first all_sum", ours),
                         (AHEAD, lambda n: ahead(n, wait=True)),
                         (AT_ONCE, lambda n: ahead(n, wait=False)),
                         ("bare ipp.Cluster + init + all_sum", functools.partial(bare, failed=bare_failed))):
            row[name] = stats([fn(n) for _ in range(REPS)])
        row["bare ipp.Cluster + init + all_sum"]["failed"] = bare_failed
        # bimodal (MLX's ring retry or not): more runs for its median
        times = [launched(n, failed, retried) for _ in range(3 * REPS)]
        launch = row["mlx.launch empty script"] = stats(times)
        launch["failed"] = failed  # runs not counted (retried)
        launch["ring retries"] = sum(retried)
        clean = [t for t, r in zip(times, retried, strict=True) if not r]
        launch["median without ring retry"] = statistics.median(clean) if clean else None
        out[f"{n} ranks"] = row
    return out


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    print(json.dumps(main(), indent=1))
