"""Collectives run in another order on one rank, on a real 2-rank group.

MLX pairs the ranks' collectives in the order they *run* (when their outputs are
evaluated), not the order they were issued: two ranks that issue the same collectives
but evaluate them in another order exchange each other's data, and with equal sizes
MLX returns wrong values without a word. Each collective carries a tag of its
position (``mlx_nbdist.engine.order``): the cell fails naming both collectives, and
the group, proved in step, stays usable.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from mlx_nbdist import CellError, Session
from mlx_nbdist.results import DRAINED

SWAP = (
    "a = mx.distributed.all_sum(mx.ones({shape}, dtype=mx.{dtype}) * (rank + 1), group=world)\n"
    "b = mx.distributed.all_sum(mx.ones({shape}, dtype=mx.{dtype}) * 10 * (rank + 1), "
    "group=world)\n"
    "if rank == 0:\n"
    "    mx.eval(a); mx.eval(b)\n"
    "else:\n"
    "    mx.eval(b); mx.eval(a)\n"
    "print(a.tolist(), b.tolist())"
)


@pytest.mark.parametrize(("shape", "dtype"), [((4,), "float32"), ((2, 2), "bfloat16"),
                                              ((3,), "int32")])
def test_collectives_evaluated_in_another_order_fail_naming_both(
        session2: Session, shape: tuple[int, ...], dtype: str) -> None:
    with pytest.raises(CellError) as info:
        session2.run(SWAP.format(shape=shape, dtype=dtype))
    text = str(info.value)
    assert (f"collective 1 of this cell (all_sum shape={shape} dtype={dtype}) ran on rank 0 "
            "together with collective 2 of rank 1") in text, text
    assert "ran them in different orders" in text and "values are wrong" in text
    assert not info.value.result.valid
    assert session2.state == "ready"
    # the same cell, the same order on both ranks: right values, no complaint
    r = session2.run(SWAP.format(shape=shape, dtype=dtype).replace(
        "mx.eval(b); mx.eval(a)", "mx.eval(a); mx.eval(b)"))
    for rank in (0, 1):
        a, b = r.stdout(rank).strip().rsplit("] [", 1)
        n = math.prod(shape)
        assert a.count("3") == n and b.count("30") == n, r.stdout(rank)


def test_the_loss_read_on_rank_0_in_the_middle_of_a_step_fails(session2: Session) -> None:
    """The user trial's case: a data-parallel step whose loss rank 0 prints before the
    step is evaluated. Rank 0 runs the loss's all_sum first, rank 1 the gradients'
    first: each is summed with the other's, and the cell said nothing."""
    session2.run(
        "import mlx.nn as nn, mlx.optimizers as optim\n"
        "mx.random.seed(rank)\n"
        "eo_model = nn.Linear(16, 8)\n"
        "eo_opt = optim.SGD(learning_rate=0.1)\n"
        "eo_x, eo_y = mx.random.normal((8, 16)), mx.random.normal((8, 8))\n"
        "eo_vg = nn.value_and_grad(eo_model, lambda m, x, y: nn.losses.mse_loss(m(x), y))\n"
        "def eo_step(peek):\n"
        "    loss, g = eo_vg(eo_model, eo_x, eo_y)\n"
        "    loss = mx.distributed.all_sum(loss, group=world) / 2\n"
        "    g = nn.average_gradients(g, group=world)\n"
        "    if peek and rank == 0:\n"
        "        print('loss', loss.item())\n"
        "    eo_opt.update(eo_model, g)\n"
        "    mx.eval(eo_model.parameters(), eo_opt.state)\n"
        "    return loss.item()\n")
    with pytest.raises(CellError) as info:
        session2.run("eo_step(peek=True)")
    text = str(info.value)
    assert "collective 1 of this cell (all_sum shape=() dtype=float32) ran on rank 0" in text
    assert "ran them in different orders" in text
    assert session2.state == "ready"
    # evaluated on every rank before it is read: the same loss everywhere, no complaint
    r = session2.run("print(eo_step(peek=False))")
    assert r.stdout(0).strip() == r.stdout(1).strip(), (r.stdout(0), r.stdout(1))


