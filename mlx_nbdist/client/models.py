"""Plan, shard and look at a model that lives on the ranks.

On the notebook side these functions take the *name* of a model (or of one of its
parameters) in the ranks' namespace and a session (default: the current one).
Inside a ``%%mlxdist`` cell, :func:`plan` and :func:`shard` also take the model
object itself and call :mod:`mlx_nbdist.engine.sharding` directly::

    %%mlxdist
    model = mlx_nbdist.shard(model, "megatron")     # on every rank
    mlx_nbdist.plan("model")                         # from the notebook: a table

What runs on the ranks is in :mod:`mlx_nbdist.engine.rpc`; slices arrive through the
session's :class:`~mlx_nbdist.client.transfer.Receiver`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..engine import rpc
from ..errors import CellError, ShardingError
from ..history import shard_entry
from ..results import GradSample, HeadRow, PlanRow, StageRow, TensorSlice, count

if TYPE_CHECKING:
    from ..session import Session
    from ..timelines import CommStats


def _session(session: Session | None) -> Session:
    from ..api import current_session

    return session or current_session()  # type: ignore[return-value]


def parse_sharding(text: str) -> str | dict[str, str | None]:
    """A strategy name, or a JSON mapping ``{layer path or glob: mode}``."""
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as e:
            raise ShardingError(f"--sharding mapping is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ShardingError("--sharding mapping must be a JSON object")
        return value
    return text


@dataclass
class PlanTable:
    """A sharding plan as the notebook shows it (HTML table, or text)."""

    rows: list[PlanRow]
    group_size: int
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    #: per attention block, the heads each rank keeps (tensor parallel)
    heads: list[HeadRow] = field(default_factory=list)
    #: per rank, the layers it runs (pipeline)
    stages: list[StageRow] = field(default_factory=list)
    #: the model's own method that shards it (``Model.shard``), if any
    own: str = ""

    def _repr_html_(self) -> str:
        from ..viz.plan import extras_of, plan_table_html

        return plan_table_html(self.rows, self.group_size, **extras_of(self))

    def __str__(self) -> str:
        from ..viz.plan import extras_of, format_plan

        return format_plan(self.rows, self.group_size, **extras_of(self))

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


def plan(
    model: Any,
    sharding: str | dict[str, str | None] = "megatron",
    *,
    segments: int = 1,
    group_size: int | None = None,
    session: Session | None = None,
) -> Any:
    """What sharding would do to each parameter, before anything moves.

    Args:
        model: the model's name on the ranks (from the notebook), or the model
            itself (inside a cell; then a :class:`~mlx_nbdist.engine.sharding.ShardPlan`).
        sharding: ``megatron``, ``all-to-sharded``, ``sharded-to-all``, ``fsdp``,
            ``inplace-…`` or a ``{layer path or glob: mode}`` mapping.
        segments: fused segments per sharded axis.
        group_size: ranks to plan for (default: the session's, or the group's).
    """
    if not isinstance(model, str):
        from ..engine.sharding import plan as _plan

        return _plan(model, sharding, group_size=group_size or _group_size(), segments=segments)
    return _plan_table(model, sharding, segments, group_size, _session(session), "plan")


def _plan_table(model: str, sharding: str | dict[str, str | None], segments: int,
                group_size: int | None, s: Session, command: str) -> PlanTable:
    n = group_size or s.n
    got = _unwrap(s.apply, rpc.plan_rows, model, sharding, n, segments, command,
                  ranks=[0])[0]
    rows = [PlanRow(**{**r, "full_shape": tuple(r["full_shape"]),
                       "local_shape": tuple(r["local_shape"])}) for r in got["rows"]]
    return PlanTable(rows, n, got["problems"], got["warnings"],
                     heads=[HeadRow(**{**h, "attrs": tuple(h["attrs"])}) for h in got["heads"]],
                     stages=[StageRow(**st) for st in got["stages"]], own=got["own"])


def shard(
    model: Any,
    sharding: str | dict[str, str | None] = "megatron",
    *,
    segments: int = 1,
    session: Session | None = None,
) -> Any:
    """Shard a model with MLX's own layers; checked on the notebook before any rank moves.

    From the notebook ``model`` is the model's name: the plan is computed on rank 0
    first and any dimension that does not divide raises :class:`ShardingError`
    naming each parameter; then every rank shards and rebinds the name. Inside a
    cell, ``model`` is the model object and the sharded model is returned.
    """
    if not isinstance(model, str):
        from ..engine.sharding import shard as _shard
        from ..engine.state import current

        return _shard(model, sharding, group=current().world, segments=segments)
    s = _session(session)
    table = _plan_table(model, sharding, segments, None, s, "shard")
    if table.problems:
        raise ShardingError(
            f"cannot shard {model!r} across {count(table.group_size, 'rank')}:\n  "
            + "\n  ".join(table.problems)
        )
    notes = _unwrap(s.apply, rpc.shard_model, model, sharding, segments)
    s.record(shard_entry(model, sharding, segments))  # an export replays it in a cell
    said = {w for text in notes.values() for w in text.splitlines() if w}
    # the rank's warnings, less those that repeat a plan warning's reason
    table.warnings = [*table.warnings, *sorted(w for w in said if not any(
        w.split(": ", 2)[-1] in p for p in table.warnings))]
    return table


def slices(name: str, *, max_elements: int | None = None, session: Session | None = None
           ) -> list[TensorSlice]:
    """Each rank's slice of a parameter as numpy, with where it sits in the full tensor.

    Values never go through a pickle. From a rank on this machine the array *is* a
    shared-memory segment the rank copied the slice into (nothing is copied in the
    notebook), or a copy read straight out of the rank's memory where no shared
    memory is to be had; from another host it comes as a raw ipyparallel buffer
    (see :mod:`mlx_nbdist.engine.transfer`).

    Args:
        name: ``model.path.to.param`` (or the name of an array) on the ranks.
        max_elements: pull a strided sample instead when a slice is larger.
    """
    s = _session(session)
    # one request to every rank: a pipeline stage that does not hold ``name`` says so
    got = s.receiver.pull(lambda *a: _unwrap(s.apply, *a, lookup=True), name,
                          max_elements, s.shm_prefix)
    out = []
    for meta, data in got:
        meta = dict(meta, data=data)
        meta["shape"], meta["full_shape"] = tuple(meta["shape"]), tuple(meta["full_shape"])
        meta["ranges"] = [tuple(r) for r in meta["ranges"]]
        meta["unit"] = tuple(meta["unit"]) if meta.get("unit") else None
        out.append(TensorSlice(**meta))
    return out


def show(name: str, *, values: bool = True, max_elements: int | None = 1 << 20,
         session: Session | None = None) -> Any:
    """A figure of the full tensor as blocks coloured by the rank that holds them.

    ``name`` may also be a quantized layer (``model.layers.0``): then its packed
    weight, scales and biases are drawn side by side.
    """
    from ..viz import show_quantized, show_tensor

    s = _session(session)
    if _unwrap(s.apply, rpc.is_quantized_layer, name, ranks=[0], lookup=True)[0]:
        parts = s.apply(rpc.quantized_parts, name, ranks=[0])[0]
        got = {p.rsplit(".", 1)[1]: one_tensor(p, slices(p, max_elements=max_elements,
                                                          session=s), "show")
               for p in parts}
        return show_quantized(got["weight"], got["scales"], got.get("biases"))
    got = one_tensor(name, slices(name, max_elements=max_elements, session=s), "show")
    title = name
    if len(got) < s.n:
        title += f" (held by rank {', '.join(str(t.rank) for t in got)} only: a pipeline stage)"
    return show_tensor(got, values=values, title=title)


def show_text(name: str, *, max_elements: int | None = 1 << 20,
              session: Session | None = None) -> str:
    """The text form of :func:`show` (``%mlxdist show NAME --text``): a character grid
    of who holds what and a table of each rank's slice."""
    from ..viz import format_tensor

    got = slices(name, max_elements=max_elements, session=_session(session))
    return format_tensor(one_tensor(name, got, "show"))


