"""The notebook's side of the commands on models that live on the ranks.

:mod:`.models` (``mlx_nbdist.plan``, ``shard``, ``slices``, ``show``, ``gradsync``,
``check``) and :mod:`.transfer` (how slices arrive); the ranks' side is
:mod:`mlx_nbdist.engine.rpc`.
"""
