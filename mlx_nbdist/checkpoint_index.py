"""A sharded checkpoint's index, and the arithmetic that reshards it. Pure Python.

A checkpoint folder holds ``index.json`` (an :class:`Index`) and one folder of
safetensors files, one per rank that wrote something. The index records, per
tensor (a model parameter or an optimizer state entry), its full shape and dtype and
how it was split when saved (a :class:`Layout`: axis, fused segments, number of
ranks) and which file holds each rank's slice; per file, the rank that wrote it and
its sha256.

:func:`pieces` is the resharding arithmetic: given how a tensor was saved and how a
rank holds it now (any number of ranks, any axis, segments, or whole), which box of
which saved file lands where in that rank's local tensor. Every layout is a list of
:class:`Block` s, boxes of the full tensor with their place in the local one, so
axis splits, fused segments (qkv), FSDP's axis-0 split, replicated tensors and
pipeline stages (a tensor held whole by one rank) are the same computation.

The checks and plans both drivers of a save or load share (the notebook's
:mod:`mlx_nbdist.client.checkpoint` and a script's :mod:`mlx_nbdist.script`) live
here too, on plain data: every rank's layout as
:func:`mlx_nbdist.engine.checkpoint.layout` describes it. :func:`check_target`
refuses a folder a save must not write into, :func:`plan_writes` decides who writes
what, :func:`new_index` makes the index of the files written, and
:func:`check_compatible` refuses a model that is not the one saved.

No MLX is imported: the notebook reads and validates indexes without it.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import CheckpointError, ranks_named
from .results import ShardMode

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "INDEX_NAME",
    "OPTIMIZER_PREFIX",
    "Block",
    "CheckpointError",
    "FileEntry",
    "Index",
    "Layout",
    "Piece",
    "Shard",
    "TensorEntry",
    "SafetensorsFile",
    "check_compatible",
    "check_target",
    "covering_runs",
    "file_problems",
    "new_index",
    "pieces",
    "plan_writes",
    "sha256",
]

#: what ``index.json`` says it is
FORMAT = "mlx_nbdist.checkpoint"
#: the index layout this mlx_nbdist writes; a newer one is refused (never guessed at)
FORMAT_VERSION = 1
INDEX_NAME = "index.json"
#: optimizer state entries are stored under this prefix, next to the parameters
OPTIMIZER_PREFIX = "optimizer/"

#: a box of a tensor: ``(start, stop)`` per axis
Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Block:
    """A box of the full tensor that a rank holds, and where it starts locally."""

    full: Box
    local_start: tuple[int, ...]


@dataclass(frozen=True)
class Layout:
    """How one tensor is split over ranks.

    Attributes:
        full_shape: the unsharded shape.
        axis: the split axis, ``None`` when each holder has it whole.
        segments: fused segments the axis is made of (3 for a fused qkv weight): each
            segment is split over the ranks and a rank's pieces are concatenated.
        n_ranks: ranks the axis is split over.
    """

    full_shape: tuple[int, ...]
    axis: int | None = None
    segments: int = 1
    n_ranks: int = 1

    def problem(self, path: str) -> str:
        """Why the full shape cannot be split like this (``""`` when it can)."""
        if self.axis is None:
            return ""
        if not 0 <= self.axis < len(self.full_shape):
            return (f"{path}: axis {self.axis} is not an axis of its shape "
                    f"{self.full_shape}")
        size = self.full_shape[self.axis]
        parts = self.segments * self.n_ranks
        if size % parts:
            seg = f" x {self.segments} segments" if self.segments > 1 else ""
            return (f"{path}: dimension {self.axis} (size {size}) does not divide across "
                    f"{self.n_ranks} ranks{seg}")
        return ""

    def local_shape(self) -> tuple[int, ...]:
        """The shape each rank holds."""
        if self.axis is None:
            return self.full_shape
        return tuple(d // self.n_ranks if i == self.axis else d
                     for i, d in enumerate(self.full_shape))

    def blocks(self, index: int) -> list[Block]:
        """The boxes of the full tensor rank ``index`` (of ``n_ranks``) holds, in local order."""
        whole = tuple((0, d) for d in self.full_shape)
        if self.axis is None:
            return [Block(whole, (0,) * len(self.full_shape))]
        if not 0 <= index < self.n_ranks:
            raise ValueError(f"rank index {index} is not one of {self.n_ranks} ranks")
        seg = self.full_shape[self.axis] // self.segments
        block = seg // self.n_ranks
        out = []
        for s in range(self.segments):
            start = s * seg + index * block
            full = tuple((start, start + block) if i == self.axis else r
                         for i, r in enumerate(whole))
            local = tuple(s * block if i == self.axis else 0 for i in range(len(whole)))
            out.append(Block(full, local))
        return out


@dataclass(frozen=True)
class Shard:
    """One saved slice of a tensor: the rank that wrote it, its index in the split,
    the file and the key it is stored under, and its shape."""

    rank: int
    index: int
    file: str
    key: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Piece:
    """Copy ``src`` (a box of ``file[key]``, local coordinates) to ``dst`` (a box of the
    rank's local tensor)."""

    file: str
    key: str
    src: Box
    dst: Box

    @property
    def size(self) -> int:
        return math.prod(b - a for a, b in self.dst)


@dataclass
class TensorEntry:
    """One tensor of the checkpoint (a parameter or an optimizer state entry).

    Attributes:
        shape: full shape; ``dtype``: MLX dtype name.
        mode: the sharding mode of the layer that owned it when saved.
        axis, segments, group_size: how it was split (``axis`` ``None``: whole).
        kind: ``sharded``, ``replicated`` or ``quantized`` (weight, scales, biases).
        layer: class name of the owning layer.
        holders: the ranks that held it when saved (fewer than N: a pipeline stage).
        shards: where each saved slice is.
        of: for an optimizer entry, the parameter it belongs to (``""``: none).
    """

    shape: tuple[int, ...]
    dtype: str
    mode: ShardMode = ShardMode.REPLICATED
    axis: int | None = None
    segments: int = 1
    group_size: int = 1
    kind: str = "replicated"
    layer: str = ""
    holders: list[int] = field(default_factory=list)
    shards: list[Shard] = field(default_factory=list)
    of: str = ""

    def layout(self) -> Layout:
        """How it was split when saved."""
        return Layout(tuple(self.shape), self.axis, self.segments,
                      self.group_size if self.axis is not None else 1)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["mode"] = self.mode.value
        d["shape"] = list(self.shape)
        d["shards"] = [{**asdict(s), "shape": list(s.shape)} for s in self.shards]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TensorEntry:
        return cls(shape=tuple(d["shape"]), dtype=d["dtype"], mode=ShardMode(d["mode"]),
                   axis=d.get("axis"), segments=int(d.get("segments", 1)),
                   group_size=int(d.get("group_size", 1)), kind=d.get("kind", "replicated"),
                   layer=d.get("layer", ""), holders=list(d.get("holders", [])),
                   shards=[Shard(int(s["rank"]), int(s["index"]), s["file"], s["key"],
                                 tuple(s["shape"])) for s in d.get("shards", [])],
                   of=d.get("of", ""))


@dataclass(frozen=True)
class FileEntry:
    """One saved file: the rank that wrote it, its sha256 and size."""

    name: str
    rank: int
    sha256: str
    bytes: int


@dataclass
class Index:
    """A checkpoint's ``index.json``.

    Attributes:
        model: the model's name on the ranks when saved; ``model_class``: its class.
        n_ranks, backend: the session that saved it.
        shards_dir: the folder (inside the checkpoint folder) that holds the files.
        params, optimizer: the tensors, by canonical path (an FSDP wrapper's
            ``module.`` prefix left out, so any layout maps onto the same names).
        optimizer_class: the optimizer's class (``""``: no optimizer saved).
        quantization: per quantized layer, its ``bits`` and ``group_size``.
        lm: for an mlx-lm model, ``{"config": {...}, "tokenizer_files": [...]}``.
    """

    model: str
    model_class: str
    n_ranks: int
    backend: str
    shards_dir: str
    params: dict[str, TensorEntry]
    files: dict[str, FileEntry]
    optimizer: dict[str, TensorEntry] = field(default_factory=dict)
    optimizer_class: str = ""
    quantization: dict[str, dict[str, Any]] = field(default_factory=dict)
    lm: dict[str, Any] | None = None
    mlx_version: str = ""
    nbdist_version: str = ""
    created: str = ""
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps({
            "format": FORMAT, "format_version": self.format_version, "model": self.model,
            "model_class": self.model_class, "n_ranks": self.n_ranks,
            "backend": self.backend, "mlx_version": self.mlx_version,
            "mlx_nbdist_version": self.nbdist_version, "created": self.created,
            "shards_dir": self.shards_dir,
            "params": {p: e.to_json() for p, e in self.params.items()},
            "optimizer_class": self.optimizer_class,
            "optimizer": {p: e.to_json() for p, e in self.optimizer.items()},
            "files": {n: asdict(f) for n, f in self.files.items()},
            "quantization": self.quantization, "lm": self.lm,
        }, indent=1)

    @classmethod
    def from_json(cls, text: str, where: str = "index.json") -> Index:
        """Parse and check an index; a newer format version or a broken file is refused."""
        try:
            d = json.loads(text)
        except ValueError as e:
            raise CheckpointError(f"{where} is not valid JSON ({e}): the index is corrupt; "
                                  "nothing was loaded") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise CheckpointError(f"{where} is not an mlx_nbdist checkpoint index (no "
                                  f"'format': {FORMAT!r})")
        version = d.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise CheckpointError(
                f"{where} has checkpoint format version {version}, newer than this "
                f"mlx_nbdist understands ({FORMAT_VERSION}; it was written by mlx_nbdist "
                f"{d.get('mlx_nbdist_version', '?')}): upgrade mlx_nbdist to read it; "
                "nothing was read or changed")
        try:
            return cls(
                model=d["model"], model_class=d.get("model_class", ""),
                n_ranks=int(d["n_ranks"]), backend=d.get("backend", ""),
                shards_dir=d["shards_dir"],
                params={p: TensorEntry.from_json(e) for p, e in d["params"].items()},
                files={n: FileEntry(**f) for n, f in d["files"].items()},
                optimizer={p: TensorEntry.from_json(e)
                           for p, e in d.get("optimizer", {}).items()},
                optimizer_class=d.get("optimizer_class", ""),
                quantization=d.get("quantization", {}), lm=d.get("lm"),
                mlx_version=d.get("mlx_version", ""),
                nbdist_version=d.get("mlx_nbdist_version", ""),
                created=d.get("created", ""), format_version=version)
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{where} is incomplete or corrupt ({type(e).__name__}: "
                                  f"{e}); nothing was loaded") from None

    def describe(self) -> str:
        """One line: what model, how many parameters, saved how and when."""
        opt = f" with {self.optimizer_class} state" if self.optimizer_class else ""
        return (f"model {self.model!r} ({self.model_class}, {len(self.params)} parameters"
                f"{opt}) saved on {self.n_ranks} rank(s) at {self.created or '?'}")

    def signature(self) -> dict[str, tuple[int, ...]]:
        """Parameter paths and full shapes: what makes two checkpoints the same model."""
        return {p: tuple(e.shape) for p, e in self.params.items()}

    def files_of(self) -> list[FileEntry]:
        return sorted(self.files.values(), key=lambda f: f.name)


# ------------------------------------------------ checks and plans of a save or load

#: every rank's layout of the model (and optimizer), as ``layout`` describes it
Layouts = dict[int, dict[str, Any]]


def check_target(directory: str, there: dict[str, Any], model: str, layouts: Layouts,
                 overwrite: bool) -> Index | None:
    """The checkpoint a save into ``directory`` replaces (``None``: none), or a refusal.

    Args:
        there: what ``directory`` holds (``engine.checkpoint.inspect``).
        model: the model's name; ``layouts``: every rank's layout of it.
        overwrite: replace another model's checkpoint, or write beside other files.
    """
    if there.get("not_dir"):
        raise CheckpointError(f"save: {directory} exists and is not a folder")
    previous = None
    if there["index"] is not None:
        previous = Index.from_json(there["index"], str(Path(directory) / INDEX_NAME))
        shapes = {p: tuple(d["shape"]) for d in layouts.values() for p, d in d["params"].items()}
        if (previous.model != model or previous.signature() != shapes) and not overwrite:
            raise CheckpointError(
                f"save: {directory} holds a checkpoint of another model: "
                f"{previous.describe()}; pass overwrite=True (--overwrite) to replace it, or "
                "choose another folder; nothing was written")
    elif there["others"] and not overwrite:
        shown = ", ".join(there["others"][:5]) + (" ..." if len(there["others"]) > 5 else "")
        raise CheckpointError(
            f"save: {directory} is not empty and holds no checkpoint ({shown}); pass "
            "overwrite=True (--overwrite) to write the checkpoint beside those files, or "
            "choose another folder; nothing was written")
    return previous


def plan_writes(layouts: Layouts) -> tuple[dict[int, dict[str, list[str]]],
                                           dict[str, TensorEntry], dict[str, TensorEntry]]:
    """Who writes what: each slice of a split tensor by its rank, a whole tensor once
    (by the lowest rank that holds it).

    Returns:
        ``(writes, params, optimizer)``: per rank ``{"params": [...], "optimizer":
        [...]}`` (canonical paths), and the index entries, their shards' files not yet
        known (:func:`new_index` fills them in).
    """
    writes: dict[int, dict[str, list[str]]] = {r: {"params": [], "optimizer": []}
                                               for r in layouts}
    out = []
    for kind in ("params", "optimizer"):
        entries: dict[str, TensorEntry] = {}
        holders: dict[str, list[int]] = {}
        for rank in sorted(layouts):
            for path, spec in layouts[rank][kind].items():
                holders.setdefault(path, []).append(rank)
                if path not in entries:
                    entries[path] = TensorEntry(
                        shape=tuple(spec["shape"]), dtype=spec["dtype"],
                        mode=ShardMode(spec["mode"]), axis=spec["axis"],
                        segments=spec["segments"], group_size=spec["group_size"],
                        kind=spec["kind"], layer=spec["layer"], of=spec.get("of", ""))
                _same_layout(path, entries[path], spec, rank)
        _same_copies(kind, [p for p, e in entries.items() if e.axis is None], holders, layouts)
        for path, entry in entries.items():
            ranks = holders[path]
            entry.holders = ranks
            writers = ranks if entry.axis is not None else ranks[:1]
            for rank in writers:
                spec = layouts[rank][kind][path]
                key = path if kind == "params" else OPTIMIZER_PREFIX + path
                entry.shards.append(Shard(rank, spec["index"], "", key,
                                          tuple(spec["local_shape"])))
                writes[rank][kind].append(path)
        out.append(entries)
    return writes, out[0], out[1]


def _same_copies(kind: str, whole: list[str], holders: dict[str, list[int]],
                 layouts: Layouts) -> None:
    """A whole tensor is saved once (its lowest holder's copy): refuse to save when
    another holder's copy differs (its sums, where the layouts carry them), naming them."""
    bad = []
    for path in whole:
        ranks = holders[path]
        sums = {r: (layouts[r].get("sums") or {}).get(kind, {}).get(path) for r in ranks}
        ref = sums[ranks[0]]
        if ref is None:
            continue
        differ = [r for r in ranks[1:] if sums[r] is not None and not _same_sums(sums[r], ref)]
        if differ:
            bad.append(f"{path}: " + (f"ranks {', '.join(map(str, differ))} differ"
                                      if len(differ) > 1 else f"rank {differ[0]} differs")
                       + f" from rank {ranks[0]}")
    if bad:
        one = len(bad) == 1
        what = {"params": ("parameters", "parameter"),
                "optimizer": ("optimizer state entries", "optimizer state entry")}[kind][one]
        listed = "\n  - ".join(bad)
        raise CheckpointError(
            f"{len(bad)} replicated {what} {'differs' if one else 'differ'} across "
            "ranks, and a checkpoint keeps one copy of each (the lowest rank's): the others' "
            "would be lost. Make the copies equal first (average the gradients with "
            "nn.average_gradients, or load the same weights on every rank). A layer sliced "
            "in place with MLX's shard_inplace, or an optimizer entry kept per slice, looks "
            f"whole and differs too: a checkpoint cannot hold it yet.\n  - {listed}")


def _same_sums(got: list[float], ref: list[float]) -> bool:
    """Two copies' sums (see ``engine.checkpoint._sums``) agree: to 1e-5 of their size,
    and exactly where not finite (inf and NaN compare as themselves)."""
    for a, b in zip(got, ref, strict=True):
        if not (math.isfinite(a) and math.isfinite(b)):
            if not (a == b or (math.isnan(a) and math.isnan(b))):
                return False
        elif abs(a - b) > 1e-5 * max(abs(b), 1.0):
            return False
    return True


def _same_layout(path: str, entry: TensorEntry, spec: dict[str, Any], rank: int) -> None:
    if (tuple(spec["shape"]) != tuple(entry.shape) or spec["dtype"] != entry.dtype
            or spec["axis"] != entry.axis or spec["segments"] != entry.segments):
        raise CheckpointError(
            f"save: {path} is laid out differently on rank {rank} (shape "
            f"{tuple(spec['shape'])}, {spec['dtype']}, axis {spec['axis']}) than on the "
            f"first rank that holds it (shape {tuple(entry.shape)}, {entry.dtype}, axis "
            f"{entry.axis}): every rank must build and shard the model the same way")


def new_index(model: str, layouts: Layouts, written: dict[int, dict[str, Any]],
              params: dict[str, TensorEntry], optimizer: dict[str, TensorEntry], *,
              n_ranks: int, backend: str, shards_dir: str) -> Index:
    """The index of a save: the entries of :func:`plan_writes` with the files each rank
    wrote (``written``: per rank, what ``engine.checkpoint.write_shard`` returned)."""
    files: dict[str, FileEntry] = {}
    for rank, g in sorted(written.items()):
        if g["file"] is None:
            continue
        files[g["file"]] = FileEntry(g["file"], rank, g["sha256"], int(g["bytes"]))
        for entry in (*params.values(), *optimizer.values()):
            for i, sh in enumerate(entry.shards):
                if sh.rank == rank:
                    entry.shards[i] = Shard(sh.rank, sh.index, g["file"], sh.key, sh.shape)
    first = layouts[min(layouts)]
    lm = first.get("lm")
    if lm is not None:
        lm = {"config": lm["config"],
              "tokenizer_files": written.get(min(written), {}).get("tokenizer_files", [])}
    return Index(
        model=model, model_class=first["model_class"], n_ranks=n_ranks, backend=backend,
        shards_dir=shards_dir, params=params, files=files, optimizer=optimizer,
        optimizer_class=first.get("optimizer_class", ""),
        quantization=first.get("quantization", {}), lm=lm, mlx_version=_mlx_version(),
        nbdist_version=_nbdist_version(),
        created=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"))


def _mlx_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mlx")
    except PackageNotFoundError:
        return ""


def _nbdist_version() -> str:
    from . import __version__

    return __version__


def check_compatible(index: Index, layouts: Layouts, optimizer: str | None) -> None:
    """Refuse, naming every problem, a model that is not the one saved.

    Args:
        layouts: every rank's layout of the model being loaded (with its optimizer's).
        optimizer: the optimizer's name, for messages (``None``: none is loaded).
    """
    problems: list[str] = []
    #: a difference each rank may find: said once, with the ranks that found it
    by_rank: dict[str, list[int]] = {}
    for kind, saved, what in (("params", index.params, "parameter"),
                              ("optimizer", index.optimizer, "optimizer entry")):
        if kind == "optimizer" and optimizer is None:
            continue
        if kind == "optimizer" and not index.optimizer_class:
            problems.append(f"the checkpoint has no optimizer state (saved without "
                            f"optimizer=); load without optimizer={optimizer!r}")
            continue
        if kind == "optimizer":
            cls = layouts[min(layouts)]["optimizer_class"]
            if cls != index.optimizer_class:
                problems.append(f"the checkpoint holds {index.optimizer_class} state, "
                                f"{optimizer!r} is a {cls}")
                continue
        held: dict[str, list[int]] = {}
        for rank, d in sorted(layouts.items()):
            for path, spec in d[kind].items():
                held.setdefault(path, []).append(rank)
                entry = saved.get(path)
                if entry is None:
                    continue
                if tuple(spec["shape"]) != tuple(entry.shape):
                    by_rank.setdefault(f"{what} {path}: the checkpoint holds shape "
                                       f"{tuple(entry.shape)}, the model has "
                                       f"{tuple(spec['shape'])}", []).append(rank)
                elif spec["dtype"] != entry.dtype:
                    by_rank.setdefault(f"{what} {path}: the checkpoint holds {entry.dtype}, "
                                       f"the model has {spec['dtype']}", []).append(rank)
                else:
                    problem = Layout(tuple(spec["shape"]), spec["axis"], spec["segments"],
                                     spec["group_size"]).problem(path)
                    if problem:
                        problems.append(f"{what} {problem}")
        missing = sorted(set(saved) - set(held))
        extra = sorted(set(held) - set(saved))
        if missing:
            problems.append(f"the model has no {what} {', '.join(missing)} that the checkpoint "
                            "holds")
        if extra:
            problems.append(f"the checkpoint has no {what} {', '.join(extra)} of the model")
    for text, ranks in by_rank.items():
        who = "every rank" if len(ranks) == len(layouts) > 1 else ranks_named(ranks)
        problems.append(f"{text} ({who})")
    if problems:
        unique = list(dict.fromkeys(problems))
        raise CheckpointError(
            f"load: the checkpoint ({index.describe()}) does not fit this model; nothing was "
            "loaded:\n  - " + "\n  - ".join(unique))


def sha256(path: str | os.PathLike[str]) -> str:
    """The sha256 of a file, as the index records it."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_problems(directory: str | os.PathLike[str], index: Index,
                  names: list[str] | None = None) -> list[str]:
    """What is wrong with the files ``names`` (all when ``None``) of the checkpoint in
    ``directory``: missing, of another size, or another sha256 than the index says;
    each named with the rank that wrote it."""
    folder = Path(directory) / index.shards_dir
    problems = []
    for n in sorted(index.files) if names is None else names:
        entry = index.files[n]
        path = folder / n
        who = f"{n} (written by rank {entry.rank})"
        if not path.is_file():
            problems.append(f"{who} is missing from {folder}")
        elif path.stat().st_size != entry.bytes:
            problems.append(f"{who} has {path.stat().st_size} bytes, the index says "
                            f"{entry.bytes}: the file is truncated or was changed")
        elif sha256(path) != entry.sha256:
            problems.append(f"{who} is corrupt: its sha256 differs from the index's")
    return problems


def pieces(path: str, entry: TensorEntry, target: Layout, index: int) -> list[Piece]:
    """Which boxes of which saved files make rank ``index``'s slice under ``target``.

    Args:
        path: the tensor's name, for messages.
        entry: how it was saved.
        target: how it is held now (its full shape must be the saved one).
        index: the rank's index in ``target``'s split (ignored when whole).

    Raises:
        CheckpointError: the shapes differ, a dimension does not divide, or the saved
            slices do not cover what the rank needs (a shard missing from the index).
    """
    if tuple(target.full_shape) != tuple(entry.shape):
        raise CheckpointError(f"{path}: the checkpoint holds shape {tuple(entry.shape)}, the "
                              f"model has {tuple(target.full_shape)}")
    for layout in (target, entry.layout()):
        problem = layout.problem(path)
        if problem:
            raise CheckpointError(problem)
    saved = entry.layout()
    if saved.axis is None:
        shards = sorted(entry.shards, key=lambda s: s.rank)[:1]  # any copy is the tensor
    else:
        shards = entry.shards
        found = sorted(s.index for s in shards)
        if found != list(range(saved.n_ranks)):
            raise CheckpointError(f"{path}: the index lists slices {found} of "
                                  f"{saved.n_ranks}: the checkpoint is incomplete")
    out = []
    for tb in target.blocks(index):
        for shard in shards:
            for sb in saved.blocks(0 if saved.axis is None else shard.index):
                inter = _intersect(tb.full, sb.full)
                if inter is None:
                    continue
                out.append(Piece(shard.file, shard.key,
                                 _shift(inter, sb.full, sb.local_start),
                                 _shift(inter, tb.full, tb.local_start)))
    need = math.prod(target.local_shape())
    if sum(p.size for p in out) != need:
        raise CheckpointError(f"{path}: the saved slices cover {sum(p.size for p in out)} of "
                              f"the {need} values this rank needs: the checkpoint is "
                              "incomplete")
    return out


def _intersect(a: Box, b: Box) -> Box | None:
    box = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return None if any(lo >= hi for lo, hi in box) else box


def _shift(box: Box, frame: Box, local_start: tuple[int, ...]) -> Box:
    """``box`` (full coordinates) in the local coordinates of a block at ``frame``."""
    return tuple((lo - f0 + s, hi - f0 + s)
                 for (lo, hi), (f0, _), s in zip(box, frame, local_start, strict=True))


def covering_runs(shape: tuple[int, ...], box: Box) -> tuple[list[int], int]:
    """The contiguous element runs of ``box`` in a C-ordered tensor of ``shape``.

    Returns:
        ``(starts, length)``: the element offset of each run, in order, and the run
        length in elements. Reading them in order gives the box in C order.
    """
    nd = len(shape)
    if nd == 0:
        return [0], 1
    strides = [math.prod(shape[i + 1:]) for i in range(nd)]
    j = nd - 1
    while j > 0 and box[j] == (0, shape[j]):
        j -= 1
    length = (box[j][1] - box[j][0]) * strides[j]
    starts = [box[j][0] * strides[j]]
    for k in range(j - 1, -1, -1):
        lo, hi = box[k]
        starts = [i * strides[k] + s for i in range(lo, hi) for s in starts]
    return starts, length


#: safetensors dtype codes as numpy dtypes (bfloat16 travels as its 16-bit pattern)
_NUMPY_OF = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "I64": "<i8",
             "I32": "<i4", "I16": "<i2", "I8": "i1", "U64": "<u8", "U32": "<u4",
             "U16": "<u2", "U8": "u1", "BOOL": "?"}


class SafetensorsFile:
    """Read boxes of the tensors of one safetensors file, only their bytes.

    ``mx.load`` of a safetensors file is lazy per tensor but reads a whole tensor when
    any slice of it is evaluated (measured with MLX 0.32: slicing 16 rows of a 64 MiB
    tensor read 64 MiB). This reader parses the header (8-byte length, JSON) and
    ``pread`` s the contiguous runs of the box only; :attr:`bytes_read` counts them.
    """

    def __init__(self, path: str, label: str = "") -> None:
        import struct

        self.path = path
        self.label = label or path
        self.bytes_read = 0
        self._fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(self._fd).st_size
            head = os.pread(self._fd, 8, 0)
            if len(head) < 8:
                raise CheckpointError(f"{self.label} is truncated (no safetensors header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise CheckpointError(f"{self.label} is corrupt (header length {n} exceeds "
                                      f"the file's {size} bytes)")
            self.header: dict[str, Any] = json.loads(os.pread(self._fd, n, 8))
            self._base = 8 + n
        except (ValueError, UnicodeDecodeError) as e:
            self.close()
            raise CheckpointError(f"{self.label} is corrupt (unreadable header: {e})") from None
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._entry(key)["shape"])

    def _entry(self, key: str) -> dict[str, Any]:
        entry = self.header.get(key)
        if not isinstance(entry, dict):
            raise CheckpointError(f"{self.label} has no tensor {key!r}: the file does not "
                                  "match the index")
        if entry.get("dtype") not in _NUMPY_OF:
            raise CheckpointError(f"{self.label}: tensor {key!r} has dtype "
                                  f"{entry.get('dtype')!r}, which this reader does not know")
        return entry

    def read(self, key: str, box: Box | None = None) -> Any:
        """The values of ``key`` in ``box`` (all of it when ``None``), as numpy (bfloat16
        as uint16)."""
        import numpy as np

        entry = self._entry(key)
        shape = tuple(entry["shape"])
        box = tuple((0, d) for d in shape) if box is None else box
        dtype = np.dtype(_NUMPY_OF[entry["dtype"]])
        begin = self._base + int(entry["data_offsets"][0])
        starts, length = covering_runs(shape, box)
        nbytes = length * dtype.itemsize
        chunks = []
        for s in starts:
            chunk = os.pread(self._fd, nbytes, begin + s * dtype.itemsize)
            if len(chunk) != nbytes:
                raise CheckpointError(f"{self.label} is truncated (tensor {key!r})")
            chunks.append(chunk)
        self.bytes_read += nbytes * len(starts)
        return np.frombuffer(b"".join(chunks), dtype=dtype).reshape(
            tuple(hi - lo for lo, hi in box))
