"""Where the ranks run when a session spans several machines.

A :class:`Placement` lists one :class:`Host` per rank, in rank order, exactly as
MLX's own launcher (``mlx.launch``) reads its hostfile: entry ``i`` of the hostfile's
``hosts`` is rank ``i``, ``ssh`` is the name ssh (or ``mpirun``) is given, and
``ips`` are the addresses that rank's MLX ring endpoints listen on. Placements come
from three sources:

* an MLX hostfile (what ``mlx.distributed_config`` writes), :func:`read_hostfile`;
* a comma separated list of hosts and a number of ranks, :func:`from_list`;
* a Slurm allocation (``SLURM_JOB_NODELIST``), :func:`from_slurm`.

The module also answers the network questions of a multi-host start: which address
of this machine the engines reach (:func:`controller_address`), and the ``mpirun``
hostfile for the same placement (:meth:`Placement.mpi_hostfile`). Nothing here
starts a process or opens a connection (the route lookup uses an unconnected UDP
socket, which sends no packet).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import SetupError

#: the hostfile ``backend`` of jaccl over a ring of Thunderbolt links (``MLX_JACCL_RING``)
JACCL_RING = "jaccl-ring"
#: one entry of a host's ``rdma`` list: no device (itself, or no link), a device, or
#: several devices to that peer
RdmaEntry = str | tuple[str, ...] | None


@dataclass(frozen=True)
class Host:
    """One machine as the launcher sees it.

    Attributes:
        name: what ssh or ``mpirun`` is given, e.g. ``node1``, ``me@node1`` or an IP.
        ips: the addresses the MLX ring listens on for ranks on this host (MLX's
            hostfile ``ips``); empty: the address this host uses to reach the
            controller, found when the engine starts.
        rdma: the hostfile's ``rdma`` list for jaccl: entry ``j`` is the RDMA device
            (or devices) this rank reaches rank ``j`` through, ``None`` for itself.
    """

    name: str
    ips: tuple[str, ...] = ()
    rdma: tuple[RdmaEntry, ...] = ()

    @property
    def hostname(self) -> str:
        """The name without ``user@``."""
        return self.name.rsplit("@", 1)[-1]

    def describe(self) -> str:
        """``node1 (10.0.0.2)`` or just ``node1``."""
        ips = ", ".join(self.ips)
        return f"{self.name} ({ips})" if ips and ips != (self.name,) else self.name


@dataclass
class Placement:
    """The host of every rank, in rank order.

    Attributes:
        hosts: one entry per rank.
        source: where the placement came from, for messages.
        backend: the backend a hostfile asks for (``""``: not said).
        envs: ``NAME=value`` settings a hostfile asks for on every rank.
    """

    hosts: list[Host]
    source: str = ""
    backend: str = ""
    envs: list[str] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.hosts)

    @property
    def backend_name(self) -> str:
        """The hostfile's backend as a ``--backend`` name (``jaccl-ring`` is jaccl)."""
        return "jaccl" if self.backend == JACCL_RING else self.backend

    @property
    def jaccl_ring(self) -> bool:
        """The hostfile asks for jaccl's ring variant (``"backend": "jaccl-ring"``)."""
        return self.backend == JACCL_RING

    def counts(self) -> dict[str, int]:
        """Ranks per host name, in order of first appearance."""
        out: dict[str, int] = {}
        for h in self.hosts:
            out[h.name] = out.get(h.name, 0) + 1
        return out

    def ranks_on(self, name: str) -> list[int]:
        """The ranks placed on the host called ``name``."""
        return [r for r, h in enumerate(self.hosts) if h.name == name]

    def distinct(self) -> list[Host]:
        """Each host once, in order of first appearance."""
        seen: dict[str, Host] = {}
        for h in self.hosts:
            seen.setdefault(h.name, h)
        return list(seen.values())

    def env(self) -> dict[str, str]:
        """The hostfile's ``envs`` as a dict."""
        out = {}
        for e in self.envs:
            key, _, value = e.partition("=")
            if not key or not all(c.isalnum() or c == "_" for c in key):
                raise SetupError(f"hostfile envs: {e!r} is not NAME=value")
            out[key] = value
        return out

    def mpi_hostfile(self) -> str:
        """An Open MPI hostfile for the same placement: ``name slots=k`` per host."""
        return "".join(f"{name} slots={k}\n" for name, k in self.counts().items())

    def mpi_hosts(self) -> str:
        """The same as ``mpirun --host`` wants it: ``a:2,b:2``."""
        return ",".join(f"{name}:{k}" for name, k in self.counts().items())

    def summary(self) -> str:
        """``a x2, b x2`` for progress messages."""
        return ", ".join(f"{name} x{k}" for name, k in self.counts().items())


