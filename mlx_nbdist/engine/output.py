"""A rank's output as it reaches the notebook: ordered, bounded, never lost, well formed.

The bootstrap installs this once per rank (:func:`install`), and the cell hooks call
:func:`begin_cell` and :func:`end_cell` (the latter before the cell's reply is sent).
It wraps the kernel's two ``OutStream`` objects (``sys.stdout``, ``sys.stderr``) and
keeps their batching (one iopub ``stream`` message per ~0.2 s per stream), adding:

* **Order.** Writing to one stream first flushes what the other one holds, so the
  ``stream`` messages come in the order the text was written
  (``print('a'); print('b', file=sys.stderr); print('c')`` gives a, b, c).
* **File-descriptor output.** fd 1 and 2 are pipes read by a thread of this module
  (a subprocess, ``os.write(1, ...)``, C/C++ code such as MLX's logging): the bytes
  are decoded as UTF-8 (incrementally, ``errors='replace'``), written to the stream,
  and echoed to the engine's original stdout/stderr (its log file), as ipykernel
  does. :func:`end_cell` reads what is still in the pipes before it returns, so
  nothing written before the cell ended is lost, and a flush of ``sys.stdout`` /
  ``sys.stderr`` (the kernel flushes before a display or the cell's result) forwards
  what the pipes hold first. So does a write from Python when a pipe holds bytes
  (one ``poll`` with no wait per write): what a subprocess or a forked child wrote
  before the cell's next ``print`` comes first. When ipykernel already watches the fds (it does,
  unless the engine's environment says it runs under pytest), its pipes are taken
  over: it stops forwarding, and :func:`uninstall` gives them back. Otherwise the
  logging handlers that wrote to fd 1/2 (the engine's own log) are moved to the
  original fds, as ipyparallel does when ipykernel watches. ``sys.stdout.fileno()``
  is the original fd (the log), as with ipykernel. A forked child (``os.fork``,
  ``multiprocessing``) writes its ``sys.stdout``/``sys.stderr`` lines into the pipes,
  so the parent forwards them.
* **A binary buffer.** ``sys.stdout.buffer`` / ``sys.stderr.buffer`` accept bytes,
  decoded into the stream (``errors='replace'``).
* **Well-formed text.** Lone surrogates (``'\\udcff'``) and undecodable bytes become
  U+FFFD; nothing in this path raises for the text it is given.
* **A bound.** At most ``limit`` characters (default :data:`DEFAULT_LIMIT`, 2**20,
  shown as "1.0 MiB") of a cell's output per rank go to the notebook, stdout and
  stderr together (the count starts at :func:`begin_cell`); the
  rest of the cell's output is appended to :func:`overflow_path`
  (``<folder>/output/cell<N>-rank<R>.txt``) and one notice line (:func:`notice`,
  matched by :data:`NOTICE_RE`) is written to the stream that crossed the limit::

      [rank 0: output past 1.0 MiB is in /tmp/.../output/cell7-rank0.txt]

  ``\\r`` progress lines count like any other text.

Nothing here may break a cell: every failure in the output path is swallowed (the
text then goes to the engine's log, when there is one).
"""

from __future__ import annotations

import atexit
import codecs
import contextlib
import io
import os
import re
import select
import selectors
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .. import _ipykernel

#: characters of one cell's output (per rank, stdout and stderr together) that reach
#: the notebook; past this, the rest goes to the cell's overflow file
DEFAULT_LIMIT = 1 << 20
#: the overflow files' folder, inside the rank's status folder
OUTPUT_DIR = "output"
#: the notice written once per cell when the limit is reached (one line)
NOTICE_RE = re.compile(
    r"^\[rank (?P<rank>\d+): output past (?P<size>[^\]]+?) is in (?P<path>.+)\]$"
)

_READ_CHUNK = 1 << 16
#: the fd pipes' capacity where it can be set (Linux): a writer holding the GIL
#: blocks only once this much is unread
_PIPE_SIZE = 1 << 20
#: the most bytes :func:`end_cell` reads from each pipe (a writer that never stops
#: cannot hold the cell's reply forever)
_DRAIN_MAX = 64 << 20


