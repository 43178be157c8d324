"""One source of defaults and timings.

The notebook's ``%config MLXDist.*`` traits, the kernel's ``MLXDistKernel.*`` traits and
:class:`~mlx_nbdist.Session`'s keyword arguments all take their defaults from here, and
the timings that must agree (how often ranks publish their state, how often the
supervisor ticks, when the dashboard calls a silent rank hung) derive from one value.
Importing this module imports nothing but the standard library.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from .enums import TextEnum


class Backend(TextEnum):
    """MLX's distributed backends a session can form its group with."""

    RING = "ring"
    MPI = "mpi"
    #: NVIDIA GPUs (MLX's CUDA build), one GPU per rank
    NCCL = "nccl"
    #: RDMA over Thunderbolt 5 between Macs (MLX >= 0.30.1 on macOS)
    JACCL = "jaccl"

    def requirement(self) -> str:
        """What this backend needs, and the fix, for an MLX build that lacks it."""
        return _REQUIREMENTS[self]

    def unavailable(self, where: str, version: str) -> str:
        """The message for an MLX (``version``, on ``where``) that lacks this backend."""
        return (
            f"MLX's '{self.value}' distributed backend is not available {where} "
            f"(mlx {version}): {self.requirement()}"
        )


_REQUIREMENTS = {
    Backend.RING: "install mlx>=0.32.1 with distributed support "
    "(pip install 'mlx_nbdist[cpu]' on Linux; the mlx wheel on macOS)",
    Backend.MPI: "MLX loads Open MPI's libmpi at run time: pip install 'mlx_nbdist[mpi]' "
    "(or set MLX_MPI_LIBNAME to a system Open MPI's libmpi), or use --backend ring",
    Backend.NCCL: "nccl needs MLX's CUDA build on a Linux machine with NVIDIA GPUs: "
    "pip install 'mlx_nbdist[cuda]' (CUDA 12) or 'mlx_nbdist[cuda13]' (CUDA 13) "
    "there; use --backend ring meanwhile",
    Backend.JACCL: "jaccl needs Macs with Thunderbolt 5 and RDMA enabled (`rdma_ctl enable` "
    "in macOS Recovery), mlx>=0.32.1 on macOS and a hostfile whose hosts list their "
    '"rdma" devices (mlx.distributed_config --backend jaccl writes one); use '
    "--backend ring meanwhile",
}


#: ranks of a session when nobody says
N = 2
BACKEND = Backend.RING
#: default deadline of a cell, seconds (``None``: none)
CELL_TIMEOUT = 300.0
#: how long engines may take to register and join the group, seconds
START_TIMEOUT = 120.0
#: characters of a cell's output per rank that reach the notebook (0: all)
OUTPUT_LIMIT = 1 << 20
#: most ranks one session may ask for
MAX_RANKS = 64

#: the controller's heartbeat period, ms: a new engine counts as registered at the
#: second beat after it registered, so this is most of a start's wait
HEARTBEAT_MS = 100
#: how often a local engine re-reads the controller's connection file while it is
#: missing or still being written, seconds (mlx_nbdist.engine.local_entry)
CONNECTION_FILE_POLL_S = 0.02
#: beats an engine may miss before the controller drops it (HEARTBEAT_MS x this:
#: 11 s, as a 1 s period with ipyparallel's default of 10 misses gave). An engine
#: checks for the pings every HEARTBEAT_MS + 500 ms and stops itself after 50 checks
#: without one (30 s) once its controller is gone
HEARTBEAT_MISSES = 110

#: keep a spare set of engines warm for the next restart (``Session(spare=...)``,
#: ``%mlxdist start --no-spare``): a restart then only forms a group on them
SPARE = True
#: the spare starts once no cell has run for this many seconds (after a start or a
#: restart), so that starting it does not compete with the cells for the CPU
SPARE_AFTER = 1.0

#: the matplotlib backend of the engines (``MPLBACKEND``): figures show inline
INLINE_BACKEND = "module://matplotlib_inline.backend_inline"

#: how often each rank publishes its state (its status file) while it runs, seconds
PUBLISH_INTERVAL = 0.25
#: a rank whose published state is older than this many intervals shows as hung
STALE_INTERVALS = 12
STALE_AFTER = PUBLISH_INTERVAL * STALE_INTERVALS
#: how long ranks may take to write their stacks when asked (a stuck rank's, on a
#: deadline, an interrupt or %mlxdist where), seconds
STACK_TIMEOUT = 1.0
#: collectives smaller than this carry a tag of their position after their data, so
#: that one run together with another collective fails its cell
#: (mlx_nbdist.engine.order); the tag copies the input: about 0.04 ms for 256 KB
#: here, 24 ms for 64 MB. Larger group collectives carry it in a collective of its
#: own; larger messages carry none
ORDER_TAG_MAX_BYTES = 1 << 20


@dataclass
class Policy:
    """Timings of the supervisor, in seconds (``%config MLXDist.policy = {...}``)."""

    timeout: float | None = None
    #: after a rank failed, how long the others may keep running before they count as stuck
    failure_grace: float = 2.0
    #: how long a drain may take before the stuck ranks are ended
    drain_timeout: float = 3.0
    #: a rank whose cell failed evaluates what it had left unevaluated; when no rank
    #: moves for this long meanwhile, its peers are taken for waiting on it in another
    #: order and are ended (longer than failure_grace: a peer may be computing before
    #: it evaluates the same collective, and ending it breaks the group)
    settle_grace: float = 10.0
    #: after SIGINT, how long before the ranks still running are ended
    interrupt_grace: float = 2.0
    #: meanwhile, how often SIGINT is sent again to local ranks still running (one that
    #: arrived before a rank took the cell's request was lost; a rank takes one per
    #: cell, so a repeat never breaks its ``except``/``finally`` blocks); 0: never
    interrupt_resend: float = 0.5
    #: how long every rank must answer the alignment check after a drain or stop
    align_timeout: float = 5.0
    #: ranks that all wait to receive from each other, none moving (same records, same
    #: place in the code), for this long are deadlocked
    deadlock_grace: float = 3.0
    poll: float = 0.02
    #: how often the rank processes are checked for life (each check reads /proc)
    alive_every: float = 0.2
    #: how often ``on_tick`` is called while a cell runs (live displays read the ranks'
    #: published state then: no point in reading faster than they publish)
    tick: float = PUBLISH_INTERVAL
    #: after the first rank finished, how long before the others' status files are
    #: read to see whether they wait in a collective it never issued (replies of a
    #: cell arrive a fraction of a millisecond apart: reading then only delays them)
    stragglers_after: float = 0.05

    def updated(self, changes: dict[str, Any]) -> Policy:
        """A copy with ``changes`` applied; a name that is no timing, or a value that
        is not a non-negative number, raises ``ValueError`` naming it."""
        names = {f.name for f in fields(self)}
        out = dict(self.__dict__)
        for key, value in changes.items():
            if key not in names:
                raise ValueError(
                    f"policy: {key!r} is not a supervisor timing; known: {', '.join(sorted(names))}"
                )
            ok = value is None and key == "timeout"
            if not ok and (isinstance(value, bool) or not isinstance(value, int | float)
                           or not math.isfinite(value) or value < 0):
                raise ValueError(f"policy: {key} must be a number of seconds >= 0, got {value!r}")
            out[key] = None if value is None else float(value)
        return Policy(**out)
