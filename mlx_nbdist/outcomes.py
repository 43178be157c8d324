"""From the futures of a cell to what the user reads: per-rank output, failures,
and the typed error a failed cell raises."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from . import mismatch
from .engine.cells import LEDGER_KEY
from .errors import CellError, CellInterrupted, CollectiveTimeout, strip_ansi
from .results import DIED, ERROR, CellResult, RankFailure, RankOutput, count
from .supervise import Outcome, error_of

#: IPython compiles a cell as a temporary file named by a hash of its source
#: (``/tmp/ipykernel_1234/3660870495.py``); a syntax error's text names that file
_CELL_FILE = re.compile(r" \((?:<ipython-input-[\d-]+>|\d+\.py), line (\d+)\)$")
_SYNTAX = ("SyntaxError", "IndentationError", "TabError")


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
        if exc is not None and _display_failed(exc):
            # the cell ran; only showing its value failed: IPython warns, so do we
            out.warnings.append(_display_warning(r, exc))
            exc = None
        if r in outcome.failures:
            out.failure = outcome.failures[r]
        elif exc is not None:
            out.failure = failure_from(r, exc)
        if out.failure is not None:
            out.status = out.failure.cause
        outs[r] = out
    return CellResult(cell=cell, ranks=outs, elapsed=elapsed, valid=outcome.valid)


def ledgers_of(futures: dict[int, Any]) -> dict[int, dict[str, Any]]:
    """Each rank's ledger of the cell (ranks that issued no collective have none)."""
    out = {}
    for r, fut in futures.items():
        try:
            led = (fut.output.metadata["data"] or {}).get(LEDGER_KEY)
        except Exception:  # noqa: BLE001 - no output metadata: no ledger
            led = None
        if led:
            out[r] = led
    return out


@dataclass
class LedgerCheck:
    """What comparing the ranks' ledgers of one cell found."""

    #: messages sent to a rank that it never received: ``{receiver: [message, ...]}``
    unmatched: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    #: why the cell's values cannot be trusted, one line each
    problems: list[str] = field(default_factory=list)


def check_ledgers(ledgers: dict[int, dict[str, Any]], ran: list[int], size: int) -> LedgerCheck:
    """Compare what the ranks issued in one cell (see ``Tracker.ledger``).

    The ranks that ran the cell must have issued the same collectives (same ops,
    shapes, dtypes, in the same order), and every message sent must have been
    received by its peer with the same size. A sent message nobody received is
    listed so the receiver can drop it before it reaches a later cell.
    """
    out = LedgerCheck(problems=[])
    for src in range(size):
        sent = (ledgers.get(src) or {}).get("sent", {})
        for dst_key, msgs in sent.items():
            dst = int(dst_key)
            got = (ledgers.get(dst) or {}).get("recvd", {}).get(str(src), [])
            _compare_messages(out, src, dst, msgs, got)
    for dst in range(size):
        for src_key, got in (ledgers.get(dst) or {}).get("recvd", {}).items():
            src = int(src_key)
            if str(dst) not in (ledgers.get(src) or {}).get("sent", {}) and got:
                _compare_messages(out, src, dst, [], got)
    _check_subgroup_messages(out, ledgers, ran)
    order = order_problems(ledgers, ran)
    # a message of another size: a tag read after it, between the same ranks over the
    # same group, follows
    pairs = {m.groups() for p in out.problems for m in [_PAIR.search(p)] if m}
    order = [p for p in order if not (p.startswith("message ") and (m := _PAIR.search(p))
                                      and m.groups() in pairs)]
    out.problems[:0] = order
    return out


def _check_subgroup_messages(out: LedgerCheck, ledgers: dict[int, dict[str, Any]],
                             ran: list[int]) -> None:
    """The messages over each subgroup (``Tracker._sub_ledger``: by its key, each
    member's world rank and count of splits), compared as the world's are: a message
    sent over it and never received would be read by a later cell's receive over it,
    its tag in step (a user trial)."""
    groups = {key for led in ledgers.values() for key in (led.get("subgroups") or {})}
    for key in sorted(groups):
        members = [int(m.split(":")[0]) for m in key.split(",")]
        over = f" over the subgroup of ranks {', '.join(map(str, members))}"
        check = LedgerCheck(problems=[])
        box = {r: (led.get("subgroups") or {}).get(key, {}) for r, led in ledgers.items()}
        for src in members:
            for dst in members:
                sent = box.get(src, {}).get("sent", {}).get(str(dst), [])
                got = box.get(dst, {}).get("recvd", {}).get(str(src), [])
                if sent or got:
                    _compare_messages(check, src, dst, sent, got, over, dst in ran)
        for dst, msgs in check.unmatched.items():
            out.unmatched.setdefault(dst, []).extend(dict(m, group=key) for m in msgs)
        out.problems += check.problems


