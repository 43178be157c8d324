"""Save and load a sharded model (and its optimizer state) on the ranks.

Runs inside a rank. The core functions take the model and optimizer *objects*:
:func:`layout`, :func:`write_shard`, :func:`load_into`. Two drivers use them:

* the notebook (:mod:`mlx_nbdist.client.checkpoint`) applies the name-taking
  wrappers with ``Session.apply`` (by reference: this module is importable on every
  rank) and owns the order: :func:`describe` on every rank, :func:`inspect` on rank 0,
  :func:`save_shard` on every rank into a staging folder, :func:`commit` on rank 0 (the
  atomic swap); or :func:`verify_files` spread over the ranks, then :func:`load_shard`.
  None of them issues a collective, so a rank that fails leaves the group usable.
* a script (:mod:`mlx_nbdist.script`) calls :func:`save_here` / :func:`load_here` on
  every rank: the same steps, with the ranks' layouts and outcomes exchanged by
  ``all_gather`` (every rank calls every collective, whatever failed, so a failure
  on one rank is raised on all of them instead of leaving peers blocked).

Tensors are named by their *canonical* path: the parameter path in the model, less the
``module.`` prefix of an FSDP wrapper, so a checkpoint saved under one layout loads
under any other. Layouts come from :func:`mlx_nbdist.engine.sharding.param_specs`.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers import distributed as mxd
from mlx.utils import tree_flatten

from ..checkpoint_index import (
    INDEX_NAME,
    OPTIMIZER_PREFIX,
    CheckpointError,
    Index,
    Layout,
    Piece,
    SafetensorsFile,
    TensorEntry,
    check_compatible,
    check_target,
    file_problems,
    new_index,
    pieces,
    plan_writes,
    sha256,
)
from ..results import ShardMode
from .dtypes import dtype_name
from .sharding import param_specs
from .state import current, own_collectives

__all__ = [
    "OPTIMIZER_PREFIX",
    "TOKENIZER_FILES",
    "commit",
    "describe",
    "discard",
    "file_name",
    "inspect",
    "layout",
    "load_here",
    "load_into",
    "load_shard",
    "save_here",
    "save_shard",
    "sha256",
    "verify_files",
    "write_shard",
    "write_tensors",
]

#: the files of an mlx-lm model folder that are not weights, copied along
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "generation_config.json", "chat_template.json", "chat_template.jinja")


def file_name(rank: int) -> str:
    """The file rank ``rank`` writes."""
    return f"rank-{rank:05d}.safetensors"


def write_tensors(path: str, arrays: dict[str, mx.array]) -> None:
    """Write ``arrays`` to ``path`` (``mx.save_safetensors``); a module attribute, so a
    test can make one rank's disk "fill" by replacing it on that rank."""
    mx.save_safetensors(path, arrays)


# ------------------------------------------------------------------- the rank's names


def _namespace() -> dict[str, Any]:
    from IPython import get_ipython

    ip = get_ipython()
    return ip.user_ns if ip is not None else {}


def _lookup(name: str, command: str) -> nn.Module:
    """The model ``name`` in this rank's namespace, or a CheckpointError saying why not."""
    ns = _namespace()
    if name not in ns:
        raise CheckpointError(f"{command}: {name!r} is not defined on this rank (define it "
                              "in a %%mlxdist cell)")
    return _model(ns[name], command, repr(name))


def _model(model: Any, command: str, what: str = "the model") -> nn.Module:
    if not isinstance(model, nn.Module):
        raise CheckpointError(f"{command}: {what} is a {type(model).__name__}, not a model "
                              "(an mlx.nn.Module)")
    return model


def _is_optimizer(opt: Any) -> bool:
    return opt is not None and hasattr(opt, "state") and hasattr(opt, "init")


def _optimizer(opt: Any, command: str) -> Any:
    if opt is not None and not _is_optimizer(opt):
        raise CheckpointError(f"{command}: optimizer= is a {type(opt).__name__}, not an "
                              "mlx.optimizers optimizer")
    return opt