def overflow_path(folder: str | os.PathLike[str], cell: int, rank: int) -> Path:
    """Where the output of ``cell`` past the limit goes on ``rank``."""
    return Path(folder) / OUTPUT_DIR / f"cell{int(cell)}-rank{int(rank)}.txt"


def human_size(n: int) -> str:
    """``1.0 MiB``, ``64.0 KiB``, ``300 B``."""
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    if n >= 1 << 10:
        return f"{n / (1 << 10):.1f} KiB"
    return f"{n} B"


def notice(rank: int, limit: int, path: str | os.PathLike[str]) -> str:
    """The notice line (without its newline) for output cut at ``limit`` characters."""
    return f"[rank {rank}: output past {human_size(limit)} is in {path}]"


def sanitize(text: str) -> str:
    """``text`` as valid Unicode: lone surrogates become U+FFFD (a surrogate pair
    written as two code units becomes the character it encodes)."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def _to_text(data: Any) -> str:
    if isinstance(data, str):
        return data
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data).decode("utf-8", "replace")
    raise TypeError(f"write() argument must be str, not {type(data).__name__}")


class _Hub:
    """What both streams of a rank share: the order, the cell's count and its file."""

    def __init__(self, folder: str | os.PathLike[str], rank: int, limit: int | None) -> None:
        self.folder = Path(folder)
        self.rank = int(rank)
        self.default_limit = DEFAULT_LIMIT if limit is None else int(limit)
        self.lock = threading.RLock()
        self.last: OrderedStream | None = None
        self.in_child = False
        self.fallback_fd: int | None = None  # the engine's log, for text that cannot go out
        self.reader: _Reader | None = None  # the fd pipes' reader, when fds are captured
        #: ``poll(0)`` on the fd pipes (non-empty: bytes wait), while they are captured
        self.pipes_ready: Any = None
        #: whether the reader holds bytes it has read and not yet forwarded
        self.pipes_busy: Any = None
        self.cell = 0
        self.limit = self.default_limit
        self.used = 0
        self.overflowed = False
        self.path: Path | None = None
        self._file: io.TextIOBase | None = None

    # -- cells ---------------------------------------------------------------------
    def begin_cell(self, cell: int, limit: int | None) -> None:
        with self.lock:
            self._close_file()
            self.cell = int(cell)
            self.limit = self.default_limit if limit is None else int(limit)
            self.used = 0
            self.overflowed = False
            self.path = None

    def end_cell(self) -> None:
        with self.lock:
            self._close_file()

    # -- writing -------------------------------------------------------------------
    def attach(self, reader: _Reader | None) -> None:
        """Forward through ``reader`` (``None``: the fds are no longer captured)."""
        self.reader = reader
        self.pipes_ready = reader.pending if reader is not None else None
        self.pipes_busy = reader.lock.locked if reader is not None else None

    def forward_pipes(self) -> None:
        """Before a write from Python: forward what the pipes hold, so text that a
        subprocess or a forked child wrote before comes first."""
        reader = self.reader
        if reader is not None:
            reader.drain(timeout=1.0, final=False)

    def write(self, stream: OrderedStream, text: str) -> None:
        if self.in_child:
            stream._child_write(text)
            return
        if stream._io_ident == threading.get_ident():
            # the IO thread must never wait for a thread that waits for it
            if not self.lock.acquire(blocking=False):
                stream._emit(text)
                return
            try:
                self._write(stream, text)
            finally:
                self.lock.release()
            return
        with self.lock:
            self._write(stream, text)

    def _write(self, stream: OrderedStream, text: str) -> None:
        if self.overflowed:
            self._to_file(text)
            return
        used = self.used + len(text)
        if used <= self.limit or self.limit <= 0:  # the usual case
            if self.last is not stream:
                self._switch_to(stream)
            stream._emit(text)
            self.used = used
            return
        # past the limit: what fits, one notice, the rest of the cell to the file
        room = max(0, self.limit - self.used)
        head, rest = text[:room], text[room:]
        self._switch_to(stream)
        if head:
            stream._emit(head)
            self.used += len(head)
        self.overflowed = True
        self.path = overflow_path(self.folder, self.cell, self.rank)
        sep = "" if stream.tail in ("", "\n") else "\n"
        stream._emit(f"{sep}{notice(self.rank, self.limit, self.path)}\n")
        self._to_file(rest)

    def _switch_to(self, stream: OrderedStream) -> None:
        """Before ``stream`` gets text: send what the other stream holds."""
        other = self.last
        self.last = stream
        if other is not None and other is not stream and other.dirty:
            other._flush_out()

    def _to_file(self, text: str) -> None:
        if not text:
            return
        try:
            if self._file is None:
                assert self.path is not None
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(  # noqa: SIM115 - kept open for the rest of the cell
                    self.path, "a", encoding="utf-8", errors="replace", newline=""
                )
            self._file.write(text)
        except Exception:  # noqa: BLE001 - a full disk must not break the cell
            pass

    def _close_file(self) -> None:
        if self._file is not None:
            with contextlib.suppress(Exception):
                self._file.close()
            self._file = None


