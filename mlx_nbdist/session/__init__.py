"""A session: one ipyparallel cluster whose engines form one MLX group.

``core`` is the facade (:class:`Session`); ``cluster`` owns the controller and
engines and every process they made; ``formation`` forms the group; ``ranks``
tells the supervisor about the ranks (alive, paused, records, signals, drain,
alignment); ``diagnostics`` explains failures across hosts.
"""

from .core import (
    DEFAULT,
    DisplayWarning,
    OversubscribedWarning,
    Session,
    SessionState,
    SessionStatus,
    others_pids,
)
from .formation import RankPlace

__all__ = [
    "DEFAULT",
    "DisplayWarning",
    "OversubscribedWarning",
    "RankPlace",
    "Session",
    "SessionState",
    "SessionStatus",
    "others_pids",
]