def _prefix(model: nn.Module) -> str:
    """What an FSDP wrapper adds in front of every parameter path."""
    return "module." if isinstance(model, mxd.FullyShardedModule) else ""


def _canonical(path: str, prefix: str) -> str:
    return path[len(prefix):] if prefix and path.startswith(prefix) else path


# ----------------------------------------------------------------------- describing


def layout(model: nn.Module, optimizer: Any = None, sums: bool = False) -> dict[str, Any]:
    """This rank's layout of ``model`` (and of ``optimizer``'s state), as plain data:
    ``{"params": {canonical: spec}, "optimizer": {canonical: spec}, "optimizer_class",
    "model_class", "quantization", "lm"}``. A fresh optimizer gets its state entries.
    ``sums``: also ``"sums"``, each whole (replicated) tensor's sum and sum of squares
    (a save keeps one copy: the ranks' copies must agree, see ``plan_writes``)."""
    st = current()
    out: dict[str, Any] = {"model_class": type(model).__name__,
                           "params": _param_layout(model, st.rank, st.size),
                           "quantization": _quantization(model), "lm": _lm_config(model),
                           "optimizer": {}, "optimizer_class": ""}
    if optimizer is not None:
        _init_state(optimizer, model)
        out["optimizer_class"] = type(optimizer).__name__
        out["optimizer"] = _optimizer_layout(optimizer, model, out["params"])
    if sums:
        # trainable only: frozen state may differ by rank by design (BatchNorm's
        # running statistics follow each rank's own batches)
        out["sums"] = {"params": _sums(model.trainable_parameters(), out["params"]),
                       "optimizer": _sums(optimizer.state, out["optimizer"])
                       if optimizer is not None else {}}
    return out


def _sums(tree: Any, specs: dict[str, dict[str, Any]]) -> dict[str, list[float]]:
    """Each whole tensor of ``tree``'s sum, sum of squares and position-weighted sum
    (float32; the last tells a reordered copy), by canonical path. One tensor at a
    time: a float32 copy of each at once would need their size again in memory."""
    arrays = dict(tree_flatten(tree))
    out = {}
    for c, spec in specs.items():
        a = arrays.get(spec["raw"])
        if spec["axis"] is not None or not isinstance(a, mx.array):
            continue
        flat = a.astype(mx.float32).reshape(-1)
        weights = mx.arange(1, flat.size + 1, dtype=mx.float32) / max(flat.size, 1)
        out[c] = mx.stack([mx.sum(flat), mx.sum(flat * flat), mx.sum(flat * weights)]).tolist()
    return out


def describe(name: str, optimizer: str | None = None, sums: bool = False) -> dict[str, Any]:
    """:func:`layout` of model ``name`` (and optimizer ``optimizer``) on this rank.

    Returns ``{"defined": False, "what": ...}`` when ``name`` is not a model here (the
    notebook names the ranks), else the layout with ``"defined": True`` and
    ``"optimizer_defined"`` (false when ``optimizer`` is not an optimizer here).
    """
    ns = _namespace()
    model = ns.get(name)
    if not isinstance(model, nn.Module):
        return {"defined": False,
                "what": "not defined" if name not in ns else f"a {type(model).__name__}"}
    opt = ns.get(optimizer) if optimizer is not None else None
    if optimizer is not None and not _is_optimizer(opt):
        return {"defined": True, **layout(model), "optimizer_defined": False}
    return {"defined": True, **layout(model, opt, sums), "optimizer_defined": True}


def _param_layout(model: nn.Module, rank: int, size: int) -> dict[str, dict[str, Any]]:
    prefix = _prefix(model)
    out = {}
    for path, spec in param_specs(model, group_size=size, rank=rank).items():
        out[_canonical(path, prefix)] = {
            "raw": path, "shape": list(spec.full_shape), "local_shape": list(spec.local_shape),
            "dtype": spec.dtype, "mode": spec.mode.value, "axis": spec.axis,
            "segments": spec.segments, "group_size": spec.group_size if spec.axis is not None
            else 1, "kind": spec.kind, "layer": spec.layer,
            "index": spec.rank if spec.axis is not None else 0}
    return out


