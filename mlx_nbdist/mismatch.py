"""Where the ranks' collectives of one cell differ.

MLX pairs the n-th collective of one rank with the n-th of every other without
checking that they agree: an ``all_sum`` of 4 floats on one rank and of 6 on another
returns wrong values on one and leaves the other waiting for data that never comes.
The ranks record each collective over the whole group with its position among the
cell's (``CollectiveRecord.group_index``); this compares them, live (the supervisor,
from the ranks' status files) and after the cell (their ledgers).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .errors import ranks_named

#: what must agree across ranks: op, shape, dtype (and whether ``--check-collectives``
#: issued it)
Signature = tuple[str, tuple[int, ...], str, bool]
#: where in a cell: ``("", n)`` for its n-th collective run over the whole group,
#: ``(trace, n)`` for the n-th one traced in ``trace`` (``compile:step#1``)
Position = tuple[str, int]

#: point-to-point ops: paired by message (sender, receiver, n-th), not by position
P2P = ("send", "recv", "recv_like")
#: one message as its sender or receiver recorded it: bytes, dtype, shape
Message = tuple[int, str, tuple[int, ...]]

#: how many of a cell's collectives over the whole group a rank's ledger lists (each
#: an index into its table of distinct signatures: a few KB at most)
LEDGER_HEAD = 1024

CONSEQUENCE = (
    "MLX pairs them without checking: their values are wrong, and a rank can wait "
    "forever for data that never comes. Every rank must issue the same collectives, "
    "with the same shapes and dtypes, in the same order (--check-collectives compares "
    "each one before it runs)."
)


MESSAGE_CONSEQUENCE = (
    "MLX sends bytes without checking what the receiver expects: it reads wrong data, "
    "or waits forever for bytes that never come. A recv must expect the shape and dtype "
    "its send sent."
)


ORDER_CONSEQUENCE = (
    "The ranks issued the same collectives but ran them in different orders: MLX runs a "
    "collective when its output is evaluated and pairs the ranks' collectives in the "
    "order they run, so its values are wrong. Evaluate collectives in the same order on "
    "every rank: evaluate a whole step on every rank (mx.eval(loss, grads)) before one "
    "rank reads a value of it (.item(), print)"
)


def signature(op: str, shape: Sequence[int], dtype: str, check: bool = False) -> Signature:
    return (op, tuple(int(d) for d in shape), dtype, bool(check))


def describe(sig: Signature) -> str:
    op, shape, dtype, _check = sig
    return f"{op} shape={shape} dtype={dtype}"


def first_mismatch(by_rank: Mapping[int, Mapping[Position, Signature]]) -> str | None:
    """``by_rank``: per rank, its collectives over the whole group by position in the
    cell. The first position at which two ranks' differ, described; None when every
    position known on two or more ranks agrees."""
    positions = sorted({k for sigs in by_rank.values() for k in sigs})
    for k in positions:
        ranks_of: dict[Signature, list[int]] = {}
        for r in sorted(by_rank):
            if k in by_rank[r]:
                ranks_of.setdefault(by_rank[r][k], []).append(r)
        if len(ranks_of) > 1:
            parts = "; ".join(f"{ranks_named(rs)}: {describe(sig)}" for sig, rs in ranks_of.items())
            trace, n = k
            where = f"collective {n} of {_trace_name(trace)}" if trace else (
                f"collective {n} of this cell")
            return f"{where} differs between the ranks ({parts})"
    return None


def lone_trace(traces: Mapping[int, set[str]]) -> str | None:
    """``traces``: per rank that ran the cell, the traces in which it recorded
    collectives. A trace on some ranks only cannot be compared: the others' call reused
    a trace of an earlier call (other input shapes), whose collectives nobody saw, so
    the cell's values cannot be vouched for. Described; None when there is none."""
    for key in sorted(set().union(*traces.values())):
        have = sorted(r for r, keys in traces.items() if key in keys)
        if len(have) < len(traces):
            others = sorted(set(traces) - set(have))
            return (
                f"{_trace_name(key)} recorded collectives on {ranks_named(have)} but not on "
                f"{ranks_named(others)}, whose call reused a trace of an earlier call (other "
                "input shapes) or did not call it: what it runs there cannot be compared, "
                "so this cell's values are not vouched for. Call it with the same input "
                "shapes on every rank (pad the last batch), or leave the step with the "
                "collectives uncompiled"
            )
    return None


