"""The ``%mlxdist`` line magic and ``%%mlxdist`` cell magic: parse, call, display.

Every command maps to a plain function or :class:`~mlx_nbdist.session.Session`
method; this module only parses arguments and shows results. Defaults are traitlets
settings, so ``%config MLXDist.timeout = 60`` changes the deadline of later cells.

While a ``%%mlxdist`` cell runs, per-rank progress bars and scalar plots published
with ``mlx_nbdist.progress`` / ``mlx_nbdist.log_scalars`` show under it
(:class:`~mlx_nbdist.viz.progress.LiveCell`); ``%mlxdist dashboard`` shows the live
dashboard, ``%mlxdist auto on|off`` switches auto mode (:mod:`mlx_nbdist.autopx`),
and ``%%local`` runs a cell here when auto mode is on.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import shlex
import sys
import warnings
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_cell_magic, magics_class
from traitlets import Bool, Dict, Float, Integer, TraitError, Unicode, validate

from . import api, autopx, config, launchers, processes
from .client import checkpoint, models
from .config import Backend
from .errors import (
    CheckpointError,
    MLXDistError,
    NoProfileError,
    NotStartedError,
    SetupError,
    ShardingError,
    StartError,
)
from .history import ExportError, note_entry
from .results import count
from .session import Session, others_pids
from .viz.cells import display_cell
from .viz.live import LiveOutput
from .viz.progress import LiveCell


class _Parser(argparse.ArgumentParser):
    """argparse that raises IPython's one-line UsageError instead of exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message}\n{self.format_usage()}")

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        if message:
            raise UsageError(message)
        raise UsageError(self.format_help())


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _ranks(text: str) -> list[int]:
    parts = text.replace(" ", "").split(",")
    if "" in parts:
        what = "no rank given" if not any(parts) else "a comma with no rank after or before it"
        raise argparse.ArgumentTypeError(
            f"{text!r}: {what}; give ranks as numbers separated by commas, e.g. 0,2"
        )
    try:
        return [int(x) for x in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give ranks as numbers separated by commas, e.g. 0,2"
        ) from None


def _seconds(text: str) -> float:
    """A ``--timeout``: seconds >= 0, 0 for no deadline."""
    t = _number_of_seconds(text)
    if not (math.isfinite(t) and t >= 0):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give a number of seconds >= 0 (0 means no deadline)"
        )
    return t


def _interval(text: str) -> float:
    """A dashboard's ``--interval``: seconds > 0."""
    t = _number_of_seconds(text)
    if not (math.isfinite(t) and t > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of seconds > 0 between "
                                          "updates (e.g. 0.5)")
    return t


def _number_of_seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None


def _config_timeout(value: float) -> float | None:
    """``MLXDist.timeout`` as a deadline (``None``: none), or a UsageError saying why
    the value set with ``%config`` is not one."""
    problem = _timeout_problem(value)
    if problem:
        raise UsageError(f"%config {problem}; nothing was run")
    return float(value) or None


def _timeout_problem(value: Any) -> str | None:
    if isinstance(value, int | float) and math.isfinite(value) and value >= 0:
        return None
    shown = f"{value:g}" if isinstance(value, float) else repr(value)
    return (f"MLXDist.timeout = {shown} is not a deadline: set a number of seconds > 0, or 0 "
            "for no deadline (e.g. %config MLXDist.timeout = 300)")


def _setting(name: str, value: Any, ok: bool, want: str) -> Any:
    """``value`` for ``%config MLXDist.<name>``, or the TraitError %config prints (the
    setting then keeps its value; IPython's own config keeps the bad one, so a later
    ``%reload_ext`` says it too)."""
    if not ok:
        shown = f"{value:g}" if isinstance(value, float) else repr(value)
        raise TraitError(f"MLXDist.{name} = {shown} is not {want}")
    return value