def test_messages_received_in_another_order_fail_naming_the_message(session2: Session) -> None:
    with pytest.raises(CellError) as info:
        session2.run(
            "if rank == 0:\n"
            "    mx.eval(mx.distributed.send(mx.arange(3), 1, group=world))\n"
            "    mx.eval(mx.distributed.send(mx.arange(3) + 10, 1, group=world))\n"
            "else:\n"
            "    y = mx.distributed.recv((3,), mx.int32, 0, group=world)\n"
            "    z = mx.distributed.recv_like(y, 0, group=world)\n"
            "    mx.eval(z); mx.eval(y)\n"
            "    print(y.tolist(), z.tolist())")
    text = str(info.value)
    assert ("message 1 from rank 0 to rank 1 (recv shape=(3,) dtype=int32) read rank 0's "
            "message 2") in text, text
    assert session2.state == "ready"


def test_tagged_collectives_return_the_users_shapes_and_values(session2: Session) -> None:
    """What each op returns with its tag stripped, against the values it must have; and
    a collective too large to tag (1 MiB and more) is untouched."""
    r = session2.run(
        "g = mx.distributed.all_gather(mx.arange(6).reshape(2, 3) + 10 * rank, group=world)\n"
        "mx_ = mx.distributed.all_max(mx.array([rank, 5 - rank], dtype=mx.int8), group=world)\n"
        "mn = mx.distributed.all_min(mx.array([rank, 5 - rank], dtype=mx.float16), group=world)\n"
        "big = mx.distributed.all_sum(mx.ones((512, 512)) * (rank + 1), group=world)\n"
        "if rank == 0:\n"
        "    m = mx.distributed.send(mx.array([[1.5, 2.5]]), 1, group=world)\n"
        "else:\n"
        "    m = mx.distributed.recv((1, 2), mx.float32, 0, group=world)\n"
        "mx.eval(g, mx_, mn, big, m)\n"
        "print(g.shape, g.tolist(), mx_.dtype, mx_.tolist(), mn.tolist(), big.shape,\n"
        "      big.min().item(), big.max().item(), m.shape, m.tolist())")
    for rank in (0, 1):
        assert r.stdout(rank).strip() == (
            "(4, 3) [[0, 1, 2], [3, 4, 5], [10, 11, 12], [13, 14, 15]] mlx.core.int8 [1, 5] "
            "[0.0, 4.0] (512, 512) 3.0 3.0 (1, 2) [[1.5, 2.5]]"), r.stdout(rank)


def test_a_swap_a_whole_forward_apart_in_float16_is_caught(session2: Session) -> None:
    """Two float16 sums 32 positions apart (one forward of a 16-layer TP model): the
    first version told float16 positions apart modulo 32 only, and missed this."""
    with pytest.raises(CellError) as info:
        session2.run(
            "xs = [mx.distributed.all_sum(mx.ones(4, dtype=mx.float16) * (i + 1), group=world)\n"
            "      for i in range(34)]\n"
            "if rank == 1:\n"
            "    mx.eval(xs[32])\n"
            "for x in xs:\n"
            "    mx.eval(x)")
    assert ("collective 1 of this cell (all_sum shape=(4,) dtype=float16) ran on rank 0 "
            "together with collective 33 of rank 1") in str(info.value), str(info.value)
    assert session2.state == "ready"


@pytest.mark.parametrize("send", [
    "mx.distributed.send(x=mx.array([1., 2., 3.]), dst=1, group=world)",
    "mx.distributed.send(np.array([1., 2., 3.], np.float32), 1, group=world)",
    "mx.compile(lambda v: mx.distributed.send(v, 1, group=world))(mx.array([1., 2., 3.]))",
])
@pytest.mark.parametrize("recv", [
    "mx.distributed.recv((3,), mx.float32, 0, group=world)",
    "mx.distributed.recv_like(np.zeros(3, np.float32), 0, group=world)",
    "mx.compile(lambda p: mx.distributed.recv_like(p, 0, group=world) * 1)(mx.zeros(3))",
])
def test_a_message_is_tagged_alike_however_each_side_issues_it(
        session2: Session, send: str, recv: str) -> None:
    """Whether a message carries a tag follows from its dtype and size alone: the first
    version tagged a receive but not a send of numpy data, by keyword or traced in
    mx.compile, so one side read the other's tag as data (or waited for it)."""
    r = session2.run(
        "import numpy as np\n"
        "for _ in range(2):\n"
        "    if rank == 0:\n"
        f"        mx.eval({send})\n"
        "    else:\n"
        f"        print(({recv}).tolist())", timeout=30)
    assert r.stdout(1).split() == ["[1.0,", "2.0,", "3.0]"] * 2, r.stdout(1)
    assert session2.state == "ready"