class OrderedStream(io.TextIOBase):
    """``sys.stdout`` / ``sys.stderr`` on a rank: the kernel's ``OutStream`` (``out``)
    behind the ordering, sanitising and bounding of its :class:`_Hub`. Attributes it
    does not define (``set_parent``, ``topic``, ``parent_header``, ...) are ``out``'s.
    """

    encoding = "UTF-8"
    errors = "replace"
    newlines = None
    line_buffering = False
    mode = "w"

    def __init__(self, hub: _Hub, name: str, out: Any) -> None:
        super().__init__()
        self._hub = hub
        self._name = name
        self.out = out
        self.dirty = False  # ``out`` holds text not flushed by us
        self.tail = ""  # the last character sent, to start the notice on its own line
        self._log_fd: int | None = None  # the engine's original fd (see ``fileno``)
        self._pipe_fd: int | None = None  # fd 1 or 2 while it is our pipe
        self._child_buf: list[str] = []  # a forked child's unfinished line
        #: the kernel's IO thread (it sends the messages): it never waits for our lock
        self._io_ident = getattr(
            getattr(getattr(out, "pub_thread", None), "thread", None), "ident", None
        )
        self.buffer = _Buffer(self)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") or attr == "out":
            raise AttributeError(attr)
        return getattr(self.out, attr)

    @property
    def name(self) -> str:  # type: ignore[override]
        return self._name

    def write(self, s: Any) -> int:  # type: ignore[override]
        text = s if type(s) is str else _to_text(s)
        if text:
            hub = self._hub
            if hub.in_child or self._io_ident == threading.get_ident():
                hub.write(self, text)
            else:
                ready = hub.pipes_ready  # not for print's own "\n": nothing can come between
                if ready is not None and text != "\n":
                    try:
                        waiting = ready(0) or hub.pipes_busy()
                    except RuntimeError:  # another thread polls now: forward to be sure
                        waiting = True
                    if waiting:
                        hub.forward_pipes()
                with hub.lock:
                    used = hub.used + len(text)
                    if (
                        hub.last is self
                        and not hub.overflowed
                        and (used <= hub.limit or hub.limit <= 0)
                        and text.isascii()
                    ):  # the usual case, inline: no switch, no limit, nothing to fix
                        try:
                            self.out.write(text)
                            hub.used = used
                            self.dirty = True
                            self.tail = text[-1]
                        except Exception:  # noqa: BLE001
                            self._emit(text)
                    else:
                        hub._write(self, text)
        return len(s)

    def writelines(self, lines: Any) -> None:  # type: ignore[override]
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        """Send what this stream holds; first what fd 1 and 2 hold (the kernel flushes
        before a display or the cell's result, which then come after that too)."""
        if self._hub.in_child:
            if self._pipe_fd is None:
                self._flush_out()
            elif self._child_buf:
                data, self._child_buf = "".join(self._child_buf), []
                _write_all(self._pipe_fd, sanitize(data).encode("utf-8"))
            return
        if self._io_ident == threading.get_ident():
            self._flush_out()
            return
        reader = self._hub.reader
        if reader is not None:
            reader.drain(timeout=1.0, final=False)  # before our lock: the reader's order
        with self._hub.lock:
            self._flush_out()

    def _flush_out(self) -> None:
        if not self.dirty and not _ipykernel.flush_pending(self.out):
            # no text waits in ``out`` (neither ours nor a writer's that kept the
            # kernel's stream): its flush would only wait for the kernel's IO thread
            # (~0.4 ms, twice a request: one cell or call in ten on 2 cores).
            # Messages queued there (displays, the idle status) stay in order without
            # it; the notebook waits for the idle status.
            return
        self.dirty = False
        try:
            self.out.flush()
        except Exception:  # noqa: BLE001
            pass

    def _child_write(self, text: str) -> None:
        """In a forked child: into the fd pipe, which the parent's reader forwards
        (the kernel stream cannot send from a child of an ipyparallel engine), a
        line at a time (a line up to 4 KiB is not mixed with other processes')."""
        if self._pipe_fd is None:
            self._emit(text)
            return
        self._child_buf.append(text)
        if "\n" in text:
            data = "".join(self._child_buf)
            cut = data.rfind("\n") + 1
            self._child_buf = [data[cut:]] if cut < len(data) else []
            _write_all(self._pipe_fd, sanitize(data[:cut]).encode("utf-8"))

    def _emit(self, text: str) -> None:
        if not text.isascii():
            text = sanitize(text)
        try:
            self.out.write(text)
        except Exception:  # noqa: BLE001 - e.g. a closed kernel stream: try the log
            fd = self._log_fd if self._log_fd is not None else self._hub.fallback_fd
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.write(fd, text.encode("utf-8", "replace"))
            return
        if text:
            self.dirty = True
            self.tail = text[-1]

    def fileno(self) -> int:
        """The engine's original fd (its log), as ipykernel's ``OutStream`` gives:
        fd 1 and 2 themselves are this module's pipes."""
        if self._log_fd is not None:
            return self._log_fd
        return self.out.fileno()

    def isatty(self) -> bool:
        try:
            return bool(self.out.isatty())
        except Exception:  # noqa: BLE001
            return False

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    def reconfigure(self, **kwargs: Any) -> None:
        """Accepted and ignored: the stream is always UTF-8 with ``errors='replace'``."""

    def close(self) -> None:
        """Never closes the kernel's stream (``del sys.stdout`` must not break it)."""


