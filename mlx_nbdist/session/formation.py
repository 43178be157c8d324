"""Forming the MLX group from registered engines, in three steps:

1. *probe*: every engine says who and where it is (PID, host, addresses, whether it
   sees this machine's files and this process);
2. *assign and place*: which engine is which rank (the launcher knows) and which host
   it is on; for the ring backend each rank picks free ports on the addresses the
   other hosts reach it at, and the ring hostfile is written; for nccl and jaccl
   rank 0 picks one free port on its address (the others connect there first) and
   each rank gets its environment (:func:`rendezvous_env`);
3. *join*: every rank runs :func:`mlx_nbdist.engine.rpc.bootstrap` at once, which
   sets that environment, calls ``mx.distributed.init(strict=True)`` and checks the
   group's size.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from .. import hosts, processes, runtime
from ..config import Backend
from ..engine import bootstrap, rpc
from ..errors import PortTakenError, StartError
from ..outcomes import short_error
from ..results import RankInfo
from .cluster import Cluster

#: what a rank's error says when a port it picked was taken before MLX bound it (by
#: another session forming at the same moment), or a stranger answered there
_PORT_TAKEN = ("Couldn't bind socket", bootstrap.STRANGERS)


@dataclass
class RankPlace:
    """Where a rank runs, as the session found out when it started.

    Attributes:
        host: the host name it was launched on (``ssh`` name), or this machine's name.
        addresses: its MLX ring endpoints (``ip:port``); empty for the mpi backend.
        local: its process is visible here (same machine and PID space): liveness
            and signals go through the PID; else through ipyparallel (registration)
            and the launcher's ssh.
        shared_files: its status file is in the session directory (shared disk).
    """

    host: str
    addresses: list[str] = field(default_factory=list)
    local: bool = True
    shared_files: bool = True

    def describe(self) -> str:
        ips = sorted({a.rsplit(":", 1)[0] for a in self.addresses})
        return f"{self.host} ({', '.join(ips)})" if ips and ips != [self.host] else self.host


@dataclass
class Formed:
    """The group as it formed: each rank's engine and process, and where it runs."""

    ranks: dict[int, RankInfo]
    places: dict[int, RankPlace]