def test_collectives_a_failed_rank_left_are_not_blamed_on_the_others_order(
        session2: Session) -> None:
    """Rank 1 raises before its mx.eval(a, b): its cell's end runs a, then b; rank 0's
    mx.eval(a, b) ran b first. Its values are wrong (they were, silently, before the
    tags), and the message says why, not that the step was read mid-way."""
    with pytest.raises(CellError) as info:
        session2.run(
            "a = mx.distributed.all_sum(mx.ones(3) * (rank + 1), group=world)\n"
            "b = mx.distributed.all_sum(mx.ones(3) * 10 * (rank + 1), group=world)\n"
            "if rank == 1:\n"
            "    raise ValueError('rank 1 fails')\n"
            "mx.eval(a, b)\n"
            "print(a.tolist(), b.tolist())")
    text = str(info.value)
    assert "ValueError" in text and "rank 1 fails" in text
    if "ran on rank 0 together with" in text:  # mx.eval(a, b) ran b first (it does here)
        assert "Rank 1 had not evaluated them when its cell ended" in text, text
        assert "mx.eval(loss, grads)" not in text
    else:
        assert info.value.result.ranks[0].stdout.strip() == "[3.0, 3.0, 3.0] [30.0, 30.0, 30.0]"
    assert session2.state == "ready"


def test_numpy_float64_data_is_described_and_tagged_as_the_float32_mlx_sends(
        session2: Session) -> None:
    """MLX sends numpy float64 data as float32: the record said float64, so the tag was
    read with the wrong width (a false alarm on right values, or, for an odd size, no
    check at all for the whole cell), and a message's bytes were counted twice over."""
    r = session2.run(
        "import numpy as np\n"
        "s = mx.distributed.all_sum(np.ones(4) * (rank + 1), group=world)\n"
        "if rank == 0:\n"
        "    mx.eval(mx.distributed.send(np.array([1.0, 2.0, 3.0]), 1, group=world))\n"
        "else:\n"
        "    print(mx.distributed.recv((3,), mx.float32, 0, group=world).tolist())\n"
        "print(s.tolist())")
    assert r.stdout(1).split("\n")[0] == "[1.0, 2.0, 3.0]", r.stdout(1)
    assert r.stdout(0).strip() == "[3.0, 3.0, 3.0, 3.0]", r.stdout(0)
    with pytest.raises(CellError) as info:  # a swap beside one: still caught
        session2.run("c = mx.distributed.all_sum(np.ones(3), group=world)\n"
                     + SWAP.format(shape=(3,), dtype="float32"))
    assert "collective 2 of this cell (all_sum shape=(3,) dtype=float32) ran on rank 0 " \
        "together with collective 3 of rank 1" in str(info.value), str(info.value)


@pytest.mark.parametrize("compiled_side", [0, 1])
def test_a_compiled_message_function_called_again_counts_every_message(
        session2: Session, compiled_side: int) -> None:
    """A call that hits mx.compile's cache runs no Python: its messages were not counted,
    so the other rank's looked like extra ones (and, for a compiled receive, the
    session broke trying to drop messages already received)."""
    send = "mx.distributed.send(mx.array([1.0, 2.0, 3.0]) + 10 * i, 1, group=world)"
    recv = "mx.distributed.recv_like(mx.zeros(3), 0, group=world) * 1"
    if compiled_side == 0:
        setup = f"f = mx.compile(lambda i: {send})\n"
        send = "f(mx.array(i))"
    else:
        setup = f"g = mx.compile(lambda: {recv})\n"
        recv = "g()"
    r = session2.run(
        setup + "for i in range(3):\n"
        f"    if rank == 0:\n        mx.eval({send})\n"
        f"    else:\n        print(({recv}).tolist())")
    assert r.stdout(1).split("\n")[:3] == [
        "[1.0, 2.0, 3.0]", "[11.0, 12.0, 13.0]", "[21.0, 22.0, 23.0]"], r.stdout(1)
    assert session2.state == "ready"


LATE_SWAP = (
    "a = mx.distributed.all_sum(mx.ones((4,)) * (rank + 1), group=world)\n"
    "b = mx.distributed.all_sum(mx.ones((4,)) * 10 * (rank + 1), group=world)\n"
    "for _ in range(300):  # many compactions of the held outputs, a and b unevaluated\n"
    "    mx.eval(mx.distributed.all_sum(mx.ones((2,)), group=world))\n"
    "if rank == 0:\n"
    "    mx.eval(a); mx.eval(b)\n"
    "else:\n"
    "    mx.eval(b); mx.eval(a)\n"
    "print(a.tolist(), b.tolist())"
)


