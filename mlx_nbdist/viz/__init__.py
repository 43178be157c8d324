"""Figures and text showing how tensors, gradients and plans are spread over ranks.

Only numpy, matplotlib and :mod:`mlx_nbdist.results` are used here: no MLX and no
session, so these functions work on values pulled back to the notebook.

One module per job: :mod:`~mlx_nbdist.viz.common` (rank colours, byte counts, text
tables, the notebook figure), :mod:`~mlx_nbdist.viz.layout` and
:mod:`~mlx_nbdist.viz.tensor` (one tensor across ranks), :mod:`~mlx_nbdist.viz.plan`
(sharding plans), :mod:`~mlx_nbdist.viz.gradsync` (gradient synchronisation),
:mod:`~mlx_nbdist.viz.timeline` (per-rank timelines of profiled cells),
:mod:`~mlx_nbdist.viz.status` (a session's status), and the live displays
:mod:`~mlx_nbdist.viz.cells`, :mod:`~mlx_nbdist.viz.live`,
:mod:`~mlx_nbdist.viz.progress` and :mod:`~mlx_nbdist.viz.dashboard` (whose buttons
reach a kernel subshell through the adapter :mod:`~mlx_nbdist.viz.subshell`).
"""

from mlx_nbdist.viz.common import NotebookFigure, human_bytes, rank_color
from mlx_nbdist.viz.gradsync import desynced, format_gradsync, gradsync_figure
from mlx_nbdist.viz.layout import MAX_PIXELS, downsample
from mlx_nbdist.viz.plan import format_plan, plan_table_html
from mlx_nbdist.viz.tensor import format_tensor, show_quantized, show_tensor
from mlx_nbdist.viz.timeline import format_timeline, timeline_figure

__all__ = [
    "MAX_PIXELS",
    "NotebookFigure",
    "desynced",
    "downsample",
    "format_gradsync",
    "format_plan",
    "format_tensor",
    "format_timeline",
    "gradsync_figure",
    "human_bytes",
    "plan_table_html",
    "rank_color",
    "show_quantized",
    "show_tensor",
    "timeline_figure",
]