def _init_state(opt: Any, model: nn.Module) -> None:
    """Give a fresh optimizer its state entries (zeros) so they can be saved or filled;
    ``Optimizer.init`` keeps the entries that exist."""
    opt.init(model.trainable_parameters())


def _optimizer_layout(opt: Any, model: nn.Module, params: dict[str, dict[str, Any]]
                      ) -> dict[str, dict[str, Any]]:
    """Each optimizer state entry, split like the parameter it belongs to (same local
    shape), else whole (``step``, ``learning_rate``)."""
    prefix = _prefix(model)
    by_raw = {p["raw"]: (c, p) for c, p in params.items()}
    out = {}
    for key, arr in tree_flatten(opt.state):
        if not isinstance(arr, mx.array):
            continue
        owner = _owner(key, by_raw)
        local = list(arr.shape)
        canonical = _canonical(key, prefix)
        if owner is not None and by_raw[owner][1]["local_shape"] == local:
            c, p = by_raw[owner]
            out[canonical] = {**p, "raw": key, "dtype": dtype_name(arr.dtype), "of": c}
        else:
            out[canonical] = {"raw": key, "shape": local, "local_shape": local,
                              "dtype": dtype_name(arr.dtype), "mode": ShardMode.REPLICATED.value,
                              "axis": None, "segments": 1, "group_size": 1,
                              "kind": "replicated", "layer": type(opt).__name__, "index": 0,
                              "of": _canonical(owner, prefix) if owner else ""}
    return out


def _owner(key: str, by_raw: dict[str, Any]) -> str | None:
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        candidate = ".".join(parts[:i])
        if candidate in by_raw:
            return candidate
    return None


def _quantization(model: nn.Module) -> dict[str, dict[str, Any]]:
    prefix = _prefix(model)
    out = {}
    for path, module in model.named_modules():
        if hasattr(module, "scales") and hasattr(module, "bits"):
            out[_canonical(path, prefix)] = {"bits": int(module.bits),
                                             "group_size": int(module.group_size),
                                             "mode": str(getattr(module, "mode", "affine"))}
    return out


def _lm_config(model: nn.Module) -> dict[str, Any] | None:
    """The mlx-lm config of ``model``: mlx-lm's ``Model`` keeps its ``ModelArgs`` as
    ``args`` (``mlx_nbdist.load`` drops the config dict ``load_model`` returns); with
    ``nbdist_source`` (a model folder) its ``config.json`` is taken as it is."""
    inner = model.module if isinstance(model, mxd.FullyShardedModule) else model
    source = getattr(inner, "nbdist_source", None)
    if source and (Path(source) / "config.json").is_file():
        import json

        return {"config": json.loads((Path(source) / "config.json").read_text()),
                "source": str(source)}
    args = getattr(inner, "args", None)
    if args is None or not is_dataclass(args) or not getattr(args, "model_type", None):
        return None
    # unset fields (None) left out: transformers' config classes, which mlx_lm.load's
    # tokenizer reads config.json with, refuse a null where they expect a number
    config = {k: v for k, v in asdict(args).items() if v is not None and _jsonable(v)}
    return {"config": config, "source": ""}


def _jsonable(value: Any) -> bool:
    import json

    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


# --------------------------------------------------------------------------- saving


def inspect(directory: str) -> dict[str, Any]:
    """What ``directory`` holds now: its index text (or ``None``) and its other entries."""
    d = Path(directory)
    if not d.exists():
        return {"exists": False, "index": None, "others": []}
    if not d.is_dir():
        return {"exists": True, "index": None, "others": [], "not_dir": True}
    index = d / INDEX_NAME
    text = index.read_text() if index.is_file() else None
    ours = (INDEX_NAME,)
    others = sorted(p.name for p in d.iterdir() if p.name not in ours and not (
        p.name.startswith((".staging-", "shards-")) and p.is_dir()))
    return {"exists": True, "index": text, "others": others, "not_dir": False}


