"""Sessions across several hosts.

The hosts are real network namespaces made by this test on this machine (``ip netns
add``, veth pairs on a private bridge, each namespace its own address): the engines
are started in them by ipyparallel's own ``SSHEngineSetLauncher``, whose ``ssh``
command is a small script mapping ``ssh HOST COMMAND`` to ``ip netns exec HOST sh -c
COMMAND``, so the real SSH launcher code runs (shell probe, profile creation, detached
start, signals, output fetch). The controller listens on the bridge's address and the
MLX ring runs over the veth links. The namespaces share this machine's disk and PID
space; :func:`test_remote_fallback_without_shared_pids_or_files` makes the session
treat them as true remote hosts to exercise the fallbacks.

Without the rights to make namespaces the netns tests skip. Slurm and ``mpirun``
across hosts cannot run here (no Slurm, one machine): their tests check the parsed
allocation and the generated command line only.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from mlx_nbdist import CellError, CollectiveTimeout, Session, SetupError, StartError, launchers
from mlx_nbdist import hosts as H
from mlx_nbdist.launchers.mpi import MPILauncher, find_mpirun, mpi_args
from mlx_nbdist.launchers.ssh import SSHLauncher

from .conftest import _ours_anywhere, wait_gone

# -- placements, Slurm and mpirun: parsing and command lines (no processes) -----------


def test_mlx_hostfile_formats(tmp_path: Path) -> None:
    f = tmp_path / "hosts.json"
    f.write_text(json.dumps({
        "backend": "ring",
        "envs": ["MLX_METAL_FAST_SYNCH=1"],
        "hosts": [
            {"ssh": "mac1", "ips": ["10.0.0.1"], "rdma": [None, "rdma_en2"]},
            {"ssh": "me@mac2", "ips": ["10.0.0.2", "10.0.1.2"], "rdma": ["rdma_en2", None]},
            {"ssh": "mac1", "ips": ["10.0.0.1"]},
        ],
    }))
    p = H.read_hostfile(f)
    assert p.n == 3 and p.backend == "ring" and p.env() == {"MLX_METAL_FAST_SYNCH": "1"}
    assert [h.name for h in p.hosts] == ["mac1", "me@mac2", "mac1"]
    assert p.hosts[1].hostname == "mac2" and p.hosts[1].ips == ("10.0.0.2", "10.0.1.2")
    assert p.counts() == {"mac1": 2, "me@mac2": 1} and p.ranks_on("mac1") == [0, 2]
    # the bare-list form mlx.launch also reads
    f.write_text(json.dumps([{"ssh": "a", "ips": ["10.0.0.1"]}, {"ssh": "b"}]))
    assert [(h.name, h.ips) for h in H.read_hostfile(f).hosts] == [("a", ("10.0.0.1",)), ("b", ())]
    for bad, msg in [
        ([{"ips": ["10.0.0.1"]}], 'entry 0 needs an "ssh" name'),
        ([{"ssh": "a", "ips": ["not-an-ip"]}], "is not an IP address"),
        ({"hosts": []}, "expected"),
    ]:
        f.write_text(json.dumps(bad))
        with pytest.raises(SetupError, match=msg):
            H.read_hostfile(f)
    with pytest.raises(SetupError, match="cannot read hostfile"):
        H.read_hostfile(tmp_path / "missing.json")
    with pytest.raises(SetupError, match="-n 5 does not match"):
        H.resolve(hostfile=_write(tmp_path, [{"ssh": "a"}]), n=5)


def _write(tmp_path: Path, data: object) -> Path:
    f = tmp_path / f"h{secrets.token_hex(3)}.json"
    f.write_text(json.dumps(data))
    return f


def test_hosts_list_spreads_ranks_in_blocks() -> None:
    names = lambda p: [h.name for h in p.hosts]  # noqa: E731
    assert names(H.from_list("a,b")) == ["a", "b"]
    assert names(H.from_list("a,b", 4)) == ["a", "a", "b", "b"]
    assert names(H.from_list(["a", "b", "c"], 4)) == ["a", "a", "b", "c"]
    assert H.from_list("10.0.0.7,b").hosts[0].ips == ("10.0.0.7",)
    assert H.from_list("a,b", 4).mpi_hosts() == "a:2,b:2"
    assert H.from_list("a,b", 3).mpi_hostfile() == "a slots=2\nb slots=1\n"
    with pytest.raises(SetupError, match="fewer ranks than"):
        H.from_list("a,b,c", 2)
    with pytest.raises(SetupError, match="twice"):
        H.from_list("a,a")
    with pytest.raises(SetupError, match="give host names"):
        H.from_list("a,,b")
    s = Session(hosts="a,b", n=4)  # placement only: nothing starts
    assert (s.n, s.launcher, s.placement.summary()) == (4, "ssh", "a x2, b x2")
    assert Session(hosts="a,b", backend="mpi").launcher == "mpi"
    with pytest.raises(SetupError, match="use --launcher ssh"):
        Session(hosts="a,b", launcher="local").start()


def test_slurm_allocation_from_a_fake_environment(tmp_path: Path) -> None:
    """No Slurm here: the allocation is a fake environment (and a fake scontrol)."""
    assert H.expand_nodelist("node[01-03,07],gpu5") == ["node01", "node02", "node03", "node07", "gpu5"]
    assert H.expand_nodelist("r[1-2]n[8-9]") == ["r1n8", "r1n9", "r2n8", "r2n9"]
    assert H.expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)",
           "PATH": str(empty)}
    p = H.from_slurm(env)
    assert [h.name for h in p.hosts] == ["node1", "node1", "node2", "node2"]
    assert "Slurm job 77" in p.source
    assert [h.name for h in H.from_slurm(env, n=2).hosts] == ["node1", "node2"]
    assert [h.name for h in H.from_slurm(env, n=1).hosts] == ["node1"]
    assert H.in_slurm_allocation(env) and H.resolve(env=env).n == 4
    assert H.resolve(hosts="local", env=env) is None
    assert H.resolve(env={"SLURM_JOB_NODELIST": "node1"}) is None  # one node: run locally
    assert H.resolve(env={}) is None
    with pytest.raises(SetupError, match="not inside a Slurm allocation"):
        H.resolve(hosts="slurm", env={})
    # with scontrol on PATH its expansion is used (it knows every nodelist syntax)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text("#!/bin/sh\n[ \"$1 $2\" = 'show hostnames' ] && printf 'alpha\\nbeta\\n'\n")
    (fake / "scontrol").chmod(0o755)
    env2 = dict(env, PATH=str(fake), SLURM_JOB_NODELIST="weird{syntax}", SLURM_TASKS_PER_NODE="1(x2)")
    assert [h.name for h in H.from_slurm(env2).hosts] == ["alpha", "beta"]


def test_mpirun_command_line_across_hosts(tmp_path: Path) -> None:
    """One machine: the generated mpirun command and hostfile are checked, not run."""
    try:
        mpirun = find_mpirun()
    except SetupError as e:
        pytest.skip(str(e))
    p = H.from_list("nodeA,nodeB", 4)
    p.envs = ["MLX_EXTRA=1"]
    cluster = _mpi_cluster(tmp_path, p, 4, "t")
    lnch = cluster.engine_launcher_class(parent=cluster, profile_dir=cluster.profile_dir,
                                         cluster_id="t")
    lnch.n = 4
    args = lnch.find_args()
    assert args[:3] == [mpirun, "-n", "4"]
    hostfile = args[args.index("--hostfile") + 1]
    assert Path(hostfile).read_text() == "nodeA slots=2\nnodeB slots=2\n"
    assert stat.S_IMODE(os.stat(hostfile).st_mode) == 0o600
    exported = {args[i + 1] for i, a in enumerate(args) if a == "-x"}
    assert {"IPP_CONNECTION_INFO", "IPP_CLUSTER_ID", "IPP_PROFILE_DIR", "MLX_EXTRA"} <= exported
    assert args[args.index("mlx_nbdist.engine.mpi_entry") + 1] == "--mpi"
    # without hosts: this machine only, nothing exported
    local = _mpi_cluster(tmp_path, None, 2, "u")
    largs = local.engine_launcher_class(parent=local, profile_dir=local.profile_dir).find_args()
    assert "--hostfile" not in largs and "-x" not in largs


def _mpi_cluster(tmp_path: Path, placement: Any, n: int, sid: str) -> Any:
    import ipyparallel as ipp

    kw = MPILauncher(placement, n=n).cluster_kwargs(tmp_path)
    return ipp.Cluster(n=n, cluster_id=sid, profile_dir=str(tmp_path / "profile"),
                       controller_ip="127.0.0.1", **kw)


def test_mpirun_options_fit_the_user_and_the_machine() -> None:
    """--allow-run-as-root only as root, --oversubscribe only past the cores."""
    assert mpi_args(2, euid=1000, cores=8) == ["--bind-to", "none"]
    assert mpi_args(4, euid=0, cores=2) == [
        "--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]


def test_launcher_registry_feeds_the_magic_and_names_bad_input() -> None:
    from mlx_nbdist.magics import _line_parser

    assert set(launchers.LAUNCHERS) == {"local", "ssh", "mpi"}
    start = _line_parser()._subparsers._group_actions[0].choices["start"]
    choices = next(a.choices for a in start._actions if a.dest == "launcher")
    assert list(choices) == list(launchers.LAUNCHERS)
    with pytest.raises(SetupError, match="unknown launcher 'srun'; choose one of local, ssh, mpi"):
        launchers.create("srun", None, 2)
    with pytest.raises(SetupError, match="unknown backend 'gloo'; choose one of ring, mpi, nccl, jaccl"):
        Session(2, backend="gloo")
    with pytest.raises(SetupError, match="--launcher ssh needs hosts"):
        launchers.create("ssh", None, 2).check(launchers.backend_of("ring"))
    with pytest.raises(SetupError, match="--backend mpi needs --launcher mpi"):
        launchers.create("local", None, 2).check(launchers.backend_of("mpi"))


def test_ssh_launcher_settings_and_controller_address() -> None:
    p = H.from_list("a,me@b", 3)
    kw = SSHLauncher(p).cluster_kwargs(Path("."))
    cfg = kw["config"]
    assert kw["engines"] == "ssh"
    assert cfg.SSHEngineSetLauncher.engines == {"a": 2, "me@b": 1}
    assert cfg.SSHLauncher.ssh_cmd == ["ssh"] and "BatchMode=yes" in cfg.SSHLauncher.ssh_args
    assert cfg.SSHLauncher.remote_python == sys.executable
    assert cfg.SSHEngineLauncher.to_send == []  # connection info goes in the environment
    custom = SSHLauncher(p, ssh_cmd=["my-ssh"], python="/opt/py").cluster_kwargs(Path("."))["config"]
    assert custom.SSHLauncher.ssh_cmd == ["my-ssh"] and custom.SSHLauncher.ssh_args == []
    assert custom.SSHLauncher.remote_python == "/opt/py"
    with pytest.raises(SetupError, match="is not an address of this machine"):
        H.controller_address(p, "203.0.113.9")
    assert H.controller_address(p, "0.0.0.0") == "0.0.0.0"  # only when asked for
    assert H.controller_address(H.from_list("127.0.0.1")) == "127.0.0.1"


def test_an_unreachable_host_is_named_and_nothing_is_left() -> None:
    before = set(_ours_anywhere())
    s = Session(hosts="ghost-node", controller_ip="127.0.0.1", ssh_cmd=["false"], start_timeout=30)
    with pytest.raises(StartError, match="could not start the engines on host ghost-node"):
        s.start()
    assert s.state == "stopped" and s.cluster is None
    # the start fails while the controller is still forking its schedulers: those
    # forked after the session listed its processes are ended too, not orphaned
    left = [pid for pid in _ours_anywhere() if pid not in before]
    assert wait_gone(left, timeout=1.0) == []


# -- hosts as network namespaces --------------------------------------------------------


@dataclass
class Net:
    """The namespaces a test made: ``hosts[i]`` has address ``ips[i]``."""

    prefix: str
    bridge: str
    controller_ip: str
    hosts: list[str]
    ips: list[str]
    host_veths: list[str]
    ssh: str
    scp: str

    def hostfile(self, path: Path, ips: list[str] | None = None) -> Path:
        path.write_text(json.dumps({"hosts": [
            {"ssh": h, "ips": [ip]} for h, ip in zip(self.hosts, ips or self.ips, strict=True)
        ]}))
        return path

    def session(self, hostfile: Path, **kw: object) -> Session:
        return Session(hostfile=hostfile, ssh_cmd=[self.ssh], scp_cmd=[self.scp], **kw)  # type: ignore[arg-type]

    def pids(self) -> list[int]:
        out = []
        for h in self.hosts:
            r = subprocess.run(["ip", "netns", "pids", h], capture_output=True, text=True)
            out += [int(x) for x in r.stdout.split()]
        return out


SSH = """#!/bin/sh
# ssh HOST COMMAND... -> run COMMAND through a shell in network namespace HOST
host="$1"; shift
exec ip netns exec "$host" sh -c "$*"
"""

SCP = """#!/bin/sh
# scp SRC DST between namespaces that share one disk: drop the `host:` prefix
src="${1#*:}"; dst="${2#*:}"
[ "$src" -ef "$dst" ] && exit 0
exec cp "$src" "$dst"
"""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Net]:
    if sys.platform != "linux" or shutil.which("ip") is None:
        pytest.skip("needs Linux and the `ip` command (iproute2) to make network namespaces")
    prefix = f"mn{os.getpid() % 10000:04d}{secrets.token_hex(1)}"
    probe = _ip("netns", "add", f"{prefix}-x", check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot make network namespaces here (needs root / CAP_SYS_ADMIN): "
                    f"`ip netns add` said: {probe.stderr.strip()}")
    _ip("netns", "del", f"{prefix}-x", check=False)
    used = set(H.local_addresses())
    octet = random.choice([o for o in range(100, 250) if not any(a.startswith(f"10.213.{o}.") for a in used)])
    subnet = f"10.213.{octet}"
    hosts = [f"{prefix}-a", f"{prefix}-b"]
    ips = [f"{subnet}.10", f"{subnet}.11"]
    bridge, veths = f"{prefix}br", [f"{prefix}h{i}" for i in range(2)]
    tmp = tmp_path_factory.mktemp("netns")
    ssh, scp = tmp / "ssh", tmp / "scp"
    ssh.write_text(SSH)
    scp.write_text(SCP)
    ssh.chmod(0o755)
    scp.chmod(0o755)
    n = Net(prefix, bridge, f"{subnet}.1", hosts, ips, veths, str(ssh), str(scp))
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{n.controller_ip}/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i, (h, ip) in enumerate(zip(hosts, ips, strict=True)):
            inner = f"{prefix}n{i}"
            _ip("netns", "add", h)
            _ip("link", "add", veths[i], "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", h)
            _ip("link", "set", veths[i], "master", bridge)
            _ip("link", "set", veths[i], "up")
            _ip("-n", h, "addr", "add", f"{ip}/24", "dev", inner)
            _ip("-n", h, "link", "set", "lo", "up")
            _ip("-n", h, "link", "set", inner, "up")
        yield n
    finally:
        for pid in n.pids():  # anything the tests left running in the namespaces
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for v in veths:
            _ip("link", "del", v, check=False)
        for h in hosts:
            _ip("netns", "del", h, check=False)
        _ip("link", "del", bridge, check=False)
        t_end = time.monotonic() + 10
        while time.monotonic() < t_end:
            left = [x for x in _ip("-br", "link").stdout.split() if x.startswith(prefix)]
            left += [x for x in _ip("netns", "list").stdout.split() if x.startswith(prefix)]
            if not left:
                break
            time.sleep(0.2)
        assert not left, f"network objects left behind: {left}"


def _addr(hexpair: str) -> tuple[str, int]:
    ip, port = hexpair.split(":")
    return socket.inet_ntoa(struct.pack("<I", int(ip, 16))), int(port, 16)


def tcp_sockets(pid: int) -> list[tuple[str, tuple[str, int], tuple[str, int]]]:
    """``(state, local, remote)`` of a process's TCP sockets, read in its own
    network namespace (psutil reads this machine's, which misses them)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if f[9] in inodes:
            out.append(({"0A": "LISTEN", "01": "ESTABLISHED"}.get(f[3], f[3]), _addr(f[1]), _addr(f[2])))
    return out


ALL_SUM = "s = mx.distributed.all_sum(mx.ones(3) * (rank + 1), group=world)\nprint(s.tolist())"

MLP = """
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_linear
mx.random.seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
x = mx.random.normal((4, 16), key=mx.random.key(1))
full = model(x)
up = shard_linear(model.layers[0], "all-to-sharded", group=world)
down = shard_linear(model.layers[2], "sharded-to-all", group=world)
y = down(nn.relu(up(x)))
mx.eval(full, y)
print(tuple(up.weight.shape), tuple(down.weight.shape), float(mx.abs(y - full).max()), float(y.sum()))
"""

LOOP = """
import time
t0, i = time.time(), 0
while time.time() - t0 < 120:
    mx.eval(mx.distributed.all_sum(mx.ones(8), group=world))
    i += 1
print(i)
"""


def _pids(s: Session) -> list[int]:
    return [info.pid for info in s.ranks.values()] + [s.cluster.controller_pid()]


def test_two_hosts_all_sum_sharded_mlp_restart_and_a_cut_link(net: Net, tmp_path: Path) -> None:
    hostfile = net.hostfile(tmp_path / "hosts.json")
    t0 = time.monotonic()
    s = net.session(hostfile, timeout=60)  # controller address: found from the route
    s.start()
    started = time.monotonic() - t0
    try:
        # placement: rank r on host r, ring endpoints on the namespaces' addresses
        assert s.controller_ip == net.controller_ip
        assert [s.ranks[r].host for r in (0, 1)] == net.hosts
        assert [s.places[r].addresses[0].split(":")[0] for r in (0, 1)] == net.ips
        ring = json.loads((s.directory / "hostfile.json").read_text())
        assert [e[0].split(":")[0] for e in ring] == net.ips
        for r in (0, 1):
            assert s.ranks[r].pid in net.pids()  # the engine runs inside its namespace
            ns = _ip("netns", "identify", str(s.ranks[r].pid)).stdout.strip()
            assert ns == net.hosts[r]

        # nothing listens on every interface; the controller only on the bridge
        ctl = psutil.Process(s.cluster.controller_pid())
        ctl_addrs = {c.laddr.ip for c in ctl.net_connections("inet") if c.status == psutil.CONN_LISTEN}
        assert ctl_addrs == {net.controller_ip}
        for r in (0, 1):
            listen = {a[0] for st, a, _ in tcp_sockets(s.ranks[r].pid) if st == "LISTEN"}
            assert listen <= {net.ips[r], "127.0.0.1"} and "0.0.0.0" not in listen
        conn_file = next((s.directory / "profile" / "security").glob("*engine.json"))
        assert stat.S_IMODE(os.stat(conn_file).st_mode) == 0o600
        conn = json.loads(conn_file.read_text())
        assert conn["key"] and conn["interface"] == f"tcp://{net.controller_ip}"
        for r in (0, 1):  # the key reaches the engines through the environment, not argv
            assert conn["key"] not in " ".join(psutil.Process(s.ranks[r].pid).cmdline())

        # an all_sum over the veth network
        res = s.run(ALL_SUM)
        assert [res.stdout(r) for r in (0, 1)] == ["[3.0, 3.0, 3.0]\n"] * 2
        peers = {rem[0] for st, _, rem in tcp_sockets(s.ranks[0].pid) if st == "ESTABLISHED"}
        assert net.ips[1] in peers  # rank 0 talks to rank 1's namespace address
        assert {k: v.state for k, v in s.rank_states().items()} == {0: "idle", 1: "idle"}

        # a tensor-parallel MLP: each host holds half of each layer, outputs match
        res = s.run(MLP)
        out = [res.stdout(r).split() for r in (0, 1)]
        for words in out:
            assert words[:4] == ["(32,", "16)", "(16,", "32)"]
            assert float(words[4]) < 1e-5
        assert out[0][5] == out[1][5]

        # restart: new engines on the same hosts
        old = _pids(s)
        t1 = time.monotonic()
        s.restart()
        restarted = time.monotonic() - t1
        assert wait_gone(old, timeout=15) == []
        assert [s.ranks[r].host for r in (0, 1)] == net.hosts
        res = s.run(ALL_SUM)
        assert res.stdout(1) == "[3.0, 3.0, 3.0]\n"

        # cut host b's link while the ranks run collectives in a loop
        cut: list[float] = []

        def cut_link() -> None:
            cut.append(time.monotonic())
            _ip("link", "set", net.host_veths[1], "down")

        timer = threading.Timer(2.0, cut_link)
        timer.start()
        t2 = time.monotonic()
        with pytest.raises(CellError) as info:
            s.run(LOOP, timeout=40)
        ended = time.monotonic()
        timer.join()
        assert ended - t2 < 40 + 3  # within the deadline (plus the reporting)
        msg = str(info.value)
        assert f"host {net.hosts[1]}" in msg and net.ips[1] in msg
        assert "lost contact" in msg or "does not answer" in msg
        assert s.state == "broken"
        print(f"\nstart {started:.1f} s, restart {restarted:.1f} s, cut -> error "
              f"{ended - cut[0]:.1f} s ({type(info.value).__name__}):\n{msg}")
    finally:
        _ip("link", "set", net.host_veths[1], "up", check=False)
        pids = _pids(s) if s.ranks else []
        s.stop()
    assert wait_gone(pids, timeout=20) == []


def test_remote_fallback_without_shared_pids_or_files(net: Net, tmp_path: Path) -> None:
    """Ranks treated as on other machines: liveness from the controller's registry,
    signals through the launcher's ssh, no status files (the deadline governs)."""
    s = net.session(net.hostfile(tmp_path / "hosts.json"), timeout=60, assume_remote=True)
    s.start()
    try:
        assert not any(p.local or p.shared_files for p in s.places.values())
        assert s.group is not None and s.group.procs == {}
        assert all(s.group.rank_alive(r) for r in (0, 1))
        assert s.rank_record(0) == {} and s.rank_states()[1].state == "unknown"
        assert s.run(ALL_SUM).stdout(0) == "[3.0, 3.0, 3.0]\n"
        victim = s.ranks[1].pid
        t0 = time.monotonic()
        with pytest.raises(CollectiveTimeout) as info:
            s.run("if rank == 0:\n    raise ValueError('boom')\n"
                  "mx.eval(mx.distributed.all_sum(mx.ones(2), group=world))", timeout=6)
        assert time.monotonic() - t0 < 6 + 8
        assert f"rank 1 on {net.hosts[1]}" in str(info.value)
        assert info.value.result.ranks[0].failure.ename == "ValueError"
        assert wait_gone([victim], timeout=10) == []  # killed over "ssh" into its namespace
    finally:
        pids = _pids(s) if s.ranks else []
        s.stop()
    assert wait_gone(pids, timeout=20) == []


def test_a_wrong_address_in_the_hostfile_names_the_host(net: Net, tmp_path: Path) -> None:
    bad = net.ips[1].rsplit(".", 1)[0] + ".99"
    s = net.session(net.hostfile(tmp_path / "bad.json", [net.ips[0], bad]),
                    controller_ip=net.controller_ip, start_timeout=60)
    with pytest.raises(StartError) as info:
        s.start()
    msg = str(info.value)
    assert f"host {net.hosts[1]}" in msg and bad in msg and net.ips[1] in msg
    assert s.state == "stopped"
    t_end = time.monotonic() + 20
    while net.pids() and time.monotonic() < t_end:
        time.sleep(0.2)
    assert net.pids() == []


def test_hostfile_rdma_and_backend_are_read(tmp_path: Path) -> None:
    """jaccl's hostfile: ``rdma`` kept per rank, ``backend`` the session's default."""
    f = tmp_path / "hosts.json"
    f.write_text(json.dumps({"backend": "jaccl", "hosts": [
        {"ssh": "mac1", "ips": ["10.0.0.1"], "rdma": [None, ["rdma_en2", "rdma_en3"]]},
        {"ssh": "mac2", "ips": ["10.0.0.2"], "rdma": ["rdma_en2", None]},
    ]}))
    p = H.read_hostfile(f)
    assert p.hosts[0].rdma == (None, ("rdma_en2", "rdma_en3")) and p.hosts[1].rdma == ("rdma_en2", None)
    assert H.ibv_devices(p) == [[None, ["rdma_en2", "rdma_en3"]], ["rdma_en2", None]]
    s = Session(hostfile=f)
    assert (s.backend, s.launcher) == ("jaccl", "ssh")
    assert Session(hostfile=f, backend="ring").backend == "ring"  # the explicit one wins
