"""Typed errors a user reads.

Modelled on ipyparallel's ``CompositeError``: an error raised by a cell carries every
failing rank's traceback, each with its rank number, and renders them in IPython
through ``_render_traceback_`` so the notebook shows the ranks' tracebacks rather than
the client's stack.
"""

from __future__ import annotations

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


class NotStartedError(MLXDistError):
    """A cell or command needs a running session and there is none."""


class SessionBrokenError(MLXDistError):
    """The MLX group is unusable (a rank died or was ended); ``restart`` is needed."""


class ShardingError(MLXDistError):
    """A sharding plan cannot be applied (bad dims, unknown paths, unsupported layer)."""


class CellError(MLXDistError):
    """One or more ranks failed a ``%%mlxdist`` cell.

    Attributes:
        result: the :class:`~mlx_nbdist.results.CellResult` with every rank's output,
            including the ranks that succeeded.
        failures: the failing ranks, the rank that raised first.
        summary: what mlx_nbdist did about ranks stuck waiting for the failed ones.
    """

    def __init__(self, result: CellResult, summary: str = ""):
        self.result = result
        self.failures: list[RankFailure] = _order_failures(result.failures)
        self.summary = summary
        super().__init__(self._message())

    def _message(self) -> str:
        lines = [f"{len(self.failures)} of {len(self.result.ranks)} ranks failed"]
        lines += [f.headline() for f in self.failures]
        if self.summary:
            lines.append(self.summary)
        return "\n".join(lines)

    def _render_traceback_(self) -> list[str]:
        out = [f"{type(self).__name__}: {self._message().splitlines()[0]}"]
        for f in self.failures:
            out.append("")
            out.append(f.headline())
            out.extend(line.rstrip("\n") for line in f.traceback)
            if f.pending:
                out.append(
                    f"  last collectives on rank {f.rank}: "
                    + "; ".join(p.describe() for p in f.pending[-3:])
                )
        if self.summary:
            out.append("")
            out.append(self.summary)
        return out

    def __str__(self) -> str:
        return self._message()


class CollectiveTimeout(CellError):
    """A cell ran past its deadline; the stuck ranks were ended."""


class CellInterrupted(CellError):
    """The user interrupted a cell; ranks that did not stop were ended."""


def _order_failures(failures: list[RankFailure]) -> list[RankFailure]:
    # Ranks whose own code raised or died come first: they are the cause; ranks
    # ended or drained because they waited on them come after.
    from .results import DIED, ERROR

    first = [f for f in failures if f.cause in (ERROR, DIED)]
    rest = [f for f in failures if f.cause not in (ERROR, DIED)]
    return sorted(first, key=lambda f: f.rank) + sorted(rest, key=lambda f: f.rank)
