"""The position tags that prove the ranks ran a collective together (pure: no engines)."""

from __future__ import annotations

import pytest

from mlx_nbdist.engine import order
from mlx_nbdist.mismatch import first_order_problem
from mlx_nbdist.results import CollectiveRecord


@pytest.mark.parametrize(("op", "dtype", "size", "base", "n"), [
    # a sum of 2 ranks holds 2 * d * d exactly: float32 to 2**24, bfloat16 to 2**8
    ("all_sum", "float32", 2, 2897, 2),
    ("all_sum", "bfloat16", 2, 12, 5),
    ("all_sum", "float16", 2, 33, 3),
    ("all_sum", "bfloat16", 4, 9, 5),
    ("all_sum", "int8", 64, 2, 15),
    ("all_max", "bfloat16", 2, 257, 2),
    ("all_gather", "int32", 8, order.SPAN, 1),
])
def test_every_tag_tells_at_least_a_span_of_positions_apart(
        op: str, dtype: str, size: int, base: int, n: int) -> None:
    assert order.width(op, dtype, size, 16) == (base, n)
    assert base**n >= order.SPAN


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "uint8", "int64",
                                   "complex64", "bool"])
@pytest.mark.parametrize("op", ["send", "recv", "recv_like"])
def test_a_messages_tag_is_the_same_bytes_whatever_its_dtype(op: str, dtype: str) -> None:
    """A sender and its receiver may name the same bytes with other dtypes (MLX allows
    ``send`` float32, ``recv`` float16): both must put and read as many bytes."""
    base, n = order.width(op, dtype, 2, 16)
    assert (base, n) == (31, order.MESSAGE_TAG_BYTES) and base**n >= order.SPAN