class _Buffer(io.BufferedIOBase):
    """``sys.stdout.buffer``: bytes decoded (UTF-8, ``errors='replace'``) into the stream."""

    mode = "wb"

    def __init__(self, stream: OrderedStream) -> None:
        super().__init__()
        self._stream = stream
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._lock = threading.Lock()

    @property
    def name(self) -> str:  # type: ignore[override]
        return self._stream.name

    def write(self, b: Any) -> int:  # type: ignore[override]
        data = bytes(b)
        with self._lock:
            text = self._decoder.decode(data)
        if text:
            self._stream.write(text)
        return len(data)

    def finish(self) -> None:
        """The end of a cell: an incomplete character left over becomes U+FFFD."""
        with self._lock:
            text = self._decoder.decode(b"", final=True)
            self._decoder.reset()
        if text:
            self._stream.write(text)

    def flush(self) -> None:
        self._stream.flush()

    def fileno(self) -> int:
        return self._stream.fileno()

    def isatty(self) -> bool:
        return self._stream.isatty()

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def close(self) -> None:
        """Never closed (see :meth:`OrderedStream.close`)."""


class _FdCapture:
    """fd ``fd`` (1 or 2) made the write end of a pipe read by :class:`_Reader`."""

    def __init__(self, fd: int, stream: OrderedStream) -> None:
        self.fd = fd
        self.stream = stream
        out = stream.out
        self.watched = _ipykernel.watched_pipe(out)  # ipykernel's pipe, when it watches fd
        self.ipykernel = out if self.watched is not None else None
        self.prev = os.dup(fd)  # what fd was: the log, or ipykernel's pipe
        # the log: a watching OutStream's fileno() is the fd it echoes to
        self.echo = int(out.fileno()) if self.ipykernel is not None else self.prev
        r, w = os.pipe()
        _grow_pipe(w)
        os.set_blocking(r, False)
        os.dup2(w, fd)  # inheritable: subprocesses write into the pipe too
        os.close(w)
        self.r = r
        self.eof = False
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        if self.ipykernel is not None:
            # nothing new enters its pipe now; let its thread forward what is there,
            # then stop it forwarding (it stays blocked on its idle pipe, and its
            # ``close`` does not wait for it)
            _wait_empty(self.watched, 0.5)
            time.sleep(0.02)  # its thread may hold a chunk it has read
            _ipykernel.set_forwarding(self.ipykernel, False)
        stream._log_fd = self.echo
        stream._pipe_fd = fd

    def pump(self, max_bytes: int) -> None:
        """Forward what the pipe holds (at most about ``max_bytes``); never blocks."""
        done = 0
        while not self.eof and done < max_bytes:
            try:
                data = os.read(self.r, _READ_CHUNK)
            except BlockingIOError:
                return
            except OSError:
                self.eof = True
                return
            if not data:
                self.eof = True
                return
            done += len(data)
            _write_all(self.echo, data)
            text = self._decoder.decode(data)
            if text:
                self.stream.write(text)

    def finish(self) -> None:
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        if text:
            self.stream.write(text)

    def restore(self) -> None:
        """Give fd back what it was before (and ipykernel its forwarding)."""
        with contextlib.suppress(OSError):
            os.dup2(self.prev, self.fd)
        if self.ipykernel is not None:
            _ipykernel.set_forwarding(self.ipykernel, True)
        self.stream._log_fd = None
        self.stream._pipe_fd = None
        for fd in (self.r, self.prev):
            with contextlib.suppress(OSError):
                os.close(fd)


