"""Record every MLX collective a rank issues, and guard the dangerous ones.

The tracker replaces the functions of ``mlx.core.distributed`` on an engine with thin
wrappers, so user code, ``mlx.nn.layers.distributed`` and ``sum_gradients`` all go
through it. Each wrapper:

* records ``(seq, op, shape, dtype, peer, nbytes)`` so the notebook can say which
  collective a stuck rank is waiting in, and can release it by replaying the same
  collective on the ranks that skipped it (see :func:`drain`);
* refuses a collective over the whole group from a cell that runs on a subset of
  ranks (it would wait forever for the ranks that are not running);
* optionally (``check`` mode) compares op, shape and dtype across ranks before the
  real collective and raises on every rank, naming the ranks that differ, instead
  of hanging or returning wrong numbers.

MLX builds graphs lazily: a collective is *issued* when its array is created and
*runs* when that array is evaluated. The records are of issue order, which is the
same on every rank for correct programs.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import mlx.core as mx

from ..results import CollectiveRecord

OPS = ("all_sum", "all_gather", "all_max", "all_min", "sum_scatter", "send", "recv", "recv_like")
_OP_CODES = {op: i + 1 for i, op in enumerate(OPS)}
_SIG_LEN = 12  # op, dtype, ndim, up to 8 dims, peer


class CollectiveError(RuntimeError):
    """A collective was refused before it could hang or give wrong numbers."""


class Tracker:
    """Per-engine record of collectives; installed once by the bootstrap."""

    def __init__(self, world: Any, rank: int, size: int, history: int = 64):
        self.world = world
        self.rank = rank
        self.size = size
        self.seq = 0
        self.bytes_moved = 0
        self.recent: deque[CollectiveRecord] = deque(maxlen=history)
        self.cell = 0
        self.active_ranks: list[int] | None = None
        self.check = False
        self._orig: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._replaying = False

    # -- installation -------------------------------------------------------------
    def install(self) -> None:
        """Wrap the functions of ``mx.distributed`` (idempotent)."""
        if self._orig:
            return
        for op in OPS:
            fn = getattr(mx.distributed, op, None)
            if fn is None:
                continue
            self._orig[op] = fn
            setattr(mx.distributed, op, self._wrap(op, fn))

    def uninstall(self) -> None:
        for op, fn in self._orig.items():
            setattr(mx.distributed, op, fn)
        self._orig.clear()

    def original(self, op: str) -> Any:
        return self._orig.get(op) or getattr(mx.distributed, op)

    # -- per cell -----------------------------------------------------------------
    def begin_cell(self, cell: int, active_ranks: list[int] | None, check: bool) -> None:
        self.cell = cell
        self.active_ranks = active_ranks
        self.check = check

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "collectives": self.seq,
                "bytes_moved": self.bytes_moved,
                "recent": [vars(r).copy() for r in list(self.recent)[-8:]],
            }

    def cell_records(self, cell: int) -> list[CollectiveRecord]:
        with self._lock:
            return [r for r in self.recent if r.cell == cell]

    # -- the wrapper --------------------------------------------------------------
    def _wrap(self, op: str, fn: Any) -> Any:
        tracker = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True  # IPython: show the user's line, not ours
            group = kwargs.get("group") or tracker.world
            x = args[0] if args else None
            shape, dtype, peer = _describe(op, args, kwargs)
            if not tracker._replaying and group.size() > 1:
                problem = tracker._subset_problem(op, group)
                if problem is None and tracker.check and op not in ("send", "recv", "recv_like"):
                    problem = tracker._signature_problem(op, shape, dtype, group)
                if problem:
                    raise CollectiveError(problem)
            nbytes = int(x.nbytes) if isinstance(x, mx.array) else _nbytes(shape, dtype)
            with tracker._lock:
                tracker.seq += 1
                tracker.bytes_moved += nbytes
                tracker.recent.append(
                    CollectiveRecord(tracker.seq, op, shape, dtype, peer, nbytes, tracker.cell)
                )
            return fn(*args, **kwargs)

        wrapper.__name__ = op
        wrapper.__qualname__ = op
        wrapper.__doc__ = fn.__doc__
        wrapper.__wrapped__ = fn
        return wrapper

    def _subset_problem(self, op: str, group: Any) -> str | None:
        active = self.active_ranks
        if active is None or len(active) >= self.size or group.size() < self.size:
            return None
        return (
            f"{op} over the whole group ({self.size} ranks) from a cell running on "
            f"ranks {active} only would wait forever for ranks "
            f"{sorted(set(range(self.size)) - set(active))}. Run the cell on all ranks "
            "(drop --ranks) or use a subgroup made on every rank with world.split()."
        )

    def _signature_problem(
        self, op: str, shape: tuple[int, ...], dtype: str, group: Any
    ) -> str | None:
        sig = _signature(op, shape, dtype)
        try:
            gathered = self._orig["all_gather"](mx.array(sig, dtype=mx.int64)[None], group=group)
            mx.eval(gathered)
        except (RuntimeError, ValueError) as e:  # inside mx.compile: cannot eval, skip
            if "transform" in str(e).lower() or "compile" in str(e).lower():
                return None
            raise
        rows = gathered.tolist()
        if all(r == rows[0] for r in rows):
            return None
        desc = "; ".join(f"rank {i}: {_unsignature(r)}" for i, r in enumerate(rows))
        return (
            f"collective mismatch at #{self.seq + 1} ({op} on rank {self.rank}): {desc}. "
            "All ranks must issue the same collective with the same shape and dtype."
        )


def _describe(op: str, args: tuple, kwargs: dict) -> tuple[tuple[int, ...], str, int | None]:
    if op == "recv":
        shape = tuple(args[0] if args else kwargs["shape"])
        dtype = args[1] if len(args) > 1 else kwargs["dtype"]
        src = args[2] if len(args) > 2 else kwargs.get("src")
        return shape, _dtype_name(dtype), src
    x = args[0] if args else kwargs.get("x")
    shape = tuple(x.shape) if hasattr(x, "shape") else ()
    dtype = _dtype_name(x.dtype) if hasattr(x, "dtype") else ""
    peer = None
    if op == "send":
        peer = args[1] if len(args) > 1 else kwargs.get("dst")
    elif op == "recv_like":
        peer = args[1] if len(args) > 1 else kwargs.get("src")
    return shape, dtype, peer


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("mlx.core.", "")


_DTYPES = [
    "bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
    "float16", "float32", "float64", "bfloat16", "complex64",
]  # fmt: skip


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    try:
        return n * getattr(mx, dtype).size
    except AttributeError:
        return 0


def _signature(op: str, shape: tuple[int, ...], dtype: str) -> list[int]:
    dims = list(shape)[:8] + [-1] * (8 - min(len(shape), 8))
    code = _DTYPES.index(dtype) if dtype in _DTYPES else -1
    return [_OP_CODES[op], code, len(shape), *dims, 0][:_SIG_LEN]


def _unsignature(row: list[int]) -> str:
    op = OPS[row[0] - 1] if 0 < row[0] <= len(OPS) else "?"
    dtype = _DTYPES[row[1]] if 0 <= row[1] < len(_DTYPES) else "?"
    shape = tuple(row[3 : 3 + row[2]])
    return f"{op} shape={shape} dtype={dtype}"


def drain(tracker: Tracker, records: list[dict[str, Any]]) -> list[str]:
    """Issue, on this rank, the collectives that a stuck peer is waiting in.

    Each record is replayed with zeros of the same shape and dtype, in sequence
    order, skipping those this rank already issued. Point-to-point records are
    replayed only when this rank is the peer. The values the peer receives are not
    meaningful: the cell that needed draining is marked invalid.

    Returns:
        One line per replayed collective.
    """
    done: list[str] = []
    outs = []
    tracker._replaying = True
    try:
        for d in sorted(records, key=lambda d: d["seq"]):
            rec = CollectiveRecord.from_dict(d)
            if rec.seq <= tracker.seq and rec.op not in ("send", "recv", "recv_like"):
                continue
            out = _replay(tracker, rec, d.get("from_rank"))
            if out is not None:
                outs.append(out)
                done.append(rec.describe())
        if outs:
            mx.eval(outs)
    finally:
        tracker._replaying = False
    return done


def _replay(tracker: Tracker, rec: CollectiveRecord, from_rank: int | None) -> Any:
    dtype = getattr(mx, rec.dtype)
    dist = mx.distributed
    if rec.op in ("all_sum", "all_gather", "all_max", "all_min", "sum_scatter"):
        return getattr(dist, rec.op)(mx.zeros(rec.shape, dtype=dtype), group=tracker.world)
    if rec.peer != tracker.rank or from_rank is None:
        return None
    if rec.op == "send":  # the stuck rank sends to us: receive it
        return dist.recv(rec.shape, dtype, from_rank, group=tracker.world)
    # the stuck rank receives from us: send it zeros
    return dist.send(mx.zeros(rec.shape, dtype=dtype), from_rank, group=tracker.world)