def form_group(
    cluster: Cluster, backend: Backend, *, assume_remote: bool = False, timeout: float
) -> Formed:
    """Make the cluster's registered engines one MLX group of ``cluster.n`` ranks.

    Raises:
        StartError: an engine did not answer, could not be placed, or the group did
            not form; the message names the rank, engine and host.
    """
    client = cluster.client
    n = cluster.n
    ids = sorted(client.ids)[:n]
    if len(ids) < n:
        raise StartError(
            f"only {len(ids)} of {n} engines are registered (one exited?){cluster.hosts_note()}"
        )
    t_end = time.monotonic() + timeout
    me = processes.identity(os.getpid()) or (os.getpid(), 0.0)  # the notebook
    probes = cluster.probes  # a spare cluster's engines answered while it warmed
    if sorted(probes) != ids:
        probes = probe(cluster, ids, t_end, gpus=backend == Backend.NCCL)
    order = cluster.launcher.assign(cluster.ipp, probes)  # rank -> engine id
    places = {
        r: RankPlace(host=cluster.launcher.host_of(r, probes[eid])) for r, eid in order.items()
    }
    for r, eid in order.items():
        pr = probes[eid]
        places[r].local = (
            not assume_remote
            and pr["machine"] == rpc.machine_id()
            and processes.same_process(pr["pid"], pr["started"])
        )
        places[r].shared_files = not assume_remote and pr["shared_files"]
    hostfile_json = None
    if backend == Backend.RING:
        endpoints = _ring_endpoints(cluster, order, places, probes, t_end)
        for r, eps in endpoints.items():
            places[r].addresses = eps
        hostfile = [endpoints[r] for r in range(n)]
        hostfile_json = json.dumps(hostfile)
        runtime.write_ring_hostfile(cluster.directory / "hostfile.json", hostfile)
    extra: dict[int, dict[str, Any]] = {r: {} for r in order}
    if backend in (Backend.NCCL, Backend.JACCL) and n > 1:
        ip = ring_ips(cluster, 0, probes[order[0]])[0]
        port = _free_port(cluster, order, places, ip, t_end)
        extra = rendezvous_env(
            backend, [probes[order[r]] for r in range(n)], ip, port, cluster.launcher.placement
        )
        places[0].addresses = [f"{ip}:{port}"]
    watch = {r: not assume_remote and probes[order[r]]["sees_client"] for r in order}
    # One rank that sees this process ends the controller if the notebook dies.
    reaper = next((r for r in sorted(order) if watch[r]), None)
    cpid = cluster.controller_pid()
    # the controller and its schedulers, by PID and start time: ended by the rank that
    # sees the notebook gone
    reap = [x for pid in ([cpid, *processes.children(cpid)] if cpid else [])
            if (x := processes.identity(pid))]
    barrier = None
    if backend == Backend.RING and all(places[r].shared_files for r in order):
        barrier = cluster.directory / f"init-{secrets.token_hex(4)}"
        barrier.mkdir()
    base = dict(
        init_barrier=str(barrier) if barrier else None,
        size=n,
        backend=str(backend),
        hostfile_json=hostfile_json,
        token=secrets.randbelow(2**31 - 1),
        session_id=cluster.session_id,
        session_dir=str(cluster.directory),
        client_pid=me[0],
        client_started=me[1],
    )
    ars = {
        r: client[eid].apply_async(
            rpc.bootstrap,
            dict(
                base,
                rank=r,
                engine_id=eid,
                host=places[r].host,
                shared_files=places[r].shared_files,
                watch_client=watch[r],
                reap_pids=reap if r == reaper else [],
                **extra[r],
            ),
        )
        for r, eid in order.items()
    }
    infos, errors = {}, []
    for r, ar in ars.items():
        try:
            info = ar.get(timeout=max(0.1, t_end - time.monotonic()))
            infos[info["rank"]] = RankInfo(**info)
        except Exception as e:  # noqa: BLE001 - reported below with the engine id
            errors.append(
                f"rank {r} (engine {order[r]} on {places[r].describe()}): {short_error(e)}"
            )
    if errors:
        hint = ""
        if cluster.launcher.placement is not None and backend == Backend.RING:
            hint = (
                "\nThe ring connects every rank to its neighbours on the addresses in "
                f"{cluster.directory / 'hostfile.json'}: check that the hosts reach each "
                'other there (firewalls, the hostfile\'s "ips").'
            )
        elif cluster.launcher.placement is not None and places[0].addresses:
            hint = (
                f"\nEvery rank first connects to rank 0 on {places[0].addresses[0]}: check "
                'that the hosts reach it there (firewalls, rank 0\'s "ips" in the hostfile).'
            )
        text = f"the {backend} group did not form:\n  " + "\n  ".join(errors) + hint
        if any(sign in e for e in errors for sign in _PORT_TAKEN):
            raise PortTakenError(text)
        raise StartError(text)
    if sorted(infos) != list(range(n)):
        raise StartError(f"ranks {sorted(infos)} do not cover 0..{n - 1}")
    return Formed(ranks=dict(sorted(infos.items())), places=dict(sorted(places.items())))


def probe(
    cluster: Cluster, ids: list[int], t_end: float, gpus: bool = False
) -> dict[int, dict[str, Any]]:
    """Step 1: ask every engine who and where it is (and, ``gpus``, how many GPUs
    its host has)."""
    me = processes.identity(os.getpid()) or (os.getpid(), 0.0)  # the notebook
    nonce = secrets.token_hex(16)
    runtime.write_private(cluster.directory / "probe", nonce)
    cfg = dict(
        session_dir=str(cluster.directory),
        nonce=nonce,
        client_pid=me[0],
        client_started=me[1],
        controller_ip=(
            cluster.controller_ip
            if cluster.controller_ip != "0.0.0.0"
            else cluster.controller_location
        ),
        gpus=gpus,
    )
    ars = {eid: cluster.client[eid].apply_async(rpc.probe, cfg) for eid in ids}
    probes, errors = {}, []
    for eid, ar in ars.items():
        try:
            probes[eid] = ar.get(timeout=max(0.1, t_end - time.monotonic()))
        except Exception as e:  # noqa: BLE001
            errors.append(f"engine {eid}: {short_error(e)}")
    if errors:
        raise StartError("engines did not answer:\n  " + "\n  ".join(errors))
    return probes


