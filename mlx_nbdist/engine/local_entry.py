"""Entry point of the engines the local launcher starts: ``python -m
mlx_nbdist.engine.local_entry [ipengine args...]``, which is ``python -m
ipyparallel.engine`` except that the controller's connection file is read only once
it is whole.

Local engines start while their controller starts (their imports overlap its own) and
read its connection file from the profile. ipengine waits until that file exists,
then reads it at once: an engine can catch the controller mid-write, read an empty or
cut file and exit with ``JSONDecodeError`` (a CI run lost a start to it).
ipyparallel's own reader in the notebook (``get_connection_info``) retries for the
same reason.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..config import CONNECTION_FILE_POLL_S


def wait_whole(path: str | Path, timeout: float, poll: float = CONNECTION_FILE_POLL_S) -> bool:
    """Wait up to ``timeout`` s until ``path`` holds one whole JSON document; whether
    it does (``False``: missing or cut when the time ran out, left to ipengine's own
    error)."""
    t_end = time.monotonic() + timeout
    while True:
        try:
            json.loads(Path(path).read_text())
            return True
        except (OSError, ValueError):
            if time.monotonic() >= t_end:
                return False
        time.sleep(poll)


def main() -> None:
    """Run the ipyparallel engine app with a connection-file reader that waits."""
    from ipyparallel.engine.app import IPEngine

    class Engine(IPEngine):
        def load_connection_file(self) -> None:
            if not self.connection_info_env:
                wait_whole(self.url_file, self.wait_for_url_file)
            super().load_connection_file()

    Engine.launch_instance()


if __name__ == "__main__":
    main()
