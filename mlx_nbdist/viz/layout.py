"""Who holds which part of one tensor: the model that tensor figures and text draw.

Consumes :class:`~mlx_nbdist.results.TensorSlice` lists (one per rank); nothing here
draws or imports matplotlib. :func:`tensor_layout` checks that the slices describe
one tensor and places each rank's blocks; :func:`heat_of` reassembles the values;
:func:`title_lines` says what is notable (gaps, overlaps, replicas that differ).

Every tensor is seen in a 2-D *view*: a 0-D tensor as ``1 x 1``, a 1-D tensor as a
``1 x n`` strip and an n-D tensor with its leading dimensions flattened into rows,
``(d0, ..., dk, c)`` shown as ``(d0 * ... * dk, c)``. Rectangles are in view
coordinates: x is the column, y is the row, row 0 at the top.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mlx_nbdist.errors import rank_span
from mlx_nbdist.results import TensorSlice

#: Largest heatmap side in pixels; bigger tensors are block-averaged down to it.
MAX_PIXELS = 256

#: (row0, row1, col0, col1) in view coordinates, half-open.
Rect = tuple[int, int, int, int]


@dataclass(frozen=True)
class Block:
    """One contiguous range one rank holds, and where it falls in the 2-D view."""

    rank: int
    segment: int
    segments: int
    start: int
    stop: int
    rects: tuple[Rect, ...]


@dataclass
class TensorLayout:
    """Who holds what of one tensor, in view coordinates."""

    name: str
    full_shape: tuple[int, ...]
    dtype: str
    axis: int | None
    slices: list[TensorSlice]
    blocks: list[Block]

    @property
    def unit(self) -> tuple[int, str] | None:
        """``(size, name)`` of the whole units the sharded axis is made of (heads)."""
        return self.slices[0].unit if self.slices and self.axis is not None else None

    def unit_lines(self, most: int = 64) -> tuple[str, list[int]]:
        """Where units meet in the view: ``("rows" | "cols", positions)``; none for
        tensors of more than two dimensions, an axis the view flattens, or more than
        ``most`` units."""
        unit = self.unit
        if unit is None or self.axis is None or len(self.full_shape) > 2:
            return "", []
        size, n = unit[0], self.full_shape[self.axis] // unit[0]
        if n < 2 or n > most:
            return "", []
        along = "cols" if self.axis == len(self.full_shape) - 1 else "rows"
        return along, [k * size for k in range(1, n)]

    @property
    def view(self) -> tuple[int, int]:
        """(rows, cols) of the 2-D view (:func:`view_shape`)."""
        return view_shape(self.full_shape)

    @property
    def replicated(self) -> bool:
        """Every rank holds the whole tensor."""
        return self.axis is None

    @property
    def ranks(self) -> list[int]:
        """The ranks holding a slice, in order."""
        return [s.rank for s in self.slices]

    @property
    def segments(self) -> int:
        """The most blocks one rank holds (fused weights sharded with ``segments``)."""
        return max((len(s.ranges) for s in self.slices), default=1)

    def slice_of(self, rank: int) -> TensorSlice:
        """The slice ``rank`` holds."""
        return next(s for s in self.slices if s.rank == rank)


def view_shape(shape: Sequence[int]) -> tuple[int, int]:
    """(rows, cols) of the 2-D view; an empty dimension still gets one row/column."""
    if len(shape) == 0:
        return (1, 1)
    if len(shape) == 1:
        return (1, max(int(shape[0]), 1))
    return (max(int(np.prod(shape[:-1])), 1), max(int(shape[-1]), 1))


def _rects(shape: Sequence[int], axis: int, start: int, stop: int) -> tuple[Rect, ...]:
    """Rectangles in the view covered by ``full[..., start:stop, ...]`` along ``axis``."""
    rows, cols = view_shape(shape)
    if len(shape) == 1:
        return ((0, 1, start, stop),)
    if axis == len(shape) - 1:
        return ((0, rows, start, stop),)
    outer = int(np.prod(shape[:axis]))
    inner = int(np.prod(shape[axis + 1 : -1]))
    span = int(shape[axis]) * inner
    return tuple((o * span + start * inner, o * span + stop * inner, 0, cols) for o in range(outer))


def tensor_layout(slices: Sequence[TensorSlice]) -> TensorLayout:
    """Check that ``slices`` describe one tensor and work out its blocks.

    Raises:
        ValueError: the slices are empty, or disagree on the full shape or the axis.
    """
    if not slices:
        raise ValueError("no slices to show")
    ordered = sorted(slices, key=lambda s: s.rank)
    first = ordered[0]
    full = tuple(int(d) for d in first.full_shape)
    for s in ordered:
        if tuple(s.full_shape) != full:
            raise ValueError(
                f"{s.name or 'the tensor'}: full_shape {full} on rank {first.rank} but "
                f"{tuple(s.full_shape)} on rank {s.rank}: the slices do not describe one tensor"
            )
        if s.axis != first.axis:
            raise ValueError(
                f"{s.name or 'the tensor'} is sharded on axis {first.axis} on rank "
                f"{first.rank} but on axis {s.axis} on rank {s.rank} (None: replicated)"
            )
    if first.axis is not None and not 0 <= first.axis < len(full):
        raise ValueError(f"{first.name}: axis {first.axis} out of range for shape {full}")
    blocks = [] if first.axis is None else [b for s in ordered for b in _slice_blocks(s, full)]
    return TensorLayout(first.name, full, first.dtype, first.axis, ordered, blocks)


def _slice_blocks(s: TensorSlice, full: tuple[int, ...]) -> list[Block]:
    n = len(s.ranges)
    return [
        Block(s.rank, i, n, int(a), int(b), _rects(full, s.axis, int(a), int(b)))
        for i, (a, b) in enumerate(s.ranges)
        if b > a
    ]


def coverage(layout: TensorLayout) -> tuple[int, int]:
    """(indices held by no rank, indices held by several) along the sharded axis."""
    if layout.replicated:
        return (0, 0)
    count = np.zeros(layout.full_shape[layout.axis], dtype=np.int32)
    for block in layout.blocks:
        count[block.start : block.stop] += 1
    return int((count == 0).sum()), int((count > 1).sum())


def range_text(shape: Sequence[int], axis: int, start: int, stop: int) -> str:
    """``[a:b]``, ``rows a:b`` / ``cols a:b`` or ``[:, a:b, :]``: one block in words."""
    if len(shape) == 1:
        return f"[{start}:{stop}]"
    if len(shape) == 2:
        return f"{('rows', 'cols')[axis]} {start}:{stop}"
    return "[" + ", ".join(f"{start}:{stop}" if d == axis else ":" for d in range(len(shape))) + "]"


def ranges_text(layout: TensorLayout, s: TensorSlice) -> str:
    """Every block of a rank's slice in words (``rows 0:4, 8:12``); ``all`` if replicated."""
    if layout.replicated:
        return "all"
    parts = [range_text(layout.full_shape, layout.axis, a, b) for a, b in s.ranges]
    if len(layout.full_shape) == 2 and len(parts) > 1:
        word = parts[0].split(" ")[0]
        return word + " " + ", ".join(p.split(" ")[1] for p in parts)
    return ", ".join(parts)


