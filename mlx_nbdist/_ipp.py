"""The one adapter over ipyparallel's private API, and why each use is needed.

``DirectView.execute`` sends the request before the caller can attach anything to
the message's future, so a callback added afterwards misses (or, replaying what was
collected, duplicates) the first output messages: ipyparallel's own
``AsyncResult.stream_output`` carries a FIXME for that race. ``Client
.send_execute_request`` takes a ``message_future_hook`` that runs before the
message is sent; calling it needs the view's socket (``view._socket``) and the
client's target resolution (``client._build_targets``), which are private.

The per-engine futures of an ``AsyncResult`` (``ar._children``): the supervisor
waits on each rank's separately, to tell which rank failed, hung or died; the
public API offers only the result as a whole. :func:`futures_of`.

A client closed by :meth:`Client.close` (``client._closed``): the dashboard must not
poll a closed client. :func:`client_closed`.

A local engine's exit status: ipyparallel's launcher reaps its engine in a
background thread (``LocalProcessLauncher._wait``) and hands the exit code to its
event loop, which, inside a kernel busy running the cell, runs too late (or never);
the session cannot reap the process itself either (the thread got there first).
:func:`engine_set_launcher` keeps the code on the launcher's process object as soon
as that thread has it.

Checked against ipyparallel 9.x.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any


def execute_streaming(
    view: Any, code: str, label: str, on_message: Callable[[int, dict[str, Any]], None]
) -> Any:
    """Like ``view.execute(code, silent=False, block=False, label=label)``, calling
    ``on_message(engine_id, msg)`` for every iopub message of each engine's request,
    from the first one on (from ipyparallel's IO thread)."""
    from ipyparallel.client.asyncresult import AsyncResult

    client = view.client
    idents, targets = client._build_targets(view.targets)
    futures = []
    for ident, eid in zip(idents, targets, strict=True):

        def hook(fut: Any, eid: int = eid) -> None:
            fut.iopub_callbacks.append(partial(on_message, eid))

        futures.append(
            client.send_execute_request(
                view._socket,
                code,
                silent=False,
                ident=ident,
                metadata={"label": label},
                message_future_hook=hook,
            )
        )
    return AsyncResult(client, futures, fname="execute", targets=targets, owner=True)


def futures_of(ar: Any) -> list[Any]:
    """The per-engine futures of an ``AsyncResult``, in target order."""
    return list(ar._children)


def client_closed(client: Any) -> bool:
    """Whether ``client.close()`` has run (it keeps the object usable-looking)."""
    return bool(getattr(client, "_closed", False))


def engine_set_launcher() -> type:
    """ipyparallel's local engine-set launcher, whose engines keep their exit code on
    ``launcher.process.exit_code`` (``None`` while running or when unknown) and start
    one after the other without a pause."""
    import psutil
    from ipyparallel.cluster.launcher import LocalEngineLauncher, LocalEngineSetLauncher

    class Recorded(psutil.Process):
        """The launcher's waiting thread calls ``wait``: keep what it returns."""

        exit_code: int | None = None

        def wait(self, timeout: float | None = None) -> int | None:
            code = super().wait(timeout)
            if code is not None:
                self.exit_code = code
            return code

    class EngineLauncher(LocalEngineLauncher):
        def notify_start(self, data: Any) -> Any:
            # called by ``start`` after it made ``self.process``, before the waiting
            # thread starts using it
            self.process = Recorded(self.process.pid)
            return super().notify_start(data)

    class EngineSetLauncher(LocalEngineSetLauncher):
        launcher_class = EngineLauncher
        #: ipyparallel waits 0.1 s between two local engines' launches; nothing needs it
        delay = 0.0

    return EngineSetLauncher
