"""MLX dtype names, as the records the ranks send carry them (``float32``, ``bfloat16``)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

_NAMES: dict[Any, str] = {}  # dtype -> name: the collective tracker asks on every call


def dtype_name(dtype: Any) -> str:
    """The short name of an MLX dtype: ``float32`` for ``mlx.core.float32``."""
    try:
        return _NAMES[dtype]
    except (KeyError, TypeError):  # TypeError: unhashable, not an MLX dtype
        name = str(dtype).rsplit(".", 1)[-1]
    try:
        _NAMES[dtype] = name
    except TypeError:
        pass
    return name


def nbytes(shape: Iterable[int], dtype: Any) -> int:
    """Bytes of an array of ``shape`` and ``dtype`` (an ``mx.Dtype`` or its name; an
    unknown name counts 0)."""
    if isinstance(dtype, str):
        dtype = mx_dtype(dtype)
        if dtype is None:
            return 0
    return math.prod(int(d) for d in shape) * dtype.size


def mx_dtype(name: str) -> Any:
    """The MLX dtype of :func:`dtype_name`'s ``name`` (``bool`` is ``mx.bool_``);
    ``None`` if MLX has none of that name."""
    import mlx.core as mx

    for attr in (name, f"{name}_"):
        dtype = getattr(mx, attr, None)
        if isinstance(dtype, mx.Dtype):
            return dtype
    return None
