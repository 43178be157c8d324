"""Collectives that ``mx.compile`` traces, on a real 2-rank group.

The tracker sees a compiled function's collectives only when it is traced, and a rank
whose call hits the compiled cache traces nothing: traced collectives are compared
with the same trace on another rank, and a trace on some ranks only fails the cell
(what the others ran cannot be compared).
"""

from __future__ import annotations

import pytest

from mlx_nbdist import CellError, CollectiveTimeout, Session


def test_a_compiled_step_traced_again_on_one_rank_only_fails_as_not_vouched_for(
        session2: Session) -> None:
    """Rank 1's batch is another size: it traces the step again, rank 0 hits the cache,
    so rank 0's compiled collectives were never seen in this cell. Here they happen to
    agree, but nothing proves it: the cell fails saying why (not "values are wrong",
    the false alarm this replaced), and the group, in step, stays usable."""
    session2.run(
        "@mx.compile\n"
        "def ord_step(x):\n"
        "    return mx.distributed.all_sum(mx.ones(3) * x.sum(), group=world)\n"
        "mx.eval(ord_step(mx.ones(8)))")
    with pytest.raises(CellError) as info:
        session2.run("bs = 8 if rank == 0 else 11\nprint(ord_step(mx.ones(bs)).tolist())")
    text = str(info.value)
    assert ("mx.compile's trace of ord_step recorded collectives on rank 1 but not on "
            "rank 0") in text, text
    assert "not vouched for" in text and "values are wrong" not in text
    assert not info.value.result.valid
    assert session2.state == "ready"
    # the same input shapes on every rank: nothing to doubt
    r = session2.run("print(ord_step(mx.ones(8)).tolist())")
    assert r.stdout(0).strip() == r.stdout(1).strip() == "[16.0, 16.0, 16.0]"


def test_a_compiled_collective_traced_with_other_shapes_is_named(fresh2: Session) -> None:
    fresh2.run(
        "@mx.compile\n"
        "def ord_step2(x):\n"
        "    return mx.distributed.all_sum(x * 2, group=world)\n"
        "mx.eval(ord_step2(mx.ones(4)))")
    with pytest.raises(CellError) as info:
        fresh2.run("n = 8 if rank == 0 else 11\nmx.eval(ord_step2(mx.ones(n)))", timeout=60)
    assert not isinstance(info.value, CollectiveTimeout), str(info.value)
    text = str(info.value)
    assert "collective 1 of mx.compile's trace of ord_step2 differs between the ranks" in text
    assert "rank 0: all_sum shape=(8,)" in text and "rank 1: all_sum shape=(11,)" in text
