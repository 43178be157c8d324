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

#: what must agree across ranks: op, shape, dtype (and whether ``--check-collectives``
#: issued it)
Signature = tuple[str, tuple[int, ...], str, bool]

#: how many of a cell's collectives over the whole group a rank's ledger lists
LEDGER_HEAD = 16

CONSEQUENCE = (
    "MLX pairs them without checking: their values are wrong, and a rank can wait "
    "forever for data that never comes. Every rank must issue the same collectives, "
    "with the same shapes and dtypes, in the same order (--check-collectives compares "
    "each one before it runs)."
)


def signature(op: str, shape: Sequence[int], dtype: str, check: bool = False) -> Signature:
    return (op, tuple(int(d) for d in shape), dtype, bool(check))


def describe(sig: Signature) -> str:
    op, shape, dtype, _check = sig
    return f"{op} shape={shape} dtype={dtype}"


def first_mismatch(by_rank: Mapping[int, Mapping[int, Signature]]) -> str | None:
    """``by_rank``: per rank, its collectives over the whole group by position in the
    cell (1-based). The first position at which two ranks' differ, described; None
    when every position known on two or more ranks agrees."""
    positions = sorted({k for sigs in by_rank.values() for k in sigs})
    for k in positions:
        ranks_of: dict[Signature, list[int]] = {}
        for r in sorted(by_rank):
            if k in by_rank[r]:
                ranks_of.setdefault(by_rank[r][k], []).append(r)
        if len(ranks_of) > 1:
            parts = "; ".join(f"{_ranks(rs)}: {describe(sig)}" for sig, rs in ranks_of.items())
            return f"collective {k} of this cell differs between the ranks ({parts})"
    return None


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {', '.join(map(str, ranks))}"
