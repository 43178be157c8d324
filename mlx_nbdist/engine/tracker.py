"""Record every MLX collective a rank issues, and guard the dangerous ones.

The tracker replaces the functions of ``mlx.core.distributed`` on an engine with thin
wrappers, so user code, ``mlx.nn.layers.distributed`` and ``sum_gradients`` all go
through it. Each wrapper:

* records ``(seq, op, shape, dtype, peer, nbytes)`` so the notebook can say which
  collective a stuck rank is waiting in, and can release it by replaying the same
  collective on the ranks that skipped it (see :func:`drain`);
* appends a tag of its position in the cell to its data, read back once it has run,
  so that ranks that ran their collectives in different orders fail the cell instead
  of returning wrong numbers (see :mod:`.order`);
* refuses a collective over the whole group from a cell that runs on a subset of
  ranks (it would wait forever for the ranks that are not running);
* optionally (``check`` mode) compares op, shape and dtype across ranks before the
  real collective and raises on every rank, naming the ranks that differ, instead
  of hanging or returning wrong numbers.

MLX builds graphs lazily: a collective is *issued* when its array is created and
*runs* when that array is evaluated. The records are of issue order, which is the
same on every rank for correct programs. In a profiled cell (``%%mlxdist --profile``)
the wrapper hands the collective to the cell's :class:`~.profile.Recorder`, which
evaluates it where it is issued so that it can be timed.
"""

from __future__ import annotations

import functools
import hashlib
import io
import operator
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from ..mismatch import LEDGER_HEAD, P2P
from ..results import CollectiveRecord
from . import dtypes, order

if TYPE_CHECKING:
    from .profile import Recorder

#: transforms whose functions trace, not run, the collectives in them
TRANSFORMS = ("compile", "vmap")
OPS = ("all_sum", "all_gather", "all_max", "all_min", "sum_scatter", "send", "recv", "recv_like")
_OP_CODES = {op: i + 1 for i, op in enumerate(OPS)}
#: which way a message goes: its sends and its receives are counted apart
_DIRECTION = {"send": "send", "recv": "recv", "recv_like": "recv"}
#: how many issued-but-unevaluated collective outputs a rank holds before it drops
#: those already evaluated (see :meth:`Tracker.settle`)
COMPACT_AT = 64
#: ... or once the held outputs reach this many bytes (large gradient buckets)
COMPACT_BYTES = 64 << 20
#: a held output this large is let go once an ``mx.eval`` that ran it returns: held
#: until a compaction, each call of a loop of large collectives got new memory
#: (``mx.eval(all_sum(x))`` of 16 MiB on mpi ran at a third of the plain script's speed)
RELEASE_BYTES = 64 << 10


@dataclass
class _Trace:
    """One call of a transformed function on this thread (see Tracker.tracing)."""

    name: str
    key: str = ""  # set at its first group collective: it traced
    count: int = 0
    #: whether it recorded anything (a call that hits the compiled cache records nothing)
    recorded: bool = False
    #: the messages it issued: ``(op, shape, dtype, peer, nbytes)``, with the group
    #: after them when it is a subgroup (see Tracker._after_call)
    messages: list[tuple[Any, ...]] = field(default_factory=list)


@dataclass(frozen=True)
class _Sub:
    """A group ``Group.split`` made (see Tracker._wrap_split)."""

    group: Any  # kept, so that its id stays its own
    #: the world ranks of its ranks, in its order (``None``: not known)
    members: tuple[int, ...] | None
    #: what names it alike on its ranks and apart from any other group, also one of
    #: the same members (a cell that splits again): each member's world rank and how
    #: many splits it had made, ``"1:2,0:2"`` (``None``: not known)
    key: str | None


class CollectiveError(RuntimeError):
    """A collective was refused before it could hang or give wrong numbers."""