#: the group and ranks a message's line names: ``from rank 0 to rank 1``, ``over the
#: subgroup of ranks 1, 0 from rank 1 to rank 0``
_PAIR = re.compile(r"((?:over the subgroup of ranks [\d, ]+ )?)from rank (\d+) to rank (\d+)")


def order_problems(ledgers: dict[int, dict[str, Any]], ran: list[int]) -> list[str]:
    """Whether the ranks that ran the cell issued the same collectives, and ran each
    with its partners' (their tags): one line per problem (messages: see
    :func:`check_ledgers`)."""
    problems = []
    digests = {r: (ledgers.get(r) or {}).get("digest", _NONE) for r in ran}
    if len(set(digests.values())) > 1:
        heads = {r: _positions(led) for r, led in ledgers.items() if r in digests}
        counts = ", ".join(f"rank {r}: {_collectives(ledgers.get(r))}" for r in sorted(digests))
        found = mismatch.first_mismatch(heads) or (
            f"the ranks issued different collectives in this cell ({counts})"
        )
        problems.append(f"{found}. {mismatch.CONSEQUENCE}")
    else:  # collectives traced by mx.compile are not in the digest: by trace
        traced = {r: _positions(ledgers.get(r) or {}, traced=True) for r in ran}
        found = mismatch.first_mismatch(traced)
        if found:
            problems.append(f"{found}. {mismatch.CONSEQUENCE}")
        else:
            lone = mismatch.lone_trace({r: {t for t, _ in traced[r]} for r in ran})
            if lone:
                problems.append(lone + ".")
    order = mismatch.first_order_problem(
        {r: led["order"] for r, led in ledgers.items() if led.get("order")},
        issued_alike=not problems, counts={r: led.get("n", 0) for r, led in ledgers.items()})
    if order:
        problems.append(order)
    return problems


_NONE = "none"


def _positions(ledger: dict[str, Any], traced: bool = False
               ) -> dict[mismatch.Position, mismatch.Signature]:
    """A ledger's listed collectives by position: those run, or those traced."""
    table = [mismatch.signature(*sig) for sig in ledger.get("sigs", [])]
    if not traced:
        return {("", i + 1): table[k] for i, k in enumerate(ledger.get("head", []))}
    return {(trace, i + 1): table[k]
            for trace, ids in ledger.get("traced", {}).items() for i, k in enumerate(ids)}


def _collectives(ledger: dict[str, Any] | None) -> str:
    if not ledger:
        return "none"
    n = int(ledger.get("n", 0)) - sum(
        len(v) for key in ("sent", "recvd") for v in ledger.get(key, {}).values()
    )
    return count(n, "collective")


def _compare_messages(
    out: LedgerCheck, src: int, dst: int, sent: list[list[Any]], got: list[list[Any]],
    over: str = "", ran: bool = True,
) -> None:
    """One pair's messages of one cell, the sender's against the receiver's (``over``:
    the subgroup they went over, as the lines say it, ``""``: the whole group;
    ``ran``: the receiver ran the cell)."""
    for i, (s, g) in enumerate(zip(sent, got, strict=False)):
        if len(s) > 3 and len(g) > 3 and s[3] != g[3]:
            out.problems.append(
                f"message {i + 1} from rank {src} to rank {dst} was sent after {s[3]} "
                f"collective(s) on rank {src} but received after {g[3]} on rank {dst}: "
                "messages and collectives in a different order on the two ranks can read "
                "each other's data"
            )
            return
        if s[0] != g[0]:
            out.problems.append(
                f"message {i + 1}{over} from rank {src} to rank {dst}: {s[0]} bytes sent "
                f"({s[1]} {tuple(s[2])}) but {g[0]} received ({g[1]} {tuple(g[2])}); "
                "the receiver read wrong data"
            )
            return
    if len(sent) > len(got):
        extra = sent[len(got) :]
        out.unmatched.setdefault(dst, []).extend(
            {"src": src, "shape": m[2], "dtype": m[1]} for m in extra
        )
        why = f"that rank {dst} never received" if ran else (
            f"but rank {dst} did not run this cell: a message is received in the cell that "
            "sends it")
        out.problems.append(
            f"rank {src} sent {len(extra)} message(s){over} to rank {dst} {why} "
            f"({', '.join(f'{m[1]} {tuple(m[2])}' for m in extra)}); they were "
            "received and dropped so that no later cell reads them"
        )
    elif len(got) > len(sent):
        out.problems.append(
            f"rank {dst} received {len(got)} message(s){over} from rank {src}, which sent "
            f"{len(sent)} in this cell: the extra data came from an earlier cell, and the "
            "values that used it are wrong"
        )


