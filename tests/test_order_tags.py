"""The position tags that prove the ranks ran a collective together (pure: no engines)."""

from __future__ import annotations

import pytest

from mlx_nbdist.engine import order
from mlx_nbdist.mismatch import first_order_problem
from mlx_nbdist.results import CollectiveRecord


def test_a_dtype_tags_positions_modulo_what_it_holds_exactly() -> None:
    # a sum of 2 ranks holds 2 * a * a: float32 up to 2**24, bfloat16 up to 2**8
    assert order.modulus("all_sum", "float32", 2, 16) == 2896
    assert order.modulus("all_sum", "bfloat16", 2, 16) == 11
    assert order.modulus("all_gather", "bfloat16", 2, 16) == 255
    assert order.modulus("all_sum", "bool", 2, 16) == 0
    assert order.modulus("sum_scatter", "float32", 2, 16) == 0
    assert order.modulus("all_sum", "float32", 2, order.MAX_BYTES) == 0
    assert order.modulus("all_sum", "bfloat16", 64, 16) == 2  # 64 * 2 * 2 = 256
    assert order.modulus("all_sum", "int8", 64, 16) == 0  # not even 2 positions


def tag(op: str, index: int, m: int = 100, size: int = 2, peer: int | None = None) -> order.Tag:
    rec = CollectiveRecord(1, op, (4,), "float32", peer, 16, 1, index, False, index, "")
    return order.Tag(rec, None, order.position(index, m), m, size)


@pytest.mark.parametrize(("op", "got"), [
    ("all_sum", [6, 18]), ("all_max", [3, 98]), ("all_min", [3, 98]),
    ("all_gather", [3, 3]), ("recv", [3])])
def test_the_expected_tag_is_no_problem(op: str, got: list[float]) -> None:
    assert tag(op, 3).problem(got, 0, issued=5) is None


def test_a_sum_names_the_partner_on_two_ranks() -> None:
    found = tag("all_sum", 3).problem([3 + 5, 9 + 25], 0, issued=5)
    assert found is not None and found["with"] == {"1": 5}
    # more positions than the modulus: the partner could be more than one
    found = tag("all_sum", 3, m=4).problem([3 + 1, 9 + 1], 0, issued=5)
    assert found is not None and found["with"] == {"1": None}


def test_three_ranks_whose_positions_average_to_ours_are_caught() -> None:
    # positions 2, 3, 4: their sum is 3 * 3, their squares' is not 3 * 9
    assert tag("all_sum", 3, size=3).problem([9, 4 + 9 + 16], 0, issued=5) is not None


def test_a_gather_names_each_rank_that_ran_another() -> None:
    found = tag("all_gather", 2, size=3).problem([2, 4, 2], 0, issued=5)
    assert found is not None and found["with"] == {"1": 4}


def test_the_lowest_ranks_first_problem_is_described() -> None:
    t1 = tag("all_sum", 1).problem([1 + 2, 1 + 4], 1, issued=2)
    t0 = tag("all_sum", 2).problem([2 + 1, 4 + 1], 0, issued=2)
    text = first_order_problem({1: [t1], 0: [t0]})
    assert text == ("collective 2 of this cell (all_sum shape=(4,) dtype=float32) ran on "
                    "rank 0 together with collective 1 of rank 1")
    msg = tag("recv", 1, peer=0).problem([2], 1, issued=2)
    assert first_order_problem({1: [msg]}) == (
        "message 1 from rank 0 to rank 1 (recv shape=(4,) dtype=float32) read rank 0's "
        "message 2")
    assert first_order_problem({}) is None