# --------------------------------------------------------------------------- values


@dataclass
class Heat:
    """The reassembled tensor, as a (downsampled) 2-D image."""

    image: np.ndarray
    factor: tuple[int, int]
    sampled: bool


def is_sampled(s: TensorSlice) -> bool:
    """The slice's data is a strided sample, not every value."""
    return s.sampled or tuple(np.shape(s.data)) != tuple(s.shape)


def _reassemble(layout: TensorLayout) -> np.ndarray | None:
    """The full tensor from the ranks' data, ``None`` when some rank sent none.

    Sharded slices are put back in place (indices no rank holds are NaN). When a
    slice is a strided sample, the samples are concatenated along the sharded axis
    instead, giving a strided picture of the full tensor.
    """
    if any(s.data is None for s in layout.slices):
        return None
    if layout.replicated:
        return np.asarray(layout.slices[0].data)
    if any(is_sampled(s) for s in layout.slices):
        return _reassemble_sampled(layout)
    return _reassemble_exact(layout)


def _reassemble_exact(layout: TensorLayout) -> np.ndarray:
    datas = [np.asarray(s.data) for s in layout.slices]
    dtype = np.result_type(*(d.dtype for d in datas), np.float16)
    full = np.full(layout.full_shape, np.nan, dtype=dtype)
    axis = layout.axis
    for s, data in zip(layout.slices, datas, strict=True):
        cuts = np.cumsum([b - a for a, b in s.ranges])[:-1]
        for (a, b), chunk in zip(s.ranges, np.split(data, cuts, axis=axis), strict=True):
            index = [slice(None)] * full.ndim
            index[axis] = slice(a, b)
            full[tuple(index)] = chunk
    return full