def save_shard(name: str, directory: str, staging: str, writes: dict[int, dict[str, list[str]]],
               optimizer: str | None = None, tokenizer_from: str | None = None
               ) -> dict[str, Any]:
    """:func:`write_shard` of model ``name`` (and optimizer ``optimizer``) on this rank."""
    model = _lookup(name, "save")
    opt = _namespace()[optimizer] if optimizer else None
    return write_shard(model, directory, staging, writes, opt, tokenizer_from)


def write_shard(model: nn.Module, directory: str, staging: str,
                writes: dict[int, dict[str, list[str]]], optimizer: Any = None,
                tokenizer_from: str | None = None) -> dict[str, Any]:
    """Write this rank's share of the checkpoint into ``directory/staging``.

    Args:
        model, optimizer: the model and its optimizer (``None``: none) on this rank.
        staging: the staging folder (inside ``directory``) every rank writes into.
        writes: per rank, ``{"params": [canonical paths], "optimizer": [canonical
            keys]}`` it writes (replicated tensors are written by one holder only).
        tokenizer_from: rank 0 copies the tokenizer files of this mlx-lm folder.

    Returns:
        ``{"file", "sha256", "bytes", "keys": {canonical: key in the file}}``, or
        ``{"file": None}`` when this rank writes nothing. The file is written under a
        temporary name and renamed when complete.
    """
    st = current()
    mine = writes.get(st.rank) or writes.get(str(st.rank)) or {}  # type: ignore[call-overload]
    folder = Path(directory) / staging
    folder.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"file": None, "keys": {}, "tokenizer_files": []}
    if st.rank == 0 and tokenizer_from:
        out["tokenizer_files"] = _copy_tokenizer(Path(tokenizer_from), folder)
    arrays: dict[str, mx.array] = {}
    prefix = _prefix(model)
    if mine.get("params"):
        params = dict(tree_flatten(model.parameters()))
        for c in mine["params"]:
            arrays[c] = params[prefix + c if prefix + c in params else c]
    if mine.get("optimizer"):
        state = dict(tree_flatten(optimizer.state)) if optimizer is not None else {}
        for c in mine["optimizer"]:
            arrays[OPTIMIZER_PREFIX + c] = state[prefix + c if prefix + c in state else c]
    if not arrays:
        return out
    mx.eval(list(arrays.values()))
    final = folder / file_name(st.rank)
    partial = folder / f"rank-{st.rank:05d}.partial.safetensors"
    try:
        write_tensors(str(partial), arrays)
        os.replace(partial, final)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    out.update(file=final.name, sha256=sha256(final), bytes=final.stat().st_size,
               keys={k: k for k in arrays})
    return out


def check_tokenizer(source: str) -> None:
    """Refuse a ``tokenizer_from`` that is no folder or holds no tokenizer file (the
    consolidated model would not load in mlx-lm)."""
    folder = Path(source)
    if not folder.is_dir():
        what = "a file, not a folder" if folder.exists() else "no such folder"
        raise CheckpointError(f"tokenizer_from (--tokenizer-from) {source}: {what}")
    if not any((folder / n).is_file() for n in TOKENIZER_FILES):
        raise CheckpointError(
            f"tokenizer_from (--tokenizer-from) {source} holds none of a tokenizer's files "
            f"({', '.join(TOKENIZER_FILES)}): give the mlx-lm model folder it came from")


def _copy_tokenizer(source: Path, folder: Path) -> list[str]:
    copied = []
    for n in TOKENIZER_FILES:
        if (source / n).is_file():
            shutil.copy2(source / n, folder / n)
            copied.append(n)
    return copied


def discard(directory: str, staging: str) -> bool:
    """Remove a staging folder left by a save that did not finish."""
    path = Path(directory) / staging
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
        return True
    return False