def test_a_swap_of_collectives_left_unevaluated_through_many_others_is_caught(
        session2: Session) -> None:
    """The tracker looks at outputs found unevaluated once only again at the cell's end
    (mlx-lm's prefill leaves some never run: looking at them again and again cost a
    decode): two such, run at last in another order on each rank, still fail the cell,
    and run in the same order they do not."""
    with pytest.raises(CellError) as info:
        session2.run(LATE_SWAP)
    text = str(info.value)
    assert ("collective 1 of this cell (all_sum shape=(4,) dtype=float32) ran on rank 0 "
            "together with collective 2 of rank 1") in text, text
    assert "Rank 1 had not evaluated them" not in text  # the user's order, not the end's
    assert session2.state == "ready"
    r = session2.run(LATE_SWAP.replace("mx.eval(b); mx.eval(a)", "mx.eval(a); mx.eval(b)"))
    for rank in (0, 1):
        assert r.stdout(rank).strip() == "[3.0, 3.0, 3.0, 3.0] [30.0, 30.0, 30.0, 30.0]", (
            r.stdout(rank))


def test_a_receive_whose_shape_is_not_ints_is_a_clear_error_and_spoils_nothing(
        session2: Session) -> None:
    """A typo'd shape is refused naming it, before anything is issued, and leaves no
    trace: the layouts of tagged messages are kept per shape, and ``(1, 4.0)`` equals
    ``(1, 4)`` as a key (the next, right, receive once failed on the float kept)."""
    with pytest.raises(CellError) as info:
        session2.run("if rank == 1:\n"
                     "    mx.distributed.recv((1, 4.0), mx.float32, 0, group=world)")
    assert "recv: the shape must be ints, got (1, 4.0)" in str(info.value), str(info.value)
    assert session2.state == "ready"
    r = session2.run("if rank == 0:\n"
                     "    mx.eval(mx.distributed.send(mx.arange(4.0)[None], 1, group=world))\n"
                     "else:\n"
                     "    print(mx.distributed.recv((1, 4), mx.float32, 0, group=world).tolist())")
    assert r.stdout(1).strip() == "[[0.0, 1.0, 2.0, 3.0]]", r.stdout(1)


def test_a_receive_whose_shape_is_an_array_is_received(session2: Session) -> None:
    """MLX takes a receive's shape as an ``mx.array`` too: it is a shape, not data (the
    tracker once read it as the data of a collective and lost the source rank)."""
    r = session2.run("if rank == 0:\n"
                     "    mx.eval(mx.distributed.send(mx.arange(6.0).reshape(2, 3), 1, group=world))\n"
                     "else:\n"
                     "    got = mx.distributed.recv(mx.array([2, 3]), mx.float32, 0, group=world)\n"
                     "    print(got.shape, got.tolist())")
    assert r.stdout(1).strip() == "(2, 3) [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]", r.stdout(1)


def test_gathers_of_scalars_are_tagged_too(session2: Session) -> None:
    """A 0-d gather went untagged: evaluated in another order on each rank, the ranks
    printed ``[1.0, 20.0]`` and ``[10.0, 2.0]`` and the cell passed."""
    swap = ("a = mx.distributed.all_gather(mx.array(1.0 + rank), group=world)\n"
            "b = mx.distributed.all_gather(mx.array(10.0 * (rank + 1)), group=world)\n"
            "if rank == 0:\n"
            "    mx.eval(a); mx.eval(b)\n"
            "else:\n"
            "    mx.eval(b); mx.eval(a)\n"
            "print(a.shape, a.tolist(), b.tolist())")
    with pytest.raises(CellError) as info:
        session2.run(swap)
    assert "collective 1 of this cell (all_gather shape=() dtype=float32)" in str(info.value), (
        str(info.value))
    assert session2.state == "ready"
    r = session2.run(swap.replace("mx.eval(b); mx.eval(a)", "mx.eval(a); mx.eval(b)"))
    for rank in (0, 1):
        assert r.stdout(rank).strip() == "(2,) [1.0, 2.0] [10.0, 20.0]", r.stdout(rank)


def test_a_group_passed_by_position_is_refused_as_mlx_refuses_it(session2: Session) -> None:
    """MLX's collectives take ``group=`` by keyword only; the tracker took a positional
    one and dropped it (a subgroup's sum would have run over the whole world)."""
    with pytest.raises(CellError) as info:
        session2.run("mx.distributed.all_sum(mx.ones(2), world)")
    assert ("mx.distributed.all_sum() takes 1 positional argument (x) but 2 were given: "
            "pass group= and stream= by keyword") in str(info.value), str(info.value)
    with pytest.raises(CellError) as info:
        session2.run("mx.distributed.send(mx.ones(2), 1 - rank, world)")
    assert "send() takes 2 positional arguments (x, dst) but 3 were given" in str(info.value)
    assert session2.state == "ready"


