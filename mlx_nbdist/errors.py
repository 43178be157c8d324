"""Typed errors a user reads.

Modelled on ipyparallel's ``CompositeError``: an error raised by a cell carries every
failing rank's traceback, each with its rank number, and renders them in IPython
through ``_render_traceback_`` so the notebook shows the ranks' tracebacks rather than
the client's stack.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .results import CellResult, RankFailure


class MLXDistError(Exception):
    """Base class of every error mlx_nbdist raises on purpose.

    IPython shows these as one message, not as a traceback through mlx_nbdist.
    """

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


class SetupError(MLXDistError):
    """The environment cannot run a session (missing package, no distributed MLX)."""


class StartError(MLXDistError):
    """The engines or the MLX group could not be started."""


class PortTakenError(StartError):
    """The group did not form because another process took a port a rank had picked
    (ports are picked free, then bound by MLX: another session starting at the same
    moment can take one in between). A new start picks new ports."""


class NotStartedError(MLXDistError):
    """A cell or command needs a running session and there is none."""


class SessionBrokenError(MLXDistError):
    """The MLX group is unusable (a rank died or was ended); ``restart`` is needed."""


class ShardingError(MLXDistError):
    """A sharding plan cannot be applied (bad dims, unknown paths, unsupported layer),
    or a model command (plan, shard, show, check, gradsync) was given an object on the
    ranks that it cannot work on (not a model, different shapes on different ranks)."""


class NoProfileError(MLXDistError):
    """A timeline, trace or statistics were asked for and there is nothing to show
    (no profiled cell yet, a stopped session, K beyond the cells kept)."""


class CheckpointError(MLXDistError):
    """A checkpoint cannot be saved, loaded or consolidated (names the file, rank,
    parameter or dimension, and what to do)."""


class CellError(MLXDistError):
    """One or more ranks failed a ``%%mlxdist`` cell.

    Ranks that failed the same way (same cause, exception, message and traceback,
    up to the ``Cell In[N]`` numbers, which differ between engines) are reported
    once, as ``[ranks 0-3] SyntaxError: ...`` with one traceback.

    Attributes:
        result: the :class:`~mlx_nbdist.results.CellResult` with every rank's output,
            including the ranks that succeeded.
        failures: the failing ranks, the rank that raised first.
        groups: the failures grouped by how the ranks failed, in the same order.
        summary: what mlx_nbdist did about ranks stuck waiting for the failed ones.
    """

    def __init__(self, result: CellResult, summary: str = ""):
        self.result = result
        self.failures: list[RankFailure] = _order_failures(result.failures)
        self.groups: list[FailureGroup] = group_failures(self.failures)
        self.summary = summary
        super().__init__(self._message())

    #: the first line when no rank failed (every rank's code ended without an error,
    #: yet the cell did not: its collectives did not match, or it was stopped)
    no_failure = "every rank finished, but the cell failed"

    def _message(self) -> str:
        n = len(self.result.ranks)
        lines = [f"{len(self.failures)} of {n} ranks failed" if self.failures else
                 self.no_failure]
        lines += [g.headline() for g in self.groups]
        if self.summary:
            lines.append(self.summary)
        return "\n".join(lines)

    def _render_traceback_(self) -> list[str]:
        out = [f"{type(self).__name__}: {self._message().splitlines()[0]}"]
        for g in self.groups:
            f = g.first
            out.append("")
            out.append(g.headline())
            out.extend(line.rstrip("\n") for line in f.traceback)
            if f.pending:
                out.append(
                    f"  last collectives on {g.label()}: "
                    + "; ".join(p.describe() for p in f.pending[-3:])
                )
            if f.stack is not None and len(f.stack.frames) > 1:  # one: the headline says it
                lines = f.stack.format().splitlines()
                verb = "was" if len(g.ranks) == 1 else "were"
                out.append(f"  {g.label()} {verb} at " + lines[0].split(" is at ", 1)[-1])
                out.extend("  " + line for line in lines[1:])
        if self.summary:
            out.append("")
            out.append(self.summary)
        return out

    def __str__(self) -> str:
        return self._message()


@dataclass
class FailureGroup:
    """Ranks that failed a cell the same way; ``first`` stands for all of them."""

    ranks: list[int]
    first: RankFailure

    def label(self) -> str:
        if len(self.ranks) == 1:
            return f"rank {self.ranks[0]}"
        return f"ranks {rank_span(self.ranks)}"

    def headline(self) -> str:
        """``RankFailure.headline`` with the group's ranks in place of the first's."""
        line = self.first.headline()
        own = f"[rank {self.first.rank}]"
        if len(self.ranks) > 1 and line.startswith(own):
            line = f"[{self.label()}]" + line[len(own):]
        return line


def group_failures(failures: list[RankFailure]) -> list[FailureGroup]:
    """Group failures that differ only in their rank (and ``Cell In[N]`` numbers),
    keeping the order of each group's first failure."""
    groups: dict[tuple, FailureGroup] = {}
    for f in failures:
        key = _failure_key(f)
        if key in groups:
            groups[key].ranks.append(f.rank)
        else:
            groups[key] = FailureGroup([f.rank], f)
    return list(groups.values())


