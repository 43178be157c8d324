"""A Jupyter kernel whose cells run on every rank of an MLX group.

``python -m mlx_nbdist install-kernel -n 2 [--backend ring|mpi]`` installs a
kernelspec ("MLX distributed, 2 ranks") that starts::

    python -m mlx_nbdist.kernel -f {connection_file} \
        --MLXDistKernel.n=2 --MLXDistKernel.backend=ring

:class:`MLXDistKernel` is an ipykernel ``IPythonKernel``: at start it loads the
``mlx_nbdist`` magics, starts the session in a background thread (the kernel answers
the front end at once; the first cell waits for the group, showing progress) and
turns auto mode on (:mod:`mlx_nbdist.autopx`), so every cell runs on every rank;
``%%local`` runs a cell in the kernel itself and ``%mlxdist ...`` commands manage the
session. At shutdown it stops the session (and if the kernel is killed instead, the
ranks notice their client is gone and end themselves).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ipykernel.ipkernel import IPythonKernel
from traitlets import Bool, Float, Integer, Unicode

from . import __version__, config

KERNEL_MODULE = "mlx_nbdist.kernel"


class MLXDistKernel(IPythonKernel):
    """IPython kernel + an MLX session started with it; cells run on every rank."""

    implementation = "mlx_nbdist"
    implementation_version = __version__

    n = Integer(config.N, help="number of ranks").tag(config=True)
    backend = Unicode(
        str(config.BACKEND), help="MLX backend: " + ", ".join(b.value for b in config.Backend)
    ).tag(config=True)
    launcher = Unicode("", help="a launcher's name (empty: by backend)").tag(config=True)
    timeout = Float(
        config.CELL_TIMEOUT, help="default deadline of a cell in seconds (0: none)"
    ).tag(config=True)
    auto = Bool(True, help="run every cell on the ranks (auto mode)").tag(config=True)
    autostart = Bool(True, help="start the session when the kernel starts").tag(config=True)

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        from . import api, autopx, register_magics
        from .session import Session

        # not load_ipython_extension: this kernel starts its own session at once, for
        # its own number of ranks (engines started ahead would only compete with it)
        mag = register_magics(self.shell)
        self.shell.extension_manager.loaded.add("mlx_nbdist")  # a %load_ext cell: a no-op
        mag.n, mag.backend, mag.launcher = self.n, self.backend, self.launcher
        mag.timeout = self.timeout
        self.mlx_session = Session(
            self.n,
            backend=self.backend,
            launcher=self.launcher or None,
            timeout=self.timeout or None,
        )
        if self.autostart:
            api.start_in_background(self.mlx_session)
            # every cell, %%local ones included, starts once the group is ready
            self.shell.events.register("pre_run_cell", _wait_for_session)
        if self.auto:
            autopx.enable(self.shell)

    @property
    def banner(self) -> str:  # type: ignore[override]
        return (
            f"MLX distributed kernel: {self.n} ranks, backend={self.backend}. Cells run on "
            "every rank; %%local runs a cell here; %mlxdist status | dashboard | restart."
        )

    def do_shutdown(self, restart: bool) -> dict[str, Any]:  # type: ignore[override]
        from . import api

        try:
            _abort_start(self.mlx_session)
            self.mlx_session.stop()
            current = api.current_session(required=False)
            if current is not None and current is not self.mlx_session:
                current.stop()
        except Exception as e:  # noqa: BLE001 - the kernel must still shut down
            self.log.warning("mlx_nbdist: stopping the session failed: %s", e)
        return super().do_shutdown(restart)


def _abort_start(session: Any, budget: float = 2.0) -> None:
    """End a session that is still starting, fast.

    The front end sends SIGTERM about 2.5 s after its shutdown request (jupyter_client
    waits half of ``shutdown_wait_time``), which ends the kernel without ``atexit``:
    instead of waiting for the start, end every process it has launched so far
    until the start gives up.
    """
    from .api import background_start
    from .processes import end_pids

    thread = background_start()
    t_end = time.monotonic() + budget
    while thread is not None and thread.is_alive() and time.monotonic() < t_end:
        pids = session.processes()
        if pids:
            end_pids(pids, grace=0.5)
        thread.join(0.1)


def _wait_for_session(info: Any) -> None:
    from IPython.core.error import UsageError

    from .magics import wait_for_start

    try:
        wait_for_start()
    except UsageError as e:
        print(str(e), file=sys.stderr)


def kernel_name(n: int, backend: str = "ring") -> str:
    """The kernelspec's name, e.g. ``mlx-nbdist-2`` (``mlx-nbdist-2-mpi``)."""
    return f"mlx-nbdist-{n}" + ("" if backend == "ring" else f"-{backend}")


