"""Engines on this machine: ipyparallel's local engine-set launcher."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from .base import Launcher


class LocalLauncher(Launcher):
    """Every rank a child process of this machine's controller launcher."""

    name = "local"
    summary = "ipyparallel engines on this machine (the default without hosts)"
    takes_hosts = False

    def cluster_kwargs(self, directory: Path) -> dict[str, Any]:
        return {
            "engine_launcher_class": engines(),
            # the engines read the controller's connection file from the profile (they
            # wait for it) instead of having it passed in their environment, which
            # ipyparallel can only do once the controller is up: so they start while
            # it starts (their imports and its own overlap: -0.4 s of a start here),
            # and wait until the file is whole (mlx_nbdist.engine.local_entry)
            "send_engines_connection_env": False,
        }


#: the local engines' command: ipengine, reading the controller's connection file only
#: once it is whole (see mlx_nbdist.engine.local_entry)
ENGINE_CMD = [sys.executable, "-m", "mlx_nbdist.engine.local_entry"]


def engines() -> type:
    """The engine-set launcher class of local engines: ipyparallel's, whose engines
    keep their exit codes (see mlx_nbdist._ipp), running :data:`ENGINE_CMD`. (A class
    default, not a ``config=`` of the cluster: that would drop the cluster's default
    parent, the user's IPython.)"""
    from traitlets import List

    from .._ipp import engine_set_launcher

    class LocalEngines(engine_set_launcher()):  # type: ignore[misc]
        engine_cmd = List(list(ENGINE_CMD), config=True, help="command to launch an engine")

    return LocalEngines