def _line_parser() -> _Parser:
    p = _Parser(prog="%mlxdist", add_help=False)
    sub = p.add_subparsers(dest="cmd", parser_class=_Parser)
    start = sub.add_parser("start", help="start N ranks in one MLX group", add_help=False)
    start.add_argument("-n", type=_positive_int, default=None, help="number of ranks")
    start.add_argument("--backend", choices=[b.value for b in Backend], default=None)
    start.add_argument("--launcher", choices=list(launchers.LAUNCHERS), default=None,
                       help="; ".join(f"{k}: {c.summary}" for k, c in launchers.LAUNCHERS.items()))
    start.add_argument("--hostfile", default=None, help="MLX hostfile (hosts: ssh names, ips)")
    start.add_argument("--hosts", default=None, help="comma separated hosts, or 'slurm' / 'local'")
    start.add_argument("--controller-ip", dest="controller_ip", default=None,
                       help="address of this machine that the hosts reach")
    start.add_argument("--python", default=None, help="Python interpreter on the hosts")
    start.add_argument("--no-spare", dest="spare", action="store_false", default=None,
                       help="keep no spare engines warm for the next restart")
    for name in ("stop", "status", "cleanup", "where"):
        sub.add_parser(name, add_help=False)
    restart = sub.add_parser("restart", add_help=False)
    restart.add_argument("-n", type=_positive_int, default=None, help="change the number of ranks")
    for name in ("plan", "shard"):
        cmd = sub.add_parser(name, add_help=False)
        cmd.add_argument("model", help="the model's name on the ranks")
        cmd.add_argument("--sharding", default="megatron", help="strategy or JSON mapping")
        cmd.add_argument("--segments", type=_positive_int, default=1)
    show = sub.add_parser("show", add_help=False)
    show.add_argument("name", help="model.path.to.parameter, or a quantized layer")
    show.add_argument("--text", action="store_true", help="a text form instead of a figure")
    show.add_argument("--no-values", action="store_true", help="blocks only, no heatmap")
    show.add_argument("--max-elements", type=_positive_int, default=1 << 20)
    grad = sub.add_parser("gradsync", add_help=False)
    grad.add_argument("model")
    grad.add_argument("--step", required=True, help="loss expression, e.g. 'loss_fn(model, x, y)'")
    grad.add_argument("--mode", choices=("auto", "dp", "tp", "fsdp"), default="auto")
    grad.add_argument("--text", action="store_true")
    check = sub.add_parser("check", add_help=False)
    check.add_argument("model")
    save = sub.add_parser("save", add_help=False)
    save.add_argument("model", help="the model's name on the ranks")
    save.add_argument("dir", help="checkpoint folder")
    save.add_argument("--optimizer", default=None, help="the optimizer's name on the ranks")
    save.add_argument("--overwrite", action="store_true",
                      help="replace another model's checkpoint in DIR")
    save.add_argument("--tokenizer-from", dest="tokenizer_from", default=None,
                      help="mlx-lm folder whose tokenizer files to keep (for consolidate)")
    load = sub.add_parser("load", add_help=False)
    load.add_argument("model", help="the model's name on the ranks (built as when saved)")
    load.add_argument("dir", help="checkpoint folder")
    load.add_argument("--optimizer", default=None, help="the optimizer's name on the ranks")
    export = sub.add_parser("export", add_help=False)
    export.add_argument("path", help="the script to write, e.g. train.py")
    export.add_argument("--overwrite", action="store_true", help="replace an existing file")
    tl = sub.add_parser("timeline", add_help=False)
    tl.add_argument("k", nargs="?", type=_positive_int, default=1,
                    help="the last K profiled cells")
    tl.add_argument("--text", action="store_true", help="text instead of a figure")
    tr = sub.add_parser("trace", add_help=False)
    tr.add_argument("path", help="file to write, e.g. run.json")
    tr.add_argument("-k", type=_positive_int, default=1, help="the last K profiled cells")
    dash = sub.add_parser("dashboard", add_help=False)
    dash.add_argument("--model", default=None, help="show this model's parameters per rank")
    dash.add_argument("--interval", type=_interval, default=0.5, help="seconds between updates")
    auto = sub.add_parser("auto", add_help=False)
    auto.add_argument("switch", choices=("on", "off"))
    return p