def commit(directory: str, staging: str, index_json: str) -> str:
    """Make the staged checkpoint the current one (rank 0, after every rank wrote).

    The staging folder becomes ``shards-<id>``; then ``index.json`` is replaced in one
    ``os.replace`` (a crash before it leaves the previous index, and its files, as
    they were); then the previous shards folder and stale staging folders go.
    """
    d = Path(directory)
    index = Index.from_json(index_json, "the new index")
    staged = d / staging
    final = d / index.shards_dir
    os.replace(staged, final)
    tmp = d / f".{INDEX_NAME}.partial"
    with open(tmp, "w") as f:
        f.write(index_json)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, d / INDEX_NAME)
    _fsync_dir(d)
    for p in d.iterdir():
        if p.is_dir() and p.name != index.shards_dir and p.name.startswith(
                ("shards-", ".staging-")):
            shutil.rmtree(p, ignore_errors=True)
    return str(final)


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# -------------------------------------------------------------------------- loading


def verify_files(directory: str, index_json: str, names: list[str]) -> list[str]:
    """Check the sha256 of the files ``names`` of the checkpoint; returns the problems."""
    return file_problems(directory, Index.from_json(index_json), names)


def load_shard(name: str, directory: str, index_json: str, optimizer: str | None = None
               ) -> dict[str, Any]:
    """:func:`load_into` model ``name`` (and optimizer ``optimizer``) on this rank."""
    model = _lookup(name, "load")
    opt = _namespace()[optimizer] if optimizer is not None else None
    return load_into(model, directory, Index.from_json(index_json), opt)


@dataclass(frozen=True)
class _Read:
    """One tensor this rank fills: its path in the model (or optimizer state), and the
    pieces of saved files it is made of."""

    raw: str
    canonical: str
    dtype: str
    local: tuple[int, ...]
    pieces: list[Piece]


def _plan_reads(model: nn.Module, index: Index, optimizer: Any = None
                ) -> tuple[list[_Read], list[_Read]]:
    """What this rank reads for its parameters, and for its optimizer's state."""
    st = current()
    params = _param_layout(model, st.rank, st.size)
    reads = [_read_of(c, index.params.get(c), spec, "parameter") for c, spec in params.items()]
    opt_reads = []
    if optimizer is not None:
        _init_state(optimizer, model)
        opt_reads = [_read_of(c, index.optimizer.get(c), spec, "optimizer entry")
                     for c, spec in _optimizer_layout(optimizer, model, params).items()]
    return reads, opt_reads


def load_into(model: nn.Module, directory: str, index: Index, optimizer: Any = None
              ) -> dict[str, Any]:
    """Fill this rank's parameters of ``model`` (and ``optimizer``'s state) from the
    checkpoint in ``directory`` (whose index is ``index``), reading only the slices
    this rank holds under its current layout.

    Returns ``{"bytes_read", "tensors", "files"}`` for this rank.
    """
    reads, opt_reads = _plan_reads(model, index, optimizer)
    folder = Path(directory) / index.shards_dir
    readers: dict[str, SafetensorsFile] = {}
    try:
        values = [(r.raw, _assemble(r, folder, index, readers)) for r in reads]
        opt_values = [(r.raw, _assemble(r, folder, index, readers)) for r in opt_reads]
        read = sum(r.bytes_read for r in readers.values())
        files = sorted(readers)
    finally:
        for r in readers.values():
            r.close()
    model.load_weights(values, strict=False)
    if optimizer is not None:
        for raw, value in opt_values:
            _set_path(optimizer.state, raw, value)
        mx.eval(optimizer.state)
    mx.eval(model.parameters())
    return {"bytes_read": read, "tensors": len(values) + len(opt_values), "files": files}


def _read_of(canonical: str, entry: TensorEntry | None, spec: dict[str, Any], what: str
             ) -> _Read:
    if entry is None:
        raise CheckpointError(f"{what} {canonical} of this rank is not in the checkpoint")
    if entry.dtype != spec["dtype"]:
        raise CheckpointError(f"{what} {canonical}: the checkpoint holds {entry.dtype}, the "
                              f"model has {spec['dtype']}")
    target = Layout(tuple(spec["shape"]), spec["axis"], spec["segments"], spec["group_size"])
    local = tuple(spec["local_shape"])
    if target.local_shape() != local:
        raise CheckpointError(f"{what} {canonical}: this rank holds {local}, which is not a "
                              f"1/{target.n_ranks} split of {tuple(spec['shape'])}")
    return _Read(spec["raw"], canonical, entry.dtype, local,
                 pieces(canonical, entry, target, spec["index"]))


