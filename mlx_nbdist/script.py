"""Run a notebook's cells as a script: the script's side and our launcher.

An exported script (:mod:`mlx_nbdist.history`) starts with::

    world, rank, size = mlx_nbdist.script.init(backend="ring", size=2)

:func:`init` joins the group that ``mlx.launch -n 2 --backend ring -- python
script.py`` started (``mx.distributed.init(backend=..., strict=True)``, its size
checked) and installs what mlx_nbdist's in-cell helpers read on a rank
(:func:`mlx_nbdist.engine.state.current`): ``mlx_nbdist.shard(model, ...)``,
``generate``, ``load``, ``lora`` and ``progress`` work as in a ``%%mlxdist`` cell.
There is no notebook, so ``progress`` prints plain text lines and ``log_scalars``
values go with them. Inside one of our ranks (``python -m mlx_nbdist run``) the
rank's group is reused.

:func:`display`, :func:`system` and :func:`getoutput` stand in for IPython's
``display``, ``!cmd`` and ``x = !cmd``.

:func:`load_checkpoint` and :func:`save_checkpoint` are a notebook's
``%mlxdist load`` / ``%mlxdist save`` in a script: called on every rank with the
model (and optimizer) objects, each rank loads or writes its own slices, by the same
code and with the same checks (:mod:`mlx_nbdist.engine.checkpoint`).

:func:`run_file` is ``python -m mlx_nbdist run -n N script.py``: a
:class:`~mlx_nbdist.session.Session` of N ranks runs the file as one cell, each
rank's output printed as it arrives with ``[rank r]`` in front of every line; it
returns 1 naming the failing ranks when any rank fails (``mlx.launch`` returns 0),
and the session is stopped whatever happens. Importing this module imports neither
MLX nor the session: scripts import it, and only :func:`init` needs MLX.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from .config import Backend
from .errors import CellError, MLXDistError, SetupError

__all__ = ["display", "getoutput", "init", "load_checkpoint", "run_file", "save_checkpoint",
           "system"]


def init(backend: str = "ring", size: int = 1) -> tuple[Any, int, int]:
    """Join this process's MLX group as a rank of ``size``; returns ``(world, rank, size)``.

    Args:
        backend: the MLX backend the exported session used (``ring``, ``mpi``,
            ``nccl``, ``jaccl``).
        size: the number of ranks the exported session had: a group of another size
            is refused.

    Raises:
        SetupError: the group has another size (both numbers named), or no group could
            be formed (the script was started without a launcher): the message says
            how to launch it.
    """
    from .engine import state

    b = Backend(str(backend))
    if state.started():  # inside one of our ranks (mlx_nbdist run), or init ran already
        st = state.current()
        _check_size(st.size, size, b)
        return st.world, st.rank, st.size
    import mlx.core as mx

    try:
        if size == 1:
            # a group of one needs no backend (mlx.launch -n 1 gives a ring no hostfile);
            # a launcher's group of another size is still found, and refused below
            world = mx.distributed.init(strict=False)
        else:
            world = mx.distributed.init(backend=b.value, strict=True)
    except RuntimeError as e:
        raise SetupError(f"this script runs on {size} ranks ({b.value} backend) and could "
                         f"not join a group: {e}; {_how(size, b)}") from None
    _check_size(world.size(), size, b)
    from .engine.tracker import Tracker

    rank = world.rank()
    # no monitor: there is no notebook to publish to (progress prints text lines)
    state.install(state.EngineState(world, rank, world.size(), "script",
                                    Tracker(world, rank, world.size(), backend=b),
                                    None))  # type: ignore[arg-type]
    return world, rank, world.size()


def _check_size(got: int, want: int, backend: Backend) -> None:
    if got != want:
        raise SetupError(f"this script was exported from a session of {want} ranks but runs "
                         f"on {got}: {_how(want, backend)}")


def _how(n: int, backend: Backend) -> str:
    # under mlx.launch and mlx_nbdist run alike, sys.argv[0] is the script's path
    script = sys.argv[0] if sys.argv and sys.argv[0].endswith(".py") else "SCRIPT"
    return (f"launch it with `mlx.launch -n {n} --backend {backend.value} -- python {script}` "
            f"or `python -m mlx_nbdist run -n {n} --backend {backend.value} {script}`")


def load_checkpoint(model: Any, directory: str | os.PathLike[str], optimizer: Any = None
                    ) -> dict[str, Any]:
    """Load a checkpoint (``mlx_nbdist.save`` or :func:`save_checkpoint`) into ``model``
    (and ``optimizer``) on every rank; call it on every rank, after :func:`init`.

    The checks of the notebook's ``load_checkpoint`` (parameters missing or extra,
    shapes, dtypes, dimensions that do not divide), then each rank verifies the sha256
    of the files it reads and reads only its slices, resharding when this script runs
    on another number of ranks or layout than the save.

    Args:
        model: the model (an ``mlx.nn.Module``) built, and sharded, as in the notebook.
        directory: the checkpoint folder; ``optimizer``: an ``mlx.optimizers`` optimizer
            whose state the checkpoint holds.

    Returns:
        This rank's ``{"bytes_read", "tensors", "files", "index"}``.

    Raises:
        CheckpointError: on every rank, naming the problem and the rank that found it;
            nothing is loaded on any rank.
    """
    from .engine.checkpoint import load_here

    _require_init("load_checkpoint")
    return load_here(model, directory, optimizer)


def save_checkpoint(model: Any, directory: str | os.PathLike[str], optimizer: Any = None, *,
                    name: str = "model", overwrite: bool = False,
                    tokenizer_from: str | os.PathLike[str] | None = None) -> Any:
    """Save ``model`` (and ``optimizer``'s state) as a sharded checkpoint from every
    rank; call it on every rank, after :func:`init`. The same checkpoint and the same
    guarantees as the notebook's ``mlx_nbdist.save``: each rank writes its slices, rank
    0 swaps the index in once every rank has written, and a failure on any rank leaves
    the previous checkpoint intact (raised on every rank).

    Args:
        name: the model's name in the index (an export passes the notebook's name;
            a save over another name's checkpoint needs ``overwrite``).
        overwrite, tokenizer_from: as for :func:`mlx_nbdist.save`.

    Returns:
        The checkpoint's :class:`~mlx_nbdist.checkpoint_index.Index`.
    """
    from .engine.checkpoint import save_here

    _require_init("save_checkpoint")
    return save_here(model, directory, optimizer, name=name, overwrite=overwrite,
                     tokenizer_from=tokenizer_from)


def _require_init(what: str) -> None:
    from .engine import state

    if not state.started():
        raise SetupError(f"mlx_nbdist.script.{what} runs on the ranks of a group: call "
                         "world, rank, size = mlx_nbdist.script.init(backend=..., size=N) "
                         "first (an exported script does)")


def display(*objs: Any) -> None:
    """IPython's ``display`` in a script: each object's ``text/plain`` form (as Jupyter
    shows it) on stdout, ``None`` skipped. Inside a kernel (a rank of a session) it is
    IPython's own display."""
    shown = [o for o in objs if o is not None]
    if not shown:
        return
    if _in_ipython():
        from IPython.display import display as ipython_display

        ipython_display(*shown)
        return
    from IPython.lib.pretty import pretty

    for o in shown:
        print(pretty(o), flush=True)


def _in_ipython() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


def system(cmd: str) -> int:
    """``!cmd`` in a script: run ``cmd`` in a shell, its output on this process's;
    returns its exit status (IPython's ``{var}`` expansion is not done)."""
    sys.stdout.flush()
    return subprocess.run(cmd, shell=True, check=False).returncode  # noqa: S602 - the user's !cmd


def getoutput(cmd: str) -> list[str]:
    """``x = !cmd`` in a script: the lines ``cmd`` printed (stdout and stderr)."""
    done = subprocess.run(cmd, shell=True, check=False, capture_output=True,  # noqa: S602
                          text=True)
    return (done.stdout + done.stderr).splitlines()


# ------------------------------------------------------------------ the launcher


class _Printer:
    """Each rank's output as whole lines, ``[rank r] `` in front, as it arrives."""

    def __init__(self, out: IO[str], err: IO[str], prefix: bool):
        self.out, self.err, self.prefix = out, err, prefix
        self.partial: dict[tuple[int, str], str] = {}

    def __call__(self, ev: Any) -> None:
        from .streams import Kind

        if ev.kind in (Kind.STDOUT, Kind.STDERR):
            self._text(ev.rank, str(ev.kind), ev.text)
        elif ev.kind in (Kind.DISPLAY, Kind.RESULT, Kind.UPDATE):
            text = (ev.data or {}).get("text/plain")
            if text:
                self._text(ev.rank, "stdout", text.rstrip("\n") + "\n")

    def _text(self, rank: int, stream: str, text: str) -> None:
        key = (rank, stream)
        text = self.partial.pop(key, "") + text.replace("\r\n", "\n")
        *lines, rest = text.split("\n")
        if rest:
            self.partial[key] = rest
        out = self.out if stream == "stdout" else self.err
        for line in lines:
            line = line.rsplit("\r", 1)[-1]  # a progress line rewritten in place
            out.write(f"[rank {rank}] {line}\n" if self.prefix else line + "\n")
        out.flush()

    def flush(self) -> None:
        return None

    def close(self) -> None:
        for (rank, stream), rest in sorted(self.partial.items()):
            self._text(rank, stream, rest + "\n")
        self.partial.clear()


def run_file(path: str | os.PathLike[str], n: int, backend: str | None = None, *,
             timeout: float | None = None, out: IO[str] | None = None,
             err: IO[str] | None = None, args: Sequence[str] = ()) -> int:
    """Run a script on ``n`` ranks of a new session (``python -m mlx_nbdist run``).

    The file runs as one cell on every rank, in this process's working directory,
    with ``__file__`` and ``sys.argv`` (``[path, *args]``) as under ``mlx.launch``;
    each rank's stdout and stderr are printed as they arrive, every line prefixed
    ``[rank r]``. The session is stopped whatever happens.

    Returns:
        0 when every rank finished (or called ``sys.exit(0)``); the status of a
        ``sys.exit(k)`` when that was every failure; 1 when a rank failed (its
        traceback, with the script's file and lines, and the failing ranks are
        printed on ``err``); 2 when the file is unreadable or the session could not
        start.
    """
    from .session import Session

    out = out or sys.stdout
    err = err or sys.stderr
    p = Path(path)
    try:
        code = p.read_text()
    except OSError as e:
        print(f"mlx_nbdist run: cannot read {p}: {e.strerror or e}", file=err)
        return 2
    try:
        session = Session(n, backend=backend, timeout=timeout)
        session.start()
    except MLXDistError as e:
        print(f"mlx_nbdist run: the session did not start: {e}", file=err)
        return 2
    printer = _Printer(out, err, prefix=True)
    try:
        session.apply(_prepare_rank, os.getcwd(), str(p), list(args))
        try:
            # a script's last expression is not shown, as under mlx.launch (a cell's is)
            cell = code + ("" if code.endswith("\n") else "\n") + _TAIL
            session.run(cell, on_output=printer, name=str(p))
        except CellError as e:
            printer.close()
            return _report(e, p, n, err, tail_line=len(cell.splitlines()))
        printer.close()
        return 0
    finally:
        session.stop()


#: after the script: its last expression is then not shown as a cell's value
_TAIL = "pass\n"


def _prepare_rank(cwd: str, file: str, argv: list[str]) -> None:
    """On a rank, before the script: its directory, ``__file__``, ``sys.argv``, and no
    IPython advice on how to leave a shell when the script calls ``sys.exit``."""
    import warnings

    from IPython import get_ipython

    os.chdir(cwd)
    sys.argv = [file, *argv]
    shell = get_ipython()
    if shell is not None:  # absolute, as Python sets a script's __file__ (argv[0] as given)
        shell.user_ns["__file__"] = os.path.abspath(file)
    warnings.filterwarnings("ignore", message="To exit: use 'exit', 'quit', or Ctrl-D")


def _report(e: CellError, path: Path, n: int, err: IO[str], tail_line: int = 0) -> int:
    """The failing ranks' tracebacks (ranks that failed alike once; the script's file
    and lines where IPython names the cell), then one line naming them. Returns the
    exit status: a ``sys.exit(k)`` that was every failure gives ``k``."""
    import re

    from .results import DIED, ERROR, PAUSED

    # the ranks that failed, not those released or ended because a peer did
    failed = [f for f in e.failures if f.cause in (ERROR, DIED, PAUSED)] or e.failures
    exits = [f for f in failed if f.ename == "SystemExit"]
    if exits and len(exits) == len(failed):  # sys.exit, as Python ends a script on it
        ends = {f.rank: _exit(f.evalue) for f in exits}
        for r, (_, message) in ends.items():
            if message:
                print(f"[rank {r}] {message}", file=err)  # sys.exit("message")
        status = max((code for code, _ in ends.values()), key=abs)
        released = sorted(f.rank for f in e.failures if f not in failed)
        if released:  # peers waited in a collective for the rank that left
            if e.summary:
                print(e.summary, file=err)
            if not status:  # their values are invalid: not a success
                print(f"mlx_nbdist run: {path} failed: sys.exit(0) on rank "
                      f"{', '.join(map(str, ends))} while rank "
                      f"{', '.join(map(str, released))} waited for it", file=err)
                err.flush()
                return 1
        if status:
            ranks = ", ".join(str(r) for r, (code, _) in ends.items() if code)
            print(f"mlx_nbdist run: {path} exited with status {status} (sys.exit on rank "
                  f"{ranks})", file=err)
        err.flush()
        return status
    ansi = re.compile(r"\x1b\[[0-9;]*m")
    cell = re.compile(r"Cell In\[\d+\], line (\d+)")
    tail = re.compile(rf"^\s*{tail_line}\s+pass\s*$")
    for g in e.groups:
        print(re.sub(r"\(line (\d+) of the cell\)", lambda m: f"({path}, line {m[1]})",
                     g.headline()), file=err)
        for line in g.first.traceback:
            line = ansi.sub("", line.rstrip("\n"))
            line = "\n".join(
                cell.sub(lambda m: f'File "{path}", line {m[1]}', x)
                for x in line.split("\n")
                if not tail.match(x)
            )
            print(line, file=err)
    if e.summary:
        print(e.summary, file=err)
    ranks = sorted(f.rank for f in failed)
    which = ", ".join(map(str, ranks))
    print(f"mlx_nbdist run: {path} failed on rank{'s' if len(ranks) > 1 else ''} {which} "
          f"of {n}", file=err)
    err.flush()
    return 1


def _exit(evalue: str) -> tuple[int, str]:
    """A ``SystemExit``'s status and the message Python prints, from its text:
    ``None`` or nothing is 0, an integer (``True``, ``False``) is itself, anything
    else is a message and status 1."""
    text = evalue.strip()
    if text in ("", "None"):
        return 0, ""
    if text in ("True", "False"):
        return int(text == "True"), ""
    try:
        return int(text), ""
    except ValueError:
        return 1, text
