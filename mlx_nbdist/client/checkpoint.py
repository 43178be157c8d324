"""Save, load and consolidate sharded checkpoints from the notebook.

:func:`save` and :func:`load` take the *name* of a model (and of an optimizer) on the
ranks and a session (default: the current one); what runs on the ranks is in
:mod:`mlx_nbdist.engine.checkpoint`. :func:`consolidate` needs no ranks at all.

A checkpoint folder::

    DIR/index.json            what is saved, how it was split, each file's sha256
    DIR/shards-<id>/rank-00000.safetensors ...   one file per rank that wrote something

A save writes into ``DIR/.staging-<id>/``; only when every rank has written its file
does rank 0 rename it to ``shards-<id>`` and replace ``index.json`` (one
``os.replace``), then remove the previous shards. Until that moment the previous
checkpoint is untouched, whatever fails.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from ..checkpoint_index import (
    INDEX_NAME,
    CheckpointError,
    Index,
    Layout,
    SafetensorsFile,
    TensorEntry,
    check_compatible,
    check_target,
    file_problems,
    new_index,
    pieces,
    plan_writes,
)
from ..engine import rpc
from ..errors import CellError
from ..history import load_entry, save_entry

if TYPE_CHECKING:
    from ..session import Session

__all__ = ["CheckpointError", "Loaded", "Saved", "consolidate", "load", "read_index", "save"]


@dataclass
class Saved:
    """What :func:`save` wrote."""

    directory: str
    index: Index
    replaced: str = ""

    def __str__(self) -> str:
        total = sum(f.bytes for f in self.index.files.values())
        opt = f" and {self.index.optimizer_class} state" if self.index.optimizer_class else ""
        text = (f"saved {self.index.model!r} ({len(self.index.params)} parameters{opt}) from "
                f"{self.index.n_ranks} ranks to {self.directory}: {len(self.index.files)} "
                f"file(s), {total:,} bytes")
        return text + (f"; replaced {self.replaced}" if self.replaced else "")

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


@dataclass
class Loaded:
    """What :func:`load` did: per rank, the bytes it read."""

    directory: str
    index: Index
    n_ranks: int
    bytes_read: dict[int, int] = field(default_factory=dict)

    @property
    def resharded(self) -> bool:
        return self.n_ranks != self.index.n_ranks

    def __str__(self) -> str:
        how = (f"resharded from {self.index.n_ranks} to {self.n_ranks} ranks"
               if self.resharded else f"on {self.n_ranks} ranks")
        read = ", ".join(f"rank {r} {b:,}" for r, b in sorted(self.bytes_read.items()))
        return f"loaded {self.index.model!r} from {self.directory} ({how}); bytes read: {read}"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


def _session(session: Session | None) -> Session:
    from ..api import current_session

    return session or current_session()  # type: ignore[return-value]


def _engine() -> Any:
    """The rank-side steps (:mod:`mlx_nbdist.engine.checkpoint`), each sent as
    ``rpc.checkpoint(step, ...)``: the notebook applies only what ``rpc`` offers."""
    return SimpleNamespace(**{step: partial(rpc.checkpoint, step) for step in rpc.CHECKPOINT_STEPS})


def _apply(s: Session, what: str, fn: Any, *args: Any, **kwargs: Any) -> dict[int, Any]:
    """``s.apply`` with the ranks' errors re-raised as one CheckpointError naming them."""
    try:
        return s.apply(fn, *args, **kwargs)
    except CellError as e:
        raise CheckpointError(f"{what} failed on " + _failures(e)) from None


def _failures(e: CellError) -> str:
    """Each group of ranks' error, one clause each (a CheckpointError's says it all)."""
    return "; ".join(
        f"{g.label()}: {'' if g.first.ename == 'CheckpointError' else g.first.ename + ': '}"
        f"{g.first.evalue}" if g.first.ename else g.headline() for g in e.groups)


# --------------------------------------------------------------------------- saving


