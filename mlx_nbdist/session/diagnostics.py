"""What a failed cell of a multi-host session adds to its message: which host each
failed rank is on, which hosts lost contact with the controller, and which do not
answer on the network."""

from __future__ import annotations

import socket
import threading

from ..config import Backend
from ..results import DIED, CellResult
from ..supervise import Outcome
from .ranks import RankGroup


def host_notes(group: RankGroup, backend: Backend, result: CellResult, outcome: Outcome) -> str:
    """Lines about the hosts of the ranks that failed (``""`` on one machine)."""
    if group.cluster.launcher.placement is None or result.ok:
        return ""
    failed = sorted(f.rank for f in result.failures if f.rank in group.places)
    if not failed:
        return ""
    try:
        registered = set(group.cluster.client.ids)
    except Exception:  # noqa: BLE001
        registered = set()
    lines = []
    # engines the controller dropped, except those the supervisor ended itself
    lost = [
        r
        for r in failed
        if group.ranks[r].engine_id not in registered
        and getattr(outcome.failures.get(r), "cause", DIED) == DIED
    ]
    for r in lost:
        place = group.places[r]
        running = r in group.procs and group.rank_alive(r)
        alive = " (its process is still running)" if running else ""
        lines.append(
            f"rank {r} on host {place.describe()}: the controller lost contact with its "
            f"engine (no heartbeat){alive}; host {place.host} or its network link is down."
        )
        fail = result.ranks[r].failure
        if fail is not None and fail.ename == "EngineError":
            fail.evalue = f"lost contact with host {place.host}: {fail.evalue}"
    trouble = outcome.timed_out or outcome.broken or outcome.interrupted or lost
    if trouble and backend == Backend.RING:
        silent = unanswering({r: group.places[r].addresses for r in failed})
        for host in sorted({group.places[r].host for r in silent}):
            ranks = [r for r in silent if group.places[r].host == host]
            eps = sorted({a for r in ranks for a in group.places[r].addresses})
            lines.append(
                f"host {host} (ranks {ranks}) does not answer at {', '.join(eps)} from "
                "this machine: it is down or cut off the network."
            )
    lines.append(
        "Failed ranks run on: "
        + "; ".join(f"rank {r} on {group.places[r].describe()}" for r in failed)
    )
    return "\n".join(lines)


def unanswering(endpoints: dict[int, list[str]], timeout: float = 1.0) -> list[int]:
    """Ranks none of whose ``ip:port`` endpoints answers a TCP connect within
    ``timeout`` (a refused connection is an answer: the host is there)."""
    results: dict[str, bool] = {}

    def knock(ep: str) -> None:
        ip, port = ep.rsplit(":", 1)
        try:
            socket.create_connection((ip, int(port)), timeout=timeout).close()
            results[ep] = True
        except ConnectionRefusedError:
            results[ep] = True
        except OSError:
            results[ep] = False

    eps = sorted({e for lst in endpoints.values() for e in lst})
    threads = [threading.Thread(target=knock, args=(e,), daemon=True) for e in eps]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 1.0)
    return [r for r, lst in endpoints.items() if lst and not any(results.get(e) for e in lst)]