def _poller(fds: list[int]) -> Any:
    """``f(0)`` -> the fds that can be read now: ``select.poll`` where there is one."""
    if hasattr(select, "poll"):
        p = select.poll()
        for fd in fds:
            p.register(fd, select.POLLIN)
        return p.poll
    return lambda timeout: select.select(fds, [], [], timeout)[0]


class _Reader(threading.Thread):
    """Forwards the fd pipes as they fill. ``lock`` is held while a chunk is read and
    forwarded, so :meth:`drain` knows nothing is half-way when it reads the rest."""

    def __init__(self, captures: list[_FdCapture]) -> None:
        super().__init__(name="mlx_nbdist-output", daemon=True)
        self.captures = captures
        self.lock = threading.Lock()
        #: the thread that holds ``lock`` (forwarding): its own writes must not wait
        self.holder: int | None = None
        self._stop_now = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        #: ``pending(0)``: the pipes that hold bytes not yet forwarded (no wait)
        self.pending = _poller([c.r for c in captures])

    def run(self) -> None:
        sel = selectors.DefaultSelector()
        try:
            for c in self.captures:
                sel.register(c.r, selectors.EVENT_READ, c)
            sel.register(self._wake_r, selectors.EVENT_READ, None)
            while not self._stop_now:
                try:
                    events = sel.select()
                except (OSError, ValueError):
                    if self._stop_now:
                        break
                    time.sleep(0.01)
                    continue
                for key, _ in events:
                    capture = key.data
                    if capture is None:
                        with contextlib.suppress(OSError):
                            os.read(self._wake_r, 4096)
                        continue
                    with self.lock:
                        self.holder = self.ident
                        try:
                            capture.pump(_PIPE_SIZE)
                        except Exception:  # noqa: BLE001 - this thread must not die
                            pass
                        finally:
                            self.holder = None
                    if capture.eof:
                        with contextlib.suppress(Exception):
                            sel.unregister(capture.r)
        except BaseException:  # noqa: BLE001
            # without a reader, writers to fd 1/2 would block once a pipe is full:
            # send the fds back to where they went before
            for c in self.captures:
                with contextlib.suppress(OSError):
                    os.dup2(c.prev, c.fd)
        finally:
            sel.close()

    def drain(self, timeout: float = 5.0, final: bool = True) -> bool:
        """Forward everything the pipes hold now (``final``: and an incomplete
        character at their end, as U+FFFD); ``False`` if the reader was stuck."""
        me = threading.get_ident()
        if self.holder == me:  # a write made while this thread forwards: in order already
            return True
        if not self.lock.acquire(timeout=timeout):
            return False
        self.holder = me
        try:
            for c in self.captures:
                try:
                    c.pump(_DRAIN_MAX)
                    if final:
                        c.finish()
                except Exception:  # noqa: BLE001
                    pass
        finally:
            self.holder = None
            self.lock.release()
        return True

    def stop(self) -> None:
        self._stop_now = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        self.join(timeout=2.0)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