def one_tensor(name: str, got: list[TensorSlice], command: str) -> list[TensorSlice]:
    """``got`` when the ranks' slices describe one tensor (the same full shape and
    sharded axis on every rank), else a ShardingError that names the ranks that differ."""
    if not got:
        return got
    ordered = sorted(got, key=lambda t: t.rank)
    first = ordered[0]
    for t in ordered[1:]:
        if tuple(t.full_shape) != tuple(first.full_shape):
            what = "shape" if first.replicated and t.replicated else "full shape"
            raise ShardingError(
                f"{name} has {what} {tuple(first.full_shape)} on rank {first.rank} but "
                f"{tuple(t.full_shape)} on rank {t.rank}: {command} needs one tensor, of "
                "the same shape on every rank (a parameter of a model, or an array every "
                "rank holds); to look at each rank's own array, print it in a %%mlxdist cell"
            )
        if t.axis != first.axis:
            def how(x: TensorSlice) -> str:
                return "replicated" if x.axis is None else f"sharded on axis {x.axis}"
            raise ShardingError(
                f"{name} is {how(first)} on rank {first.rank} but {how(t)} on rank {t.rank}: "
                f"{command} needs the same layout on every rank (was the model sharded on "
                "every rank?)"
            )
    return got


@dataclass
class GradSync:
    """Per-rank gradients of one step, before and after synchronisation.

    Attributes:
        samples: one per parameter and rank.
        comm: the step's collectives per op and rank (count, bytes, time, GB/s and
            the ratio to the backend's probe), timed as ``%%mlxdist --profile`` times
            a cell's; ``None`` when the ranks sent no record.
    """

    samples: list[GradSample]
    comm: CommStats | None = None

    def desynced(self, tol: float = 1e-6) -> list[str]:
        from ..viz import desynced

        return desynced(self.samples, tol)

    def figure(self) -> Any:
        from ..viz import gradsync_figure

        return gradsync_figure(self.samples, comm=self.comm)

    def __str__(self) -> str:
        from ..viz import format_gradsync

        return format_gradsync(self.samples, comm=self.comm)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