def _reassemble_sampled(layout: TensorLayout) -> np.ndarray:
    axis = layout.axis
    pieces: list[tuple[int, np.ndarray]] = []
    for s in layout.slices:
        data = np.asarray(s.data)
        taken = max(data.shape[axis], 1)
        stride = max(1, math.ceil(s.shape[axis] / taken))
        bounds = np.cumsum([b - a for a, b in s.ranges])[:-1]
        cuts = [min(data.shape[axis], math.ceil(c / stride)) for c in bounds]
        pieces += [
            (a, chunk)
            for (a, _), chunk in zip(s.ranges, np.split(data, cuts, axis=axis), strict=True)
        ]
    pieces.sort(key=lambda p: p[0])
    ndim = pieces[0][1].ndim
    common = [min(p.shape[d] for _, p in pieces) for d in range(ndim)]
    crop = tuple(slice(None) if d == axis else slice(0, common[d]) for d in range(ndim))
    return np.concatenate([p[crop] for _, p in pieces], axis=axis)


def _sample_stride(layout: TensorLayout) -> int:
    """The largest stride of the sampled slices (along their first axis)."""
    strides = [
        math.ceil(s.shape[0] / max(np.shape(s.data)[0], 1))
        for s in layout.slices
        if s.data is not None and np.ndim(s.data) and len(s.shape)
    ]
    return max(strides, default=1)


def _replica_diff(layout: TensorLayout) -> float | None:
    """max |x_r - x_first| over the replicas, ``None`` when it cannot be told."""
    if not layout.replicated:
        return None
    datas = [np.asarray(s.data) for s in layout.slices if s.data is not None]
    if len(datas) < 2 or any(d.shape != datas[0].shape for d in datas):
        return None
    ref = datas[0]
    diff = 0.0
    for d in datas[1:]:
        if np.array_equal(d, ref, equal_nan=np.issubdtype(d.dtype, np.inexact)):
            continue
        delta = np.abs(d.astype(np.float64) - ref.astype(np.float64))
        diff = max(diff, float(np.nanmax(delta)) if delta.size else 0.0)
    return diff


def _as_view(array: np.ndarray) -> np.ndarray:
    a = np.asarray(array)
    if np.iscomplexobj(a):
        a = np.abs(a)
    if not np.issubdtype(a.dtype, np.floating):
        a = a.astype(np.float64)
    if a.ndim == 0:
        return a.reshape(1, 1)
    if a.ndim == 1:
        return a.reshape(1, -1)
    return a.reshape(-1, a.shape[-1])


def downsample(
    image: np.ndarray, max_pixels: int = MAX_PIXELS
) -> tuple[np.ndarray, tuple[int, int]]:
    """Block-average a 2-D array so that neither side exceeds ``max_pixels``.

    Args:
        image: a 2-D array.
        max_pixels: the largest side of the result.

    Returns:
        ``(means, (row_factor, col_factor))``: bin ``(i, j)`` is the mean of
        ``image[i*fr:(i+1)*fr, j*fc:(j+1)*fc]`` (the last bins may be smaller), as
        float64.
    """
    rows, cols = image.shape
    fr = max(1, math.ceil(rows / max_pixels))
    fc = max(1, math.ceil(cols / max_pixels))
    if fr == fc == 1:
        return np.asarray(image, dtype=np.float64), (1, 1)
    ri, ci = np.arange(0, rows, fr), np.arange(0, cols, fc)
    sums = np.add.reduceat(np.add.reduceat(image, ri, axis=0, dtype=np.float64), ci, axis=1)
    counts = np.outer(np.diff(np.append(ri, rows)), np.diff(np.append(ci, cols)))
    return sums / counts, (fr, fc)


