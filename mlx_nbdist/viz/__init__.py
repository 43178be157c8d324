"""Figures and text showing how tensors, gradients and plans are spread over ranks.

Only numpy, matplotlib and :mod:`mlx_nbdist.results` are used here: no MLX and no
session, so these functions work on values pulled back to the notebook.
"""

from mlx_nbdist.viz.gradsync import desynced, format_gradsync, gradsync_figure
from mlx_nbdist.viz.sharding import (
    MAX_PIXELS,
    NotebookFigure,
    downsample,
    format_plan,
    format_tensor,
    human_bytes,
    plan_table_html,
    rank_color,
    show_quantized,
    show_tensor,
)

__all__ = [
    "MAX_PIXELS",
    "NotebookFigure",
    "desynced",
    "downsample",
    "format_gradsync",
    "format_plan",
    "format_tensor",
    "gradsync_figure",
    "human_bytes",
    "plan_table_html",
    "rank_color",
    "show_quantized",
    "show_tensor",
]