def gradsync(name: str, step: str, *, mode: str = "auto", session: Session | None = None
             ) -> GradSync:
    """Capture one step's gradients on every rank before and after synchronisation.

    Args:
        name: the model's name on the ranks.
        step: the loss expression, evaluated on each rank with ``name`` bound to the
            model, e.g. ``"loss_fn(model, x, y)"``.
        mode: ``auto``, ``dp`` (average_gradients), ``tp`` or ``fsdp``.

    The real step's collectives are timed on every rank as in a ``%%mlxdist
    --profile`` cell (each evaluated where it is issued) and summed up in
    :attr:`GradSync.comm`; the first call of a session also probes the backend's
    bandwidth (see :meth:`Session.run`'s ``profile``).
    """
    s = _session(session)
    got = _unwrap(s.apply, rpc.grad_samples, name, step, mode, own=True)
    samples = [GradSample(**{**d, "shape": tuple(d["shape"])})
               for _, out in sorted(got.items()) for d in out["samples"]]
    records = {r: out["profile"] for r, out in got.items() if out.get("profile")}
    comm = s.profiles.window(records, name=f"gradsync({name!r})").stats if records else None
    return GradSync(samples, comm)


@dataclass
class CheckReport:
    """Replicated parameters compared across ranks.

    Attributes:
        n_params: the replicated parameters every rank holds, which were compared.
        diverged: ``{path: {rank: |sum - sum on rank 0|}}`` of those that differ.
        only_on: ``{path: ranks}`` of the parameters only some ranks hold (a pipeline
            stage's layers): not compared, since no other rank has a copy.
    """

    n_params: int
    diverged: dict[str, dict[int, float]]
    only_on: dict[str, list[int]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.diverged

    def _not_compared(self) -> str:
        if not self.only_on:
            return ""
        by_ranks: dict[tuple[int, ...], set[str]] = {}
        for path, ranks in self.only_on.items():
            by_ranks.setdefault(tuple(ranks), set()).add(_layer_of(path))
        where = "; ".join(f"rank {', '.join(map(str, r))}: {', '.join(sorted(layers))}"
                          for r, layers in sorted(by_ranks.items()))
        return (f"\n{len(self.only_on)} parameters are held by one rank only (pipeline stages) "
                f"and were not compared: {where}")

    def __str__(self) -> str:
        if self.ok:
            held = " that every rank holds" if self.only_on else ""
            return (f"all {self.n_params} replicated parameters{held} are identical on every "
                    "rank" + self._not_compared())
        lines = [f"{len(self.diverged)} of {self.n_params} replicated parameters diverged:"]
        for path, ranks in self.diverged.items():
            detail = ", ".join(f"rank {r} (|Δsum| {d:.3g})" for r, d in sorted(ranks.items()))
            lines.append(f"  {path}: {detail} differ from rank 0")
        return "\n".join(lines) + self._not_compared()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


def check(name: str, *, rtol: float = 0.0, session: Session | None = None) -> CheckReport:
    """Checksum every replicated parameter on every rank; report ranks that diverged."""
    s = _session(session)
    sums = _unwrap(s.apply, rpc.checksums, name, own=True)
    holders: dict[str, list[int]] = {}
    for rank, table in sorted(sums.items()):
        for path in table:
            holders.setdefault(path, []).append(rank)
    everywhere = [p for p, ranks in holders.items() if len(ranks) == len(sums)]
    first = min(sums)
    diverged: dict[str, dict[int, float]] = {}
    for path in everywhere:
        r_total, r_sq, _ = sums[first][path]
        for rank, table in sorted(sums.items()):
            total, sq, _shape = table[path]
            scale = max(abs(r_sq), 1e-30) ** 0.5
            if abs(total - r_total) > rtol * scale or abs(sq - r_sq) > rtol * abs(r_sq):
                diverged.setdefault(path, {})[rank] = abs(total - r_total)
    only_on = {p: ranks for p, ranks in holders.items() if len(ranks) < len(sums)}
    return CheckReport(len(everywhere), diverged, only_on)


def _layer_of(path: str) -> str:
    """``model.layers.3`` for any parameter under it; else the path's owner."""
    parts = path.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        return ".".join(parts[: i + 2])
    return path.rsplit(".", 1)[0]


def _unwrap(apply: Any, *args: Any, own: bool = False, lookup: bool = False,
            **kwargs: Any) -> Any:
    """Re-raise a rank's error about the names it was given as the one-line error it is.

    By default a ShardingError, NameError or TypeError (plan, shard); with ``own``
    only the errors mlx_nbdist raised itself (the commands that run the user's code:
    a TypeError there keeps its traceback); with ``lookup`` also a KeyError (an unknown
    parameter path, with close matches).
    """
    try:
        return apply(*args, **kwargs)
    except CellError as e:
        first = e.failures[0] if e.failures else None
        if first is None:
            raise
        ours = first.ename in ("ShardingError", rpc.WrongObjectError.__name__) or (
            first.ename == "NameError" and "is not defined on this rank" in first.evalue)
        if own and not ours:
            raise
        if ours or first.ename in ("NameError", "TypeError") or (
                lookup and first.ename == "KeyError"):
            text = first.evalue
            if first.ename == "KeyError":
                text = _unrepr(text)  # str(KeyError(msg)) is repr(msg)
            where = f"rank {first.rank}" if len(e.groups[0].ranks) == 1 else e.groups[0].label()
            raise ShardingError(f"[{where}] {text}") from None
        raise


def _unrepr(text: str) -> str:
    """``repr(msg)`` back to ``msg`` (either quote); other text as it is."""
    import ast

    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    return value if isinstance(value, str) else text


def _group_size() -> int:
    import mlx.core as mx

    return mx.distributed.init().size()
