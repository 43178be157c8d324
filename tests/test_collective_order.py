"""Collectives that ``mx.compile`` traces, on a real 2-rank group.

The tracker sees a compiled function's collectives only when it is traced, and a rank
whose call hits the compiled cache traces nothing: traced collectives are compared
only with the same trace on another rank.
"""

from __future__ import annotations

import pytest

from mlx_nbdist import CellError, CollectiveTimeout, Session


def test_a_compiled_step_traced_again_on_one_rank_only_is_not_a_difference(
        session2: Session) -> None:
    session2.run(
        "@mx.compile\n"
        "def ord_step(x):\n"
        "    return mx.distributed.all_sum(mx.ones(3) * x.sum(), group=world)\n"
        "mx.eval(ord_step(mx.ones(8)))")
    # rank 1's batch is another size: it traces again, rank 0 hits the cache; the
    # collective's shape does not depend on the batch, so the sums are right
    r = session2.run("bs = 8 if rank == 0 else 11\nprint(ord_step(mx.ones(bs)).tolist())")
    for k in (0, 1):
        assert r.stdout(k).strip() == "[19.0, 19.0, 19.0]", r.stdout(k)


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