def test_a_message_sent_as_one_dtype_and_received_as_another_is_read_right() -> None:
    import mlx.core as mx

    fns = {"send": lambda x, dst: x, "recv": lambda shape, dtype, src: None}
    sent, ds = order.call("send", fns, mx.array([1.0, 2.0, 3.0, 4.0]), (4,), "float32", 1,
                          {}, 40, 31, 8, 2)
    wire = sent[1][0]
    assert wire.nbytes == 16 + order.MESSAGE_TAG_BYTES
    plan, rds = order.call("recv", fns, None, (8,), "float16", 0, {}, 40, 31, 8, 2)
    assert plan[1][0] == (8 + order.MESSAGE_TAG_BYTES // 2,) and list(rds) == list(ds)
    got = mx.array(memoryview(wire).cast("B")).view(mx.float16)  # what the receiver holds
    user, full = plan[3](got)
    assert user.tolist() == mx.array([1.0, 2.0, 3.0, 4.0]).view(mx.float16).tolist()
    rec = CollectiveRecord(1, "recv", (8,), "float16", 0, 16, 1, 40, False, 40, "")
    t = order.Tag(rec, full, rds, 31, 2)
    assert t.as_expected() and t.problem(t.values(), 1, issued=40) is None
    # another position's message: caught, whatever dtype it was sent as
    other, _ = order.call("send", fns, mx.array([1, 2, 3, 4], dtype=mx.int32), (4,), "int32",
                          1, {}, 41, 31, 8, 2)
    t.full = plan[3](mx.array(memoryview(other[1][0]).cast("B")).view(mx.float16))[1]
    assert not t.as_expected()
    found = t.problem(t.values(), 1, issued=41)
    assert found is not None and found["with"] == {"0": 41}


def test_a_bool_messages_tag_is_zeros_and_not_checked() -> None:
    import mlx.core as mx

    fns = {"send": lambda x, dst: x}
    sent, _ = order.call("send", fns, mx.array([True, False, True]), (3,), "bool", 1, {}, 7,
                         31, 8, 2)
    wire = sent[1][0]
    assert wire.nbytes == 3 + order.MESSAGE_TAG_BYTES
    assert bytes(memoryview(wire).cast("B"))[3:] == bytes(order.MESSAGE_TAG_BYTES)
    rec = CollectiveRecord(1, "recv", (3,), "uint8", 0, 3, 1, 7, False, 7, "")
    t = order.Tag(rec, mx.array(memoryview(wire).cast("B")), order.digits(7, 31, 8), 31, 2)
    assert t.problem(t.values(), 1, issued=7) is None


def test_what_is_not_tagged() -> None:
    assert order.width("all_sum", "bool", 2, 16) == (0, 0)
    assert order.width("sum_scatter", "float32", 2, 16) == (0, 0)
    assert order.width("send", "float32", 2, order.MAX_BYTES) == (0, 0)  # a large message
    # a large group collective is tagged, in a collective of its own (test_evaluation_order)
    assert order.width("all_sum", "float32", 2, order.MAX_BYTES) == order.width(
        "all_sum", "float32", 2, 16) != (0, 0)
    assert order.width("all_sum", "float32", 1, 16) == (0, 0)


def test_digits_are_a_position_and_the_wildcard_is_none() -> None:
    assert order.digits(1, 12, 3) == [0, 0, 0]
    assert order.digits(12 * 12 + 3, 12, 3) == [2, 0, 1]
    assert order.digits(order.WILDCARD, 12, 3) == [12, 12, 12]


def tag(op: str, index: int, base: int = 10, n: int = 2, size: int = 2,
        peer: int | None = None) -> order.Tag:
    rec = CollectiveRecord(1, op, (4,), "float32", peer, 16, 1, index, False, index, "")
    return order.Tag(rec, None, order.digits(index, base, n), base, size)


@pytest.mark.parametrize(("op", "got"), [
    # position 13: digits [2, 1]
    ("all_sum", [4, 8, 2, 2]), ("all_max", [2, 7, 1, 8]), ("all_min", [2, 7, 1, 8]),
    ("all_gather", [2, 1, 2, 1]), ("recv", [2, 1])])
def test_the_expected_tag_is_no_problem(op: str, got: list[float]) -> None:
    assert tag(op, 13).problem(got, 0, issued=20) is None


def test_a_message_from_a_traced_sender_is_any_position() -> None:
    assert tag("recv", 13).problem([10, 10], 1, issued=20) is None
    assert tag("recv", 13).problem([3, 1], 1, issued=20) is not None


def test_a_sum_names_the_partner_on_two_ranks() -> None:
    # ours is position 13 ([2, 1]), theirs 15 ([4, 1])
    found = tag("all_sum", 13).problem([6, 20, 2, 2], 0, issued=20)
    assert found is not None and found["with"] == {"1": 15} and not found["settled"]
    # more positions than the tag tells apart: the partner could be more than one
    assert tag("all_sum", 13).problem([6, 20, 2, 2], 0, issued=101)["with"] == {"1": None}
    # not a tag at all (a collective of another size ran with it): no position
    assert tag("all_sum", 13).problem([6.5, 20, 2, 2], 0, issued=20)["with"] == {"1": None}


def test_three_ranks_whose_digits_average_to_ours_are_caught() -> None:
    # digits 1, 2, 3 for ours 2: their sum is 3 * 2, their squares' is not 3 * 4
    assert tag("all_sum", 3, size=3).problem([6, 14, 0, 0], 0, issued=5) is not None


def test_a_gather_names_each_rank_that_ran_another() -> None:
    found = tag("all_gather", 2, size=3).problem([1, 0, 3, 0, 1, 0], 0, issued=5)
    assert found is not None and found["with"] == {"1": 4}


def test_the_lowest_ranks_first_problem_is_described() -> None:
    t1 = tag("all_sum", 1).problem([1, 1, 0, 0], 1, issued=2)
    t0 = tag("all_sum", 2).problem([1, 1, 0, 0], 0, issued=2)
    text = first_order_problem({1: [t1], 0: [t0]})
    assert text is not None and text.startswith(
        "collective 2 of this cell (all_sum shape=(4,) dtype=float32) ran on rank 0 together "
        "with collective 1 of rank 1. The ranks issued the same collectives but ran them in "
        "different orders")
    msg = tag("recv", 1, peer=0).problem([1, 0], 1, issued=2)
    text = first_order_problem({1: [msg]})
    assert text is not None and text.startswith(
        "message 1 from rank 0 to rank 1 (recv shape=(4,) dtype=float32) read rank 0's "
        "message 2. ")
    assert first_order_problem({}) is None


def test_a_subgroups_collective_is_named_by_its_members_world_ranks() -> None:
    """Over a group ``world.split`` made, positions count in that group; its partners
    are found by their ranks in it and named by their world ranks (its members,
    gathered when it was made)."""
    t = tag("all_sum", 2)
    # world rank 2 is the group's rank 1 of ranks (3, 2); its partner ran position 1
    t.place = (12345, 1, 2, (3, 2))
    found = t.problem([1, 1, 0, 0], 2, issued=2)
    assert found is not None and found["with"] == {"0": 1} and found["n"] == 2
    assert found["group"] == {"rank": 1, "size": 2, "members": [3, 2]}
    text = first_order_problem({2: [found]})
    assert text is not None and text.startswith(
        "collective 2 over the subgroup of ranks 3, 2 (all_sum shape=(4,) dtype=float32) ran "
        "on rank 2 together with collective 1 of rank 3. "), text
    msg = tag("recv", 1, peer=1)
    msg.place = (12345, 0, 1, (0, 2))
    text = first_order_problem({0: [msg.problem([1, 0], 0, issued=2)]})
    assert text is not None and text.startswith(
        "message 1 over the subgroup of ranks 0, 2 from rank 2 to rank 0 (recv shape=(4,) "
        "dtype=float32) read rank 2's message 2. "), text
    # members not known (a backend that could not gather them): ranks in the group
    msg.place = (12345, 0, 1, None)
    text = first_order_problem({0: [msg.problem([1, 0], 0, issued=2)]})
    assert text is not None and text.startswith(
        "message 1 over a subgroup of 2 ranks from the subgroup's rank 1 to rank 0"), text


def test_a_message_read_out_of_turn_by_the_receiver_is_not_blamed_on_a_cells_end() -> None:
    """A user trial: rank 1 read message 1 itself (the sender's mx.eval had sent 3
    first), then raised; its later receives ran at its cell's end. The first problem
    is the sender's order, not the cell's end."""
    first = tag("recv", 1, peer=0).problem([2, 0], 1, issued=3)
    later = tag("recv", 2, peer=0).problem([0, 0], 1, issued=3, settled=True)
    text = first_order_problem({1: [first, later]})
    assert text is not None and "had not evaluated them when" not in text
    assert "The ranks issued the same collectives but ran them in different orders" in text


def test_collectives_run_at_a_cells_end_are_blamed_on_that_end_not_on_mx_eval() -> None:
    """A rank that raised before evaluating two collectives has them run in issue order
    when its cell ends; its peer's mx.eval(a, b) ran b first."""
    t0 = tag("all_sum", 1).problem([1, 1, 0, 0], 0, issued=2)
    t1 = tag("all_sum", 1).problem([1, 1, 0, 0], 1, issued=2, settled=True)
    text = first_order_problem({0: [t0], 1: [t1]})
    assert text is not None and "Rank 1 had not evaluated them when its cell ended" in text
    assert "The values those ranks computed from them are wrong" in text
    assert "mx.eval(loss, grads)" not in text


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "int8", "uint64"])
def test_a_tag_is_read_from_the_outputs_buffer(dtype: str) -> None:
    import mlx.core as mx

    rec = CollectiveRecord(1, "all_sum", (3,), dtype, None, 0, 1, 1, False, 1, "")
    full = mx.array([7, 7, 7, 2, 2, 0, 0], dtype=getattr(mx, dtype))  # 2 ranks, digits [1, 0]
    t = order.Tag(rec, full, [1, 0], 10, 2)
    assert t.values() == [2, 2, 0, 0] and t.problem(t.values(), 0, issued=1) is None
    gather = CollectiveRecord(2, "all_gather", (2,), dtype, None, 0, 1, 2, False, 2, "")
    rows = mx.array([9, 9, 1, 8, 8, 3], dtype=getattr(mx, dtype))  # each rank's row, its tag
    assert order.Tag(gather, rows, [1], 10, 2).values() == [1, 3]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64", "int8",
                                   "uint8", "int16", "uint32", "int64", "uint64"])