# Per-engine numbers in a traceback: IPython's ``Cell In[12]`` (execution counts
# differ between engines once a cell ran on some ranks only), the older
# ``<ipython-input-12-…>`` and ipykernel's per-process temporary directory.
_PER_ENGINE = (
    (re.compile(r"In\[\d+\]"), "In[]"),
    (re.compile(r"ipython-input-\d+-"), "ipython-input--"),
    (re.compile(r"ipykernel_\d+"), "ipykernel_"),
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def strip_ansi(text: str) -> str:
    """``text`` without terminal colour codes (IPython colours tracebacks)."""
    return _ANSI.sub("", text)


def _normalise(text: str) -> str:
    text = strip_ansi(text)
    for pattern, repl in _PER_ENGINE:
        text = pattern.sub(repl, text)
    return text


def _failure_key(f: RankFailure) -> tuple:
    return (
        f.cause,
        f.ename,
        _normalise(f.evalue),
        tuple(_normalise(line) for line in f.traceback),
        tuple(p.describe() for p in f.pending[-3:]),
        _stack_key(f),
    )


def _stack_key(f: RankFailure) -> tuple:
    """Ranks stopped at different lines are reported apart."""
    if f.stack is None or not f.stack.frames:
        return ()
    return tuple((fr.cell, fr.line, fr.func) if fr.cell is not None else (fr.file, fr.line)
                 for fr in f.stack.frames)


def ranks_named(ranks: list[int]) -> str:
    """``[1]`` as ``rank 1``, ``[0, 2]`` as ``ranks 0, 2``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {', '.join(map(str, ranks))}"


def rank_span(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``."""
    ordered = sorted(set(ranks))
    parts = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ", ".join(parts)


class CollectiveTimeout(CellError):
    """A cell ran past its deadline; the stuck ranks were ended."""

    no_failure = "the cell ran past its deadline; no rank raised (each finished or caught it)"


class CellInterrupted(CellError):
    """The user interrupted a cell; ranks that did not stop were ended."""

    no_failure = "the cell was interrupted; no rank raised (each finished or caught it)"


def _order_failures(failures: list[RankFailure]) -> list[RankFailure]:
    # Ranks whose own code raised or died come first: they are the cause; ranks
    # ended or drained because they waited on them come after.
    from .results import DIED, ERROR

    first = [f for f in failures if f.cause in (ERROR, DIED)]
    rest = [f for f in failures if f.cause not in (ERROR, DIED)]
    return sorted(first, key=lambda f: f.rank) + sorted(rest, key=lambda f: f.rank)