# -- the three sources ---------------------------------------------------------------
def read_hostfile(path: str | os.PathLike[str]) -> Placement:
    """Read MLX's hostfile (a dict with ``hosts``, or a bare list of hosts).

    Each host is ``{"ssh": name, "ips": [addresses...], "rdma": [devices...]}``
    (``rdma`` only for jaccl, see :func:`ibv_devices`). Entry ``i`` is rank ``i``, so a
    machine listed twice runs two ranks. ``backend`` becomes the session's backend
    unless one is asked for explicitly.

    Raises:
        SetupError: the file is missing, is not JSON, or an entry is malformed.
    """
    p = Path(path).expanduser()
    try:
        data = json.loads(p.read_text())
    except OSError as e:
        raise SetupError(f"cannot read hostfile {p}: {e.strerror or e}") from None
    except ValueError as e:
        raise SetupError(f"hostfile {p} is not JSON: {e}") from None
    backend, envs = "", []
    if isinstance(data, dict):
        backend = str(data.get("backend") or "")
        envs = [str(e) for e in data.get("envs") or []]
        entries = data.get("hosts")
    else:
        entries = data
    if not isinstance(entries, list) or not entries:
        raise SetupError(
            f'hostfile {p}: expected {{"hosts": [{{"ssh": "name", "ips": ["10.0.0.2"]}}, ...]}}'
        )
    hosts = []
    for i, h in enumerate(entries):
        if not isinstance(h, dict) or not isinstance(h.get("ssh"), str) or not h["ssh"]:
            raise SetupError(f'hostfile {p}: entry {i} needs an "ssh" name, got {h!r}')
        ips = h.get("ips") or []
        if not isinstance(ips, list):
            raise SetupError(f'hostfile {p}: "ips" of entry {i} must be a list')
        for ip in ips:
            _check_ip(ip, f"hostfile {p}, entry {i}")
        rdma = _rdma_entries(h.get("rdma"), f"hostfile {p}, entry {i} ({h['ssh']})")
        hosts.append(Host(h["ssh"], tuple(ips), rdma))
    if backend:
        from .config import Backend

        known = [b.value for b in Backend] + [JACCL_RING]
        if backend not in known:
            raise SetupError(
                f'hostfile {p}: "backend": {backend!r} is not one of {", ".join(known)}'
            )
    return Placement(hosts, source=f"hostfile {p}", backend=backend, envs=envs)


