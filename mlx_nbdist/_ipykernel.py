"""The one adapter over ipykernel's private API, and why each use is needed.

**Rank output** (:mod:`mlx_nbdist.engine.output`).
In a kernel, ``sys.stdout``/``sys.stderr`` are ipykernel ``OutStream`` objects, and
unless told otherwise each one *watches* its fd: fd 1 (2) is made the write end of a
pipe, and a thread of the stream forwards what arrives to the notebook and to the
original fd (the engine's log). :mod:`mlx_nbdist.engine.output` takes those pipes
over so that fd output and ``print`` output reach the notebook in the order they
were written: it must tell whether a stream watches (its pipe's read end, ``_fid``,
and ``_should_watch``), wait for that pipe to empty, and stop and restart the
forwarding (``_should_watch``). ipykernel has no public API for any of this. The
original fd is public: a watching stream's ``fileno()``. A flush with nothing to send
still waits for the kernel's IO thread, so a rank's stream skips it, and only when the
``OutStream`` holds no text either (``_flush_pending``, set by its ``write`` until its
IO thread sends): text written to it past our wrapper must still go with its cell.

**Kernel subshells for the dashboard's buttons** (:mod:`mlx_nbdist.viz.dashboard`).
A widget click waits behind a running cell unless the kernel delivers it to a
subshell (JEP 91, ipykernel >= 7.4). Asking for a subshell is public (a
``create_subshell_request`` on the control channel), but two things have no public
API, so they are read here and nowhere else:

* ``kernel._supports_kernel_subshells``: whether this kernel has subshells at all
  (without it, the request would wait out its timeout on older kernels);
* ``comm._reply_subshell_for`` / ``comm._reply_subshell_id``: the subshell a comm's
  incoming messages go to. ipykernel sets it when the comm last published from a
  subshell; the dashboard sets it once so its buttons' clicks reach the subshell's
  thread, which runs while a cell runs.

**Cell file names for stacks** (:mod:`mlx_nbdist.session.stacks`).
A rank's stack names a cell by the file name ipykernel compiled it under
(``<tmp>/ipykernel_<pid>/<murmur2 of the cell's text>.py``). ipykernel makes that name
in ``ipykernel.compiler`` (``murmur2_x86``, ``get_tmp_hash_seed``: public functions,
but the naming scheme is ipykernel's own choice, not an API), so the notebook can
tell which of its cells a frame is in and show that line.

Checked against ipykernel 6.29 and 7.4.
"""

from __future__ import annotations

import time
from typing import Any


def watched_pipe(out: Any) -> int | None:
    """The read end of the pipe ``out`` (an ``OutStream``) forwards its fd from, or
    ``None`` when it does not watch its fd."""
    watching = bool(getattr(out, "_should_watch", False))
    fid = getattr(out, "_fid", None)
    original = getattr(out, "_original_stdstream_copy", None)
    return int(fid) if watching and fid is not None and original is not None else None


def flush_pending(out: Any) -> bool:
    """Whether ``out`` (an ``OutStream``) holds text its IO thread has not sent yet
    (``True`` when it cannot tell: not an ``OutStream``, or another ipykernel)."""
    return bool(getattr(out, "_flush_pending", True))


def set_forwarding(out: Any, on: bool) -> None:
    """Let ``out``'s thread forward its pipe (``on``) or stop it; a stopped thread
    stays blocked on its idle pipe, and the stream's ``close`` does not wait for it."""
    out._should_watch = on

_SUBSHELL: dict[int, str | None] = {}


def control_subshell(timeout: float = 5.0) -> str | None:
    """A subshell of this kernel for the dashboard's buttons (created once), or None.

    Sends ``create_subshell_request`` on the kernel's own control channel, as a
    front end would. ``None`` outside a kernel or where the kernel has no subshells.
    """
    try:
        from IPython import get_ipython

        kernel = getattr(get_ipython(), "kernel", None)
    except ImportError:  # pragma: no cover
        return None
    if kernel is None or not getattr(kernel, "_supports_kernel_subshells", False):
        return None
    if id(kernel) in _SUBSHELL:
        return _SUBSHELL[id(kernel)]
    sid = None
    try:
        from ipykernel.connect import get_connection_file
        from jupyter_client import BlockingKernelClient

        kc = BlockingKernelClient(connection_file=get_connection_file())
        kc.load_connection_file()
        kc.start_channels(shell=False, iopub=False, stdin=False, hb=False, control=True)
        try:
            msg = kc.session.msg("create_subshell_request", {})
            kc.control_channel.send(msg)
            t_end = time.monotonic() + timeout
            while time.monotonic() < t_end:
                reply = kc.control_channel.get_msg(timeout=max(0.1, t_end - time.monotonic()))
                if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                    if reply["content"].get("status") == "ok":
                        sid = reply["content"]["subshell_id"]
                    break
        finally:
            kc.stop_channels()
    except Exception:  # noqa: BLE001 - no subshell: the buttons work between cells
        sid = None
    _SUBSHELL[id(kernel)] = sid
    return sid


def route_to_subshell(widgets: list[Any], subshell_id: str | None) -> bool:
    """Have the kernel deliver these widgets' front-end messages to the subshell.

    ipykernel >= 7.4 routes a comm's incoming messages to ``comm._reply_subshell_id``
    (set when the comm last published from a subshell); setting it here sends the
    buttons' clicks to the dashboard's subshell thread, which runs while a cell runs.
    """
    if subshell_id is None:
        return False
    ok = True
    for wdg in widgets:
        comm = getattr(wdg, "comm", None)
        if comm is None or not hasattr(comm, "_reply_subshell_for"):
            ok = False
            continue
        comm._reply_subshell_id = subshell_id
    return ok


def cell_file_name(source: str) -> str | None:
    """The last part of the file name an ipykernel kernel runs ``source`` as (``None``
    when this ipykernel names cells otherwise)."""
    try:
        from ipykernel.compiler import get_tmp_hash_seed, murmur2_x86

        return f"{murmur2_x86(source, get_tmp_hash_seed())}.py"
    except Exception:  # noqa: BLE001 - another ipykernel: frames show the file instead
        return None
