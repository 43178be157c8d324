"""Every function the notebook applies on the ranks, and nothing else.

The notebook (the session, :mod:`mlx_nbdist.client.models`, the dashboard) sends these
with ipyparallel's ``apply`` and refers to them as ``rpc.<name>``; each runs on a rank
and returns plain data. Importing this module imports no MLX (the notebook imports
it): a function imports what it needs when it runs, on the rank.

* forming the group (:mod:`.bootstrap`): :func:`probe`, :func:`free_ports`,
  :func:`bootstrap` (:func:`warm`: its imports, ahead, on a spare cluster's engines);
  :func:`machine_id` is also what the notebook compares ``probe``'s
  answer with;
* running: :func:`call` (``Session.apply``), :func:`pull` (``Session.pull``);
* releasing a stuck group (:mod:`.tracker`): :func:`drain`, :func:`receive_unmatched`,
  :func:`align`;
* models (names in the rank's namespace): :func:`plan_rows`, :func:`shard_model`,
  :func:`slice_of`, :func:`quantized_parts`, :func:`is_quantized_layer`,
  :func:`grad_samples`, :func:`checksums`;
* slice transfers (:mod:`.transfer`): :func:`pool_state`, :func:`settle`;
* checkpoints (:mod:`.checkpoint`): :func:`checkpoint` (one step of a save or load);
* profiled cells (:mod:`.profile`): :func:`profile_clock`, :func:`probe_bandwidth`;
* the dashboard: :func:`watch_model`.

Arrays travel as separate items of a returned tuple, so ipyparallel sends them as
zero-copy buffers instead of pickling them.
"""

from __future__ import annotations

import linecache
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np

from . import cells, interrupts, state, transfer
from .bootstrap import bootstrap, free_ports, machine_id, probe, warm
from .transfer import pool_state, settle

__all__ = [
    "WrongObjectError",
    "align",
    "bootstrap",
    "call",
    "checkpoint",
    "checksums",
    "drain",
    "free_ports",
    "grad_samples",
    "is_quantized_layer",
    "machine_id",
    "plan_rows",
    "probe_bandwidth",
    "profile_clock",
    "pool_state",
    "probe",
    "pull",
    "quantized_parts",
    "receive_unmatched",
    "settle",
    "shard_model",
    "slice_of",
    "warm",
    "watch_model",
]


class WrongObjectError(TypeError):
    """A model command was given the name of the wrong kind of object (an int where it
    needs a model, a model where it needs an array); the notebook shows it as one line."""


# ---------------------------------------------------------------------- running


