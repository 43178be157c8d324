"""Plain dataclasses that travel back from the ranks to the notebook.

Nothing here imports MLX, ipyparallel or the session: these are values that the
session produces and that :mod:`mlx_nbdist.viz` and the magics consume.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .enums import TextEnum

#: A rank's cell ended normally.
OK = "ok"
#: The user's code raised on that rank.
ERROR = "error"
#: The engine process died (``os._exit``, SIGKILL, segfault) while running the cell.
DIED = "died"
#: mlx_nbdist ended the rank because it was stuck (deadline, interrupt, failed drain).
KILLED = "killed"
#: The rank was stuck in a collective and was released by replaying it on its peers;
#: it finished, but the values it computed in this cell are not meaningful.
DRAINED = "drained"
#: The rank's process was paused (SIGSTOP, a debugger) until the controller dropped it.
PAUSED = "paused"


def count(n: int, noun: str) -> str:
    """``1 rank``, ``2 ranks``: a number and its noun, for messages."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


@dataclass
class CollectiveRecord:
    """One collective a rank issued through MLX (recorded on the engine).

    Attributes:
        seq: 1-based sequence number of this collective on this rank since start.
        op: ``all_sum``, ``all_gather``, ``all_max``, ``all_min``, ``sum_scatter``,
            ``send``, ``recv`` or ``recv_like``.
        shape: shape of the local input (``recv``: of the expected output).
        dtype: MLX dtype name, e.g. ``float32``.
        peer: the other rank for ``send``/``recv``, else ``None``.
        nbytes: bytes of the local input.
        cell: the cell number in which it was issued.
        index: 1-based position among the collectives this rank issued in that cell.
        check: issued by ``--check-collectives`` to compare signatures (not user code).
        group_index: 1-based position among the collectives over the whole group
            that this rank issued in that cell (0: point-to-point, or a subgroup's);
            the same position must hold the same collective on every rank. For one
            traced by ``mx.compile`` / ``mx.vmap``: its position in that trace; for
            ``send``/``recv``: the n-th message to/from ``peer`` in that cell.
        trace: the trace it was recorded in (``compile:step#1``), ``""`` when run.
        bare: a group collective of 1 MiB or more issued under ``mx.jvp``, which
            carried no order tag (a drain's replay of it carries none either).
    """

    seq: int
    op: str
    shape: tuple[int, ...]
    dtype: str
    peer: int | None = None
    nbytes: int = 0
    cell: int = 0
    index: int = 0
    check: bool = False
    group_index: int = 0
    trace: str = ""
    bare: bool = False

    def describe(self) -> str:
        peer = f" peer={self.peer}" if self.peer is not None else ""
        what = " (--check-collectives signature)" if self.check else ""
        return f"#{self.seq} {self.op}{peer} shape={tuple(self.shape)} dtype={self.dtype}{what}"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CollectiveRecord:
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**{**known, "shape": tuple(d.get("shape", ()))})


@dataclass(frozen=True)
class Frame:
    """One frame: where (file, line) and in which function.

    ``cell`` names the cell when the file is one the session ran (``In [7]`` from
    the magic, ``cell #3`` from :meth:`Session.run`), and ``text`` is that cell's
    line (``""`` when the source is not known here).
    """

    file: str
    line: int
    func: str
    cell: str | None = None
    text: str = ""

    def where(self) -> str:
        place = self.cell if self.cell is not None else self.file
        return f"{place}, line {self.line}, in {self.func}"


@dataclass
class RankStack:
    """Rank ``rank``'s main thread, outermost frame first (``frames``), trimmed to
    the user's code; ``note`` says why there is none (no answer, no signal...)."""

    rank: int
    frames: list[Frame] = field(default_factory=list)
    note: str = ""

    def innermost(self) -> Frame | None:
        """The innermost frame in a cell, else the innermost frame."""
        cells = [f for f in self.frames if f.cell is not None]
        return (cells or self.frames or [None])[-1]

    def format(self) -> str:
        """The stack as a traceback's lines, innermost last."""
        if not self.frames:
            return f"rank {self.rank}: no stack ({self.note or 'none was written'})"
        lines = [f"rank {self.rank} is at {self.innermost().where()}"]  # type: ignore[union-attr]
        for f in self.frames:
            lines.append(f"  {f.where()}")
            if f.text:
                lines.append(f"    {f.text.strip()}")
        if self.note:
            lines.append(f"  ({self.note})")
        return "\n".join(lines)