@functools.cache
def _without_comment(line: str) -> str:
    """``line`` up to a ``#`` that starts a word outside quotes, as in a shell or
    Python (``%mlxdist start -n 2  # two ranks``); ``a#b`` and ``'# x'`` stay."""
    quote = ""
    escaped = False
    for i, ch in enumerate(line):
        if escaped:
            escaped = False
        elif ch == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def _cell_parser() -> _Parser:
    """Built once: it runs before every cell (parsers keep no state between parses)."""
    p = _Parser(prog="%%mlxdist", add_help=False)
    p.add_argument("--ranks", type=_ranks, default=None, help="run on these ranks only")
    p.add_argument("--timeout", type=_seconds, default=None, help="deadline in seconds")
    p.add_argument("--quiet", action="store_true", help="show only failing ranks")
    p.add_argument("--check-collectives", action="store_true", default=None)
    p.add_argument("--profile", action="store_true",
                   help="time every collective (evaluated where issued: no overlap)")
    return p


@functools.lru_cache(maxsize=64)
def _cell_args(line: str) -> argparse.Namespace:
    """The parsed ``%%mlxdist`` line, kept per line (the same line is parsed again
    and again; a bad one raises each time). Shared: read it, never change it."""
    return MLXDist._parse(_cell_parser(), line)