def first_order_problem(found: Mapping[int, Sequence[Mapping[str, Any]]],
                        issued_alike: bool = True,
                        counts: Mapping[int, int] | None = None) -> str | None:
    """``found``: per rank, the collectives whose tag says they ran together with
    another collective (``engine.order.Tag.problem``). The lowest rank's first,
    described with why (``issued_alike``: the ranks' issued collectives agreed, so the
    order they ran in is the cause); None when there is none. ``counts``: per rank,
    how many collectives it issued in the cell: a partner's position past its count
    was another collective's data read as a tag (one of another size ran with it),
    and is not named."""
    problems = [(rank, p) for rank in sorted(found) for p in found[rank]]
    if not problems:
        return None
    rank, p = problems[0]
    what = describe(signature(p["op"], p["shape"], p["dtype"]))
    group = p.get("group")
    members = (group or {}).get("members")
    world_rank = (lambda r: members[int(r)]) if members else int
    withs = {r: n for r, n in (p.get("with") or {}).items()
             if not n or counts is None or (group and not members)
             or n <= counts.get(world_rank(r), n)}
    name = _rank_namer(group)
    over = ""
    if group:
        over = (f" over the subgroup of ranks {', '.join(map(str, members))}" if members
                else f" over a subgroup of {group['size']} ranks")
    if p["op"] in P2P:
        src, got = p["peer"], withs.get(str(p["peer"]))
        read = f"{name(src)}'s message {got}" if got else f"another message of {name(src)}"
        text = f"message {p['n']}{over} from {name(src)} to rank {rank} ({what}) read {read}"
    else:
        known = [f"collective {n} of {name(int(r))}" for r, n in withs.items() if n]
        partner = " and ".join(known) if known else "another collective on another rank"
        text = (f"collective {p['n']}{over or ' of this cell'} ({what}) ran on rank {rank} "
                f"together with {partner}")
    if not issued_alike:  # the cause is said already; which ran with which is the fact
        return f"{text}."
    left = sorted({r for r, q in problems if q.get("settled")})
    if p["op"] in P2P and not p.get("settled"):
        left = []  # a message read out of turn as the receiver ran it: the sender's order
    if left:
        cells = "its cell" if len(left) == 1 else "their cells"
        who = ranks_named(left)
        return (f"{text}. {who[0].upper()}{who[1:]} had not evaluated them when {cells} ended (an "
                "error, an interrupt, or outputs left unevaluated), so mlx_nbdist ran them "
                "then, in the order they were issued, while the other ranks ran other "
                "collectives: a later one they had reached (a rank interrupted or failing "
                "in a loop), or the same ones in the order their mx.eval chose (mx.eval(a, b) "
                "may run b first). The values those ranks computed from them are wrong.")
    return f"{text}. {ORDER_CONSEQUENCE}."


def _rank_namer(group: Mapping[str, Any] | None) -> Any:
    """How a tag's partner is named: by its world rank, also over a subgroup whose
    members are known (``"rank 2"``); else by its rank in the subgroup."""
    members = (group or {}).get("members")
    if not group:
        return lambda r: f"rank {r}"
    if members:
        return lambda r: f"rank {members[r]}"
    return lambda r: f"the subgroup's rank {r}"


def _trace_name(trace: str) -> str:
    """``compile:step#1`` -> ``mx.compile's trace of step``."""
    transform, _, fn = trace.partition(":")
    return f"mx.{transform}'s trace of {fn.rsplit('#', 1)[0]}"


def first_message_mismatch(sent: Mapping[tuple[int, int, int], Message],
                           received: Mapping[tuple[int, int, int], Message]) -> str | None:
    """``sent`` / ``received``: by ``(sender, receiver, n)``, the n-th message between
    them as the sender sent it and as the receiver waits for it. The first whose sizes
    differ, described; None when every message known on both sides agrees."""
    for key in sorted(set(sent) & set(received)):
        (nb_s, dt_s, sh_s), (nb_r, dt_r, sh_r) = sent[key], received[key]
        if nb_s != nb_r:
            src, dst, n = key
            return (f"message {n} from rank {src} to rank {dst} differs: {nb_s} bytes sent "
                    f"({dt_s} {sh_s}) but {nb_r} expected ({dt_r} {sh_r})")
    return None