def test_a_collective_on_another_threads_stream_is_tagged_on_that_stream(
        session2: Session) -> None:
    """MLX 0.32 keeps streams per thread: the tag's nodes went on the calling thread's
    stream, so the main thread could not evaluate a worker's collective on its own."""
    r = session2.run(
        "import threading\n"
        "s_main = mx.new_stream(mx.cpu)\n"
        "box = []\n"
        "t = threading.Thread(target=lambda: box.append(\n"
        "    mx.distributed.all_sum(mx.array([1.0, rank]), group=world, stream=s_main)))\n"
        "t.start(); t.join()\n"
        "print(box[0].tolist())")
    for rank in (0, 1):
        assert r.stdout(rank).strip() == "[2.0, 1.0]", r.stdout(rank)


def test_bool_messages_are_counted_in_bytes_and_received(session2: Session) -> None:
    """A ``bool`` receive was counted as 0 bytes (MLX names it ``bool_``): a right
    program failed with '3 bytes sent but 0 received'."""
    r = session2.run(
        "if rank == 0:\n"
        "    mx.eval(mx.distributed.send(mx.array([True, False, True]), 1, group=world))\n"
        "else:\n"
        "    print(mx.distributed.recv((3,), mx.bool_, 0, group=world).tolist())")
    assert r.stdout(1).strip() == "[True, False, True]", r.stdout(1)


def test_a_message_to_a_rank_that_is_not_a_ring_neighbour_is_refused_when_issued(
        session2: Session) -> None:
    """MLX's ring refuses it only when the message is evaluated; a reviewer caught that
    error and the cell then failed blaming the ranks' evaluation order (the tag was read
    from a receive that never ran)."""
    r = session2.run(
        "try:\n"
        "    y = mx.distributed.recv((2,), mx.float32, rank, group=world)\n"
        "except RuntimeError as e:\n"
        "    print(e)\n")
    for rank in (0, 1):
        assert r.stdout(rank).startswith(
            f"[ring] Recv only supported from direct neighbors: rank {rank} receives from "
            f"rank {rank}, and its neighbours in the ring of 2 are rank(s) {1 - rank}."), (
            r.stdout(rank))
    assert session2.state == "ready"
    r = session2.run("try:\n"
                     "    mx.distributed.send(mx.ones(2), 5, group=world)\n"
                     "except RuntimeError as e:\n"
                     "    print(e)\n")
    assert r.stdout(0).strip() == "Invalid destination=5: the group's ranks are 0 to 1"
    assert session2.state == "ready"


def test_a_message_received_as_another_dtype_of_the_same_bytes_is_read_right(
        session2: Session) -> None:
    """MLX lets a receiver name the sender's bytes with another dtype. The tag was as long
    as each side's dtype made it: float32 sent, float16 received left 4 bytes in the
    ring's stream, so the next messages read stale bytes and the cells passed (the
    other way round, the receiver waited for bytes never sent)."""
    cells = [("mx.array([1.0, 2.0, 3.0, 4.0])", "(8,), mx.float16"),
             ("mx.array([True, False, True, True, False, False, True, False])",
              "(8,), mx.uint8"),
             ("mx.array([5.0, 6.0, 7.0, 0.0])", "(4,), mx.float32"),
             ("mx.array([1.0, 2.0, 3.0, 4.0], dtype=mx.float16)", "(2,), mx.float32"),
             ("mx.array([9, 8], dtype=mx.int32)", "(2,), mx.int32")]
    for data, received in cells:
        r = session2.run(
            f"x = {data}\n"
            "if rank == 0:\n"
            "    mx.eval(mx.distributed.send(x, 1, group=world))\n"
            "else:\n"
            f"    y = mx.distributed.recv({received}, 0, group=world)\n"
            "    print(y.tolist() == x.view(y.dtype).tolist(), y.tolist())")
        assert r.stdout(1).startswith("True "), (data, received, r.stdout(1))
        assert session2.state == "ready"


