"""The base of the package's enums of names (states, modes, backends)."""

from __future__ import annotations

from enum import StrEnum


class TextEnum(StrEnum):
    """An enum whose members are their names as users type and read them: a member
    compares equal to its value (``SessionState.READY == "ready"``), prints as it
    (``str``, f-strings) and serialises to JSON as a plain string."""


class SessionState(TextEnum):
    """The one state of a session; compares equal to its value (``"ready"``)."""

    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    BROKEN = "broken"
