"""Start-up: %mlxdist start to the first collective, versus a bare ipyparallel cluster
plus ``mx.distributed.init``, versus ``mlx.launch`` of an empty script."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import bin_path, stats

from mlx_nbdist import Session, runtime
from mlx_nbdist.engine.rpc import free_ports

REPS = 3


def ours(n: int) -> float:
    t0 = time.perf_counter()
    s = Session(n).start()
    s.run("mx.eval(mx.distributed.all_sum(mx.ones(1), group=world))")
    t = time.perf_counter() - t0
    s.stop()
    return t


def bare(n: int) -> float:
    import ipyparallel as ipp

    t0 = time.perf_counter()
    c = ipp.Cluster(n=n, controller_ip="127.0.0.1", log_level=40)
    rc = c.start_and_connect_sync()
    rc.wait_for_engines(n)
    with tempfile.TemporaryDirectory() as d:
        host = runtime.write_ring_hostfile(
            Path(d) / "h.json", [[f"127.0.0.1:{p}"] for p in free_ports(["127.0.0.1"] * n)]
        )
        ars = [
            rc[e].execute(
                "import os; os.environ['MLX_RANK']='%d'; os.environ['MLX_HOSTFILE']=%r\n"
                "import mlx.core as mx\ng = mx.distributed.init(backend='ring', strict=True)\n"
                "mx.eval(mx.distributed.all_sum(mx.ones(1), group=g))" % (i, str(host)),
                block=False,
            )
            for i, e in enumerate(sorted(rc.ids))
        ]
        for ar in ars:
            ar.get(timeout=120)
    t = time.perf_counter() - t0
    c.stop_cluster_sync()
    return t


def mlx_launch(n: int, failed: list[str]) -> float:
    """One run of ``mlx.launch``; a run in which not every rank printed (mlx.launch
    exits 0 even then) is noted in ``failed`` (its stderr's tail) and run again on
    fresh ports, at most twice."""
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "empty.py"
        script.write_text(
            "import mlx.core as mx\ng = mx.distributed.init(backend='ring', strict=True)\n"
            "mx.eval(mx.distributed.all_sum(mx.ones(1), group=g))\nprint('DONE', flush=True)\n"
        )
        for _ in range(3):
            port = free_ports(["127.0.0.1"])[0]
            t0 = time.perf_counter()
            p = subprocess.run([bin_path("mlx.launch"), "--backend", "ring", "-n", str(n),
                                "--starting-port", str(port), "--", sys.executable, str(script)],
                               capture_output=True, text=True, timeout=300)  # fmt: skip
            t = time.perf_counter() - t0
            if p.stdout.count("DONE") == n:
                return t
            failed.append(f"exit {p.returncode}, {p.stdout.count('DONE')} of {n} ranks: "
                          f"{p.stderr.strip()[-500:]}")
        raise RuntimeError("mlx.launch did not run the script three times:\n" + "\n".join(failed))


def main() -> dict:
    out = {}
    for n in (2, 4):
        row = {}
        failed: list[str] = []
        for name, fn in (("%mlxdist start + first all_sum", ours),
                         ("bare ipp.Cluster + init + all_sum", bare),
                         ("mlx.launch empty script", functools.partial(mlx_launch, failed=failed))):
            row[name] = stats([fn(n) for _ in range(REPS)])
        row["mlx.launch empty script"]["failed"] = failed  # runs not counted (retried)
        out[f"{n} ranks"] = row
    return out


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    print(json.dumps(main(), indent=1))