class Output:
    """A rank's installed output path (see the module docstring)."""

    def __init__(
        self,
        folder: str | os.PathLike[str],
        rank: int,
        stdout: Any,
        stderr: Any,
        *,
        limit: int | None = None,
    ) -> None:
        self.hub = _Hub(folder, rank, limit)
        self.stdout = OrderedStream(self.hub, "stdout", stdout)
        self.stderr = OrderedStream(self.hub, "stderr", stderr)
        self.captures: list[_FdCapture] = []
        self.reader: _Reader | None = None
        self._rerouted: list[tuple[Any, Any]] = []

    def capture_fds(self, fds: dict[str, int] | None = None) -> None:
        """Make fds (default ``{"stdout": 1, "stderr": 2}``) pipes read by a thread."""
        fds = fds or {"stdout": 1, "stderr": 2}
        streams = {"stdout": self.stdout, "stderr": self.stderr}
        try:
            for name, fd in fds.items():
                self.captures.append(_FdCapture(fd, streams[name]))
        except BaseException:
            for c in self.captures:  # a pipe nobody reads would block its writers
                c.restore()
            self.captures = []
            raise
        self.hub.fallback_fd = self.stderr._log_fd
        self._rerouted = _reroute_log_handlers({c.fd: c.echo for c in self.captures})
        self.reader = _Reader(self.captures)
        self.reader.start()
        self.hub.attach(self.reader)

    def begin_cell(self, cell: int, limit: int | None = None) -> None:
        self.hub.begin_cell(cell, limit)

    def end_cell(self) -> None:
        """Forward everything written so far (fd pipes, partial characters), then
        close the cell's overflow file. Returns when it is all in the streams."""
        if self.reader is not None:
            self.reader.drain()
        for s in (self.stdout, self.stderr):
            with contextlib.suppress(Exception):
                s.buffer.finish()
        self.hub.end_cell()

    def uninstall(self) -> None:
        """Forward what is pending and give the fds back; the streams stay usable."""
        if self.reader is not None:
            self.reader.drain(timeout=1.0)
            self.hub.attach(None)
            self.reader.stop()
            self.reader = None
        for handler, stream in self._rerouted:
            handler.setStream(stream)
        self._rerouted = []
        for c in self.captures:
            c.restore()
        self.captures = []
        self.hub.end_cell()


_CURRENT: Output | None = None


def current() -> Output | None:
    """This process's installed output path, if any."""
    return _CURRENT


def install(
    folder: str | os.PathLike[str],
    rank: int,
    *,
    limit: int | None = None,
    capture_fds: bool = True,
) -> Output | None:
    """Install the rank's output path: wrap ``sys.stdout``/``sys.stderr`` and (with
    ``capture_fds``) read fd 1 and 2 through pipes. Once per process (later calls
    return the installed one); does nothing outside an IPython kernel.

    Args:
        folder: the rank's status folder (the session directory, or the rank's
            private one); overflow files go to its ``output`` folder.
        rank: the session's rank, for the file names and the notice.
        limit: characters per cell (default :data:`DEFAULT_LIMIT`); ``0`` or less:
            no limit. :func:`begin_cell` can set it per cell.
    """
    global _CURRENT
    if _CURRENT is not None:
        return _CURRENT
    if not _in_kernel():
        return None
    out = Output(folder, rank, sys.stdout, sys.stderr, limit=limit)
    sys.stdout, sys.stderr = out.stdout, out.stderr
    if capture_fds:
        try:
            out.capture_fds()
        except OSError:  # no fd 1/2 to capture: text output still works
            pass
    _CURRENT = out
    atexit.register(_at_exit)
    return out