def test_an_extra_collective_on_one_rank_is_named_as_the_cause_of_the_drain(
        session2: Session) -> None:
    """The user trial's case: rank 1 issues and runs one more all_sum than rank 0. Rank
    0's sum paired with rank 1's extra one (it printed 6 for 2), and rank 1's waited
    until drained; the error said only that rank 1 had been stuck and drained."""
    with pytest.raises(CellError) as info:
        session2.run("a = mx.distributed.all_sum(mx.ones(4), group=world)\n"
                     "if rank == 1:\n"
                     "    mx.eval(mx.distributed.all_sum(mx.ones(4) * 5, group=world))\n"
                     "mx.eval(a)\n"
                     "print(rank, a)")
    text = str(info.value)
    assert ("the ranks issued different collectives in this cell (rank 0: 1 collective, "
            "rank 1: 2 collectives)") in text, text
    assert ("collective 1 of this cell (all_sum shape=(4,) dtype=float32) ran on rank 0 "
            "together with collective 2 of rank 1.") in text, text
    assert "issued the same collectives" not in text  # they did not
    assert "Drained" in text and not info.value.result.valid
    assert session2.state == "ready"


def test_collectives_issued_in_another_order_are_not_said_to_be_issued_alike(
        session2: Session) -> None:
    with pytest.raises(CellError) as info:
        session2.run("a = mx.array([1.0, 2.0 + rank])\n"
                     "if rank == 0:\n"
                     "    p = mx.distributed.all_max(a, group=world)\n"
                     "    q = mx.distributed.all_min(a, group=world)\n"
                     "else:\n"
                     "    q = mx.distributed.all_min(a, group=world)\n"
                     "    p = mx.distributed.all_max(a, group=world)\n"
                     "mx.eval(p, q)")
    text = str(info.value)
    assert ("collective 1 of this cell differs between the ranks (rank 0: all_max shape=(2,) "
            "dtype=float32; rank 1: all_min shape=(2,) dtype=float32)") in text, text
    assert "issued the same collectives" not in text, text
    assert session2.state == "ready"


# ------------------------------------------------ large outputs let go at mx.eval


