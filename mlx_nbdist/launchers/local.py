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
        from traitlets.config import Config

        from .._ipp import engine_set_launcher

        cfg = Config()
        # ipengine, reading the controller's connection file only once it is whole
        cfg.LocalEngineSetLauncher.engine_cmd = [
            self.python or sys.executable,
            "-m",
            "mlx_nbdist.engine.local_entry",
        ]
        return {
            "config": cfg,
            "engine_launcher_class": engine_set_launcher(),  # engines keep exit codes
            # the engines read the controller's connection file from the profile (they
            # wait for it) instead of having it passed in their environment, which
            # ipyparallel can only do once the controller is up: so they start while
            # it starts (their imports and its own overlap: -0.4 s of a start here),
            # and wait until the file is whole (mlx_nbdist.engine.local_entry)
            "send_engines_connection_env": False,
        }