def _rdma_entries(value: Any, where: str) -> tuple[RdmaEntry, ...]:
    """A hostfile's ``rdma`` list as a tuple (lists of devices become tuples)."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise SetupError(f'{where}: "rdma" must be a list (one entry per rank), got {value!r}')
    out: list[RdmaEntry] = []
    for j, e in enumerate(value):
        if e is None or (isinstance(e, str) and e):
            out.append(e)
        elif isinstance(e, list) and e and all(isinstance(d, str) and d for d in e):
            out.append(tuple(e))
        else:
            raise SetupError(
                f'{where}: "rdma" entry {j} must be a device name such as "rdma_en2", '
                f"a list of them, or null; got {e!r}"
            )
    return tuple(out)


# -- what each rank's MLX needs in its environment (pure: placement in, dict out) ----
def ibv_devices(placement: Placement, ring: bool = False) -> list[list[Any]]:
    """The jaccl device matrix (``MLX_IBV_DEVICES``' file) from the hosts' ``rdma``.

    Row ``i`` is rank ``i``'s ``rdma`` list: ``null`` for itself, else the device to
    each peer (every peer for the mesh, the two neighbours with ``ring``), the checks
    ``mlx.launch --backend jaccl`` makes.

    Raises:
        SetupError: a host has no ``rdma`` list, or not one entry per rank, an entry
            names a device to itself, or a device to a peer is missing; the message
            names the host, rank and entry.
    """
    n = placement.n
    where = placement.source or "the hostfile"
    for i, h in enumerate(placement.hosts):
        if not h.rdma:
            raise SetupError(
                f'jaccl: rank {i} (host {h.name}) has no "rdma" list in {where}; jaccl '
                f'needs each host\'s RDMA devices to every other rank, e.g. "rdma": '
                f"{json.dumps(_example_rdma(i, n))} (mlx.distributed_config --backend "
                "jaccl writes them)"
            )
        if len(h.rdma) != n:
            raise SetupError(
                f'jaccl: rank {i} (host {h.name}) has {len(h.rdma)} "rdma" entries in '
                f"{where}, but the session has {n} ranks: the device matrix must be "
                f"{n} x {n} (one entry per rank, null for itself)"
            )
        if h.rdma[i] is not None:
            raise SetupError(
                f'jaccl: rank {i} (host {h.name}): "rdma" entry {i} is its own and must '
                f"be null in {where}, got {h.rdma[i]!r}"
            )
        peers = ((i - 1) % n, (i + 1) % n) if ring else range(n)
        for j in peers:
            if j != i and h.rdma[j] is None:
                raise SetupError(
                    f'jaccl: rank {i} (host {h.name}) lists no RDMA device to rank {j} '
                    f"(host {placement.hosts[j].name}) in {where} (\"rdma\" entry {j} is "
                    "null); "
                    + (
                        "the jaccl ring needs one to each neighbour"
                        if ring
                        else "the jaccl mesh needs a Thunderbolt link between every pair"
                    )
                )
    return [[list(e) if isinstance(e, tuple) else e for e in h.rdma] for h in placement.hosts]


def _example_rdma(i: int, n: int) -> list[str | None]:
    return [None if j == i else f"rdma_en{j + 2}" for j in range(n)]


def local_indices(hosts: Sequence[str]) -> list[int]:
    """Each rank's index among the ranks on its host: ``[a, a, b, b]`` -> ``[0, 1, 0, 1]``."""
    seen: dict[str, int] = {}
    out = []
    for h in hosts:
        out.append(seen.get(h, 0))
        seen[h] = out[-1] + 1
    return out


def cuda_device(local_index: int, visible: str | None = None, gpus: int = 0) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` of the rank with ``local_index`` on its host.

    ``visible``: the host's own ``CUDA_VISIBLE_DEVICES`` (a list the user chose: the
    rank gets one of those, round robin); else ``gpus`` (the host's GPU count: rank
    ``local_index % gpus``); else, count unknown, ``local_index`` itself, as
    ``mlx.launch --backend nccl`` does (``rank % ranks per host``).
    """
    chosen = [d.strip() for d in (visible or "").split(",") if d.strip()]
    if chosen:
        return chosen[local_index % len(chosen)]
    return str(local_index % gpus if gpus > 0 else local_index)


def nccl_env(rank: int, size: int, host_ip: str, port: int, device: str) -> dict[str, str]:
    """What MLX's nccl backend reads, for ``rank``: rank 0's address and a port it
    listens on for the others (``NCCL_HOST_IP``, ``NCCL_PORT``), the group
    (``MLX_RANK``, ``MLX_WORLD_SIZE``) and the one GPU it uses
    (``CUDA_VISIBLE_DEVICES``; see :func:`cuda_device`)."""
    return {
        "NCCL_HOST_IP": host_ip,
        "NCCL_PORT": str(int(port)),
        "MLX_WORLD_SIZE": str(int(size)),
        "MLX_RANK": str(int(rank)),
        "CUDA_VISIBLE_DEVICES": device,
    }


def jaccl_env(
    rank: int, size: int, coordinator: str, ring: bool = False
) -> dict[str, str]:
    """What MLX's jaccl backend reads, for ``rank``, besides ``MLX_IBV_DEVICES`` (the
    path of a file holding :func:`ibv_devices`, written on the rank's host):
    ``MLX_JACCL_COORDINATOR`` (``ip:port`` rank 0 listens on), ``MLX_RANK``,
    ``MLX_WORLD_SIZE`` (jaccl takes the size from the device matrix; set for
    code that reads it) and ``MLX_JACCL_RING=1`` for the ring variant."""
    env = {
        "MLX_JACCL_COORDINATOR": coordinator,
        "MLX_RANK": str(int(rank)),
        "MLX_WORLD_SIZE": str(int(size)),
    }
    if ring:
        env["MLX_JACCL_RING"] = "1"
    return env


def from_list(spec: str | Sequence[str], n: int | None = None) -> Placement:
    """Spread ``n`` ranks over the hosts of ``spec`` (``"a,b"`` or ``["a", "b"]``).

    The ranks are split as evenly as possible and kept together per host, in the
    order given (4 ranks on ``a,b``: ``a a b b``; 3 ranks: ``a a b``). ``n`` defaults
    to one rank per host. A host given as an IP address also gives the ring its
    address; a name is resolved when its engine starts (the address it uses to
    reach the controller).

    Raises:
        SetupError: empty or repeated hosts, or fewer ranks than hosts.
    """
    names = [x.strip() for x in (spec.split(",") if isinstance(spec, str) else spec)]
    if not names or any(not x for x in names):
        raise SetupError(f"--hosts {spec!r}: give host names separated by commas, e.g. a,b")
    dup = sorted({x for x in names if names.count(x) > 1})
    if dup:
        raise SetupError(f"--hosts lists {', '.join(dup)} twice; use -n for more ranks per host")
    n = len(names) if n is None else int(n)
    if n < len(names):
        raise SetupError(f"-n {n} is fewer ranks than the {len(names)} hosts in --hosts")
    per, extra = divmod(n, len(names))
    hosts: list[Host] = []
    for i, name in enumerate(names):
        host = Host(name, (name.rsplit("@", 1)[-1],) if _is_ip(name.rsplit("@", 1)[-1]) else ())
        hosts += [host] * (per + (1 if i < extra else 0))
    return Placement(hosts, source="--hosts " + ",".join(names))


def slurm_nodes(
    env: Mapping[str, str] | None = None,
    run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run,
) -> list[str]:
    """The node names of the Slurm allocation this process runs in (``[]``: none).

    Uses ``scontrol show hostnames`` when ``scontrol`` is on PATH (it knows every
    nodelist syntax), else :func:`expand_nodelist`.
    """
    env = os.environ if env is None else env
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    if not nodelist:
        return []
    scontrol = shutil.which("scontrol", path=env.get("PATH"))
    if scontrol:
        try:
            out = run(
                [scontrol, "show", "hostnames", nodelist],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            )
            names = out.stdout.split()
            if names:
                return names
        except (OSError, subprocess.SubprocessError):
            pass
    return expand_nodelist(nodelist)


def from_slurm(
    env: Mapping[str, str] | None = None,
    n: int | None = None,
    run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run,
) -> Placement | None:
    """A placement over the nodes of the current Slurm allocation, or ``None``.

    Without ``n`` the ranks per node follow ``SLURM_TASKS_PER_NODE`` (e.g.
    ``2(x3),1``), else one per node; with ``n`` they are spread as in :func:`from_list`
    (over the first ``n`` nodes when there are more nodes than ranks).
    """
    env = os.environ if env is None else env
    nodes = slurm_nodes(env, run)
    if not nodes:
        return None
    if n is None:
        tasks = expand_tasks_per_node(env.get("SLURM_TASKS_PER_NODE", ""))
        if len(tasks) == len(nodes):
            hosts = [Host(name) for name, k in zip(nodes, tasks, strict=True) for _ in range(k)]
            p = Placement(hosts)
        else:
            p = from_list(nodes)
    else:
        # fewer ranks than nodes: use the first n nodes of the allocation
        p = from_list(nodes[:n], n)
    p.source = f"Slurm job {env.get('SLURM_JOB_ID', '?')} (nodes {','.join(nodes)})"
    return p


def in_slurm_allocation(env: Mapping[str, str] | None = None) -> bool:
    """True inside a Slurm allocation of more than one node."""
    env = os.environ if env is None else env
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    return bool(nodelist) and len(expand_nodelist(nodelist)) > 1


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand Slurm's compressed nodelist: ``node[01-03,07],gpu5`` -> 4 names.

    Handles zero padding, several ranges per bracket and several brackets per name
    (``r[1-2]n[1-2]``), as ``scontrol show hostnames`` does.
    """
    out: list[str] = []
    for part in _split_top(nodelist):
        if part:
            out += _expand_one(part)
    return out


def expand_tasks_per_node(spec: str) -> list[int]:
    """``2(x3),1`` -> ``[2, 2, 2, 1]`` (Slurm's SLURM_TASKS_PER_NODE)."""
    out: list[int] = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item)
        if not m:
            return []
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for c in text:
        if c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
        if c == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += c
    parts.append(cur)
    return [p.strip() for p in parts]


def _expand_one(name: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", name)
    if not m:
        return [name]
    head, tail = name[: m.start()], name[m.end() :]
    out = []
    for rng in m.group(1).split(","):
        lo, _, hi = rng.partition("-")
        if not hi:
            values = [lo]
        else:
            width = len(lo) if lo.startswith("0") else 0
            values = [str(v).zfill(width) for v in range(int(lo), int(hi) + 1)]
        for v in values:
            out += _expand_one(head + v + tail)
    return out


def resolve(
    *,
    hosts: str | Sequence[str] | None = None,
    hostfile: str | os.PathLike[str] | None = None,
    n: int | None = None,
    env: Mapping[str, str] | None = None,
) -> Placement | None:
    """The placement a session asks for, or ``None`` for ranks on this machine only.

    ``hosts="slurm"`` uses the Slurm allocation; ``hosts="local"`` forces a local
    session; with neither hosts nor a hostfile, a Slurm allocation of more than one
    node is used when this process runs inside one.
    """
    env = os.environ if env is None else env
    if hostfile is not None and hosts is not None:
        raise SetupError("give either a hostfile or --hosts, not both")
    if hostfile is not None:
        p = read_hostfile(hostfile)
        if n is not None and n != p.n:
            raise SetupError(
                f"-n {n} does not match {p.source}, which places {p.n} ranks "
                "(one per entry: list a host twice to run two ranks on it)"
            )
        return p
    if isinstance(hosts, str) and hosts.strip().lower() == "local":
        return None
    if isinstance(hosts, str) and hosts.strip().lower() == "slurm":
        p = from_slurm(env, n)
        if p is None:
            raise SetupError("--hosts slurm: not inside a Slurm allocation (no SLURM_JOB_NODELIST)")
        return p
    if hosts is not None:
        return from_list(hosts, n)
    if in_slurm_allocation(env):
        return from_slurm(env, n)
    return None


# -- addresses -----------------------------------------------------------------------
def local_addresses() -> list[str]:
    """The IPv4 addresses of this machine's interfaces."""
    import psutil

    return sorted(
        {
            a.address
            for addrs in psutil.net_if_addrs().values()
            for a in addrs
            if a.family == socket.AF_INET
        }
    )


def route_address(ip: str) -> str:
    """The address of this machine that packets to ``ip`` leave from (no packet sent)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((ip, 9))
        return s.getsockname()[0]
    finally:
        s.close()


def host_address(host: Host) -> str:
    """The first address of ``host``: its ``ips``, else its name resolved here.

    Raises:
        SetupError: the name does not resolve to an IPv4 address.
    """
    if host.ips:
        return host.ips[0]
    try:
        return socket.getaddrinfo(host.hostname, None, socket.AF_INET)[0][4][0]
    except (OSError, IndexError):
        raise SetupError(
            f"cannot resolve host {host.name!r} to an address; give its address in "
            'the hostfile ("ips") or pass --controller-ip'
        ) from None


def controller_address(placement: Placement, explicit: str | None = None) -> str:
    """The address the controller listens on so that every host reaches it.

    ``explicit`` must be an address of this machine (or ``0.0.0.0``, all interfaces,
    only when asked for). Without it, the address of the route towards the first
    host that is not this machine.

    Raises:
        SetupError: ``explicit`` is not one of this machine's addresses.
    """
    mine = local_addresses()
    if explicit:
        if explicit != "0.0.0.0" and explicit not in mine:
            raise SetupError(
                f"--controller-ip {explicit} is not an address of this machine "
                f"(its addresses: {', '.join(mine)})"
            )
        return explicit
    for host in placement.distinct():
        addr = host_address(host)
        if addr in mine or ipaddress.ip_address(addr).is_loopback:
            continue
        try:
            return route_address(addr)
        except OSError as e:
            raise SetupError(
                f"no route from this machine to {host.describe()}: {e}; "
                "pass --controller-ip with the address the hosts reach"
            ) from None
    return "127.0.0.1"


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _check_ip(ip: object, where: str) -> None:
    if not isinstance(ip, str) or not _is_ip(ip):
        raise SetupError(f"{where}: {ip!r} is not an IP address")
    if ipaddress.ip_address(ip).version != 4:
        raise SetupError(f"{where}: {ip} is IPv6; the MLX ring needs IPv4 addresses")


def match_host(probe: dict[str, Any], hosts: list[Host], pids: dict[str, set[int]]) -> str | None:
    """The host an engine runs on: by the PID its launcher reported, then by its
    addresses, then by its hostname; ``None`` when that is ambiguous."""
    cands = [h for h in hosts if probe["pid"] in pids.get(h.name, ())]
    if len(cands) == 1:
        return cands[0].name
    cands = cands or hosts
    by_ip = [h for h in cands if h.ips and set(h.ips) <= set(probe["addresses"])]
    if len(by_ip) == 1:
        return by_ip[0].name
    by_ip = [h for h in cands if h.hostname in probe["addresses"]]
    if len(by_ip) == 1:
        return by_ip[0].name
    short = probe["hostname"].split(".")[0]
    by_name = [h for h in cands if h.hostname.split(".")[0] == short]
    if len(by_name) == 1:
        return by_name[0].name
    return None
