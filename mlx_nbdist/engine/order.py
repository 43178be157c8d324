"""Prove that the ranks ran each collective together: the same one, in the same order.

MLX *issues* a collective when its array is created and *runs* it when the array is
evaluated, and the ranks' collectives pair in the order they run. Ranks that issue
the same collectives but evaluate them in another order (``mx.eval(b); mx.eval(a)``
on one rank, ``a.item()`` on rank 0 between two, ``mx.eval(y, z)`` of two receives,
which may run ``z`` first) pair one rank's n-th collective with another's m-th: with
equal sizes MLX returns wrong values, silently.

So a collective carries a *tag* after the user's data, made from its position in the
cell (``CollectiveRecord.group_index``, the same on every rank for the same
collective), written as digits small enough for the dtype to hold exactly (:func:`width`):
``all_sum`` adds each digit ``d`` and ``d*d`` (their sums are ``size*d`` and
``size*d*d`` only when every rank's ``d`` is the same), ``all_max`` / ``all_min`` add
``d`` and ``base-1-d``, ``all_gather`` adds ``d``. A message's tag is
:data:`MESSAGE_TAG_BYTES` bytes whatever its dtype, one byte a digit
(``_MESSAGE_BYTE + d``: a normal number in every float dtype's bytes): its sender and
receiver may name the same bytes with other dtypes (``send`` float32, ``recv``
float16), as MLX allows, and must still agree on the bytes on the wire and on what the
tag says. A bool message's tag is zeros (whether every backend copies a bool's other
bytes as they are was not seen): it keeps the bytes in step and is not checked. When
the collective has run, the rank reads its tag back (:meth:`Tag.problem`). The user's
array is the rest of the output, with the input's shape and dtype; the data and the
tag are contiguous, so the bytes on the wire do not depend on how either side laid
them out.

A group collective of ``config.ORDER_TAG_MAX_BYTES`` or more carries its tag in a
collective of its own, issued right after it with the same op, dtype, group and
stream (the tag after the data would copy the data): the user's array depends on
it (``mx.depends``), so that whatever evaluates the one runs the other right after
it, in the same order on every rank, and two large collectives run in another order
have their tags' collectives run in that order too.

Positions are told apart modulo :data:`SPAN` or more: two collectives that far apart
look alike. Tagged: collectives over the whole group, or over a group ``Group.split``
made (positions counted in that group, sums over its size), messages under
``config.ORDER_TAG_MAX_BYTES`` (the tag copies the data), of a dtype that holds
small integers exactly, and, for group collectives, run rather than traced in
``mx.compile`` (every rank runs the same code there; a traced tag could not be read).
A message is tagged wherever it is issued, traced or not, because its sender and its
receiver run different code: whether a message carries a tag must follow from its
dtype and size alone, or one side would read the other's tag as data. The rule is a
function of op, dtype, group size and bytes (and, for a drain, of the record: see
``tracker._replay``), so a drain's replay carries a tag of the same size as the
collective it releases.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from ..config import ORDER_TAG_MAX_BYTES as MAX_BYTES
from ..mismatch import P2P
from ..results import CollectiveRecord
from . import dtypes

#: positions told apart: a collective is mistaken only for one SPAN or more away
SPAN = 1 << 15
#: the largest integer each dtype holds exactly
_EXACT = {
    "float16": 1 << 11, "bfloat16": 1 << 8, "float32": 1 << 24, "float64": 1 << 53,
    "int8": (1 << 7) - 1, "uint8": (1 << 8) - 1, "int16": (1 << 15) - 1,
    "uint16": (1 << 16) - 1, "int32": (1 << 31) - 1, "uint32": (1 << 32) - 1,
    "int64": 1 << 62, "uint64": 1 << 62,
}
#: the position of a message sent from a traced function (see :func:`digits`)
WILDCARD = 0
#: how numpy reads each dtype's bytes (bfloat16: see Tag.values)
_NUMPY = {"bfloat16": "uint16"}
#: a message's tag, in bytes, whatever its dtype (a multiple of every dtype's size)
MESSAGE_TAG_BYTES = 8
#: a message tag's digit ``d`` is the byte ``_MESSAGE_BYTE + d`` (``d`` < 32: with
#: these high bits every float dtype reads it as a normal number, never a NaN or a
#: subnormal a device could flush)
_MESSAGE_BYTE = 0x40
#: a message tag's digits are 0 to ``_MESSAGE_BASE - 1``; WILDCARD's are ``_MESSAGE_BASE``
_MESSAGE_BASE = 31
_SUMS = ("all_sum",)
_PAIRED = ("all_sum", "all_max", "all_min")  # two values a digit
_OPS = (*_PAIRED, "all_gather", "send", "recv", "recv_like")

#: the arguments the tracker reads itself (see :func:`call`): the rest are MLX's
#: keywords (``group``, ``stream``)
_READ = frozenset(("x", "shape", "dtype", "src", "dst"))

Plan = tuple[Callable[..., Any], tuple, dict[str, Any], Callable[[Any], tuple[Any, Any]]]


def width(op: str, dtype: str, size: int, nbytes: int) -> tuple[int, int]:
    """The digits' base and how many a tag of ``op`` has; ``(0, 0)``: not tagged."""
    if nbytes >= MAX_BYTES and op in P2P:
        return 0, 0
    return _width(op, dtype, size)