class Tracker:
    """Per-engine record of collectives; installed once by the bootstrap.

    Besides the records, the tracker keeps this cell's *ledger*: the collectives it
    issued (count and a digest of their ops, shapes and dtypes) and the bytes of each
    message sent to or received from each peer. It also holds every collective output
    of the cell until :meth:`settle` at the cell's end evaluates those still
    unevaluated, so that a collective issued in a cell has run when the cell ends on
    every rank: it can never pair with a later cell's collective.
    """

    def __init__(self, world: Any, rank: int, size: int, history: int = 64, backend: str = ""):
        self.world = world
        self.backend = backend
        self.rank = rank
        self.size = size
        self.seq = 0
        self.bytes_moved = 0
        #: collectives mlx_nbdist issued itself (``--check-collectives`` signatures, a
        #: bandwidth probe, gradsync's comparison, see :meth:`internal`): tracked like
        #: any, but not in the totals the dashboard and ``%mlxdist status`` show
        self.internal_count = 0
        self.internal_bytes = 0
        self._internal = threading.local()  # per thread: another thread's are not ours
        self.recent: deque[CollectiveRecord] = deque(maxlen=history)
        self.cell = 0
        self.active_ranks: list[int] | None = None
        self.check = False
        self._orig: dict[str, Any] = {}
        #: the groups ``Group.split`` made, by id (see :meth:`_wrap_split`)
        self._subgroups: dict[int, _Sub] = {}
        self._lock = threading.Lock()
        #: held by the one compaction in flight (it looks at a snapshot of the held
        #: outside ``_lock``) and by settle's taking of the held: a cell's threads may
        #: issue collectives while another compacts or the cell's end settles.
        #: Reentrant: an interrupt (raised on the main thread only) landing just after
        #: a non-blocking acquire leaves it held by the main thread, whose settle at
        #: the cell's end must still take it (a plain lock hung the cell's end there)
        self._compacting = threading.RLock()
        self._replaying = False
        #: per thread: how deep in functions mx.compile / mx.vmap transform (tracing())
        self._transforms = threading.local()
        #: per thread: how deep in functions ``mx.jvp`` differentiates (see _wrap_jvp)
        self._jvp = threading.local()
        self._begin_ledger()
        #: records being evaluated by :meth:`settle` right now (published), and the
        #: error the cell ended with ("": none)
        self.settling: list[CollectiveRecord] = []
        self.settling_after = ""
        #: how many of :attr:`settling` have run (published: a settle that moves)
        self.settled = 0
        #: times each collective of a profiled cell (see :mod:`.profile`); ``None``
        #: (every other cell) costs the wrapper one attribute test
        self.recorder: Recorder | None = None

    def _begin_ledger(self) -> None:
        self.cell_count = 0
        self._digest = hashlib.blake2b(digest_size=8)
        self._collectives = 0  # group collectives (not point-to-point) in the digest
        #: the first of them, as indices into ``_sigs`` (``[op, shape, dtype, check]``,
        #: each once): what differs, when digests do
        self._head: list[int] = []
        self._sigs: list[list[Any]] = []
        self._sig_ids: dict[tuple[Any, ...], int] = {}
        #: the same for collectives traced in mx.compile / mx.vmap, by trace
        #: (``compile:step#1``: the first trace of ``step`` in this cell)
        self._traced: dict[str, list[int]] = {}
        self._traces: dict[str, int] = {}
        #: per peer, one ``[nbytes, dtype, shape, k]`` per message, in order; ``k`` is
        #: how many group collectives this rank issued before it (ring shares streams)
        self._sent: dict[int, list[list[Any]]] = {}
        self._recvd: dict[int, list[list[Any]]] = {}
        self._held: list[tuple[CollectiveRecord, Any, order.Tag | None]] = []
        self._held_bytes = 0
        #: the held outputs of at least RELEASE_BYTES not yet looked at by an eval,
        #: by id, with the thread that issued them (see :meth:`_release`)
        self._large: dict[int, tuple[Any, int]] = {}
        #: how many of the first held were found unevaluated by a compaction: they are
        #: looked at again by a compaction by bytes, by one by count once there are 8
        #: more than twice as many as at the last look (``_stale_looked``), and by settle
        self._stale = 0
        self._stale_looked = 0
        self._compact_at = COMPACT_AT
        #: collectives whose tag says they ran with another collective (see :mod:`.order`)
        self._order: list[dict[str, Any]] = []
        #: positions over subgroups, by group id and direction (``""``: its group
        #: collectives, peer ``None``) and peer (its rank in the group)
        self._sub_counts: dict[tuple[int, str, int | None], int] = {}
        #: the messages over subgroups, the same way: ``[nbytes, dtype, shape]`` each
        self._sub_msgs: dict[tuple[int, str, int | None], list[list[Any]]] = {}

    # -- installation -------------------------------------------------------------
    def install(self) -> None:
        """Wrap the functions of ``mx.distributed``, and ``mx.compile`` and ``mx.vmap``
        so that a collective knows when it is traced (idempotent)."""
        if self._orig:
            return
        for op in OPS:
            fn = getattr(mx.distributed, op, None)
            if fn is None:
                continue
            self._orig[op] = fn
            setattr(mx.distributed, op, self._wrap(op, fn))
        for name in TRANSFORMS:
            setattr(mx, name, self._wrap_transform(getattr(mx, name)))
        mx.eval = self._wrap_eval(mx.eval)
        mx.jvp = self._wrap_jvp(mx.jvp)
        group = getattr(mx.distributed, "Group", None)
        if group is not None and hasattr(group, "split"):
            group.split = self._wrap_split(group.split)

    def _wrap_split(self, split: Any) -> Any:
        """``Group.split`` whose groups are known as subgroups: a split of the world's
        size, its ranks in another order (mpi, nccl), is not the world, whose ranks the
        drains count in. Every rank of a new group gathers, over it at once (every
        member is in this call), each member's world rank and count of splits made
        (:attr:`_Sub.key`), so that the ledgers can pair the messages over it and the
        errors name its ranks; collectives over it are tagged with their positions in
        it (:mod:`.order`)."""
        subgroups, tracker = self._subgroups, self

        def wrapped(group: Any, *args: Any, **kwargs: Any) -> Any:
            sub = split(group, *args, **kwargs)
            made = len(subgroups) + 1  # splits this rank made, this one included
            members = key = None
            if sub.size() > 1 and "all_gather" in tracker._orig:
                try:
                    out = tracker._orig["all_gather"](
                        mx.array([tracker.rank, made], dtype=mx.int32), group=sub)
                    mx.eval(out)
                    row = [int(v) for v in out.tolist()]
                    members = tuple(row[0::2])
                    key = ",".join(f"{r}:{n}" for r, n in zip(row[0::2], row[1::2], strict=True))
                except Exception:  # noqa: BLE001 - a backend without it: ranks unnamed
                    members = key = None
            subgroups[id(sub)] = _Sub(sub, members, key)
            return sub

        wrapped.__name__ = "split"
        wrapped.__doc__ = split.__doc__
        return wrapped

    @property
    def holding(self) -> tuple[int, int]:
        """How many collective outputs this rank holds for the cell's end, and their
        bytes (see :meth:`settle`)."""
        with self._lock:
            return len(self._held), self._held_bytes

    def is_world(self, group: Any) -> bool:
        """Whether ``group`` is the whole world (not a subgroup that ``split`` made)."""
        return group.size() == self.size and id(group) not in self._subgroups

    def tracing(self) -> bool:
        """Whether this thread is inside a function that ``mx.compile`` or ``mx.vmap``
        transforms (its collectives are traced there, not run)."""
        return bool(getattr(self._transforms, "calls", None))

    def _wrap_eval(self, evaluate: Any) -> Any:
        """``mx.eval`` that then lets go of the large held outputs that ran."""
        tracker = self

        @functools.wraps(evaluate)
        def eval(*args: Any) -> None:  # noqa: A001 - mx.eval, as MLX names it
            __tracebackhide__ = True  # IPython: show the user's line, not ours
            evaluate(*args)
            if tracker._large:
                tracker._release(args)

        return eval

    def _release(self, args: tuple[Any, ...]) -> None:
        """After an ``mx.eval(*args)`` on this thread: let go of the large held outputs
        that ran, their tags read first. Those among ``args`` (or in a list or tuple
        there) ran, whichever thread issued them. Those this thread issued are looked
        at once, all in one graph export (a few microseconds when they ran, as a
        data-parallel step's gradient buckets have once its parameters are evaluated);
        any still unevaluated are not looked at by an eval again (such a look walks
        their whole graph): they wait for a compaction or the cell's end. Another
        thread's are not looked at: MLX cuts a graph as it schedules it, so one that
        thread is evaluating now looks evaluated before its data (and tag) are written.
        Skipped while a compaction or settle has the held (the next eval tries again)."""
        if not self._compacting.acquire(False):
            return
        try:
            ids = {id(a) for a in args}
            ids.update(id(b) for a in args if isinstance(a, (list, tuple)) for b in a)
            me = threading.get_ident()
            with self._lock:
                looked = {i: a for i, (a, t) in self._large.items() if i in ids or t == me}
            ran = {i for i in looked if i in ids}
            rest = [a for i, a in looked.items() if i not in ran]
            if rest and _evaluated(*rest):
                ran.update(id(a) for a in rest)
            with self._lock:
                for i in looked:
                    self._large.pop(i, None)
                kept, stale, done = [], self._stale, []
                for n, item in enumerate(self._held):
                    if id(item[1]) in ran:
                        done.append(item)
                        stale -= n < self._stale
                    else:
                        kept.append(item)
                self._held, self._stale = kept, stale
                self._held_bytes -= sum(int(item[1].nbytes) for item in done)
            self._read_tags([item[2] for item in done if item[2] is not None])
        finally:
            self._compacting.release()

    def _wrap_jvp(self, jvp: Any) -> Any:
        """``mx.jvp`` under which a group collective of 1 MiB or more carries no tag:
        its tag's own collective is joined to it by ``mx.depends``, which MLX cannot
        differentiate forward (``[Primitive::jvp] Not implemented for Depends``)."""
        local = self._jvp

        @functools.wraps(jvp)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with _deeper(local):
                return jvp(*args, **kwargs)

        return wrapped

    def _wrap_transform(self, transform: Any) -> Any:
        """``transform`` (``mx.compile``, ``mx.vmap``) whose functions, when called,
        count as tracing for :meth:`tracing` (a call that hits the compiled cache
        runs no Python, so no collective of ours sees it)."""
        local = self._transforms
        label = f"{getattr(transform, '__name__', 'transform')}:"

        def wrapped(fun: Any, *args: Any, **kwargs: Any) -> Any:
            inner = transform(fun, *args, **kwargs)
            name = label + str(getattr(fun, "__qualname__", None) or type(fun).__name__)
            #: by input signature, the messages its trace issued (see _after_call)
            traced_messages: dict[Any, list[tuple[Any, ...]]] = {}

            @functools.wraps(fun)
            def call(*a: Any, **k: Any) -> Any:
                calls = local.__dict__.setdefault("calls", [])
                trace = _Trace(name)
                calls.append(trace)
                try:
                    return inner(*a, **k)
                finally:
                    calls.pop()
                    self._after_call(trace, traced_messages, (a, k))

            return call

        wrapped.__name__ = getattr(transform, "__name__", "transform")
        wrapped.__doc__ = transform.__doc__
        wrapped.__wrapped__ = transform  # type: ignore[attr-defined]
        return wrapped

    def _after_call(self, trace: _Trace, messages: dict[Any, list[tuple[Any, ...]]],
                    inputs: Any) -> None:
        """After a call of a transformed function: remember, by its inputs' shapes and
        dtypes, the messages its trace sent and received. A call that recorded
        nothing hit the compiled cache (or issues nothing), so no Python of ours ran:
        its trace's messages are recorded again, or a peer's count of them would not
        match this rank's (a correct program reported as messages never received)."""
        if not trace.recorded and not messages:
            return  # it never traced a message (mlx-lm's compiled activations): no cost
        try:
            key = _input_key(inputs)
        except Exception:  # noqa: BLE001 - inputs we cannot describe: counts as before
            return
        if trace.recorded:
            messages[key] = trace.messages
            return
        for op, shape, dtype, peer, nbytes, *group in messages.get(key, ()):
            if group:  # over a subgroup: its position (its tag's, see _wrap) and ledger
                self._sub_position(group[0], op, peer, [nbytes, dtype, list(shape)])
            else:
                self._record(op, shape, dtype, peer, nbytes, world=True)

    def original(self, op: str) -> Any:
        return self._orig.get(op) or getattr(mx.distributed, op)

    @contextmanager
    def internal(self) -> Iterator[None]:
        """Collectives issued inside are mlx_nbdist's own: recorded, in the ledger and
        drainable like any, but left out of the rank's totals of collectives and bytes."""
        with _deeper(self._internal):
            yield

    # -- per cell -----------------------------------------------------------------
    def begin_cell(self, cell: int, active_ranks: list[int] | None, check: bool) -> None:
        self.cell = cell
        self.active_ranks = active_ranks
        self.check = check
        with self._compacting, self._lock:  # (a thread of the last cell may compact)
            self._begin_ledger()

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                # the user's: what mlx_nbdist issued itself is left out
                "collectives": self.seq - self.internal_count,
                "bytes_moved": self.bytes_moved - self.internal_bytes,
                "recent": [vars(r).copy() for r in list(self.recent)[-32:]],
                "tracker_cell": self.cell,
                "cell_collectives": self.cell_count,
                "settling": [vars(r).copy() for r in self.settling],
                # the error the cell ended with while it settles ("": it ended well)
                "settling_after": self.settling_after if self.settling else "",
                "settled": self.settled,
                # messages issued in this cell, per peer (the supervisor's deadlock test)
                "sent": {str(p): len(v) for p, v in self._sent.items()},
                "recvd": {str(p): len(v) for p, v in self._recvd.items()},
            }

    def ledger(self) -> dict[str, Any]:
        """What this rank issued in the current cell, to compare across ranks."""
        with self._lock:
            return {
                "cell": self.cell,
                "n": self.cell_count,
                # "none" when it issued no group collective (an idle rank has no ledger)
                "digest": self._digest.hexdigest() if self._collectives else "none",
                "sigs": list(self._sigs),
                "head": list(self._head),
                "traced": {k: list(v) for k, v in self._traced.items()},
                "sent": {str(p): list(v) for p, v in self._sent.items()},
                "recvd": {str(p): list(v) for p, v in self._recvd.items()},
                "order": list(self._order),
                "subgroups": self._sub_ledger(),
            }

    def _sub_ledger(self) -> dict[str, dict[str, dict[str, list[list[Any]]]]]:
        """The messages over subgroups, as the notebook pairs them: by group
        (:attr:`_Sub.key`), ``sent`` / ``recvd``, the peer's world rank."""
        out: dict[str, dict[str, dict[str, list[list[Any]]]]] = {}
        for (gid, direction, peer), msgs in self._sub_msgs.items():
            sub = self._subgroups.get(gid)
            if sub is None or sub.members is None or sub.key is None or peer is None:
                continue
            box = out.setdefault(sub.key, {"sent": {}, "recvd": {}})
            box["sent" if direction == "send" else "recvd"][str(sub.members[peer])] = list(msgs)
        return out

    def settle(self, after: str = "") -> list[CollectiveRecord]:
        """Evaluate, in issue order, this cell's collectives that are still unevaluated
        (``after``: the error the cell ended with, published meanwhile).

        MLX runs a collective only when its output is evaluated; one issued and left
        unevaluated on some ranks would otherwise run whenever it is evaluated later
        and pair with another cell's collective. Called at the end of every cell.
        One that cannot be evaluated (a tracer of ``mx.compile``, an op the backend
        lacks) is skipped: it never runs, so it cannot pair with anything either.
        Returns the records it evaluated.
        """
        with self._compacting, self._lock:
            held, self._held, self._stale, self._stale_looked = self._held, [], 0, 0
            self._large, self._held_bytes = {}, 0
        everything_ran = _evaluated(*(a for _, a, _ in held))
        pending = [] if everything_ran else [(rec, a) for rec, a, _ in held if not _evaluated(a)]
        failed: set[int] = set()
        self.settling_after, self.settled = after, 0
        self.settling = [rec for rec, _ in pending]
        done = []
        try:
            for rec, a in pending:
                try:
                    mx.eval(a)
                except Exception:  # noqa: BLE001 - it did not run, so it cannot pair either
                    # a tracer of mx.compile (it runs inside the compiled call), an op the
                    # backend lacks (ring has no sum_scatter), a peer gone: not our error
                    failed.add(rec.seq)
                    continue
                finally:
                    self.settled += 1
                done.append(rec)
        finally:
            self.settling = []
        self._read_tags([t for rec, _, t in held if t is not None and rec.seq not in failed],
                        frozenset(rec.seq for rec in done))
        return done

    def _read_tags(self, tags: list[order.Tag], settled: frozenset[int] = frozenset()
                   ) -> None:
        """Read the tags of collectives that have run (``settled``: the seqs of those
        :meth:`settle` ran); note those that ran with another collective (the first
        few: the ledger names the first)."""
        for t in tags:
            if len(self._order) >= 4:
                return
            try:
                if t.as_expected():  # the common case: its bytes are those expected
                    continue
                got = t.values()
            except Exception:  # noqa: BLE001 - a peer gone mid-collective: the cell says so
                continue
            peer = t.rec.peer
            if t.place is not None:  # over a subgroup: its own positions
                key = (t.place[0], _DIRECTION.get(t.rec.op, ""), peer)
                issued = self._sub_counts.get(key, 0)
            elif peer is None:
                issued = self._collectives
            else:
                issued = len(self._recvd.get(int(peer), []))
            found = t.problem(got, self.rank, issued, t.rec.seq in settled)
            if found is not None:
                self._order.append(found)

    # -- the wrapper --------------------------------------------------------------
    def _record(
        self,
        op: str,
        shape: tuple[int, ...],
        dtype: str,
        peer: int | None,
        nbytes: int,
        *,
        world: bool,
        check: bool = False,
        traced: bool = False,
        bare: bool = False,
    ) -> CollectiveRecord:
        if traced:
            call = self._transforms.calls[-1]
            call.recorded = True
            if world and op in P2P:
                call.messages.append((op, shape, dtype, peer, nbytes))
        with self._lock:
            self.seq += 1
            self.cell_count += 1
            self.bytes_moved += nbytes
            if check or getattr(self._internal, "depth", 0):
                self.internal_count += 1
                self.internal_bytes += nbytes
            group_index, trace = 0, ""
            if world and op not in P2P and traced:
                # traced in mx.compile: a rank whose call hit the compiled cache traces
                # nothing, so traces are compared only with the same trace on another rank
                call = self._transforms.calls[-1]
                if not call.key:
                    n = self._traces[call.name] = self._traces.get(call.name, 0) + 1
                    call.key = f"{call.name}#{n}"
                call.count += 1
                group_index, trace = call.count, call.key
                traces = self._traced.setdefault(trace, [])
                if len(traces) < LEDGER_HEAD:
                    traces.append(self._sig_id(op, shape, dtype, check))
            elif world and op not in P2P:
                self._collectives += 1
                group_index = self._collectives
                self._digest.update(_signature_bytes(op, shape, dtype, check))
                if len(self._head) < LEDGER_HEAD:
                    self._head.append(self._sig_id(op, shape, dtype, check))
            if world and op in P2P and peer is not None:
                msg = [nbytes, dtype, list(shape), self._collectives]
                box = self._sent if op == "send" else self._recvd
                box.setdefault(int(peer), []).append(msg)
                group_index = len(box[int(peer)])  # the n-th message to/from that peer
            rec = CollectiveRecord(
                self.seq, op, shape, dtype, peer, nbytes, self.cell, self.cell_count, check,
                group_index, trace, bare,
            )
            self.recent.append(rec)
        return rec

    def _sig_id(self, op: str, shape: tuple[int, ...], dtype: str, check: bool) -> int:
        """The index of this signature in the cell's ledger table (added once)."""
        key = (op, shape, dtype, check)
        sid = self._sig_ids.get(key)
        if sid is None:
            sid = self._sig_ids[key] = len(self._sigs)
            self._sigs.append([op, list(shape), dtype, check])
        return sid

    def _hold(self, rec: CollectiveRecord, out: Any, tag: order.Tag | None) -> None:
        if not isinstance(out, mx.array):
            return
        with self._lock:
            self._held.append((rec, out, tag))
            nbytes = int(out.nbytes)
            self._held_bytes += nbytes
            if nbytes >= RELEASE_BYTES:
                self._large[id(out)] = (out, threading.get_ident())
            by_bytes = self._held_bytes >= COMPACT_BYTES
            if len(self._held) < self._compact_at and not by_bytes:
                return
        # another thread compacting now: the next collective tries again. (An interrupt
        # landing just after the acquire leaves it held: see _compacting.)
        acquired = False
        try:
            acquired = self._compacting.acquire(blocking=False)
            if acquired:
                self._compact(by_bytes)
        finally:
            if acquired:
                self._compacting.release()

    def _compact(self, by_bytes: bool) -> None:
        """Let go of the held outputs that ran (their tags read first)."""
        with self._lock:
            held, stale = list(self._held), self._stale
            if by_bytes or stale > 2 * self._stale_looked + 8:
                stale = 0  # they are looked at too (outputs of a step in flight run soon)
        # Proving an array unevaluated walks its whole graph (_evaluated): the newest
        # outputs are most likely in the graph being built right now (a decode step's
        # next token), so a compaction by count checks the older half only; the newer
        # half is checked at the next one. (Checking all cost a tensor-parallel decode
        # ~4 % of its time: bench/NOTES.md, round 4.) By bytes: all of them. Those found
        # unevaluated stay first and are not looked at by every compaction: some never
        # run in the cell (a prompt's last layers in mlx-lm's prefill, whose logits
        # nobody evaluates), and looking at them each time made every look at the others
        # one by one (a TP decode of 5 x 64 tokens: 2,600 looks, now 240). Once they
        # grow (a step's outputs still running when looked at, which run soon after)
        # they are looked at again, so that those that ran are let go.
        cut = len(held) if by_bytes else stale + (len(held) - stale) // 2
        older = held[stale:cut]
        if _evaluated(*(item[1] for item in older)):  # usually: one look for them all
            unran = []
        else:
            unran = [item for item in older if not _evaluated(item[1])]
        unran_ids = {id(item) for item in unran}
        # those that ran are dropped: read their tags first
        self._read_tags([item[2] for item in older if id(item) not in unran_ids and item[2]])
        with self._lock:
            added = self._held[len(held) :]
            self._held = held[:stale] + unran + held[cut:] + added
            if not stale:
                self._stale_looked = len(unran)
            self._stale = stale + len(unran)
            self._held_bytes = sum(int(a.nbytes) for _, a, _ in self._held)
            still = {id(a) for _, a, _ in self._held}
            self._large = {i: v for i, v in self._large.items() if i in still}
            self._compact_at = max(COMPACT_AT, 2 * len(self._held))

    def _wrap(self, op: str, fn: Any) -> Any:
        tracker = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True  # IPython: show the user's line, not ours
            group = kwargs.get("group") or tracker.world
            # the usual call: a group collective of an mx.array (messages: _describe)
            if len(args) == 1 and isinstance(args[0], mx.array) and op not in P2P:
                x = args[0]
                shape, dtype, peer = x.shape, dtypes.dtype_name(x.dtype), None
            else:
                if len(args) > len(_POSITIONAL.get(op, ("x",))):
                    raise TypeError(_too_many(op, len(args)))  # MLX's would; ours may not
                # what MLX sends: numpy float64 data goes as float32: say so (and tag it so)
                args, kwargs = _as_arrays(op, args, kwargs)
                # (a receive's first argument is its shape, an mx.array too if so given)
                x = None if op == "recv" else args[0] if args else kwargs.get("x")
                shape, dtype, peer = _describe(op, args, kwargs)
            size = group.size()
            if size > 1 and not tracker._replaying:
                problem = None if tracker.active_ranks is None else tracker._subset_problem(
                    op, group)
                if problem is None and op in P2P:
                    problem = _peer_problem(op, peer, group, tracker.backend == "ring")
                if problem is None and tracker.check and op not in P2P:
                    problem = tracker._signature_problem(op, shape, dtype, group)
                if problem:
                    raise CollectiveError(problem)
            nbytes = int(x.nbytes) if isinstance(x, mx.array) else dtypes.nbytes(shape, dtype)
            sub = tracker._subgroups.get(id(group))
            world = size == tracker.size and sub is None  # is_world, inline
            traced = bool(getattr(tracker._transforms, "calls", None))  # tracing(), inline
            # under mx.jvp a large group collective goes untagged (see _wrap_jvp)
            bare = (nbytes >= order.MAX_BYTES and op not in P2P
                    and bool(getattr(tracker._jvp, "depth", 0)))
            rec = tracker._record(op, shape, dtype, peer, nbytes, world=world, traced=traced,
                                  bare=bare)
            # tagged with its position, to prove the ranks ran it together (see .order)
            if traced and op not in P2P:
                base = n = 0
            elif world:
                base, n = order.width(op, dtype, size, nbytes)
                index = order.WILDCARD if traced else rec.group_index
            elif sub is not None and size > 1:
                base, n = order.width(op, dtype, size, nbytes)
                index = tracker._sub_position(group, op, peer, [nbytes, dtype, list(shape)])
                if traced:  # counted again when a call reuses the trace (_after_call)
                    tracker._transforms.calls[-1].messages.append(
                        (op, shape, dtype, peer, nbytes, group))
                    index = order.WILDCARD
                place = (id(group), group.rank(), index, sub.members)
            else:
                base = n = 0
            if bare:
                base = n = 0
            found = base and order.call(op, tracker._orig, x, shape, dtype, peer, kwargs,
                                        index, base, n, size)
            run, a, kw, split = found[0] if found else (fn, args, kwargs, None)
            recorder = tracker.recorder
            # a profiled cell: evaluate the inputs, then this collective, timed
            out = run(*a, **kw) if recorder is None else recorder.timed(rec, run, a, kw, world)
            tag = None
            if found:
                out, full = order.on_stream(kwargs.get("stream"), split, out)
                if full is not None and not tracker._replaying and not traced:
                    tag = order.Tag(rec, full, found[1], base, size,
                                    None if world else place)
            if not traced:  # a tracer never runs as such (settle could not evaluate it)
                tracker._hold(rec, out, tag)
            return out

        wrapper.__name__ = op
        wrapper.__qualname__ = op
        wrapper.__doc__ = fn.__doc__
        wrapper.__wrapped__ = fn
        return wrapper

    def _sub_position(self, group: Any, op: str, peer: int | None, desc: list[Any]) -> int:
        """The position of this collective over subgroup ``group`` in the cell: of its
        group collectives, or of its messages to ``peer``, or of those from ``peer``
        (a message's ``desc``, ``[nbytes, dtype, shape]``, goes to the ledger)."""
        key = (id(group), _DIRECTION.get(op, ""), peer)
        with self._lock:
            n = self._sub_counts[key] = self._sub_counts.get(key, 0) + 1
            if op in P2P:
                self._sub_msgs.setdefault(key, []).append(desc)
        return n

    def _subset_problem(self, op: str, group: Any) -> str | None:
        active = self.active_ranks
        if active is None or len(active) >= self.size or group.size() < self.size:
            return None
        others = sorted(set(range(self.size)) - set(active))
        text = (
            f"{op} over the whole group ({self.size} ranks) from a cell running on "
            f"ranks {active} only would wait forever for ranks {others}. "
            "Run the cell on all ranks (drop --ranks)"
        )
        if self.backend == "mpi":  # MLX's only backend with Group.split
            return text + (
                ", or make a subgroup in a cell on every rank, e.g. "
                f"sub = world.split(0 if rank in {active} else 1), and pass group=sub."
            )
        return (
            text + f"; the {self.backend or 'ring'} backend has no subgroups "
            "(of MLX's backends only mpi has world.split())."
        )

    def _gather_check(self, row: list[int], group: Any) -> list[list[int]]:
        """All-gather one int64 row for ``--check-collectives``. It is recorded like a
        user collective, so a rank blocked in it shows where and can be drained."""
        shape = (1, len(row))
        world = self.is_world(group)
        self._record("all_gather", shape, "int64", None, 8 * len(row), world=world, check=True)
        out = self._orig["all_gather"](mx.array(row, dtype=mx.int64)[None], group=group)
        mx.eval(out)
        return out.tolist()

    def _signature_problem(
        self, op: str, shape: tuple[int, ...], dtype: str, group: Any
    ) -> str | None:
        try:
            rows = self._gather_check(_signature(op, shape, dtype), group)
        except (RuntimeError, ValueError) as e:  # inside mx.compile: cannot eval, skip
            if "transform" in str(e).lower() or "compile" in str(e).lower():
                return None
            raise
        if all(r == rows[0] for r in rows):
            return None
        missing = [i for i, r in enumerate(rows) if r[0] == 0]
        where = f"collective mismatch at #{self.seq + 1} ({op} on rank {self.rank})"
        garbled = [i for i, r in enumerate(rows) if r[0] != 0 and not _is_signature(r)]
        if garbled:  # the check ran together with another collective: its rows are data
            return (
                f"{where}: the check of this collective read rank(s) {garbled}'s row as "
                "something that is not a collective's description: on some rank it ran "
                "together with another collective of this cell, so the ranks ran their "
                "collectives in different orders (e.g. a value read on one rank between two "
                "collectives). Evaluate collectives in the same order on every rank."
            )
        if missing:  # a peer released by a drain: it never issued this collective
            return (
                f"{where}: rank(s) {missing} did not issue it (they failed or skipped it). "
                "All ranks must issue the same collectives in the same order."
            )
        # every rank saw the same rows, so every rank gathers the full description too
        width = max(1, max(r[2] for r in rows))
        dims = list(shape) + [-1] * (width - len(shape))
        name = list(dtype.encode()[:_NAME_LEN].ljust(_NAME_LEN, b"\0"))
        full = self._gather_check([*dims, *name], group)
        desc = "; ".join(
            f"rank {i}: {_unsignature(rows[i], full[i], width)}" for i in range(len(rows))
        )
        return (
            f"{where}: {desc}. "
            "All ranks must issue the same collective with the same shape and dtype."
        )