def save(model: str, directory: str | Path, optimizer: str | None = None, *,
         overwrite: bool = False, tokenizer_from: str | Path | None = None,
         session: Session | None = None) -> Saved:
    """Save the sharded model ``model`` (a name on the ranks) and optionally its optimizer.

    Each rank writes its own slices (a replicated tensor once, by the lowest rank that
    holds it) with ``mx.save_safetensors``; rank 0 writes the index and swaps the new
    checkpoint in atomically. A failing rank (a full disk included) leaves the previous
    checkpoint intact, and the error says so.

    Args:
        model: the model's name on the ranks; ``optimizer``: an ``mlx.optimizers``
            optimizer's name (its state is sharded like the parameters).
        directory: the checkpoint folder (on a filesystem every rank sees).
        overwrite: replace a checkpoint of another model in ``directory``, or write
            into a folder that holds other files.
        tokenizer_from: an mlx-lm model folder whose tokenizer files are kept with the
            checkpoint (for :func:`consolidate`).

    Raises:
        CheckpointError: the model (or optimizer) is missing on some ranks (named), the
            folder holds another model's checkpoint or a newer format, or a rank failed.
    """
    s = _session(session)
    engine = _engine()
    directory = str(Path(directory).expanduser().absolute())
    layouts = _describe(s, model, optimizer, "save", sums=True)
    there = _apply(s, "save", engine.inspect, directory, ranks=[0])[0]
    previous = check_target(directory, there, model, layouts, overwrite)
    writes, params, opt_entries = plan_writes(layouts)
    given = str(Path(tokenizer_from).expanduser().absolute()) if tokenizer_from else None
    if given:  # on rank 0, which copies it (its host's files)
        _apply(s, "save", engine.check_tokenizer, given, ranks=[0])
    source = (layouts[min(layouts)].get("lm") or {}).get("source")
    tokenizer_from = tokenizer_from or source or None
    token = uuid.uuid4().hex[:10]
    staging = f".staging-{token}"
    intact = (f"the previous checkpoint in {directory} ({previous.describe()}) is intact"
              if previous is not None else f"nothing was saved in {directory}")
    try:
        got = s.apply(engine.save_shard, model, directory, staging, writes, optimizer,
                      str(tokenizer_from) if tokenizer_from else None)
    except CellError as e:
        _discard(s, directory, staging)
        raise CheckpointError(f"save of {model!r} failed on {_failures(e)}; {intact} "
                              "(the partial files were removed)") from None
    except BaseException:
        _discard(s, directory, staging)
        raise
    missing = [r for r in layouts if r not in got]
    if missing:
        _discard(s, directory, staging)
        raise CheckpointError(f"save of {model!r}: ranks {missing} did not answer; {intact}")
    index = new_index(model, layouts, got, params, opt_entries, n_ranks=s.n,
                      backend=str(getattr(s, "backend", "")), shards_dir=f"shards-{token}")
    try:
        _apply(s, "save (writing the index)", engine.commit, directory, staging,
               index.to_json(), ranks=[0])
    except CheckpointError as e:
        _discard(s, directory, staging)
        raise CheckpointError(f"{e}; {intact}") from None
    # an export replays it: each rank of the script saves its own slices
    s.record(save_entry(model, directory, optimizer, overwrite=overwrite,
                        tokenizer_from=given))
    return Saved(directory, index, previous.describe() if previous is not None else "")


def _discard(s: Session, directory: str, staging: str) -> None:
    try:
        s.apply(_engine().discard, directory, staging, ranks=[0])
    except Exception:  # noqa: BLE001 - the save's own error is the one to report
        pass


def _describe(s: Session, model: str, optimizer: str | None, command: str, sums: bool = False
              ) -> dict[int, dict[str, Any]]:
    """Every rank's layout (``sums``: with its whole tensors' sums); refuses a model or
    optimizer missing on some ranks."""
    layouts = _apply(s, command, _engine().describe, model, optimizer, sums)
    absent = {r: d["what"] for r, d in layouts.items() if not d["defined"]}
    if absent:
        where = "; ".join(f"rank {r}: {what}" for r, what in sorted(absent.items()))
        raise CheckpointError(
            f"{command}: {model!r} is not a model (an mlx.nn.Module) on every rank ({where}); "
            "define it on every rank (a %%mlxdist cell) first")
    if optimizer is not None:
        no_opt = sorted(r for r, d in layouts.items() if not d["optimizer_defined"])
        if no_opt:
            raise CheckpointError(
                f"{command}: {optimizer!r} is not an mlx.optimizers optimizer on ranks "
                f"{no_opt}; define it on every rank first")
    return layouts


# -------------------------------------------------------------------------- loading


def read_index(directory: str | Path) -> Index:
    """The index of the checkpoint in ``directory`` (read here, in the notebook)."""
    path = Path(directory).expanduser() / INDEX_NAME
    if not path.is_file():
        raise CheckpointError(f"{Path(directory)} has no {INDEX_NAME}: it is not a checkpoint "
                              "folder (or no save into it finished)")
    return Index.from_json(path.read_text(), str(path))