def ring_ips(cluster: Cluster, rank: int, probe: dict[str, Any]) -> list[str]:
    """The addresses rank ``rank``'s ring endpoints listen on: loopback on one
    machine; else its hostfile ``ips`` (checked against the host's own addresses),
    else the address its host routes to the controller from."""
    placement = cluster.launcher.placement
    if placement is None:
        return [runtime.LOOPBACK]
    host = placement.hosts[rank]
    if host.ips:
        missing = [ip for ip in host.ips if ip not in probe["addresses"]]
        if missing:
            raise StartError(
                f'host {host.name}: {", ".join(missing)} (its "ips" in '
                f"{placement.source}) is not an address of that machine; it has "
                f"{', '.join(probe['addresses'])}"
            )
        return list(host.ips)
    if not probe["route"] or probe["route"].startswith("127."):
        raise StartError(
            f"host {host.name}: cannot tell which of its addresses "
            f"({', '.join(probe['addresses'])}) the other hosts reach; give its "
            'address in a hostfile ("ips")'
        )
    return [probe["route"]]


def rendezvous_env(
    backend: Backend,
    probes: list[dict[str, Any]],
    ip: str,
    port: int,
    placement: hosts.Placement | None,
) -> dict[int, dict[str, Any]]:
    """Each rank's ``env`` (and ``env_files``) for :func:`~mlx_nbdist.engine.rpc.bootstrap`
    with nccl or jaccl: rank 0 listens on ``ip:port``; ``probes[r]`` is rank ``r``'s
    probe (its machine, GPU count and ``CUDA_VISIBLE_DEVICES``). Pure: no engine is
    asked anything."""
    n = len(probes)
    out: dict[int, dict[str, Any]] = {}
    if backend == Backend.NCCL:
        local = hosts.local_indices([pr["machine"] for pr in probes])
        for r, pr in enumerate(probes):
            device = hosts.cuda_device(local[r], pr.get("cuda_visible"), pr.get("gpus", 0))
            out[r] = {"env": hosts.nccl_env(r, n, ip, port, device)}
    elif backend == Backend.JACCL:
        if placement is None:
            raise StartError("jaccl needs a hostfile with each host's rdma devices")
        devices = json.dumps(hosts.ibv_devices(placement, ring=placement.jaccl_ring))
        for r in range(n):
            out[r] = {
                "env": hosts.jaccl_env(r, n, f"{ip}:{port}", ring=placement.jaccl_ring),
                "env_files": {"MLX_IBV_DEVICES": devices},
            }
    return out


def _free_port(
    cluster: Cluster, order: dict[int, int], places: dict[int, RankPlace], ip: str, t_end: float
) -> int:
    """A free port on rank 0's ``ip``, where the other ranks meet it."""
    ar = cluster.client[order[0]].apply_async(rpc.free_ports, [ip])
    try:
        return int(ar.get(timeout=max(0.1, t_end - time.monotonic()))[0])
    except Exception as e:  # noqa: BLE001
        raise StartError(
            f"rank 0 (engine {order[0]} on {places[0].describe()}): {short_error(e)}"
        ) from None


def _ring_endpoints(
    cluster: Cluster,
    order: dict[int, int],
    places: dict[int, RankPlace],
    probes: dict[int, dict[str, Any]],
    t_end: float,
) -> dict[int, list[str]]:
    """Step 2: each rank picks free ports on its own host's ring addresses."""
    ips = {r: ring_ips(cluster, r, probes[order[r]]) for r in order}
    endpoints: dict[int, list[str]] = {}
    todo = list(order)
    for _ in range(4):
        ars = {r: cluster.client[order[r]].apply_async(rpc.free_ports, ips[r]) for r in todo}
        for r, ar in ars.items():
            try:
                ports = ar.get(timeout=max(0.1, t_end - time.monotonic()))
            except Exception as e:  # noqa: BLE001
                raise StartError(
                    f"rank {r} (engine {order[r]} on {places[r].describe()}): {short_error(e)}"
                ) from None
            endpoints[r] = [f"{ip}:{port}" for ip, port in zip(ips[r], ports, strict=True)]
        # two ranks on one host may draw the same free port: draw again for those
        seen: dict[str, int] = {}
        todo = []
        for r in sorted(endpoints):
            for ep in endpoints[r]:
                if ep in seen and r not in todo:
                    todo.append(r)
                seen.setdefault(ep, r)
        if not todo:
            return endpoints
    raise StartError("could not find distinct free ports for the ring endpoints")