@contextmanager
def _deeper(local: threading.local) -> Iterator[None]:
    """One level deeper in ``local.depth`` (this thread's) while inside."""
    local.depth = getattr(local, "depth", 0) + 1
    try:
        yield
    finally:
        local.depth -= 1


def _evaluated(*arrays: Any) -> bool:
    """Whether arrays have all been evaluated: MLX drops an evaluated array's graph, so
    their graph export has no edge (cheap: a few microseconds once evaluated, and one
    export for many costs about what one for one does)."""
    if not arrays:
        return True
    f = io.StringIO()
    try:
        mx.export_to_dot(f, *arrays)
    except Exception:  # noqa: BLE001 - cannot tell: one is taken as evaluated (never
        # block on it); of several, each is then asked alone (a caller that took them all
        # as evaluated would drop, unrun, those it must run at the cell's end)
        return len(arrays) == 1
    return "->" not in f.getvalue()


_SIGNATURES: dict[tuple[Any, ...], bytes] = {}  # what the ledger's digest takes, by call
_SIGNATURES_MAX = 4096


def _signature_bytes(op: str, shape: tuple[int, ...], dtype: str, check: bool) -> bytes:
    """What one group collective adds to the cell's ledger digest (kept: a decode
    step issues the same few signatures over and over)."""
    key = (op, shape, dtype, check)
    sig = _SIGNATURES.get(key)
    if sig is None:
        if len(_SIGNATURES) >= _SIGNATURES_MAX:
            _SIGNATURES.clear()
        sig = _SIGNATURES[key] = f"{op}{tuple(shape)}{dtype}{check};".encode()
    return sig