@dataclass
class RankFailure:
    """Why one rank did not finish a cell normally."""

    rank: int
    cause: str  # one of ERROR, DIED, KILLED, DRAINED, PAUSED
    ename: str = ""
    evalue: str = ""
    traceback: list[str] = field(default_factory=list)
    #: Collectives the rank had issued in this cell and not seen matched (newest last).
    pending: list[CollectiveRecord] = field(default_factory=list)
    #: where its main thread was when mlx_nbdist stopped or released it
    stack: RankStack | None = None

    def headline(self) -> str:
        if self.cause == ERROR:
            return f"[rank {self.rank}] {self.ename}: {self.evalue}"
        if self.cause == DIED:
            return f"[rank {self.rank}] engine process died ({self.evalue or 'no exit status'})"
        if self.cause == PAUSED:
            return f"[rank {self.rank}] was paused: {self.evalue}"
        where = f" in {self.pending[-1].describe()}" if self.pending else ""
        where += self.stopped_at()
        if self.cause == DRAINED:
            return f"[rank {self.rank}] was stuck{where}; released by replaying it on its peers"
        return f"[rank {self.rank}] ended by mlx_nbdist ({self.evalue}){where}"

    def stopped_at(self) -> str:
        """`` at cell [3], line 4: y = ...`` where its stack says it was (or ``""``)."""
        inner = self.stack.innermost() if self.stack is not None else None
        if inner is None:
            return ""
        text = f": {inner.text.strip()}" if inner.text.strip() else ""
        return f" at {inner.where()}{text}"


@dataclass
class RankOutput:
    """Everything one rank produced for one cell."""

    rank: int
    engine_id: int
    status: str = OK
    stdout: str = ""
    stderr: str = ""
    #: ``display_data`` messages: dicts with ``data`` (a MIME bundle) and ``metadata``.
    outputs: list[dict[str, Any]] = field(default_factory=list)
    #: MIME bundle of the cell's last expression, or ``None``.
    result: dict[str, Any] | None = None
    failure: RankFailure | None = None
    duration: float | None = None
    #: the rank's output area in the order it was written (``mlx_nbdist.streams.Item``):
    #: stdout and stderr interleaved, displays as last updated
    items: list[Any] = field(default_factory=list)
    #: problems that did not fail the cell (e.g. a display formatter that raised)
    warnings: list[str] = field(default_factory=list)

    @property
    def result_text(self) -> str | None:
        """The ``text/plain`` form of the cell's last expression, if any."""
        if self.result is None:
            return None
        return self.result.get("text/plain")


@dataclass
class CellResult:
    """The outcome of one ``%%mlxdist`` cell across the ranks it ran on."""

    cell: int
    ranks: dict[int, RankOutput]
    elapsed: float = 0.0
    #: False when the values computed in this cell cannot be trusted (drained ranks).
    valid: bool = True

    @property
    def ok(self) -> bool:
        return all(o.status == OK for o in self.ranks.values())

    @property
    def failures(self) -> list[RankFailure]:
        return [o.failure for o in self.ranks.values() if o.failure is not None]

    def stdout(self, rank: int) -> str:
        return self.ranks[rank].stdout

    def __repr__(self) -> str:
        # one line: a cell's last expression shows it (every rank's output is in .ranks)
        statuses = ", ".join(f"{r}: {o.status}" for r, o in sorted(self.ranks.items()))
        valid = "" if self.valid else ", values invalid"
        return f"CellResult(cell {self.cell}, ranks {{{statuses}}}, {self.elapsed:.2f} s{valid})"


@dataclass
class RankInfo:
    """What a rank reported when it joined the group."""

    rank: int
    engine_id: int
    pid: int
    host: str
    device: str
    size: int
    backend: str
    #: its main thread's id, as a stack dump names it (``None``: dumps unavailable)
    main_thread: int | None = None


class RankStatus(TextEnum):
    """What a rank is doing, as its status file and the session tell it; compares equal
    to its value (``"busy"``). The first four are what a rank publishes itself."""

    STARTING = "starting"
    IDLE = "idle"
    BUSY = "busy"
    ERROR = "error"
    #: its process is gone
    DEAD = "dead"
    #: alive, but in a group that is broken
    BROKEN = "broken"
    #: its status file is on its own host
    UNKNOWN = "unknown"
    #: alive and busy, but silent for longer than ``config.STALE_AFTER``
    HUNG = "hung"