def _assemble(read: _Read, folder: Path, index: Index, readers: dict[str, SafetensorsFile]
              ) -> mx.array:
    import numpy as np

    out: Any = None
    for piece in read.pieces:
        reader = readers.get(piece.file)
        if reader is None:
            rank = index.files[piece.file].rank if piece.file in index.files else "?"
            path = folder / piece.file
            if not path.is_file():
                raise CheckpointError(f"{piece.file} (written by rank {rank}) is missing from "
                                      f"{folder}")
            reader = readers[piece.file] = SafetensorsFile(
                str(path), f"{piece.file} (written by rank {rank})")
        data = reader.read(piece.key, piece.src)
        if out is None:
            out = np.empty(read.local, dtype=data.dtype)
        out[tuple(slice(a, b) for a, b in piece.dst)] = data
    arr = mx.array(out)
    if read.dtype == "bfloat16":
        arr = arr.view(mx.bfloat16)
    return arr


def _set_path(tree: Any, path: str, value: mx.array) -> None:
    parts = path.split(".")
    node = tree
    for p in parts[:-1]:
        node = node[int(p)] if isinstance(node, list | tuple) else node[p]
    last = parts[-1]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value


# ------------------------------------------------- driven from every rank (scripts)


def save_here(model: nn.Module, directory: str | os.PathLike[str], optimizer: Any = None, *,
              name: str = "model", overwrite: bool = False,
              tokenizer_from: str | os.PathLike[str] | None = None) -> Index:
    """Save ``model`` (and ``optimizer``'s state) from every rank of this group: call it
    on every rank (it is collective). The same checkpoint as a notebook's save: each
    rank writes its slices into a staging folder, then rank 0, once every rank has
    written (an ``all_gather``), writes the index and swaps it in atomically.

    Args:
        name: the model's name in the index (the notebook's name for it).
        overwrite, tokenizer_from: as for :func:`mlx_nbdist.save`.

    Returns:
        The new index, on every rank.

    Raises:
        CheckpointError: on every rank, naming the ranks that failed (a full disk
            included) and saying that the previous checkpoint is intact.
    """
    st = current()
    command = f"save of {name!r}"
    model = _model(model, command)
    optimizer = _optimizer(optimizer, command)
    directory = str(Path(directory).expanduser().absolute())

    def first() -> dict[str, Any]:
        out = {"layout": layout(model, optimizer, sums=True), "there": None, "token": ""}
        if st.rank == 0:
            if tokenizer_from:
                check_tokenizer(str(Path(tokenizer_from).expanduser().absolute()))
            out.update(there=inspect(directory), token=uuid.uuid4().hex[:10])
        return out

    got = _agree(command, first)
    layouts = {r: g["layout"] for r, g in got.items()}
    token = got[0]["token"]
    previous = check_target(directory, got[0]["there"], name, layouts, overwrite)
    writes, params, opt_entries = plan_writes(layouts)
    staging = f".staging-{token}"
    intact = (f"the previous checkpoint in {directory} ({previous.describe()}) is intact"
              if previous is not None else f"nothing was saved in {directory}")
    source = (layouts[0].get("lm") or {}).get("source")
    tokens = str(tokenizer_from or source or "") or None
    try:
        written = _agree(command, lambda: write_shard(model, directory, staging, writes,
                                                      optimizer, tokens))
    except CheckpointError as e:
        if st.rank == 0:
            discard(directory, staging)
        raise CheckpointError(f"{e}; {intact} (the partial files were removed)") from None
    index = new_index(name, layouts, written, params, opt_entries, n_ranks=st.size,
                      backend=str(getattr(st.tracker, "backend", "") or ""),
                      shards_dir=f"shards-{token}")

    def swap() -> None:
        if st.rank == 0:
            commit(directory, staging, index.to_json())

    try:
        _agree(f"{command} (writing the index)", swap)
    except CheckpointError as e:
        if st.rank == 0:
            discard(directory, staging)
        raise CheckpointError(f"{e}; {intact}") from None
    return index