def _as_arrays(op: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with the data (``x``) an ``mx.array``, as MLX makes it."""
    if op == "recv":
        return args, kwargs
    if args and args[0] is not None and not isinstance(args[0], mx.array):
        return (mx.array(args[0]), *args[1:]), kwargs
    if kwargs.get("x") is not None and not isinstance(kwargs["x"], mx.array):
        return args, {**kwargs, "x": mx.array(kwargs["x"])}
    return args, kwargs


#: each op's positional arguments (MLX's, the rest keyword-only), where not just ``x``
_POSITIONAL = {"send": ("x", "dst"), "recv": ("shape", "dtype", "src"), "recv_like": ("x", "src")}


def _too_many(op: str, given: int) -> str:
    names = _POSITIONAL.get(op, ("x",))
    return (f"mx.distributed.{op}() takes {len(names)} positional argument"
            f"{'s' if len(names) > 1 else ''} ({', '.join(names)}) but {given} were given: "
            "pass group= and stream= by keyword")


def _input_key(tree: Any) -> Any:
    """What a compiled function's cache tells calls apart by, as far as we can see:
    the shapes and dtypes of its array inputs, the other inputs' values."""
    if isinstance(tree, mx.array):
        return ("a", tuple(tree.shape), str(tree.dtype))
    if isinstance(tree, list | tuple):
        return (type(tree).__name__, tuple(_input_key(t) for t in tree))
    if isinstance(tree, dict):
        return ("d", tuple((str(k), _input_key(v)) for k, v in tree.items()))
    return ("c", type(tree).__name__, repr(tree)[:200])


def _describe(op: str, args: tuple, kwargs: dict) -> tuple[tuple[int, ...], str, int | None]:
    if op == "recv":
        given = args[0] if args else kwargs["shape"]
        try:
            shape = tuple(operator.index(d) for d in given)
        except TypeError:
            raise TypeError(f"recv: the shape must be ints, got {given!r}") from None
        dtype = args[1] if len(args) > 1 else kwargs["dtype"]
        src = args[2] if len(args) > 2 else kwargs.get("src")
        return shape, dtypes.dtype_name(dtype), src
    x = args[0] if args else kwargs.get("x")
    shape = tuple(x.shape) if hasattr(x, "shape") else ()
    dtype = dtypes.dtype_name(x.dtype) if hasattr(x, "dtype") else ""
    peer = None
    if op == "send":
        peer = args[1] if len(args) > 1 else kwargs.get("dst")
    elif op == "recv_like":
        peer = args[1] if len(args) > 1 else kwargs.get("src")
    return shape, dtype, peer


_NAME_LEN = 16
#: the most dimensions a signature is believed to describe (more: not a signature)
_MAX_NDIM = 64


def _code(text: str) -> int:
    """A stable 62-bit number for a string (same on every rank and host)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 2


def _signature(op: str, shape: tuple[int, ...], dtype: str) -> list[int]:
    """op, dtype, ndim and the whole shape (as a hash): equal rows mean equal calls."""
    return [_OP_CODES[op], _code(dtype), len(shape), _code(repr(tuple(int(d) for d in shape)))]


def _peer_problem(op: str, peer: int | None, group: Any, ring: bool) -> str | None:
    """A message to or from no rank of ``group`` (MLX refuses it as it is issued, after
    mlx_nbdist counted it: a right program's next drop then failed), and, on ``ring``,
    to or from a rank that is not a neighbour: MLX's ring sends messages between
    neighbours only and says so only when the message is evaluated (the receive's
    output then holds no message). Said when it is issued."""
    if peer is None:
        return None
    size, me = group.size(), group.rank()
    if not 0 <= int(peer) < size:
        which = "destination" if op == "send" else "source"
        return f"Invalid {which}={peer}: the group's ranks are 0 to {size - 1}"
    if not ring:
        return None
    near = sorted({(me - 1) % size, (me + 1) % size})
    if int(peer) in near:
        return None
    words = ("Send only supported to", "sends to") if op == "send" else (
        "Recv only supported from", "receives from")
    return (f"[ring] {words[0]} direct neighbors: rank {me} {words[1]} rank {peer}, and its "
            f"neighbours in the ring of {size} are rank(s) {', '.join(map(str, near))}. "
            "Pass the message along the ring, or start with --backend mpi")


@functools.cache
def _dtype_codes() -> frozenset[int]:
    return frozenset(_code(dtypes.dtype_name(v)) for v in vars(mx).values()
                     if isinstance(v, mx.Dtype))


def _is_signature(row: list[int]) -> bool:
    """Whether ``row`` can be a :func:`_signature` (not another collective's data)."""
    return (len(row) == 4 and 0 < row[0] <= len(OPS) and row[1] in _dtype_codes()
            and 0 <= row[2] <= _MAX_NDIM)


def _unsignature(row: list[int], full: list[int], width: int) -> str:
    op = OPS[row[0] - 1] if 0 < row[0] <= len(OPS) else "?"
    shape = tuple(full[: row[2]]) if 0 <= row[2] <= width else "?"
    dtype = bytes(b for b in full[width:] if 0 < b < 128).decode(errors="replace") or "?"
    return f"{op} shape={shape} dtype={dtype}"


def drain(tracker: Tracker, records: list[dict[str, Any]]) -> list[str]:
    """Issue, on this rank, the collectives that a stuck peer is waiting in.

    ``records`` are exactly the peer's collectives this rank must match, in order
    (the notebook picks them: those past what this rank issued in the cell). Each is
    replayed with zeros of the same shape and dtype and evaluated before the next.
    Point-to-point records are replayed only when this rank is their peer (a stuck
    ``send`` to us is received and dropped; a stuck ``recv`` from us gets zeros).
    The values the peer receives are not meaningful: the cell is marked invalid.

    Returns:
        One line per replayed collective.
    """
    done: list[str] = []
    tracker._replaying = True
    try:
        for d in records:
            rec = CollectiveRecord.from_dict(d)
            out = _replay(tracker, rec, d.get("from_rank"))
            if out is not None:
                mx.eval(out)
                done.append(rec.describe())
    finally:
        tracker._replaying = False
    return done


def _replay(tracker: Tracker, rec: CollectiveRecord, from_rank: int | None) -> Any:
    dtype = dtypes.mx_dtype(rec.dtype)
    dist = mx.distributed
    if (rec.trace or rec.check or rec.bare) and rec.op not in P2P:
        # traced in mx.compile, --check-collectives' own gather, or a large one under
        # mx.jvp: it carried no tag
        return tracker.original(rec.op)(mx.zeros(rec.shape, dtype=dtype), group=tracker.world)
    if rec.op not in P2P:  # through the wrapper: tagged as the peer's was (see .order)
        return getattr(dist, rec.op)(mx.zeros(rec.shape, dtype=dtype), group=tracker.world)
    if rec.peer != tracker.rank or from_rank is None:
        return None
    if rec.op == "send":  # the stuck rank sends to us: receive it
        return dist.recv(rec.shape, dtype, from_rank, group=tracker.world)
    # the stuck rank receives from us: send it zeros
    return dist.send(mx.zeros(rec.shape, dtype=dtype), from_rank, group=tracker.world)


def receive_unmatched(tracker: Tracker, messages: list[dict[str, Any]]) -> int:
    """Receive and drop messages a peer sent in the last cell that this rank never
    received, so they cannot be read by a later cell's ``recv``."""
    tracker._replaying = True
    try:
        for m in messages:
            group, src = tracker.world, int(m["src"])
            if m.get("group"):  # over a subgroup: its key (see _Sub.key)
                sub = next((s for s in tracker._subgroups.values() if s.key == m["group"]), None)
                if sub is None or sub.members is None:
                    raise CollectiveError(
                        f"rank {tracker.rank} knows no subgroup {m['group']} to receive rank "
                        f"{src}'s message over (its split was never made here)")
                group, src = sub.group, sub.members.index(src)
            out = mx.distributed.recv(
                tuple(m["shape"]), dtypes.mx_dtype(m["dtype"]), src, group=group
            )
            mx.eval(out)
    finally:
        tracker._replaying = False
    return len(messages)


def align(tracker: Tracker, nonce: int) -> dict[str, Any]:
    """Prove that the group's message streams are in step: every rank gathers a row
    of the same fresh ``nonce``, its rank and the group size, sums nonce-derived
    arrays of two sizes (MLX's ring moves small and large sums over different
    connections and directions), and exchanges the nonce with both neighbours by
    send/recv (the streams point-to-point messages use). A stream that still holds
    a stale message makes a rank read a wrong value; a rank still blocked elsewhere
    never answers."""
    world, size, rank = tracker.world, tracker.size, tracker.rank
    orig = tracker.original
    bad: list[str] = []
    row = [nonce, rank, size, nonce ^ 0x2AAAAAAAAAAAAAAA, -nonce]
    out = orig("all_gather")(mx.array(row, dtype=mx.int64)[None], group=world)
    mx.eval(out)
    for i, r in enumerate(out.tolist()):
        if r != [nonce, i, size, nonce ^ 0x2AAAAAAAAAAAAAAA, -nonce]:
            bad.append(f"all_gather row of rank {i}")
    small = nonce % 1000 + 1
    for n in (1, 4096):
        got = orig("all_sum")(mx.full((n,), small, dtype=mx.int32), group=world)
        mx.eval(got)
        if not bool(mx.all(got == small * size).item()):
            bad.append(f"all_sum of {n}")
    if size > 1 and "send" in tracker._orig:
        right, left = (rank + 1) % size, (rank - 1) % size
        token = mx.array([nonce, rank], dtype=mx.int64)
        for dst, src in ((right, left), (left, right)):
            if rank % 2 == 0:  # even ranks send first: no pair waits on each other
                mx.eval(orig("send")(token, dst, group=world))
                got = orig("recv")((2,), mx.int64, src, group=world)
                mx.eval(got)
            else:
                got = orig("recv")((2,), mx.int64, src, group=world)
                mx.eval(got)
                mx.eval(orig("send")(token, dst, group=world))
            if got.tolist() != [nonce, src]:
                bad.append(f"message from rank {src}")
    return {"rank": rank, "bad": bad, "seq": tracker.seq}