def heat_of(layout: TensorLayout) -> Heat | None:
    """The reassembled values as a heatmap image; ``None`` without values to show."""
    full = _reassemble(layout)
    if full is None or full.size == 0:
        return None
    image, factor = downsample(_as_view(full))
    return Heat(image, factor, any(is_sampled(s) for s in layout.slices))


def slice_stats(s: TensorSlice) -> dict[str, float]:
    """min/max/norm of a slice: its summary (computed from complete data on first
    read), else, for a summary given without them, from complete data here."""
    out = {k: float(v) for k, v in s.summary.items() if k in ("min", "max", "norm")}
    if len(out) < 3 and s.data is not None and not is_sampled(s) and np.size(s.data):
        data = np.asarray(s.data)
        if np.iscomplexobj(data):
            data = np.abs(data)
        data = data.astype(np.float64)
        out.setdefault("min", float(np.min(data)))
        out.setdefault("max", float(np.max(data)))
        out.setdefault("norm", float(np.linalg.norm(data.ravel())))
    return out


def title_lines(
    layout: TensorLayout, heat: Heat | None, title: str | None, *, drawn: bool = True
) -> tuple[list[str], bool]:
    """Heading lines for a tensor figure (``drawn``) or its text, and whether
    something is wrong."""
    lines = [title or f"{layout.name}  {layout.full_shape} {layout.dtype}"]
    if layout.replicated:
        lines.append(f"whole on rank {layout.ranks[0]} only" if len(layout.ranks) == 1 else
                     f"replicated on ranks {rank_span(layout.ranks)} (each holds the whole tensor)")
    else:
        mode = f"sharded on axis {layout.axis} over {len(layout.ranks)} ranks"
        if layout.segments > 1:
            mode += f", {layout.segments} segments per rank"
        lines.append(mode)
    notes, warnings = _notes(layout, heat, drawn)
    if notes:
        lines.append("; ".join(notes))
    lines += warnings
    return lines, bool(warnings)


def _notes(layout: TensorLayout, heat: Heat | None, drawn: bool = True
           ) -> tuple[list[str], list[str]]:
    notes: list[str] = []
    warnings: list[str] = []
    if len(layout.full_shape) > 2:
        notes.append(f"{layout.full_shape} shown as {layout.view}")
    if any(s.data is None for s in layout.slices):
        notes.append("summary only (values not pulled)")
    elif heat is not None and any(is_sampled(s) for s in layout.slices):
        notes.append(f"values sampled (stride {_sample_stride(layout)} on every axis)")
    along, lines = layout.unit_lines()
    if lines and layout.unit is not None:
        size, name = layout.unit
        what = f"{name}s of {size} {'rows' if along == 'rows' else 'columns'}"
        notes.append(f"dashed lines: {what}" if drawn else f"{len(lines) + 1} {what}")
    if heat is not None and heat.factor != (1, 1):
        notes.append(f"each heatmap cell: the mean of {heat.factor[0]}x{heat.factor[1]} values")
    gaps, overlaps = coverage(layout)
    if gaps:
        warnings.append(f"{gaps} indices of axis {layout.axis} held by no rank")
    if overlaps:
        warnings.append(f"{overlaps} indices of axis {layout.axis} held by several ranks")
    diff = _replica_diff(layout)
    if diff:
        warnings.append(f"replicas DIFFER across ranks: max |diff| = {diff:.3g}")
    elif diff == 0.0:
        notes.append("replicas identical")
    return notes, warnings
