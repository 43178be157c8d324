"""The order a rank runs its collectives in, on a real 2-rank group.

MLX pairs the n-th collective one rank *runs* with the n-th its peer runs, and runs
them when their arrays are evaluated. A rank that evaluates them in another order
than its peer (``loss.item()`` on rank 0 only, mid-step) pairs the wrong ones: wrong
numbers, or a hang. The tracker makes each collective depend on the one issued before
it, so every rank runs them in the order it issued them. Collectives that
``mx.compile`` traces are compared only with the same trace on another rank (a call
that hits the compiled cache traces nothing).
"""

from __future__ import annotations

import pytest

from mlx_nbdist import CellError, CollectiveTimeout, Session


def test_the_same_collectives_evaluated_in_another_order_give_the_right_sums(
        session2: Session) -> None:
    code = (
        "a = mx.distributed.all_sum(mx.ones(3), group=world)\n"
        "b = mx.distributed.all_sum(mx.ones(100000), group=world)\n"
        "if rank == 0:\n    mx.eval(a)\n    mx.eval(b)\n"
        "else:\n    mx.eval(b)\n    mx.eval(a)\n"
        "print(a.tolist(), b.sum().item())"
    )
    r = session2.run(code)
    for k in (0, 1):  # before: [1, 1, 2] 200007 on one rank and [4, 4, 4] on the other
        assert r.stdout(k).strip() == "[2.0, 2.0, 2.0] 200000.0", r.stdout(k)


def test_logging_the_loss_on_rank_0_only_mid_step_neither_hangs_nor_mixes(
        session2: Session) -> None:
    code = (
        "import mlx.optimizers as optim\n"
        "mx.random.seed(0)\n"
        "ord_model = nn.Linear(8, 1)\n"
        "mx.eval(ord_model.parameters())\n"
        "opt = optim.SGD(learning_rate=0.1)\n"
        "X, Y = mx.random.normal((16, 8)), mx.random.normal((16, 1))\n"
        "vg = nn.value_and_grad(ord_model, lambda m, x, y: ((m(x) - y) ** 2).mean())\n"
        "for i in range(10):\n"
        "    loss, g = vg(ord_model, X, Y)\n"
        "    g = nn.average_gradients(g, group=world)\n"
        "    ell = mx.distributed.all_sum(loss, group=world) / size\n"
        "    if rank == 0:\n"
        "        print(round(ell.item(), 6))  # evaluates this all_sum before the gradients'\n"
        "    opt.update(ord_model, g)\n"
        "    mx.eval(ord_model.parameters(), opt.state, ell)\n"
        "print('w', round(ord_model.weight.sum().item(), 6))"
    )
    r = session2.run(code, timeout=60)  # before: a hang to the deadline
    w0 = r.stdout(0).strip().splitlines()[-1]
    assert w0.startswith("w ") and w0 == r.stdout(1).strip(), (r.stdout(0), r.stdout(1))
    assert len(r.stdout(0).strip().splitlines()) == 11


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