@magics_class
class MLXDist(Magics):
    """``%mlxdist`` / ``%%mlxdist``: interactive distributed MLX."""

    n = Float(config.N, help="default number of ranks for %mlxdist start").tag(config=True)
    backend = Unicode(
        "",
        help="default MLX backend: " + " or ".join(b.value for b in Backend)
        + " (empty: the hostfile's, else ring)",
    ).tag(config=True)
    launcher = Unicode(
        "", help=f"default launcher: {', '.join(launchers.LAUNCHERS)} (empty: by backend and hosts)"
    ).tag(config=True)
    timeout = Float(
        config.CELL_TIMEOUT, help="default deadline of a %%mlxdist cell in seconds (0: none)"
    ).tag(config=True)
    start_timeout = Float(config.START_TIMEOUT, help="how long start may take").tag(config=True)
    check_collectives = Bool(
        False, help="check op/shape/dtype across ranks before each collective"
    ).tag(config=True)
    spare = Bool(
        config.SPARE,
        help="keep a spare set of engines warm so that %mlxdist restart only forms a group "
        "(local engines only)",
    ).tag(config=True)
    prewarm = Bool(
        True,
        help="when the extension loads, start the engines of a plain %mlxdist start "
        "(n ranks, the default backend, local) in the background, so that the start "
        "only forms the group (also off with MLX_NBDIST_PREWARM=0)",
    ).tag(config=True)
    policy = Dict(
        help="supervisor timings in seconds, e.g. {'drain_timeout': 5} (see "
        "mlx_nbdist.config.Policy)"
    ).tag(config=True)
    output_limit = Integer(
        config.OUTPUT_LIMIT,
        help="characters of a cell's output per rank shown in the notebook (0: all); the "
        "rest is kept in a file in the session directory, and a line says where",
    ).tag(config=True)

    # -- settings are checked when set: %config prints the error, keeps the old value
    @validate("n")
    def _check_n(self, proposal: Any) -> Any:
        v = proposal["value"]
        return _setting("n", v, math.isfinite(v) and v >= 1 and v == int(v),
                        "a number of ranks: set a whole number >= 1")

    @validate("timeout")
    def _check_timeout(self, proposal: Any) -> Any:
        problem = _timeout_problem(proposal["value"])
        if problem:
            raise TraitError(problem)
        return proposal["value"]

    @validate("start_timeout")
    def _check_start_timeout(self, proposal: Any) -> Any:
        v = proposal["value"]
        return _setting("start_timeout", v, math.isfinite(v) and v > 0,
                        "a time to start in: set a number of seconds > 0")

    @validate("output_limit")
    def _check_output_limit(self, proposal: Any) -> Any:
        return _setting("output_limit", proposal["value"], proposal["value"] >= 0,
                        "a number of characters: set one >= 0 (0: all)")

    @validate("policy")
    def _check_policy(self, proposal: Any) -> Any:
        try:
            config.Policy().updated(proposal["value"])
        except ValueError as e:
            raise TraitError(f"MLXDist.{e}") from None
        return proposal["value"]

    #: (the setting, the Policy built from it, that Policy's values) - see _policy
    _last_policy: tuple[dict[str, Any], config.Policy, dict[str, Any]] | None = None

    # -- entry point ----------------------------------------------------------------
    @line_cell_magic
    def mlxdist(self, line: str, cell: str | None = None) -> Any:
        """Run a cell on every rank (cell magic) or manage the session (line magic).

        Line: ``%mlxdist start -n N [--backend ring|mpi|nccl|jaccl] [--launcher local|mpi]``,
        ``stop``, ``restart``, ``status``, ``cleanup``, ``dashboard [--model NAME]
        [--interval S]``, ``auto on|off``, and the model commands ``plan``, ``shard``,
        ``show``, ``gradsync``, ``check``.
        Cell: ``%%mlxdist [--ranks 0,2] [--timeout S] [--quiet] [--check-collectives]``.
        """
        if cell is not None:
            return self._cell(line, cell)
        args = self._parse(_line_parser(), line)
        if args.cmd is None:
            raise UsageError(
                "%mlxdist needs a command: start, stop, restart, status, cleanup, where, "
                "plan, shard, show, gradsync, check, save, load, export, timeline, trace, "
                "dashboard, auto on|off "
                "(or use %%mlxdist as a cell magic)"
            )
        result = getattr(self, f"_cmd_{args.cmd}")(args)
        self._record(args, line)
        return result

    @staticmethod
    def _record(args: argparse.Namespace, line: str) -> None:
        """A command that ran on the ranks (or looked at them), in the session's history:
        a comment in an export (``shard``, ``save`` and ``load`` record themselves, as
        the lines that replay them)."""
        if args.cmd not in _NOTES:
            return
        entry = note_entry(f"%mlxdist {line.strip()}")
        s = api.current_session(required=False)
        if s is not None:
            s.record(entry)

    @staticmethod
    def _parse(parser: _Parser, line: str) -> argparse.Namespace:
        try:
            words = shlex.split(_without_comment(line))
        except ValueError as e:
            raise UsageError(f"%mlxdist: {e}") from None
        return parser.parse_args(words)

    # -- line commands ---------------------------------------------------------------
    def _cmd_start(self, args: argparse.Namespace) -> None:
        from . import hosts as _hosts

        multi = bool(args.hostfile or args.hosts or _hosts.in_slurm_allocation())
        # with hosts, None means one rank per hostfile entry / host / Slurm task
        n = args.n if multi else (args.n or int(self.n))
        backend = args.backend or self.backend or None
        timeout = _config_timeout(self.timeout)
        try:
            wait_for_start()
        except UsageError as e:  # the kernel's own start failed: say why, start again
            print(str(e).splitlines()[0], file=sys.stderr)
        # built first: it starts nothing, and bad hosts/flags become a UsageError
        session = self._guard(lambda: Session(
            n,
            backend=backend,
            launcher=args.launcher or self.launcher or None,
            hosts=args.hosts,
            hostfile=args.hostfile,
            controller_ip=args.controller_ip,
            python=args.python,
            timeout=timeout,
            start_timeout=self.start_timeout,
            check_collectives=self.check_collectives,
            spare=self.spare if args.spare is None else args.spare,
        ))
        session.policy = self._policy()
        s = api.current_session(required=False)
        if s is not None and s.state != "stopped":
            want = (session.n, session.backend, session.launcher)
            if (s.n, s.backend, s.launcher) != want:
                hint = (
                    f"%mlxdist restart -n {session.n}"
                    if (s.backend, s.launcher) == want[1:]
                    else "%mlxdist stop, then start again"
                )
                raise UsageError(
                    f"a session of {s.n} ranks ({s.backend}/{s.launcher}) is already running; "
                    f"to get {session.n} ranks ({session.backend}/{session.launcher}) use {hint}"
                )
            if s.status().state == "broken":
                raise UsageError(
                    f"session {s.session_id} is broken ({s.broken_reason}): "
                    "run %mlxdist restart to get new engines"
                )
            print(f"session {s.session_id} is already running: {_describe(s)}")
            return
        before = processes.child_pids()
        try:
            with _Progress() as progress, warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                self._guard(session.start, progress.update)
        except KeyboardInterrupt:
            # Session.start ended what it had started before re-raising
            raise UsageError(_interrupted_start(before, session=session)) from None
        for w in caught:
            print(f"warning: {w.message}", file=sys.stderr)
        progress.keep(session.notes)
        api.set_current_session(session)
        print(_describe(session, ranks=True))

    def _cmd_stop(self, args: argparse.Namespace) -> None:
        wait_for_start()
        s = api.current_session(required=False)
        if s is None or s.state == "stopped":
            print("no session is running")
            return
        s.stop()
        print(f"session {s.session_id} stopped")

    def _cmd_restart(self, args: argparse.Namespace) -> None:
        s = self._session(allow_stopped=True)
        if args.n and args.n != s.n:  # (the same N keeps the spare engines)
            s.stop()
            s.n = args.n
        before = processes.child_pids()
        try:
            with _Progress() as progress:
                self._guard(s.restart, progress.update)
        except KeyboardInterrupt:
            raise UsageError(_interrupted_start(before, "restart", session=s)) from None
        progress.keep(s.notes)
        print(_describe(s, ranks=True))

    def _cmd_status(self, args: argparse.Namespace) -> None:
        wait_for_start()
        s = api.current_session(required=False)
        if s is None:
            from .session import standby

            ahead = standby.describe()
            print("no session (start one with %mlxdist start -n N)" + (ahead and f"; {ahead}"))
            return
        print(api.format_status(s.status()))

    # save and load say what they did as they finish (a value is shown only when it is
    # the cell's last line: a cell that saves twice said so once)
    def _cmd_save(self, args: argparse.Namespace) -> None:
        print(self._guard(lambda: checkpoint.save(
            args.model, args.dir, args.optimizer, overwrite=args.overwrite,
            tokenizer_from=args.tokenizer_from, session=self._session())))  # fmt: skip

    def _cmd_load(self, args: argparse.Namespace) -> None:
        print(self._guard(lambda: checkpoint.load(
            args.model, args.dir, args.optimizer, session=self._session())))  # fmt: skip

    def _cmd_export(self, args: argparse.Namespace) -> None:
        s = self._session(allow_stopped=True)
        path = self._guard(lambda: s.export(args.path, overwrite=args.overwrite))
        print(f"wrote {path}: run it with `mlx.launch -n {s.n} --backend {s.backend} -- "
              f"python {path.name}` or `python -m mlx_nbdist run -n {s.n} {path.name}`")

    def _cmd_timeline(self, args: argparse.Namespace) -> Any:
        from .viz import format_timeline

        tl = self._guard(_usage("timeline", lambda: self._session().timeline(args.k)))
        if args.text:
            print(format_timeline(tl))
            return None
        print(tl.summary())
        return tl.figure()

    def _cmd_trace(self, args: argparse.Namespace) -> None:
        path = self._guard(_usage("trace", lambda: self._session().trace(args.path, args.k)))
        print(f"wrote {path}: open it in https://ui.perfetto.dev or chrome://tracing")

    def _cmd_where(self, args: argparse.Namespace) -> None:
        stacks = self._guard(self._session().where)
        print("\n".join(st.format() for st in stacks.values()))

    def _cmd_plan(self, args: argparse.Namespace) -> Any:
        sharding = self._guard(models.parse_sharding, args.sharding)
        return self._guard(lambda: models.plan(args.model, sharding, segments=args.segments,
                                                session=self._session()))

    def _cmd_shard(self, args: argparse.Namespace) -> Any:
        sharding = self._guard(models.parse_sharding, args.sharding)
        table = self._guard(lambda: models.shard(args.model, sharding, segments=args.segments,
                                                 session=self._session()))
        print(f"sharded {args.model!r} across {count(table.group_size, 'rank')} ({args.sharding})")
        for w in table.warnings:
            print(f"warning: {w}", file=sys.stderr)
        return table

    def _cmd_show(self, args: argparse.Namespace) -> Any:
        s = self._session()
        if args.text:
            print(self._guard(lambda: models.show_text(args.name, max_elements=args.max_elements,
                                                       session=s)))
            return None
        return self._guard(lambda: models.show(args.name, values=not args.no_values,
                                               max_elements=args.max_elements, session=s))

    def _cmd_gradsync(self, args: argparse.Namespace) -> Any:
        s = self._session()
        result = self._guard(lambda: models.gradsync(args.model, args.step, mode=args.mode,
                                                     session=s))
        bad = result.desynced()
        if bad:
            print(f"DESYNC: replicated parameters differ across ranks: {', '.join(bad)}",
                  file=sys.stderr)
        if args.text:
            print(result)
            return None
        return result.figure()

    def _cmd_check(self, args: argparse.Namespace) -> None:
        s = self._session()
        report = self._guard(lambda: models.check(args.model, session=s))
        print(report, file=sys.stdout if report.ok else sys.stderr)

    def _cmd_dashboard(self, args: argparse.Namespace) -> None:
        from .viz.dashboard import dashboard

        s = self._session(allow_stopped=True)
        global _DASHBOARD
        if _DASHBOARD is not None:  # the cell was run again: the old view is gone
            _DASHBOARD.close()
        _DASHBOARD = dashboard(s, model=args.model, interval=args.interval)

    def _cmd_auto(self, args: argparse.Namespace) -> None:
        if args.switch == "on":
            autopx.enable(self.shell)
            print("auto mode on: every cell runs on the ranks; start a cell with %%local "
                  "to run it here, or with a %magic for the client")
        else:
            autopx.disable(self.shell)
            print("auto mode off: cells run here; use %%mlxdist to run one on the ranks")

    @cell_magic
    def local(self, line: str, cell: str) -> None:
        """``%%local``: run this cell here, on the notebook's client (for auto mode)."""
        self.shell.run_cell(cell, store_history=False)
        s = api.current_session(required=False)
        if s is not None:
            s.record(note_entry("%%local", cell))

    def _cmd_cleanup(self, args: argparse.Namespace) -> None:
        from .processes import cleanup

        ended = cleanup()
        print("\n".join(ended) if ended else "nothing to clean up")

    # -- cell ---------------------------------------------------------------------------
    def _cell(self, line: str, cell: str) -> None:
        args = _cell_args(line)
        timeout = _config_timeout(self.timeout) if args.timeout is None else args.timeout
        s = self._session()
        try:
            targets = s.resolve_ranks(args.ranks)
        except ValueError as e:  # bad --ranks
            raise UsageError(f"%%mlxdist: {e}") from None
        # in a kernel each rank's output streams into its own area; in a terminal
        # (no front end to update a display) it is printed when the cell ends
        view = None
        in_kernel = getattr(self.shell, "kernel", None) is not None
        if in_kernel:
            view = LiveOutput(targets, headers=len(targets) > 1, quiet=args.quiet)
        try:
            with LiveCell(s, mode="widget" if in_kernel else "text") as live:

                result = s.run(
                    cell,
                    ranks=targets,
                    timeout=timeout or None,
                    check_collectives=args.check_collectives,
                    on_tick=live.tick,
                    on_output=view,  # its flush() shows throttled updates on each poll
                    output_limit=self.output_limit,
                    name=f"In [{_cell_number(self.shell)}]",
                    profile=args.profile,
                )
        except ValueError as e:  # bad --timeout, or await outside a function
            raise UsageError(f"%%mlxdist: {e}") from None
        except MLXDistError as e:
            partial = getattr(e, "result", None)
            if view is not None:
                view.finish(partial)
            elif partial is not None:
                display_cell(partial, quiet=args.quiet)
            raise
        if view is not None:
            view.finish(result)
        else:
            display_cell(result, quiet=args.quiet)

    def _session(self, allow_stopped: bool = False) -> Session:
        wait_for_start()
        try:
            s = api.current_session()
        except NotStartedError as e:
            raise UsageError(str(e)) from None
        if s.state == "stopped" and not allow_stopped:
            raise UsageError("the session is stopped: run %mlxdist start -n N")
        s.policy = self._policy()
        return s

    def _policy(self) -> config.Policy:
        """``%config MLXDist.policy`` over the defaults (a bad entry: a UsageError).

        Built again only when the setting changed (or the last one was changed in
        place): every cell asks."""
        changes = self.policy
        last = self._last_policy
        if last is not None and last[0] == changes and vars(last[1]) == last[2]:
            return last[1]
        try:
            policy = config.Policy().updated(changes)
        except ValueError as e:
            raise UsageError(f"%config MLXDist.{e}") from None
        self._last_policy = (dict(changes), policy, dict(vars(policy)))
        return policy

    @staticmethod
    def _guard(fn: Any, *a: Any) -> Any:
        try:
            return fn(*a)
        except (SetupError, ShardingError, CheckpointError, NoProfileError, ExportError) as e:
            raise UsageError(str(e)) from None