@functools.lru_cache(maxsize=256)
def _width(op: str, dtype: str, size: int) -> tuple[int, int]:
    # asked on every collective: a decode step issues the same few again and again
    if op not in _OPS or size < 2:
        return 0, 0
    if op in P2P:  # bytes, the same for every dtype (see the module's text)
        return _MESSAGE_BASE, MESSAGE_TAG_BYTES
    exact = _EXACT.get(dtype, 0)
    # digits 0..base-1: a sum holds size * d * d, the others d and base - 1 - d
    base = min(SPAN, (math.isqrt(exact // size) if op in _SUMS else exact) + 1)
    if base < 2:
        return 0, 0
    n = 1
    while base**n < SPAN:
        n += 1
    return base, n


def digits(index: int, base: int, n: int) -> list[int]:
    """The digits of position ``index`` (1-based), least significant first; of a
    message sent from a function ``mx.compile`` traces (``index`` :data:`WILDCARD`),
    digits the receiver takes as any position: its trace runs again, unseen, with
    the digits of the first call."""
    if index == WILDCARD:
        return [base] * n
    p, out = index - 1, []
    for _ in range(n):
        p, d = divmod(p, base)
        out.append(d)
    return out


@functools.lru_cache(maxsize=4096)
def _expected(op: str, ds: tuple[int, ...], base: int, size: int) -> tuple[int, ...]:
    """What a tag of digits ``ds`` reads once every rank's was the same."""
    own = _values(op, list(ds), base)
    if op in _SUMS:
        return tuple(size * v for v in own)
    return tuple(own * size if op == "all_gather" else own)


@functools.lru_cache(maxsize=4096)
def _expected_bytes(op: str, ds: tuple[int, ...], base: int, size: int, name: str) -> bytes:
    """The bytes of :func:`_expected`'s values as dtype ``name`` holds them (exactly:
    :func:`width` keeps them small enough); a message's, whatever its dtype."""
    if op in P2P:
        return _message_bytes(ds)
    exact = np.array(_expected(op, ds, base, size), dtype=np.float32 if name == "bfloat16"
                     else _NUMPY.get(name, name))
    if name == "bfloat16":  # a float32's upper half
        return (exact.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    return exact.tobytes()


def _message_bytes(ds: Sequence[int]) -> bytes:
    return bytes(_MESSAGE_BYTE + d for d in ds)


def _length(op: str, n: int, dtype: str) -> int:
    """How many values of ``dtype`` a tag of ``n`` digits takes."""
    if op in P2P:
        return MESSAGE_TAG_BYTES // dtypes.mx_dtype(dtype).size
    return 2 * n if op in _PAIRED else n


def _values(op: str, ds: list[int], base: int) -> list[int]:
    if op in _SUMS:
        return [v for d in ds for v in (d, d * d)]
    if op in _PAIRED:
        return [v for d in ds for v in (d, base - 1 - d)]
    return list(ds)


@dataclass(slots=True)
class Tag:
    """The tag of one run collective, read back when it has run."""

    rec: CollectiveRecord
    #: the collective's whole output: the user's data, then the tag (per rank, for a
    #: gather); read through its buffer, not sliced in MLX (a node costs ~20 us)
    full: Any
    digits: Sequence[int]
    base: int
    size: int
    #: over a subgroup: its id, this rank's rank in it, the collective's position
    #: there, and its members' world ranks (``None``: not known); ``None``: the world
    place: tuple[int, int, int, tuple[int, ...] | None] | None = None

    def values(self) -> list[float]:
        """The tag's values in :attr:`full` (evaluated: waits for it); a message's:
        its digits (a bool sender's zeros read ``-_MESSAGE_BYTE`` each)."""
        if self.rec.op in P2P:
            tail = memoryview(self.full).cast("B")[-MESSAGE_TAG_BYTES:]
            return [float(b - _MESSAGE_BYTE) for b in tail]
        name = dtypes.dtype_name(self.full.dtype)
        t = _length(self.rec.op, len(self.digits), name)
        raw = np.frombuffer(memoryview(self.full).cast("B"), dtype=_NUMPY.get(name, name))
        tail = raw.reshape(self.size, -1)[:, -t:] if self.rec.op == "all_gather" else raw[-t:]
        if name == "bfloat16":  # numpy has none: its bits are a float32's upper half
            tail = (tail.astype(np.uint32) << 16).view(np.float32)
        return tail.ravel().tolist()

    def expected(self) -> list[int]:
        return list(_expected(self.rec.op, tuple(self.digits), self.base, self.size))

    def as_expected(self) -> bool:
        """Whether the tag's bytes are those :meth:`expected` gives (the common case,
        read without making numbers of them; ``False``: read :meth:`values`). A
        gather's tags lie at the end of each rank's row: always ``False``."""
        if self.rec.op == "all_gather":
            return False
        want = _expected_bytes(self.rec.op, tuple(self.digits), self.base, self.size,
                               dtypes.dtype_name(self.full.dtype))
        buf = memoryview(self.full).cast("B")
        return buf[len(buf) - len(want):] == want

    def problem(self, got: list[float], rank: int, issued: int,
                settled: bool = False) -> dict[str, Any] | None:
        """``got``: the tag's values (:meth:`values`); ``issued``: how many collectives of its kind
        (group, or messages with its peer) the cell has issued, so that a partner is
        named only when its position cannot be another; ``settled``: mlx_nbdist ran it
        at the cell's end (see ``Tracker.settle``). What paired wrongly, or ``None``."""
        expected = self.expected()
        if got == expected or [float(g) for g in got] == [float(e) for e in expected]:
            return None
        if self.rec.op in P2P and got in ([self.base] * len(expected),
                                          [-_MESSAGE_BYTE] * len(expected)):
            return None  # sent from a traced function: any position (see digits); or bool
        op, rec, n = self.rec.op, self.rec, len(self.digits)
        if self.place is not None:
            rank = self.place[1]  # partners are found by their ranks in the group
        partners: dict[str, int | None] = {}
        if op == "all_gather":
            partners = {str(r): self._position(got[r * n:(r + 1) * n], issued)
                        for r in range(self.size) if got[r * n:(r + 1) * n] != list(self.digits)}
        elif op in ("recv", "recv_like"):
            partners = {str(rec.peer): self._position(got, issued)}
        elif op in _SUMS and self.size == 2:
            theirs = [got[2 * j] - d for j, d in enumerate(self.digits)]
            squares = [got[2 * j + 1] - d * d for j, d in enumerate(self.digits)]
            ok = all(s == t * t for s, t in zip(squares, theirs, strict=True))
            partners = {str(1 - rank): self._position(theirs, issued) if ok else None}
        found = {"op": op, "shape": list(rec.shape), "dtype": rec.dtype, "n": rec.group_index,
                 "peer": rec.peer, "with": partners, "settled": settled}
        if self.place is not None:
            _, group_rank, position, members = self.place
            found.update(n=position, group={"rank": group_rank, "size": self.size,
                                            "members": list(members) if members else None})
        return found

    def _position(self, ds: list[float], issued: int) -> int | None:
        if issued > self.base ** len(self.digits):
            return None  # known modulo the span only: could be more than one
        if any(d != int(d) or not 0 <= d < self.base for d in ds):
            return None  # not a tag: a collective of another size ran with it
        return 1 + sum(int(d) * self.base**j for j, d in enumerate(ds))


def call(op: str, fns: dict[str, Callable[..., Any]], x: Any, shape: tuple[int, ...],
         dtype: str, peer: int | None, kwargs: dict[str, Any], index: int, base: int, n: int,
         size: int) -> tuple[Plan, Any] | None:
    """How to run collective ``op`` tagged with position ``index``: the function, its
    arguments, and what turns its output into the user's array and the output to
    read the tag from (``None`` for a send); and the position's digits. ``x``,
    ``shape``, ``dtype`` and ``peer`` are what the tracker read of the call (``x``:
    the data, an ``mx.array``; none for a receive). ``None``: run it as it is."""
    rest = kwargs if _READ.isdisjoint(kwargs) else {
        key: v for key, v in kwargs.items() if key not in _READ}
    lay = _layout(op, shape, _length(op, n, dtype), size)
    if op in ("recv", "recv_like"):  # the sender's tag comes after the user's values
        if "recv" not in fns:
            return None
        return (fns["recv"], (lay.wire, dtypes.mx_dtype(dtype), peer), rest, lay.split), digits(
            index, base, n)
    if not isinstance(x, mx.array):
        return None
    if x.nbytes >= MAX_BYTES:  # a group collective: its tag in a collective of its own
        ds, tag = _tag(op, index, base, n, x.dtype, 1)
        return (_apart(fns[op], tag, kwargs.get("stream")), (x,), rest, _pair), ds
    ds, tag = _tag(op, index, base, n, x.dtype, len(shape) if lay.row else 1)
    tagged = on_stream(kwargs.get("stream"), _tagged, x, tag, lay.row)
    args = (tagged, peer) if op == "send" else (tagged,)
    return (fns[op], args, rest, lay.split), ds


def on_stream(stream: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with its nodes on a collective's ``stream=`` (``None``: the
    default), which may be another thread's (MLX keeps streams per thread): the tag's
    nodes go where the collective goes."""
    if stream is None:
        return fn(*args)
    with mx.stream(stream):
        return fn(*args)


def _apart(fn: Callable[..., Any], tag: Any, stream: Any) -> Callable[..., list[Any]]:
    """``fn`` (a group collective) that issues, right after the user's, the same
    collective of ``tag`` alone; returns the user's output, which depends on the tag's
    (so both run together, the user's first), and the tag's."""

    def run(x: Any, **kwargs: Any) -> list[Any]:
        out = fn(x, **kwargs)
        full = fn(tag, **kwargs)
        return [on_stream(stream, mx.depends, out, full), full]

    return run


def _pair(outs: list[Any]) -> tuple[Any, Any]:
    return outs[0], outs[1]


def _tagged(x: Any, tag: Any, row: bool) -> Any:
    return mx.concatenate([x, tag] if row else [x.reshape(-1), tag], axis=-1)


@functools.lru_cache(maxsize=4096)
def _tag(op: str, index: int, base: int, n: int, dtype: Any, ndim: int
         ) -> tuple[tuple[int, ...], Any]:
    """Position ``index``'s digits and its tag, an array of ``ndim`` dimensions (kept:
    a cell that runs again, a decode's next generation, issues the same positions;
    an evaluated constant, so any thread and stream may read it)."""
    ds = tuple(digits(index, base, n))
    if op in P2P:  # its bytes (see the module's text), as the data's dtype names them
        raw = bytes(len(ds)) if dtype == mx.bool_ else _message_bytes(ds)
        tag = mx.array(np.frombuffer(raw, dtype=np.uint8)).view(dtype)
        tag = tag.reshape((1,) * (ndim - 1) + (tag.size,))
        mx.eval(tag)
        return ds, tag
    values: Any = _values(op, list(ds), base)
    for _ in range(ndim - 1):
        values = [values]
    return ds, mx.array(values, dtype=dtype)


@dataclass(frozen=True)
class _Layout:
    """Where a tagged collective's data and tag lie (the same for every call of one
    op and shape: kept, see :func:`_layout`)."""

    row: bool
    #: a receive's shape on the wire: the user's values, then the tag
    wire: tuple[int, ...]
    split: Callable[[Any], tuple[Any, Any]]


@functools.lru_cache(maxsize=1024)
def _layout(op: str, shape: tuple[int, ...], t: int, size: int) -> _Layout:
    k = math.prod(shape)
    # Every node costs a rank a few microseconds to schedule (tens on busy cores): a
    # decode step issues small collectives by the dozen. Hence one row (a decoded
    # token's activations) takes its tag after it, with no reshape, and the tag is
    # made in its final shape.
    row = bool(shape) and op != "all_gather" and math.prod(shape[:-1]) == 1
    wire = (*shape[:-1], k + t) if row else (k + t,)
    if op == "all_gather":  # each rank's row: its data, then its tag

        gathered = (size * shape[0], *shape[1:]) if shape else (size,)  # a scalar a rank

        def rows(out: Any) -> tuple[Any, Any]:
            by_rank = out.reshape(size, k + t)
            return by_rank[:, :k].reshape(gathered), out

        return _Layout(row, wire, rows)
    return _Layout(row, wire, _split(shape, k, row, keep=op != "send"))


def _split(shape: tuple[int, ...], k: int, row: bool, keep: bool
           ) -> Callable[[Any], tuple[Any, Any]]:
    """What turns a tagged output back into the user's array of ``shape`` (its first
    ``k`` values), with the whole output to read the tag from (``keep``)."""

    def split(out: Any) -> tuple[Any, Any]:
        return (out[..., :k] if row else out[:k].reshape(shape)), (out if keep else None)

    return split
