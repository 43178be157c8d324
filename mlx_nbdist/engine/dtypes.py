"""MLX dtype names, as the records the ranks send carry them (``float32``, ``bfloat16``)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any


def dtype_name(dtype: Any) -> str:
    """The short name of an MLX dtype: ``float32`` for ``mlx.core.float32``."""
    return str(dtype).rsplit(".", 1)[-1]


def nbytes(shape: Iterable[int], dtype: Any) -> int:
    """Bytes of an array of ``shape`` and ``dtype`` (an ``mx.Dtype`` or its name; an
    unknown name counts 0)."""
    if isinstance(dtype, str):
        import mlx.core as mx

        dtype = getattr(mx, dtype, None)
        if not isinstance(dtype, mx.Dtype):
            return 0
    return math.prod(int(d) for d in shape) * dtype.size