def _usage(command: str, fn: Any) -> Any:
    """``fn`` with a bad argument (``ValueError``) or an unwritable path (``OSError``)
    turned into the one-line error of ``%mlxdist COMMAND``."""

    def call() -> Any:
        try:
            return fn()
        except (ValueError, OSError) as e:
            raise UsageError(f"%mlxdist {command}: {e}") from None

    return call


def _interrupted_start(before: set[int], what: str = "start", wait: float = 5.0,
                       session: Session | None = None) -> str:
    """The one line a Ctrl-C during ``%mlxdist start`` (or ``restart``) of ``session``
    shows.

    ``Session.start`` tears down what it launched before re-raising; ipyparallel's
    nannies take a few seconds to follow. What is still there after ``wait`` seconds
    (an interrupt that landed before the session knew of a process) is ended here, by
    PID and start time: it is this kernel's child, launched by this start, unless
    another session of this kernel runs it (its spare, brought up meanwhile).
    """
    left = processes.end_started_since(before, wait, others=lambda: others_pids(session))
    again = "" if what == "start" else " (the session is stopped: %mlxdist restart starts it)"
    if not left:
        return f"{what} interrupted; nothing is left running{again}"
    shown = ", ".join(str(p.pid) for p in left[:8]) + (" …" if len(left) > 8 else "")
    return (
        f"{what} interrupted; {len(left)} process(es) it started are still running "
        f"(pids {shown}): run %mlxdist cleanup{again}"
    )


