"""Prove that the ranks ran each collective together: the same one, in the same order.

MLX *issues* a collective when its array is created and *runs* it when the array is
evaluated, and the ranks' collectives pair in the order they run. Ranks that issue
the same collectives but evaluate them in another order (``mx.eval(b); mx.eval(a)``
on one rank, ``a.item()`` on rank 0 between two) pair one rank's n-th collective with
another's m-th: with equal sizes MLX returns wrong values, silently.

So a collective carries a *tag* after the user's data, made from its position in the
cell (``CollectiveRecord.group_index``, the same on every rank for the same
collective): ``all_sum`` adds ``a`` and ``a*a`` (their sums are ``size*a`` and
``size*a*a`` only when every rank's ``a`` is the same), ``all_max`` / ``all_min`` add
``a`` and ``m+1-a``, ``all_gather`` and a message add ``a``. When the collective has
run, the rank reads its tag back (:meth:`Tag.problem`). The user's array is the rest
of the output, with the input's shape and dtype.

Positions are counted modulo what the dtype holds exactly (:func:`modulus`), so a
collective that meets another a multiple of that apart is not caught (a bfloat16
``all_sum`` on 2 ranks: 11 apart; float32: 2896). Tagged only: collectives over the
whole group, run (a collective traced in ``mx.compile`` is not tagged: its output is
a tracer), of a dtype that holds small integers exactly, under
``config.ORDER_TAG_MAX_BYTES`` (the tag copies the input). The rule is a function of
op, dtype, group size and bytes alone (and, for a drain, of the record: see
``tracker._replay``), so a drain's replay carries a tag of the same size as the
collective it releases.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..config import ORDER_TAG_MAX_BYTES as MAX_BYTES
from ..results import CollectiveRecord

#: the largest position modulus, whatever the dtype holds
_CAP = 1 << 20
#: the largest integer each dtype holds exactly (and its neighbours)
_EXACT = {
    "float16": 1 << 11, "bfloat16": 1 << 8, "float32": 1 << 24, "float64": 1 << 53,
    "int8": (1 << 7) - 1, "uint8": (1 << 8) - 1, "int16": (1 << 15) - 1,
    "uint16": (1 << 16) - 1, "int32": (1 << 31) - 1, "uint32": (1 << 32) - 1,
    "int64": 1 << 62, "uint64": 1 << 62,
}
#: values in each op's tag
_TAG_LEN = {"all_sum": 2, "all_max": 2, "all_min": 2, "all_gather": 1, "send": 1,
            "recv": 1, "recv_like": 1}


def modulus(op: str, dtype: str, size: int, nbytes: int) -> int:
    """Positions are tagged modulo this; 0: the collective is not tagged."""
    if op not in _TAG_LEN or nbytes >= MAX_BYTES or size < 2:
        return 0
    exact = _EXACT.get(dtype, 0)
    # a sum holds size * a * a; the others hold a and m + 1 - a as they are
    m = math.isqrt(exact // size) if op == "all_sum" else exact - 1
    m = min(_CAP, m)
    return m if m >= 2 else 0


def position(index: int, m: int) -> int:
    """What a collective at ``index`` carries: 1..m."""
    return (index - 1) % m + 1


@dataclass
class Tag:
    """The tag of one run collective, read back when it has run."""

    rec: CollectiveRecord
    #: the tag's values in the collective's output (lazy: a slice of it)
    tail: Any
    #: the position tagged (1..m) and its modulus
    a: int
    m: int
    size: int

    def expected(self) -> list[int]:
        a, m, n = self.a, self.m, self.size
        if self.rec.op == "all_sum":
            return [n * a, n * a * a]
        if self.rec.op in ("all_max", "all_min"):
            return [a, m + 1 - a]
        if self.rec.op == "all_gather":
            return [a] * n
        return [a]

    def problem(self, got: list[float], rank: int, issued: int) -> dict[str, Any] | None:
        """``got``: the tail's values; ``issued``: how many collectives of its kind
        (group, or messages with its peer) the cell has issued, so that a partner is
        named only when its position cannot be another modulo m. What paired
        wrongly, or ``None``."""
        if [float(g) for g in got] == [float(e) for e in self.expected()]:
            return None
        op, rec = self.rec.op, self.rec
        partners: dict[str, int | None] = {}
        if op == "all_gather":
            partners = {str(r): self._position(g, issued) for r, g in enumerate(got)
                        if g != self.a}
        elif op in ("recv", "recv_like"):
            partners = {str(rec.peer): self._position(got[0], issued)}
        elif op == "all_sum" and self.size == 2:
            partners = {str(1 - rank): self._position(got[0] - self.a, issued)}
        return {"op": op, "shape": list(rec.shape), "dtype": rec.dtype, "n": rec.group_index,
                "peer": rec.peer, "with": partners}

    def _position(self, value: float, issued: int) -> int | None:
        a = int(value)
        if a != value or not 1 <= a <= self.m or issued > self.m:
            return None  # a position modulo m only: could be more than one
        return a


def call(
    op: str, fns: dict[str, Callable[..., Any]], args: tuple, kwargs: dict[str, Any],
    index: int, m: int, size: int,
) -> tuple[Callable[..., Any], tuple, dict[str, Any], Callable[[Any], tuple[Any, Any]]] | None:
    """How to run collective ``op`` tagged with position ``index`` (modulo ``m``):
    the function, its arguments, and what turns its output into the user's array
    and the tag's values (``None`` for a send). ``None``: run it as it is."""
    a = position(index, m)
    if op in ("recv", "recv_like"):
        return _recv(op, fns, args, kwargs)
    x = args[0] if args else None
    if not isinstance(x, mx.array) or (op == "all_gather" and x.ndim == 0):
        return None
    k = x.size
    values = {"all_sum": [a, a * a], "all_max": [a, m + 1 - a], "all_min": [a, m + 1 - a]}
    tag = mx.array(values.get(op, [a]), dtype=x.dtype)
    tagged = (mx.concatenate([x.reshape(-1), tag]), *args[1:])
    shape = x.shape

    def split(out: Any) -> tuple[Any, Any]:
        if op == "all_gather":
            rows = out.reshape(size, k + 1)
            return rows[:, :k].reshape((size * shape[0], *shape[1:])), rows[:, k]
        return out[:k].reshape(shape), None if op == "send" else out[k:]

    return fns[op], tagged, kwargs, split


def _recv(
    op: str, fns: dict[str, Callable[..., Any]], args: tuple, kwargs: dict[str, Any]
) -> tuple[Callable[..., Any], tuple, dict[str, Any], Callable[[Any], tuple[Any, Any]]] | None:
    """A receive of one value more than the user's (the sender's tag): ``recv_like``
    runs as ``recv`` of that size."""
    rest = dict(kwargs)
    if op == "recv_like":
        x = args[0] if args else rest.pop("x", None)
        if not isinstance(x, mx.array) or "recv" not in fns:
            return None
        shape, dtype = x.shape, x.dtype
        src = args[1] if len(args) > 1 else rest.pop("src")
    else:
        shape = tuple(args[0] if args else rest.pop("shape"))
        dtype = args[1] if len(args) > 1 else rest.pop("dtype")
        src = args[2] if len(args) > 2 else rest.pop("src")
    k = math.prod(shape)

    def split(out: Any) -> tuple[Any, Any]:
        return out[:k].reshape(shape), out[k:]

    return fns["recv"], ((k + 1,), dtype, src), rest, split