@dataclass
class RankState:
    """A live snapshot of one rank, read from its status file (see engine.monitor)."""

    rank: int
    pid: int = 0
    state: RankStatus = RankStatus.STARTING
    cell: int = 0
    cell_started: float | None = None
    last_duration: float | None = None
    last_status: str | None = None
    device: str = ""
    active_memory: int = 0
    peak_memory: int = 0
    rss: int = 0
    cpu_percent: float = 0.0
    collectives: int = 0
    bytes_moved: int = 0
    recent: list[CollectiveRecord] = field(default_factory=list)
    progress: dict[str, Any] = field(default_factory=dict)
    updated: float = 0.0


@dataclass
class TensorSlice:
    """The part of one (possibly sharded) tensor that one rank holds.

    The rank's local array is the concatenation, along ``axis``, of the blocks
    ``full[..., start:stop, ...]`` for each ``(start, stop)`` in ``ranges``. With
    ``segments == 1`` there is one block; fused weights sharded with ``segments > 1``
    (for example a fused QKV) give one block per segment. A replicated tensor has
    ``axis is None`` and every rank holds the whole of it.

    Attributes:
        name: parameter path, e.g. ``layers.0.weight``.
        rank: the rank holding this slice.
        shape: the local shape on this rank.
        full_shape: the shape of the unsharded tensor.
        dtype: MLX dtype name of the local array.
        axis: the sharded axis (non-negative), or ``None`` when replicated.
        ranges: ``(start, stop)`` blocks along ``axis`` in the full tensor.
        kind: ``sharded``, ``replicated`` or ``quantized`` (packed weights, scales, biases).
        data: the local values as numpy (``None`` when only a summary was pulled).
        summary: ``min``, ``max``, ``mean``, ``std``, ``norm`` of the local values
            (the whole slice even when ``data`` is a sample). The rank computes it
            when it does not send every value; else it is computed here, on first
            read, from ``data``.
        sampled: True when ``data`` is a strided sample rather than the whole slice.
        unit: ``(size, name)`` when the sharded axis is made of whole units, e.g.
            ``(32, "head")`` for an attention projection whose heads are 32 rows
            (figures mark them); ``None`` otherwise.
    """

    name: str
    rank: int
    shape: tuple[int, ...]
    full_shape: tuple[int, ...]
    dtype: str
    axis: int | None = None
    ranges: list[tuple[int, int]] = field(default_factory=list)
    kind: str = "sharded"
    data: np.ndarray | None = None
    summary: dict[str, float] = field(default_factory=dict)
    sampled: bool = False
    unit: tuple[int, str] | None = None

    @property
    def replicated(self) -> bool:
        return self.axis is None

    def metadata(self) -> dict[str, Any]:
        """Every field but ``data``; ``summary`` as it stands (not computed here)."""
        out = {
            f: getattr(self, f) for f in self.__dataclass_fields__ if f not in ("data", "summary")
        }
        return {**out, "summary": self.__dict__.get("_summary") or {}}

    @property
    def nbytes(self) -> int:
        itemsize = np.dtype(_NUMPY_NAMES.get(self.dtype, self.dtype)).itemsize
        return int(np.prod(self.shape, dtype=np.int64)) * itemsize


def _get_summary(self: TensorSlice) -> dict[str, float]:
    got = self.__dict__.get("_summary") or {}
    complete = self.data is not None and not self.sampled
    if not got and complete and tuple(np.shape(self.data)) == tuple(self.shape):
        got = self.__dict__["_summary"] = summarize(self.data)
    return got


def _set_summary(self: TensorSlice, value: dict[str, float]) -> None:
    self.__dict__["_summary"] = value


# Computed on first read when the slice came whole: a pull of a large slice does not
# wait for four passes over it on the rank. Assigned after @dataclass, which set up
# __init__/__eq__/__repr__ to go through the attribute.
TensorSlice.summary = property(_get_summary, _set_summary)  # type: ignore[assignment]


