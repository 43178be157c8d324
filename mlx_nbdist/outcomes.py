"""From the futures of a cell to what the user reads: per-rank output, failures,
and the typed error a failed cell raises."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from .errors import CellError, CellInterrupted, CollectiveTimeout
from .results import DIED, ERROR, CellResult, RankFailure, RankOutput
from .supervise import Outcome, error_of


def collect(
    futures: dict[int, Any], outcome: Outcome, cell: int, engine_ids: dict[int, int], elapsed: float
) -> CellResult:
    """Each rank's output and failure, from its future and the supervisor's outcome."""
    outs: dict[int, RankOutput] = {}
    for r, fut in futures.items():
        if r in outcome.replied:
            _wait_output(fut)
        md = fut.output.metadata
        out = RankOutput(
            rank=r,
            engine_id=engine_ids[r],
            stdout=md["stdout"] or "",
            stderr=md["stderr"] or "",
            outputs=list(md["outputs"] or []),
            result=(md["execute_result"] or {}).get("data"),
        )
        out.duration = _seconds(md["started"], md["completed"])
        exc = error_of(fut)
        if r in outcome.failures:
            out.failure = outcome.failures[r]
        elif exc is not None:
            out.failure = failure_from(r, exc)
        if out.failure is not None:
            out.status = out.failure.cause
        outs[r] = out
    return CellResult(cell=cell, ranks=outs, elapsed=elapsed, valid=outcome.valid)


def _seconds(start: Any, end: Any) -> float | None:
    if not start or not end:
        return None
    start, end = (datetime.fromisoformat(t) if isinstance(t, str) else t for t in (start, end))
    try:
        return (end - start).total_seconds()
    except TypeError:  # one naive, one aware
        return None


def _wait_output(fut: Any, timeout: float = 2.0) -> None:
    try:
        fut.output.result(timeout=timeout)
    except Exception:  # noqa: BLE001 - outputs are best effort after a reply
        pass


def failure_from(rank: int, err: BaseException) -> RankFailure:
    ename = getattr(err, "ename", type(err).__name__)
    evalue = getattr(err, "evalue", str(err))
    tb = getattr(err, "traceback", None)
    if isinstance(tb, str):
        lines = tb.splitlines()
    elif isinstance(tb, list):
        lines = [str(x) for x in tb]
    else:
        lines = []
    cause = DIED if ename in ("EngineError",) else ERROR
    return RankFailure(
        rank=rank, cause=cause, ename=ename, evalue=evalue, traceback=_trim_internal(lines)
    )


def _trim_internal(lines: list[str]) -> list[str]:
    """Drop the traceback blocks of mlx_nbdist's own engine wrappers."""
    blocks: list[list[str]] = [[]]
    for line in lines:
        if not line.strip():
            blocks.append([])
        else:
            blocks[-1].append(line)
    keep = [b for b in blocks if b and not any("mlx_nbdist/engine/" in x for x in b[:1])]
    out: list[str] = []
    for b in keep:
        out += [*b, ""]
    return out[:-1] if out else lines


def raise_for(result: CellResult, outcome: Outcome, timeout: float | None, notes: str = "") -> None:
    if result.ok:
        return
    summary = outcome.summary
    if notes:
        summary = (summary + "\n" if summary else "") + notes
    if outcome.broken:
        summary = (summary + "\n" if summary else "") + (
            f"The MLX group is broken ({outcome.broken}); run %mlxdist restart."
        )
    if outcome.timed_out:
        summary += (
            f"\nThe cell ran past its deadline of {timeout:g} s. If it legitimately needs "
            "longer, run it with a larger --timeout (or set %config MLXDist.timeout)."
        )
        raise CollectiveTimeout(result, summary.strip())
    if outcome.interrupted:
        raise CellInterrupted(result, summary.strip())
    raise CellError(result, summary.strip())


def short_error(e: BaseException) -> str:
    ename = getattr(e, "ename", None)
    if ename:
        return f"{ename}: {getattr(e, 'evalue', '')}"
    return f"{type(e).__name__}: {e}"