def test_a_large_output_is_let_go_once_an_mx_eval_that_ran_it_returns(tracked: Any) -> None:
    """Held until a compaction, each call of a loop of large collectives got new memory
    (a 16 MiB all_sum loop on mpi ran at a third of a plain script's speed). An output
    of at least RELEASE_BYTES is let go once an mx.eval that ran it returns: given to
    it, or in the graph it ran; one not evaluated is still held for the cell's end, as
    is a small one."""
    from mlx_nbdist.engine.tracker import RELEASE_BYTES

    mx, tracker, world = tracked.mx, tracked.tracker, tracked.world
    x = mx.ones((RELEASE_BYTES // 4,))
    mx.eval(x)
    for _ in range(5):
        mx.eval(mx.distributed.all_sum(x, group=world))
    assert tracker.holding == (0, 0)
    kept = mx.distributed.all_sum(x * 2, group=world)  # issued, never evaluated
    mx.eval(mx.distributed.all_sum(x[:4], group=world))
    assert tracker.holding == (2, RELEASE_BYTES + 16)  # kept, and the small one
    mx.eval([mx.distributed.all_sum(x, group=world) for _ in range(2)])
    used = mx.distributed.all_sum(x * 3, group=world)
    total = used.sum() + 1
    del used
    mx.eval(total)  # it ran in total's graph
    assert tracker.holding == (2, RELEASE_BYTES + 16)
    assert [r.op for r in tracker.settle()] == ["all_sum"]  # kept: run at the end
    assert tracker.holding == (0, 0)
    assert kept[:2].tolist() == [2.0, 2.0] and total.item() == 3 * x.size + 1


@pytest.mark.timeout(30)
def test_the_cell_end_settles_after_an_interrupt_left_the_compaction_lock_held(
        tracked: Any) -> None:
    """A review's case: a KeyboardInterrupt landing just after mx.eval's non-blocking
    acquire of the compaction lock (a notebook's ``try: train() except
    KeyboardInterrupt``) left it held, and settle at the cell's end waited forever."""
    from mlx_nbdist.engine.tracker import RELEASE_BYTES

    mx, tracker, world = tracked.mx, tracked.tracker, tracked.world
    x = mx.ones((RELEASE_BYTES // 4,))
    kept = mx.distributed.all_sum(x * 2, group=world)
    tracker._compacting.acquire(False)  # what the interrupt left: held by this thread
    mx.eval(mx.distributed.all_sum(x, group=world))
    assert [r.op for r in tracker.settle()] == ["all_sum"]
    assert tracker.holding == (0, 0) and kept[:1].tolist() == [2.0]


def test_another_threads_evals_do_not_read_this_threads_tags(session2: Session) -> None:
    """A review's case: a thread looping on mx.eval while the cell's main thread ran
    128 KiB all_sums. Its evals looked at the main thread's outputs, which MLX had cut
    from their graphs while still running them: their tags read early, the correct
    cell failed as run in different orders (and a rank crashed at times)."""
    r = session2.run(
        "import threading\n"
        "stop = False\n"
        "def bg():\n"
        "    while not stop:\n"
        "        mx.eval(mx.ones(8) + 1)\n"
        "t = threading.Thread(target=bg); t.start()\n"
        "x = mx.ones((32768,)) * (rank + 1)\n"
        "bad = 0\n"
        "try:\n"
        "    for i in range(200):\n"
        "        a = mx.distributed.all_sum(x * (i + 1), group=world)\n"
        "        mx.eval(a)\n"
        "        bad += a[-1].item() != 3 * (i + 1)\n"
        "finally:\n"
        "    stop = True; t.join()\n"
        "print('wrong values:', bad)")
    for rank in (0, 1):
        assert r.stdout(rank).strip() == "wrong values: 0", r.stdout(rank)


@pytest.mark.parametrize("backend", ["ring", "mpi"])
def test_large_collectives_evaluated_in_another_order_still_fail(backend: str) -> None:
    """Their tags are read when mx.eval lets them go (not at a compaction): swaps of
    128 KiB all_sums (the tag after the data) and of 1 MiB ones (the tag apart), over
    the world and (mpi) over a subgroup, evaluated one by one, still fail the cell."""
    groups = ["world"] + (["world.split(0)"] if backend == "mpi" else [])
    with Session(2, backend=backend, timeout=120) as s:
        for group, n in [(g, n) for g in groups for n in (32768, 1 << 18)]:
            code = ("g = " + group + "\n" + SWAP.format(shape=(n,), dtype="float32").replace(
                "print(a.tolist(), b.tolist())", "print(a[:2].tolist(), b[:2].tolist())")
                    .replace("group=world", "group=g"))
            with pytest.raises(CellError) as info:
                s.run(code)
            where = "of this cell" if group == "world" else "over the subgroup of ranks 0, 1"
            assert (f"collective 1 {where} (all_sum shape=({n},) dtype=float32) ran on "
                    "rank 0 together with collective 2 of rank 1") in str(info.value), (
                group, n, str(info.value))
            r = s.run(code.replace("mx.eval(b); mx.eval(a)", "mx.eval(a); mx.eval(b)"))
            for rank in (0, 1):
                assert r.stdout(rank).strip() == "[3.0, 3.0] [30.0, 30.0]", r.stdout(rank)


# ------------------------------------------------ 1 MiB and more: the tag apart

#: elements of 1 MiB in a 4-byte and a 2-byte dtype: the tag goes in a collective of its own
MIB = {"float32": 1 << 18, "bfloat16": 1 << 19}
BIG_SWAP = (
    "a = mx.distributed.{op}(mx.ones(({n},), dtype=mx.{dtype}) * (rank + 1), group=world)\n"
    "b = mx.distributed.{op}(mx.ones(({n},), dtype=mx.{dtype}) * 10 * (rank + 1), "
    "group=world)\n"
    "if rank == 0:\n"
    "    mx.eval(a); mx.eval(b)\n"
    "else:\n"
    "    mx.eval(b); mx.eval(a)\n"
    "print(a[:2].tolist(), b[:2].tolist())"
)


@pytest.mark.parametrize(("op", "dtype", "right"), [
    ("all_sum", "float32", "[3.0, 3.0] [30.0, 30.0]"),
    ("all_max", "bfloat16", "[2.0, 2.0] [20.0, 20.0]"),
    ("all_gather", "float32", "[1.0, 1.0] [10.0, 10.0]"),
])
def test_collectives_of_a_mib_evaluated_in_another_order_fail_naming_both(
        session2: Session, op: str, dtype: str, right: str) -> None:
    """A user trial's and a review's case: two 1 MiB collectives (gradient buckets, a
    long sequence's activations) run in another order on one rank returned each
    other's values without a word: they carried no tag (after the data it would copy
    them). Their tags now go in a collective of their own, issued right after each."""
    code = BIG_SWAP.format(op=op, n=MIB[dtype], dtype=dtype)
    with pytest.raises(CellError) as info:
        session2.run(code)
    text = str(info.value)
    assert f"collective 1 of this cell ({op} shape=({MIB[dtype]},) dtype={dtype}) ran on rank 0" in text, text
    assert "ran them in different orders" in text
    assert session2.state == "ready"
    r = session2.run(code.replace("mx.eval(b); mx.eval(a)", "mx.eval(a); mx.eval(b)"))
    for rank in (0, 1):
        assert r.stdout(rank).strip() == right, r.stdout(rank)


def test_a_mib_collective_a_failed_rank_left_is_drained(session2: Session) -> None:
    """The drain's replay goes through the wrapper: it issues the tag's collective too,
    as the stuck rank's did, so the stuck rank is released and the group stays in step."""
    with pytest.raises(CellError) as info:
        session2.run("if rank == 1:\n    raise RuntimeError('rank one fails')\n"
                     f"mx.eval(mx.distributed.all_sum(mx.ones({MIB['float32']}), group=world))",
                     timeout=60)
    assert info.value.result.ranks[0].status == DRAINED
    assert session2.state == "ready"
    r = session2.run(BIG_SWAP.format(op="all_sum", n=MIB["float32"], dtype="float32").replace(
        "mx.eval(b); mx.eval(a)", "mx.eval(a); mx.eval(b)"))
    assert r.stdout(1).strip() == "[3.0, 3.0] [30.0, 30.0]"


def test_a_profiled_cell_runs_mib_collectives_where_issued_with_no_false_alarm(
        session2: Session) -> None:
    """A profiled cell evaluates each collective where it is issued, its tag's too: a
    later evaluation in another order reads values that are right, and says nothing."""
    r = session2.run(BIG_SWAP.format(op="all_sum", n=MIB["float32"], dtype="float32"),
                     profile=True)
    for rank in (0, 1):
        assert r.stdout(rank).strip() == "[3.0, 3.0] [30.0, 30.0]", r.stdout(rank)


JVP = (
    "x = mx.ones((512, 256)); w = mx.ones((256, 2048)) * (rank + 1)\n"
    "def f(w):\n"
    "    return mx.distributed.all_sum(x @ w, group=world)  # 4 MiB\n"
    "o, t = mx.jvp(f, [w], [mx.ones_like(w)])\n"
    "hvp = mx.jvp(mx.grad(lambda w: (f(w) ** 2).sum() / 1e6), [w], [mx.ones_like(w)])[1]\n"
    "print(o[0][0, 0].item(), t[0][0, 0].item(), hvp[0][0, 0].item())"
)


def test_forward_mode_through_a_mib_collective_is_right_untagged(session2: Session) -> None:
    """A review's case: mx.jvp (and a Hessian-vector product) through a 4 MiB all_sum
    failed a correct cell, '[Primitive::jvp] Not implemented for Depends': the tag's
    collective is joined by mx.depends. Under mx.jvp such a collective goes untagged,
    as before; its drain's replay carries no tag either, so a rank left in one is
    released."""
    r = session2.run(JVP)
    for rank in (0, 1):  # x @ w summed over ranks: 256 * (1 + 2); its tangent 256 * 2;
        # the hvp: 512 rows of x, each 2 * 512 (the tangent, summed) / 1e6
        o, t, h = map(float, r.stdout(rank).split())
        assert (o, t) == (768.0, 512.0) and h == pytest.approx(512 * 2 * 512 / 1e6, rel=1e-5), (
            r.stdout(rank))
    # rank 0 waits in the primal's all_sum (the tangents' collectives are MLX's own,
    # which no drain can replay: left unevaluated here)
    primal = JVP.split("hvp =")[0] + "print(o[0][0, 0].item())"
    with pytest.raises(CellError) as info:
        session2.run("if rank == 1:\n    raise RuntimeError('rank one fails')\n" + primal,
                     timeout=60)
    assert info.value.result.ranks[0].status == DRAINED
    assert session2.state == "ready"
    assert session2.run(JVP).stdout(1).split()[:2] == ["768.0", "512.0"]


def test_a_mib_collective_run_with_a_small_one_names_no_made_up_partner(
        session2: Session) -> None:
    """A review's case: a 1 MiB all_sum that ran with a 4-value one read the other's
    data as its tag and named 'collective 2898 of rank 1' in a cell of two."""
    with pytest.raises(CellError) as info:
        session2.run(BIG_SWAP.format(op="all_sum", n=MIB["float32"], dtype="float32")
                     .replace("mx.ones(({n},)".format(n=MIB["float32"]) + ", dtype=mx.float32) * 10",
                              "mx.ones((4,), dtype=mx.float32) * 10"), timeout=60)
    text = str(info.value)
    assert "ran them in different orders" in text, text
    assert "collective 2898" not in text and "together with another collective" in text, text