def _seconds(start: Any, end: Any) -> float | None:
    if not start or not end:
        return None
    start, end = (_parse_time(t) if isinstance(t, str) else t for t in (start, end))
    try:
        return (end - start).total_seconds()
    except TypeError:  # one naive, one aware
        return None


def _parse_time(text: str) -> datetime:
    """ISO 8601 with a trailing ``Z`` (only Python 3.11 parses that itself)."""
    return datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text)


def _wait_output(fut: Any, timeout: float = 2.0) -> None:
    try:
        fut.output.result(timeout=timeout)
    except Exception:  # noqa: BLE001 - outputs are best effort after a reply
        pass


def _display_failed(err: BaseException) -> bool:
    """An error reply with no exception: a display formatter failed after the cell
    ran (IPython prints that traceback and carries on)."""
    return getattr(err, "ename", None) == "NoneType" and getattr(err, "evalue", None) == "None"


def _display_warning(rank: int, err: BaseException) -> str:
    tb = getattr(err, "traceback", None) or []
    lines = tb.splitlines() if isinstance(tb, str) else [str(x) for x in tb]
    last = next((x for x in reversed(lines) if x.strip()), "")
    return f"rank {rank}: showing the cell's result failed ({strip_ansi(last).strip()})"


def failure_from(rank: int, err: BaseException) -> RankFailure:
    ename = getattr(err, "ename", type(err).__name__)
    evalue = getattr(err, "evalue", str(err))
    tb = getattr(err, "traceback", None)
    if isinstance(tb, str):
        lines = [tb]
    elif isinstance(tb, list):
        lines = [str(x) for x in tb]
    else:
        lines = []
    if ename in _SYNTAX:  # "... (3660870495.py, line 1)": the cell's line instead
        evalue = _CELL_FILE.sub(r" (line \1 of the cell)", evalue)
    if ename == "EngineError":  # ipyparallel's own traceback says nothing about the rank
        return RankFailure(
            rank=rank, cause=DIED, ename=ename, evalue="its engine stopped answering"
        )
    if not ename or ename == "None":
        # IPython reports some errors outside the user's code (a failing display
        # formatter, a broken output hook) with no exception name
        ename = "Error"
        if not evalue or evalue == "None":
            evalue = "the rank reported an error outside the cell's code (no exception name)"
    return RankFailure(
        rank=rank, cause=ERROR, ename=ename, evalue=evalue, traceback=_trim_internal(lines)
    )


#: how IPython begins a frame of a traceback: ``File /path/to/x.py:157, in fn(...)``
_FRAME = re.compile(r"File (?:.+\.py|<[^>]+>):\d+(?:, in .*)?$")
#: the frames that are not the user's: mlx_nbdist's engine wrappers, ipyparallel's
#: apply (``do_apply``) and the one-line code string it runs (``<string>`` at line 1
#: only: a user's ``exec`` of longer code is theirs)
_INTERNAL = re.compile(r"File (?:.*/mlx_nbdist/engine/[^/]+\.py:\d+"
                       r"|.*/ipyparallel/engine/kernel\.py:\d+|<string>:1)(?:, in .*)?$")


def _trim_internal(entries: list[str]) -> list[str]:
    """A traceback's lines without the blocks (frames) of mlx_nbdist's own engine
    wrappers and of the ipyparallel apply that ran them. ``entries``: IPython's
    structured traceback (an entry a header or frame), or one text."""
    blocks: list[list[str]] = []
    for entry in entries:
        blocks.append([])
        for line in entry.splitlines():
            if not line.strip():
                blocks.append([])
            elif _FRAME.match(strip_ansi(line)):  # a frame, maybe right after the header
                blocks.append([line])
            else:
                blocks[-1].append(line)
    keep = [b for b in blocks if b and not _INTERNAL.match(strip_ansi(b[0]))]
    out: list[str] = []
    for b in keep:
        out += [*b, ""]
    return out[:-1] if out else [line for e in entries for line in e.splitlines()]


def raise_for(result: CellResult, outcome: Outcome, timeout: float | None, notes: str = "") -> None:
    result.valid = result.valid and outcome.valid
    stopped = outcome.timed_out or outcome.interrupted or not result.valid
    if result.ok and not outcome.problem and not outcome.broken and not stopped:
        return
    summary = outcome.summary
    if outcome.problem:
        summary = (outcome.problem + "\n" + summary).strip()
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