def begin_cell(cell: int, limit: int | None = None) -> None:
    """A cell starts: its count starts at 0 (``limit``: this cell's, else the default)."""
    if _CURRENT is not None:
        try:
            _CURRENT.begin_cell(cell, limit)
        except Exception:  # noqa: BLE001 - output must never break a cell
            pass


def end_cell() -> None:
    """A cell ends (call before its reply): everything it wrote is in the streams."""
    if _CURRENT is not None:
        try:
            _CURRENT.end_cell()
        except Exception:  # noqa: BLE001
            pass


def uninstall() -> None:
    """Undo :func:`install`: the kernel's streams and fds are back."""
    global _CURRENT
    out, _CURRENT = _CURRENT, None
    if out is None:
        return
    if sys.stdout is out.stdout:
        sys.stdout = out.stdout.out
    if sys.stderr is out.stderr:
        sys.stderr = out.stderr.out
    out.uninstall()


def _at_exit() -> None:
    """At exit: forward what is pending, and let late writes go to the log."""
    out = _CURRENT
    if out is None:
        return
    with contextlib.suppress(Exception):
        out.end_cell()
    if out.reader is not None:
        out.hub.attach(None)
        with contextlib.suppress(Exception):
            out.reader.stop()
        out.reader = None
    for c in out.captures:
        with contextlib.suppress(OSError):
            os.dup2(c.echo, c.fd)


def _after_fork_in_child() -> None:
    # the parent's threads are gone and its locks may be held: a forked child writes
    # straight into the fd pipes (read by the parent), else to the kernel streams
    if _CURRENT is not None:
        _CURRENT.hub.in_child = True
        _CURRENT.hub.lock = threading.RLock()
        for stream in (_CURRENT.stdout, _CURRENT.stderr):
            stream.buffer._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    ip = get_ipython()
    return ip is not None and hasattr(sys.stdout, "set_parent")


def _reroute_log_handlers(echo: dict[int, int]) -> list[tuple[Any, Any]]:
    """Logging handlers that write to fd 1 or 2 (the engine's own log, when
    ipykernel does not watch the fds) keep writing to the engine's log file, not
    to the notebook: what ipyparallel does when ipykernel watches. Returns
    ``(handler, old stream)`` pairs."""
    import logging

    loggers = [logging.getLogger()] + [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    done: list[tuple[Any, Any]] = []
    for lg in loggers:
        for h in list(lg.handlers):
            if type(h) is not logging.StreamHandler or isinstance(h.stream, OrderedStream):
                continue
            try:
                fd = h.stream.fileno()
            except Exception:  # noqa: BLE001 - no fd: not ours to move
                continue
            if fd in echo and all(h is not d[0] for d in done):
                log = io.TextIOWrapper(
                    io.FileIO(echo[fd], "w", closefd=False),
                    encoding="utf-8",
                    errors="replace",
                    write_through=True,
                )
                done.append((h, h.setStream(log)))
    return done


def _grow_pipe(fd: int) -> None:
    try:
        import fcntl

        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _PIPE_SIZE)  # Linux only
    except (AttributeError, ImportError, OSError):
        pass


def _wait_empty(fd: int, timeout: float) -> None:
    """Wait until nothing is left to read in pipe ``fd`` (someone else reads it)."""
    try:
        import array
        import fcntl
        import termios

        buf = array.array("i", [0])
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            fcntl.ioctl(fd, termios.FIONREAD, buf, True)
            if buf[0] == 0:
                return
            time.sleep(0.005)
    except (ImportError, OSError):
        pass


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    try:
        while view:
            n = os.write(fd, view)
            view = view[n:]
    except OSError:
        pass
