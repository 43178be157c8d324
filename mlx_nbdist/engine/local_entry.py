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
from collections.abc import Callable
from pathlib import Path

from ..config import CONNECTION_FILE_POLL_S


def wait_whole(
    path: str | Path,
    timeout: float,
    poll: float = CONNECTION_FILE_POLL_S,
    on_wait: Callable[[], None] = lambda: None,
) -> bool:
    """Wait up to ``timeout`` s until ``path`` holds one whole JSON document; whether
    it does (``False``: missing or cut when the time ran out, left to ipengine's own
    error). ``on_wait`` is called once, when the first read finds it not whole."""
    t_end = time.monotonic() + timeout
    waited = False
    while True:
        try:
            json.loads(Path(path).read_text())
            return True
        except (OSError, ValueError):
            if time.monotonic() >= t_end:
                return False
            if not waited:
                waited = True
                on_wait()
        time.sleep(poll)


def main() -> None:
    """Run the ipyparallel engine app with a connection-file reader that waits."""
    from ipyparallel.engine.app import IPEngine as Base

    class IPEngine(Base):  # the same name: the engine's log lines and config sections
        def load_connection_file(self) -> None:
            if not self.connection_info_env:
                wait_whole(
                    self.url_file,
                    self.wait_for_url_file,
                    on_wait=lambda: self.log.info(
                        "Connection file %r is not whole yet: waiting", self.url_file
                    ),
                )
            super().load_connection_file()

    IPEngine.launch_instance()


if __name__ == "__main__":
    main()