def load_here(model: nn.Module, directory: str | os.PathLike[str], optimizer: Any = None
              ) -> dict[str, Any]:
    """Load the checkpoint in ``directory`` into ``model`` (and ``optimizer``) on every
    rank of this group: call it on every rank (it is collective). The checks of a
    notebook's load (:func:`mlx_nbdist.checkpoint_index.check_compatible` on every
    rank's layout), then each rank verifies the sha256 of the files it reads and, when
    every rank's files are sound, reads its slices (resharding when N or the layout
    differs from the save's).

    Returns:
        This rank's ``{"bytes_read", "tensors", "files"}`` and the index (``"index"``).

    Raises:
        CheckpointError: on every rank, naming the problem (and the rank that found
            it); nothing is loaded on any rank.
    """
    st = current()
    directory = str(Path(directory).expanduser().absolute())
    command = f"load of {directory}"
    model = _model(model, command)
    optimizer = _optimizer(optimizer, command)
    where = str(Path(directory) / INDEX_NAME)

    def first() -> dict[str, Any]:
        text = None
        if st.rank == 0:
            if not Path(where).is_file():
                raise CheckpointError(f"{directory} has no {INDEX_NAME}: it is not a "
                                      "checkpoint folder (or no save into it finished)")
            text = Path(where).read_text()
            Index.from_json(text, where)  # a broken index is refused here, by rank 0
        return {"layout": layout(model, optimizer), "index": text}

    got = _agree(command, first)
    index = Index.from_json(got[0]["index"], where)
    check_compatible(index, {r: g["layout"] for r, g in got.items()},
                     None if optimizer is None else "optimizer")

    def verify() -> None:
        reads, opt_reads = _plan_reads(model, index, optimizer)
        names = sorted({p.file for r in (*reads, *opt_reads) for p in r.pieces})
        problems = file_problems(directory, index, names)
        if problems:
            raise CheckpointError(f"the checkpoint in {directory} is damaged: "
                                  + "; ".join(problems))

    try:
        _agree(command, verify)
    except CheckpointError as e:
        raise CheckpointError(f"{e}; nothing was loaded") from None
    return {**load_into(model, directory, index, optimizer), "index": index}


def _agree(what: str, step: Callable[[], Any]) -> dict[int, Any]:
    """Run ``step`` on this rank and gather every rank's value; when it raised on any
    rank, raise on every rank a CheckpointError naming the ranks and their errors."""
    try:
        mine = {"value": step(), "error": ""}
    except Exception as e:  # noqa: BLE001 - sent to the peers, raised below on every rank
        label = "" if isinstance(e, CheckpointError) else f"{type(e).__name__}: "
        mine = {"value": None, "error": f"{label}{e}"}
    got = _gather(mine)
    errors: dict[str, list[int]] = {}
    for rank, g in enumerate(got):
        if g["error"]:
            errors.setdefault(g["error"], []).append(rank)
    if errors:
        said = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {e}"
                         for e, r in errors.items())
        raise CheckpointError(f"{what} failed on {said}")
    return {rank: g["value"] for rank, g in enumerate(got)}


def _gather(value: Any) -> list[Any]:
    """Every rank's ``value`` (JSON data), in rank order: two ``all_gather`` s (the
    lengths, then the padded bytes). Collective: every rank must call it."""
    import numpy as np

    st = current()
    if st.size == 1:
        return [json.loads(json.dumps(value))]
    data = np.frombuffer(json.dumps(value).encode(), dtype=np.uint8)
    with own_collectives():  # mlx_nbdist's own exchange: not in the rank's totals
        lengths = np.array(mx.distributed.all_gather(mx.array([data.size], dtype=mx.int32),
                                                     group=st.world))
        longest = int(lengths.max())
        buf = np.zeros(longest, dtype=np.uint8)
        buf[:data.size] = data
        rows = np.array(mx.distributed.all_gather(mx.array(buf), group=st.world)).reshape(
            st.size, longest)
    return [json.loads(bytes(row[:n])) for row, n in zip(rows, lengths, strict=True)]
