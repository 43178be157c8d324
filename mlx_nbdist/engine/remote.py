"""Functions the notebook applies on the ranks to plan, shard and look at a model.

Each takes names in the rank's namespace (``model``, ``model.layers.0.weight``),
works on the rank, and returns plain data. Arrays travel as separate items of a
tuple so ipyparallel sends them as zero-copy buffers instead of pickling them.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import numpy as np


class WrongObjectError(TypeError):
    """A model command was given the name of the wrong kind of object (an int where it
    needs a model, a model where it needs an array); the notebook shows it as one line."""


def _ns() -> dict[str, Any]:
    from IPython import get_ipython

    ip = get_ipython()
    return ip.user_ns if ip is not None else {}


def resolve(expr: str) -> tuple[Any, str]:
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


def model_of(name: str, command: str) -> Any:
    """The ``mlx.nn.Module`` that ``name`` (``model`` or ``model.layers.0``) names,
    or a :class:`WrongObjectError` saying what it is instead."""
    import mlx.nn as nn

    obj, rest = resolve(name)
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


def plan_rows(name: str, sharding: Any, group_size: int, segments: int,
              command: str = "plan") -> dict[str, Any]:
    from ..sharding import plan

    model = model_of(name, command)
    p = plan(model, sharding, group_size=group_size, segments=segments)
    return {
        "rows": [asdict(r) for r in p.rows],
        "problems": list(p.problems),
        "warnings": list(p.warnings),
        "text": str(p),
    }


def shard_model(name: str, sharding: Any, segments: int) -> str:
    """Shard ``name`` in the namespace and rebind it to the sharded model."""
    import warnings

    from ..sharding import shard
    from .bootstrap import current

    ns = _ns()
    _, rest = resolve(name)
    if rest:
        raise ValueError(f"shard takes a model name, not a path: {name!r}")
    model = model_of(name, "shard")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ns[name] = shard(model, sharding, group=current().world, segments=segments)
    return "\n".join(str(w.message) for w in caught)


def slice_of(
    expr: str,
    max_elements: int | None,
    shm_prefix: str | None = None,
    client_host: str = "",
    routes: tuple[str, ...] = (),
    held: dict[int, list[int]] | None = None,
) -> tuple[dict[str, Any], dict[str, Any] | None, np.ndarray | None]:
    """This rank's slice of a parameter: (metadata, transfer info, values or None).

    When the notebook runs on this host (``shm_prefix`` given) the values go by one
    of the local ``routes`` it offers (a shared-memory pool, or its reading this
    rank's memory); else they travel as an out-of-band ipyparallel buffer (a
    top-level item of the returned tuple). See :mod:`mlx_nbdist.engine.transfer`.
    ``held`` lists, per rank, the earlier transfers the notebook still uses; the
    rest are freed first.
    """
    from .bootstrap import current
    from .slices import local_slice
    from .transfer import pack, release, same_host

    if held is not None:
        release(held.get(current().rank, []))
    import mlx.core as mx
    import mlx.nn as nn

    obj, rest = resolve(expr)
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
    sl = local_slice(obj, rest or expr, max_elements=max_elements, group=current().world)
    prefix = shm_prefix if shm_prefix and same_host(client_host) else None
    info, values = (None, None) if sl.data is None else pack(sl.data, prefix, tuple(routes))
    return sl.metadata(), info, values


def quantized_parts(expr: str) -> list[str]:
    """The parameter paths of a quantized layer (weight, scales, biases)."""
    obj, rest = resolve(expr)
    mod = _child(obj, rest) if rest else obj
    names = [k for k in ("weight", "scales", "biases") if k in mod]
    return [f"{expr}.{k}" for k in names]


def is_quantized_layer(expr: str) -> bool:
    obj, rest = resolve(expr)
    try:
        mod = _child(obj, rest) if rest else obj
    except (AttributeError, LookupError, ValueError, TypeError):
        return False  # not a layer: slice_of says what it is (with close matches)
    return hasattr(mod, "scales") and hasattr(mod, "bits")


def grad_samples(name: str, step: str, mode: str) -> list[dict[str, Any]]:
    """GradSamples of one step whose loss is the expression ``step``."""
    from .bootstrap import current
    from .gradsync import grad_sync

    ns = _ns()
    _, rest = resolve(name)
    if rest:
        raise ValueError(f"gradsync takes a model name, not a path: {name!r}")
    model = model_of(name, "gradsync")
    loss_fn = eval(f"lambda {name}: ({step})", ns)  # noqa: S307 - the user's own expression
    return [asdict(s) for s in grad_sync(model, loss_fn, group=current().world, mode=mode)]


def checksums(name: str) -> dict[str, tuple[float, float, tuple[int, ...]]]:
    """Sum and sum of squares (float64) of every replicated parameter of a model."""
    import mlx.core as mx

    from ..sharding import param_specs
    from .bootstrap import current

    model = model_of(name, "check")
    st = current()
    specs = param_specs(model, group_size=st.size, rank=st.rank)
    out = {}
    from mlx.utils import tree_flatten

    for path, arr in tree_flatten(model.parameters()):
        spec = specs.get(path)
        if spec is not None and spec.axis is not None:
            continue
        a = np.asarray(arr.astype(mx.float32) if arr.dtype == mx.bfloat16 else arr, np.float64)
        out[path] = (float(a.sum()), float((a * a).sum()), tuple(a.shape))
    return out


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