def _describe(s: Session, ranks: bool = False) -> str:
    from .viz.status import format_group

    return format_group(s, ranks)


_DASHBOARD: Any = None
#: commands that only look at the ranks: comments in an export
_NOTES = {"plan", "show", "gradsync", "check", "timeline", "trace", "where", "status",
          "dashboard"}


def wait_for_start() -> None:
    """Wait for the kernel's background start, showing its progress; its failure is
    a UsageError (once)."""
    thread = api.background_start()
    if thread is None:
        return
    progress = _Progress() if thread.is_alive() else contextlib.nullcontext()
    try:
        with progress:
            api.wait_for_background_start(getattr(progress, "update", None))
    except StartError as e:
        raise UsageError(str(e)) from None


class _Progress:
    """One line that updates while the session starts (a display handle in Jupyter)."""

    def __enter__(self) -> _Progress:
        from IPython.display import display

        self._handle = display({"text/plain": "starting…"}, raw=True, display_id=True)
        return self

    def update(self, message: str) -> None:
        if self._handle is not None:
            self._handle.update({"text/plain": message}, raw=True)
        else:
            print(message, flush=True)

    def keep(self, notes: list[str]) -> None:
        """Print ``notes`` (the start's :attr:`Session.notes`) where the progress line
        replaced them (a terminal printed every line already)."""
        if self._handle is not None:
            for note in notes:
                print(f"note: {note}")

    def __exit__(self, *exc: object) -> None:
        return None


def _cell_number(shell: Any) -> int:
    """The number the front end shows for the running cell (``In [7]``).

    Its input is in the history by now, on every IPython; ``execution_count`` is
    already the next cell's number there from IPython 9 on (8 counts after the cell).
    """
    history = getattr(getattr(shell, "history_manager", None), "input_hist_raw", None)
    if history:
        return len(history) - 1
    return int(getattr(shell, "execution_count", 0) or 0)