def summarize(values: np.ndarray) -> dict[str, float]:
    """min, max, mean, std and norm in a few fast passes (no float64 copy of the values);
    of the magnitudes for complex values."""
    if values.size == 0:
        nan = float("nan")
        return {"min": nan, "max": nan, "mean": nan, "std": nan, "norm": 0.0}
    flat = values.reshape(-1)
    if np.iscomplexobj(flat):
        flat = np.abs(flat)
    if not np.issubdtype(flat.dtype, np.floating):
        flat = flat.astype(np.float64)
    mean = float(np.add.reduce(flat, dtype=np.float64)) / flat.size
    sq = flat if flat.dtype != np.float16 else flat.astype(np.float32)
    sumsq = float(np.dot(sq, sq))
    var = max(sumsq / flat.size - mean * mean, 0.0)
    return {"min": float(flat.min()), "max": float(flat.max()), "mean": mean,
            "std": math.sqrt(var), "norm": math.sqrt(max(sumsq, 0.0))}  # fmt: skip


_NUMPY_NAMES = {"bfloat16": "float16"}


@dataclass
class GradSample:
    """One parameter's gradient on one rank, before and after synchronisation."""

    name: str
    rank: int
    replicated: bool
    norm_before: float
    norm_after: float
    #: ``max |after_r - after_0|`` over the elements (replicated parameters only, else 0).
    max_diff_after: float = 0.0
    shape: tuple[int, ...] = ()
    #: collective that synchronised it (``all_sum`` …) and the bytes it moved on this rank.
    collective: str = ""
    nbytes: int = 0
    #: tensor parallelism synchronises activation gradients once per step, not per
    #: parameter: the backward ``all_sum`` calls and bytes of the whole step on this
    #: rank (the same in each of its rows); ``None`` when the step has no such
    #: collective of its own (``dp`` and ``fsdp`` count bytes per parameter).
    step_calls: int | None = None
    step_nbytes: int | None = None


class ShardMode(TextEnum):
    """How a parameter (or the layer that owns it) is laid out across the ranks.

    A ``str``: a mode compares equal to its value (``ShardMode.FSDP == "fsdp"``),
    hashes like it and prints as it. What each mode does on a rank is one row of
    ``mlx_nbdist.engine.sharding.RULES``.
    """

    #: ``AllToShardedLinear``: whole input, output split across ranks (bwd all_sum)
    ALL_TO_SHARDED = "all-to-sharded"
    #: ``ShardedToAllLinear``: split input, output summed to whole (fwd all_sum)
    SHARDED_TO_ALL = "sharded-to-all"
    #: under a ``FullyShardedModule``: split on axis 0, gathered for each use
    FSDP = "fsdp"
    #: every rank holds all of it
    REPLICATED = "replicated"
    #: ``shard_inplace``: sliced like all-to-sharded, but no collective is inserted
    INPLACE_ALL_TO_SHARDED = "inplace-all-to-sharded"
    #: ``shard_inplace``: sliced like sharded-to-all, but no collective is inserted
    INPLACE_SHARDED_TO_ALL = "inplace-sharded-to-all"
    #: pipeline stage: the layer is whole on the one rank that runs it, absent elsewhere
    PIPELINE = "pipeline"




@dataclass
class PlanRow:
    """One row of a sharding plan: what a parameter becomes on each rank."""

    path: str
    layer: str
    mode: ShardMode
    full_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    axis: int | None
    dtype: str
    bytes_per_rank: int
    collectives_per_step: str = ""
    problem: str = ""
    #: the one rank that holds the parameter (a pipeline stage); ``None``: every rank
    holder: int | None = None

    def __post_init__(self) -> None:
        self.mode = ShardMode(self.mode)  # a plain string (rows read back, tests) too


@dataclass
class HeadRow:
    """One attention block of a tensor-parallel plan: the heads each rank keeps."""

    path: str
    heads: int
    kv_heads: int
    head_dim: int
    group_size: int
    problem: str = ""
    #: the block's attributes that hold the counts (divided by ``shard``)
    attrs: tuple[str, ...] = ()

    @property
    def heads_per_rank(self) -> int:
        return self.heads // self.group_size

    @property
    def kv_heads_per_rank(self) -> int:
        return self.kv_heads // self.group_size


@dataclass
class StageRow:
    """One pipeline stage: the layers a rank runs and the parameter bytes it holds.

    ``first``/``last`` are layer indices (inclusive); data flows from the highest
    rank (the first layers) down to rank 0 (the last layers), as in mlx-lm.
    """

    rank: int
    first: int
    last: int
    param_bytes: int

    @property
    def n_layers(self) -> int:
        return self.last - self.first + 1