def call(meta: dict[str, Any], fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn`` for :meth:`Session.apply` with the cell's metadata in effect; a
    SIGINT is held until ``fn`` starts, and ``fn`` takes one (:mod:`.interrupts`)."""
    try:
        interrupts.hold()
        cells.begin(meta)
    except BaseException:
        interrupts.done()
        raise
    status, error = "ok", ""
    try:
        if interrupts.enter_body():
            raise KeyboardInterrupt
        return fn(*args, **kwargs)
    except BaseException as e:
        status, error = type(e).__name__, cells.error_line(e)
        raise
    finally:
        interrupts.done()
        cells.finish(status, error)


def pull(name: str) -> Any:
    """The value of ``name`` in this rank's namespace (``Session.pull``)."""
    ns = _ns()
    if name not in ns:
        raise NameError(f"name {name!r} is not defined on this rank")
    value = ns[name]
    cls = type(value)
    if cls.__module__ == "__main__":
        # pickled by reference to a class the notebook does not have: ipyparallel would
        # fail to rebuild it in the notebook and never complete the call
        raise TypeError(
            f"{name!r} is a {cls.__name__}, a class defined in a cell on the ranks, which "
            "the notebook cannot rebuild; pull plain data (arrays, numbers, dicts), or use "
            "mlx_nbdist.slices()/show() for a model's parameters"
        )
    return value


# ------------------------------------------------------- releasing a stuck group


def drain(records: list[dict[str, Any]]) -> list[str]:
    """Replay a stuck peer's collectives here (see :func:`.tracker.drain`)."""
    from . import tracker

    return tracker.drain(state.current().tracker, records)


def receive_unmatched(messages: list[dict[str, Any]]) -> int:
    """Drop messages sent to this rank that it never received (see
    :func:`.tracker.receive_unmatched`)."""
    from . import tracker

    return tracker.receive_unmatched(state.current().tracker, messages)


def align(nonce: int) -> dict[str, Any]:
    """Check that the group's streams are in step (see :func:`.tracker.align`)."""
    from . import tracker

    return tracker.align(state.current().tracker, nonce)


# ----------------------------------------------------------------------- models


def plan_rows(name: str, sharding: Any, group_size: int, segments: int,
              command: str = "plan") -> dict[str, Any]:
    """The sharding plan of the model ``name``: rows (as dicts), problems, warnings."""
    from .sharding import plan

    model = _model_of(name, command)
    p = plan(model, sharding, group_size=group_size, segments=segments)
    return {
        "rows": [asdict(r) for r in p.rows],
        "problems": list(p.problems),
        "warnings": list(p.warnings),
        "heads": [asdict(h) for h in p.heads],
        "stages": [asdict(st) for st in p.stages],
        "own": p.own,
    }


def shard_model(name: str, sharding: Any, segments: int) -> str:
    """Shard ``name`` in the namespace and rebind it to the sharded model; returns the
    warnings it gave, one a line."""
    import warnings

    from .sharding import shard

    ns = _ns()
    _, rest = _resolve(name)
    if rest:
        raise ValueError(f"shard takes a model name, not a path: {name!r}")
    model = _model_of(name, "shard")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ns[name] = shard(model, sharding, group=state.current().world, segments=segments)
    return "\n".join(str(w.message) for w in caught)


def slice_of(
    expr: str,
    max_elements: int | None,
    shm_prefix: str | None = None,
    client_host: str = "",
    routes: tuple[str, ...] = (),
    held: dict[int, list[int]] | None = None,
    absent_ok: bool = False,
) -> tuple[dict[str, Any], dict[str, Any] | None, np.ndarray | None] | None:
    """This rank's slice of a parameter: (metadata, transfer info, values or None).

    When the notebook runs on this host (``shm_prefix`` given) the values go by one
    of the local ``routes`` it offers (a shared-memory pool, or its reading this
    rank's memory); else they travel as an out-of-band ipyparallel buffer (a
    top-level item of the returned tuple). See :mod:`mlx_nbdist.engine.transfer`.
    ``held`` lists, per rank, the earlier transfers the notebook still uses; the
    rest are freed first. With ``absent_ok`` a rank that does not hold ``expr`` (a
    pipeline stage's layer, see :func:`holds`) answers ``None`` instead of raising,
    so one request serves any set of holders.
    """
    import mlx.core as mx
    import mlx.nn as nn

    from .slices import local_slice

    st = state.current()
    if held is not None:
        transfer.release(held.get(st.rank, []))
    if absent_ok and not holds(expr):
        return None
    obj, rest = _resolve(expr)
    if not rest and not isinstance(obj, mx.array):
        raise WrongObjectError(
            f"{expr!r} is {_a(obj)}; name a parameter (model.path.weight) or an mx.array"
        )
    if rest and not isinstance(obj, nn.Module):
        head = expr.partition(".")[0]
        raise WrongObjectError(
            f"{head!r} is {_a(obj)}, not a model (an mlx.nn.Module), so {expr!r} is not a "
            "parameter; name a parameter or an mx.array"
        )
    # an array is labelled with its own name (a parameter with its path in the model)
    sl = local_slice(obj, rest or expr, max_elements=max_elements, group=st.world)
    prefix = shm_prefix if shm_prefix and transfer.same_host(client_host) else None
    info, values = (None, None) if sl.data is None else transfer.pack(sl.data, prefix,
                                                                      tuple(routes))
    return sl.metadata(), info, values


def quantized_parts(expr: str) -> list[str]:
    """The parameter paths of a quantized layer (weight, scales, biases)."""
    obj, rest = _resolve(expr)
    mod = _child(obj, rest) if rest else obj
    names = [k for k in ("weight", "scales", "biases") if k in mod]
    return [f"{expr}.{k}" for k in names]


def holds(expr: str) -> bool:
    """Whether this rank holds ``expr`` (a pipeline stage holds only its own layers)."""
    try:
        obj, rest = _resolve(expr)
        return (_child(obj, rest) if rest else obj) is not None
    except (NameError, AttributeError, LookupError, ValueError, TypeError):
        return False


def is_quantized_layer(expr: str) -> bool:
    """Whether ``expr`` names a quantized layer (``model.layers.0``)."""
    obj, rest = _resolve(expr)
    try:
        mod = _child(obj, rest) if rest else obj
    except (AttributeError, LookupError, ValueError, TypeError):
        return False  # not a layer: slice_of says what it is (with close matches)
    return hasattr(mod, "scales") and hasattr(mod, "bits")


def grad_samples(name: str, step: str, mode: str) -> dict[str, Any]:
    """One step whose loss is the expression ``step``: ``samples``, the GradSamples as
    dicts, and ``profile``, the step's timed collectives (a
    :class:`~.profile.Recorder`'s record, as a profiled cell publishes it)."""
    import mlx.core as mx

    from .gradsync import grad_sync
    from .profile import Recorder, recording

    ns = _ns()
    _, rest = _resolve(name)
    if rest:
        raise ValueError(f"gradsync takes a model name, not a path: {name!r}")
    model = _model_of(name, "gradsync")
    # on its own line: a trailing "# comment" in the step must not swallow the ")"
    source = f"lambda {name}: (\n{step}\n)"
    where = "<gradsync --step>"  # a traceback through it shows the step's line
    linecache.cache[where] = (len(source), None, source.splitlines(True), where)
    step_fn = eval(compile(source, where, "eval"), ns)  # noqa: S307 - the user's own expression

    def loss_fn(m: Any) -> Any:
        loss = step_fn(m)
        first = loss[0] if isinstance(loss, tuple) and loss else loss
        if not (isinstance(first, mx.array) and first.size == 1):
            got = (f"an mx.array of shape {tuple(first.shape)}" if isinstance(first, mx.array)
                   else f"a {type(first).__name__}")
            raise TypeError(f"gradsync: --step {step!r} gave {got}, not the loss (a scalar "
                            "mx.array, or a tuple that starts with one)")
        return loss

    st = state.current()
    recorder = Recorder(st.rank, st.size, st.tracker.backend)
    recorder.cell = st.tracker.cell
    samples = grad_sync(model, loss_fn, group=st.world, mode=mode,
                        timing=lambda: recording(recorder, st.tracker))
    return {"samples": [asdict(s) for s in samples], "profile": recorder.finish("ok")}


def checksums(name: str) -> dict[str, tuple[float, float, tuple[int, ...]]]:
    """Sum and sum of squares (float64) of every replicated parameter of a model."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from .sharding import param_specs

    model = _model_of(name, "check")
    st = state.current()
    specs = param_specs(model, group_size=st.size, rank=st.rank)
    out = {}
    for path, arr in tree_flatten(model.parameters()):
        spec = specs.get(path)
        if spec is not None and spec.axis is not None:
            continue
        a = np.asarray(arr.astype(mx.float32) if arr.dtype == mx.bfloat16 else arr, np.float64)
        out[path] = (float(a.sum()), float((a * a).sum()), tuple(a.shape))
    return out


# -------------------------------------------------------------------- checkpoints

#: the steps of a save or load that run on a rank (functions of :mod:`.checkpoint`)
CHECKPOINT_STEPS = ("describe", "inspect", "check_tokenizer", "save_shard", "discard", "commit",
                    "verify_files", "load_shard")  # fmt: skip


def checkpoint(step: str, *args: Any, **kwargs: Any) -> Any:
    """One step of saving or loading a checkpoint on this rank (``step``: one of
    :data:`CHECKPOINT_STEPS`; see :mod:`mlx_nbdist.engine.checkpoint`)."""
    if step not in CHECKPOINT_STEPS:
        raise ValueError(f"{step!r} is not a checkpoint step; known: {', '.join(CHECKPOINT_STEPS)}")
    from . import checkpoint as ck

    return getattr(ck, step)(*args, **kwargs)


# ------------------------------------------------------------------ profiled cells


def profile_clock() -> int:
    """This rank's wall clock in ns, for the notebook's clock offsets (see
    :func:`.profile.clock_ns`)."""
    from .profile import clock_ns

    return clock_ns()


def probe_bandwidth(nbytes: int | None = None, repeats: int | None = None) -> dict[str, Any]:
    """Time a small all_sum on every rank at once (see :func:`.profile.probe_bandwidth`)."""
    from . import profile

    return profile.probe_bandwidth(
        profile.PROBE_BYTES if nbytes is None else nbytes,
        profile.PROBE_REPEATS if repeats is None else repeats,
    )


# -------------------------------------------------------------------- dashboard


def watch_model(name: str | None) -> str | None:
    """Publish the parameters of the model ``name`` in the rank's state (``None`` stops)."""
    state.current().monitor.watch_model(name)
    return name


# ---------------------------------------------------- names in the rank's namespace


def _ns() -> dict[str, Any]:
    from IPython import get_ipython

    ip = get_ipython()
    return ip.user_ns if ip is not None else {}


def _resolve(expr: str) -> tuple[Any, str]:
    """Split ``model.layers.0.weight`` into the object ``model`` and the rest."""
    ns = _ns()
    head, _, rest = expr.partition(".")
    if head not in ns:
        raise NameError(f"{head!r} is not defined on this rank (define it in a %%mlxdist cell)")
    return ns[head], rest


def _a(obj: Any) -> str:
    """``an int``, ``a Linear``: the object's type for a message."""
    t = type(obj).__name__
    return f"{'an' if t[:1].lower() in 'aeiou' else 'a'} {t}"


def _model_of(name: str, command: str) -> Any:
    """The ``mlx.nn.Module`` that ``name`` (``model`` or ``model.layers.0``) names,
    or a :class:`WrongObjectError` saying what it is instead."""
    import mlx.nn as nn

    obj, rest = _resolve(name)
    if rest and isinstance(obj, nn.Module | list | tuple | dict):
        obj = _child(obj, rest)
    if not isinstance(obj, nn.Module):
        if rest:
            name = name.partition(".")[0]
        raise WrongObjectError(
            f"{name!r} is {_a(obj)}, not a model (an mlx.nn.Module): "
            f"{command} needs the name of a model on the ranks"
        )
    return obj


def _child(model: Any, path: str) -> Any:
    obj = model
    for part in path.split("."):
        if isinstance(obj, list | tuple):
            obj = obj[int(part)]
        elif isinstance(obj, dict) and part in obj:
            obj = obj[part]
        else:
            obj = getattr(obj, part)
    return obj