def load(model: str, directory: str | Path, optimizer: str | None = None, *,
         session: Session | None = None) -> Loaded:
    """Load a checkpoint into ``model`` (a name on the ranks), on any number of ranks.

    The model must be built (and sharded) on the ranks as the one saved, on any N
    and layout: each rank reads only the slices of the saved files its current layout
    needs. Every file's sha256 is verified first (each file by one rank).

    Raises:
        CheckpointError: parameters missing or extra (named), a shape or dtype that
            differs, a dimension that does not divide across the ranks, a missing or
            corrupt file (named, with the rank that wrote it), a newer format version.
    """
    s = _session(session)
    engine = _engine()
    directory = str(Path(directory).expanduser().absolute())
    layouts = _describe(s, model, optimizer, "load")
    there = _apply(s, "load", engine.inspect, directory, ranks=[0])[0]
    if there["index"] is None:
        raise CheckpointError(f"load: {directory} has no {INDEX_NAME}: it is not a checkpoint "
                              "folder (or no save into it finished)")
    index = Index.from_json(there["index"], str(Path(directory) / INDEX_NAME))
    check_compatible(index, layouts, optimizer)
    text = index.to_json()
    names = [f.name for f in index.files_of()]
    ranks = sorted(layouts)
    share = {r: names[i::len(ranks)] for i, r in enumerate(ranks)}
    problems = []
    for r in ranks:
        if share[r]:
            problems += _apply(s, "load (verifying checksums)", engine.verify_files,
                               directory, text, share[r], ranks=[r])[r]
    if problems:
        raise CheckpointError(f"load: the checkpoint in {directory} is damaged; nothing was "
                              "loaded:\n  - " + "\n  - ".join(problems))
    got = _apply(s, "load", engine.load_shard, model, directory, text, optimizer)
    # an export replays it: each rank of the script loads its own slices
    s.record(load_entry(model, directory, optimizer))
    return Loaded(directory, index, s.n, {r: g["bytes_read"] for r, g in got.items()})


# --------------------------------------------------------------------- consolidating


def consolidate(directory: str | Path, out: str | Path, *, optimizer: bool = False) -> Path:
    """Write the checkpoint in ``directory`` unsharded to ``out``, without the ranks.

    ``out/model.safetensors`` holds every parameter whole, under its path in the model,
    so plain MLX loads it with ``model.load_weights``; a quantized model must be
    quantized the same way first (``nn.quantize``: the index records bits and group
    size). For an mlx-lm model ``out`` is also an mlx-lm model folder (``config.json``
    and the saved tokenizer files) that ``mlx_lm.load`` opens. With ``optimizer`` the
    optimizer state goes to ``out/optimizer.safetensors``.

    Returns:
        ``out``. Reads each file's bytes once (checksums verified first).
    """
    import json
    import shutil

    import mlx.core as mx

    index = read_index(directory)
    folder = Path(directory).expanduser() / index.shards_dir
    problems = file_problems(Path(directory).expanduser(), index)
    if problems:
        raise CheckpointError(f"consolidate: the checkpoint in {directory} is damaged; "
                              "nothing was written:\n  - " + "\n  - ".join(problems))
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    readers: dict[str, SafetensorsFile] = {}
    try:
        weights = _whole(index.params, folder, index, readers)
        opt = _whole(index.optimizer, folder, index, readers) if optimizer else {}
    finally:
        for r in readers.values():
            r.close()
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    if opt:
        mx.save_safetensors(str(out / "optimizer.safetensors"), opt)
    if index.lm is not None:
        config = dict(index.lm["config"])
        if index.quantization and "quantization" not in config:
            first = next(iter(index.quantization.values()))
            config["quantization"] = {"group_size": first["group_size"], "bits": first["bits"]}
        (out / "config.json").write_text(json.dumps(config, indent=2))
        for n in index.lm.get("tokenizer_files", []):
            shutil.copy2(folder / n, out / n)
    return out


def _whole(entries: dict[str, TensorEntry], folder: Path, index: Index,
           readers: dict[str, SafetensorsFile]) -> dict[str, Any]:
    import mlx.core as mx
    import numpy as np

    out = {}
    for path, entry in entries.items():
        arr = None
        for piece in pieces(path, entry, Layout(tuple(entry.shape)), 0):
            reader = readers.get(piece.file)
            if reader is None:
                reader = readers[piece.file] = SafetensorsFile(
                    str(folder / piece.file),
                    f"{piece.file} (written by rank {index.files[piece.file].rank})")
            data = reader.read(piece.key, piece.src)
            if arr is None:
                arr = np.empty(tuple(entry.shape), dtype=data.dtype)
            arr[tuple(slice(a, b) for a, b in piece.dst)] = data
        value = mx.array(arr)
        out[path] = value.view(mx.bfloat16) if entry.dtype == "bfloat16" else value
    return out