@pytest.mark.parametrize("op", ["all_sum", "all_max", "all_min", "recv"])
def test_a_tags_bytes_are_as_expected_exactly_when_its_values_are(op: str, dtype: str) -> None:
    """The tracker reads a tag's bytes first (``as_expected``) and its values only when
    they differ: the two must agree, for every value of every digit that can be wrong."""
    import mlx.core as mx

    def output(values: list[int]) -> mx.array:
        if op != "recv":
            return mx.array([5, 6, 7, *values], dtype=getattr(mx, dtype))
        tail = mx.array(bytes(0x40 + v for v in values)).view(getattr(mx, dtype))
        return mx.concatenate([mx.array([5, 6, 7], dtype=getattr(mx, dtype)), tail])

    for size in (2, 3):
        base, n = order.width(op, dtype, size, 16)
        for index in (1, 2, base + 1, order.SPAN):
            rec = CollectiveRecord(1, op, (3,), dtype, None, 12, 1, index, False, index, "")
            t = order.Tag(rec, None, order.digits(index, base, n), base, size)
            want = t.expected()
            t.full = output(want)
            assert t.as_expected() and t.problem(t.values(), 0, issued=index) is None
            for j, v in enumerate(want):
                wrong = [*want[:j], v - 1 if v else 1, *want[j + 1:]]
                t.full = output(wrong)
                assert not t.as_expected(), (size, index, j)
                assert t.problem(t.values(), 0, issued=index) is not None


def test_a_gathers_tags_are_always_read_as_values() -> None:
    import mlx.core as mx

    gather = CollectiveRecord(2, "all_gather", (2,), "int32", None, 0, 1, 2, False, 2, "")
    t = order.Tag(gather, mx.array([9, 9, 1, 8, 8, 1], dtype=mx.int32), [1], 10, 2)
    assert not t.as_expected() and t.problem(t.values(), 0, issued=2) is None