def kernel_spec(n: int, backend: str = "ring", launcher: str = "") -> dict[str, Any]:
    """The ``kernel.json`` of a distributed kernel of ``n`` ranks."""
    argv = [
        sys.executable,
        "-m",
        KERNEL_MODULE,
        "-f",
        "{connection_file}",
        f"--MLXDistKernel.n={n}",
        f"--MLXDistKernel.backend={backend}",
    ]
    if launcher:
        argv.append(f"--MLXDistKernel.launcher={launcher}")
    ranks = "rank" if n == 1 else "ranks"
    display = f"MLX distributed, {n} {ranks}" + ("" if backend == "ring" else f" ({backend})")
    return {
        "argv": argv,
        "display_name": display,
        "language": "python",
        "interrupt_mode": "signal",
        "metadata": {"debugger": False, "mlx_nbdist": {"n": n, "backend": backend}},
    }


def install(
    n: int = 2,
    *,
    backend: str = "ring",
    launcher: str = "",
    name: str | None = None,
    display_name: str | None = None,
    user: bool = False,
    prefix: str | None = None,
) -> str:
    """Install the kernelspec; returns the directory it was installed to.

    Args:
        n: number of ranks.
        backend: a :class:`~mlx_nbdist.config.Backend` value (``ring``, ``mpi``,
            ``nccl``, ``jaccl``).
        launcher: a launcher's name (empty: by backend).
        name: kernelspec name (default :func:`kernel_name`).
        display_name: the name the front end shows.
        user: install for the current user instead of ``sys.prefix``.
        prefix: install under this prefix (``<prefix>/share/jupyter/kernels``).
    """
    from jupyter_client.kernelspec import KernelSpecManager

    from .errors import SetupError

    if not isinstance(n, int) or n < 1:
        raise SetupError(f"-n must be a whole number of ranks >= 1, got {n!r}")
    names = [b.value for b in config.Backend]
    if backend not in names:
        raise SetupError(f"--backend must be one of {', '.join(names)}, got {backend!r}")
    spec = kernel_spec(n, backend, launcher)
    if display_name:
        spec["display_name"] = display_name
    name = name or kernel_name(n, backend)
    if not user and prefix is None:
        prefix = sys.prefix
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        path.mkdir()
        (path / "kernel.json").write_text(json.dumps(spec, indent=1))
        _copy_logos(path)
        return KernelSpecManager().install_kernel_spec(
            str(path), name, user=user, prefix=None if user else prefix
        )


def _copy_logos(dest: Path) -> None:
    try:
        import ipykernel

        res = Path(ipykernel.__file__).parent / "resources"
        for f in res.glob("logo-*.png"):
            shutil.copy(f, dest / f.name)
    except OSError:
        pass


def main() -> None:
    """Launch the kernel (the kernelspec's ``argv``)."""
    from ipykernel.kernelapp import IPKernelApp

    IPKernelApp.launch_instance(kernel_class=MLXDistKernel)


if __name__ == "__main__":
    from mlx_nbdist.kernel import main as _main  # the class under its importable name

    _main()
