"""The routes a Mac takes, on this machine, in portable mode (``MLX_NBDIST_PORTABLE=1``).

No ``/proc`` reads of ours, no ``/dev/shm`` path, no ``process_vm_readv``: slices of
1 MiB and more go through a pool of POSIX shared memory (``shm_open``), smaller ones
as ipyparallel buffers; segments a dead rank leaves are found through the ranks'
registries. ``make test`` runs this module once in portable mode after the main suite.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from mlx_nbdist import platform

if not platform.portable():
    pytest.skip(
        "portable mode is off: run MLX_NBDIST_PORTABLE=1 pytest tests/test_portable.py "
        "(make test does)",
        allow_module_level=True,
    )

import mlx_nbdist  # noqa: E402
from mlx_nbdist import Session, watchdog  # noqa: E402
from mlx_nbdist.client.transfer import Lease, local_routes, vm_available  # noqa: E402
from mlx_nbdist.engine import rpc, transfer  # noqa: E402
from mlx_nbdist.engine.slices import needs_host_copy  # noqa: E402
from mlx_nbdist.engine.transfer import Route  # noqa: E402

from .conftest import wait_gone  # noqa: E402

ON = {platform.PORTABLE_ENV: "1"}
#: a model whose first weight is 4 MiB (2 MiB a rank, megatron): pool; its biases: buffers
MODEL = """
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

def build(seed=0):
    mx.random.seed(seed)
    return nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 64))

def params_np(m):
    return {k: np.array(v) for k, v in tree_flatten(m.parameters())}
"""
#: records the paths under /proc and /dev/shm that mlx_nbdist's own code opens or lists
#: (psutil's reads of /proc are psutil's: on macOS it uses sysctl instead)
WATCH = '''
import inspect, os, sys, sysconfig
import mlx_nbdist

OURS_OPENED = []
_STD = sysconfig.get_paths()["stdlib"]
_PKG = os.path.dirname(mlx_nbdist.__file__) + os.sep
_SITE = (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], _PKG)

def _std(filename):
    return filename.startswith(_STD) and not filename.startswith(_SITE)

def _who_opens(event, args):
    if event not in ("open", "os.listdir", "os.scandir", "glob.glob") or not args:
        return
    path = args[0]
    if not isinstance(path, (str, bytes, os.PathLike)):
        return
    path = os.fsdecode(path)
    if not path.startswith(("/proc", "/dev/shm")):
        return
    frame = inspect.currentframe().f_back
    while frame is not None and _std(frame.f_code.co_filename):
        frame = frame.f_back  # pathlib, io, glob: whoever called them
    if frame is not None and frame.f_code.co_filename.startswith(_PKG):
        OURS_OPENED.append((path, frame.f_code.co_filename, frame.f_lineno))

sys.addaudithook(_who_opens)
'''


def watch_opens() -> list[tuple[str, str, int]]:
    """Start recording, in this process, what :data:`WATCH` records; returns the list."""
    ns: dict[str, Any] = {}
    exec(WATCH, ns)  # noqa: S102 - our own code, the same the ranks run
    return ns["OURS_OPENED"]


def buffer_owner(arr: np.ndarray) -> Any:
    obj: Any = arr
    while isinstance(obj, np.ndarray) and obj.base is not None:
        obj = obj.base
    return obj


def reassemble(slices: list[Any]) -> np.ndarray:
    """The full tensor from the ranks' slices (each a block of ``ranges`` on ``axis``)."""
    first = slices[0]
    if first.axis is None:
        return first.data
    full = np.zeros(first.full_shape, dtype=first.data.dtype)
    for sl in slices:
        offset = 0
        for start, stop in sl.ranges:
            dst = [slice(None)] * full.ndim
            src = [slice(None)] * full.ndim
            dst[sl.axis], src[sl.axis] = slice(start, stop), slice(offset, offset + stop - start)
            full[tuple(dst)] = sl.data[tuple(src)]
            offset += stop - start
    return full


def segment_exists(name: str) -> bool:
    """Whether the POSIX segment ``name`` exists (asked by name: macOS cannot list them)."""
    try:
        platform.shm_attach(name, 1).close()
    except FileNotFoundError:
        return False
    return True


# ------------------------------------------------------------------ no engines


def test_platform_says_what_a_mac_and_portable_mode_offer() -> None:
    for value, on in (("1", True), ("true", True), ("YES", True), ("0", False), ("", False)):
        assert platform.portable({platform.PORTABLE_ENV: value}) is on
    assert platform.portable({}) is False
    for ask in (platform.has_proc, platform.has_dev_shm, platform.has_vm_read):
        assert ask({}, "darwin") is False and ask(ON, "linux") is False
    assert platform.has_vm_read({}, "linux") is True
    assert platform.has_posix_shm()
    # this process: portable, so only the POSIX-shm pool is offered
    assert local_routes() == [Route.SHM] and not vm_available()
    with pytest.raises(OSError, match="process_vm_readv is not available"):
        from mlx_nbdist.client.transfer import vm_read

        vm_read(os.getpid(), np.zeros(1).ctypes.data, np.empty(8, np.uint8))


def test_a_macs_machine_identity_is_its_boot_session_not_the_clock(tmp_path: Path) -> None:
    """macOS's boot time moves with the clock (a Mac that slept, then synced it): the
    identity is the kernel's id of the boot, ``kern.bootsessionuuid``, as sysctl says
    it (a stand-in sysctl here); without an answer, the boot time as before."""
    sysctl = tmp_path / "sysctl"
    sysctl.write_text('#!/bin/sh\n[ "$1 $2" = "-n kern.bootsessionuuid" ] && '
                      'echo 5B0A2C1E-0000-4000-8000-0123456789AB\n')
    sysctl.chmod(0o755)
    mac = {"PATH": str(tmp_path)}
    ident = platform.machine_id(mac, "darwin")
    assert ident == f"{socket.gethostname()}/5B0A2C1E-0000-4000-8000-0123456789AB"
    sysctl.write_text("#!/bin/sh\nexit 1\n")
    assert platform.machine_id(mac, "darwin") == (
        f"{socket.gethostname()}/{psutil.boot_time():.0f}")


def test_machine_identity_without_proc() -> None:
    opened = watch_opens()
    ident = platform.machine_id()
    assert ident == f"{socket.gethostname()}/{psutil.boot_time():.0f}"
    assert opened == []
    if sys.platform.startswith("linux"):  # control: outside portable mode it reads /proc
        linux = platform.machine_id({})
        assert linux != ident and len(linux.split("/", 1)[1]) == 36  # the boot id (a UUID)
        assert opened and opened[0][0] == str(platform.BOOT_ID)
        opened.clear()


def test_gpu_arrays_are_copied_to_the_host_unless_unified_memory() -> None:
    assert needs_host_copy("gpu", "cuda") is True
    assert needs_host_copy("gpu", "") is True  # a GPU of unknown kind: copy, to be safe
    assert needs_host_copy("gpu", "metal") is False  # Apple unified memory
    assert needs_host_copy("cpu", "cuda") is False and needs_host_copy("cpu", "") is False


def test_posix_shared_memory_adapter() -> None:
    name = transfer.shm_name(f"mlxnb-test-{os.getpid()}", os.getpid(), 12345)
    assert len(name) <= platform.SHM_NAME_MAX and not name.startswith("/mlxnb-")
    mm = platform.shm_create(name, 1 << 20)
    try:
        with pytest.raises(FileExistsError):
            platform.shm_create(name, 1 << 20)
        mm[:5] = b"hello"
        other = platform.shm_attach(name, 1 << 20)
        assert other[:5] == b"hello"
        other.close()
    finally:
        mm.close()
        assert platform.shm_unlink(name) is True
    assert platform.shm_unlink(name) is False and not segment_exists(name)
    with pytest.raises(FileNotFoundError):
        platform.shm_attach(name, 1)
    with pytest.raises(ValueError, match="bad shared-memory name"):
        platform.shm_create("/" + "x" * 40, 4096)


def test_the_watchdog_script_removes_registered_segments(tmp_path: Path) -> None:
    """The watchdog runs as a plain script (platform.py loaded by path): when the
    notebook is gone it unlinks the segments the ranks' registries name."""
    sid = time.strftime("%Y%m%d-%H%M%S-") + os.urandom(3).hex()
    prefix = f"mlxnb-{sid}"
    names = [transfer.shm_name(prefix, 4242, k) for k in range(2)]
    for name in names:
        platform.shm_create(name, 4096).close()
    reg = transfer.registry(prefix, 4242)
    reg.write_text(json.dumps([*names, "/not-ours"]))
    notebook = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        d = tmp_path / sid
        d.mkdir()
        started = watchdog.start_time(notebook.pid)
        (d / "session.json").write_text(json.dumps(
            {"session_id": sid, "client_pid": notebook.pid, "client_started": started, "clock": watchdog.CLOCK,
             "state": "ready", "pids": []}))
        assert watchdog.registries(sid) == [reg] and watchdog.leftovers(sid)
        wd = watchdog.start(d, notebook.pid, started)
        assert all(map(segment_exists, names))  # the notebook lives
        notebook.kill()  # not waited for: a zombie notebook is a dead one
        assert wait_gone([wd], timeout=10) == []
        assert not any(map(segment_exists, names)) and not reg.exists()
        assert "removed 2 shared-memory segments" in (d / "watchdog.log").read_text()
    finally:
        notebook.kill()
        notebook.wait()
        reg.unlink(missing_ok=True)
        for name in names:
            platform.shm_unlink(name)


# ------------------------------------------------------------------ real engines


#: what mlx_nbdist opened under /proc or /dev/shm in this process from the start of s2
STARTED: list[tuple[str, str, int]] = []


@pytest.fixture(scope="module")
def s2() -> Iterator[Session]:
    opened = watch_opens()
    s = Session(2, timeout=60).start()
    STARTED.extend(opened)
    try:
        s.run(MODEL + "\nimport mlx_nbdist\n" + WATCH)
        yield s
    finally:
        s.stop()


def test_all_sum_on_every_rank(s2: Session) -> None:
    res = s2.run("y = mx.distributed.all_sum(mx.ones(4) * (rank + 1))\ny.tolist()")
    assert [res.ranks[r].result_text for r in (0, 1)] == ["[3.0, 3.0, 3.0, 3.0]"] * 2
    assert s2.receiver.routes == [Route.SHM]  # no /dev/shm files, no process_vm_readv
    assert STARTED == []  # the start read nothing of /proc or /dev/shm here
    # the ranks' machine identity (how the session tells hosts apart) has no /proc in it
    assert s2.apply(rpc.machine_id) == {0: platform.machine_id(), 1: platform.machine_id()}
    assert s2.pull("OURS_OPENED") == {0: [], 1: []}


def test_slices_of_a_sharded_model_big_and_small(s2: Session) -> None:
    ns: dict[str, Any] = {}
    exec(MODEL, ns)  # noqa: S102 - the same code the ranks run
    full = ns["params_np"](ns["build"]())
    opened = watch_opens()
    s2.run('tp = mlx_nbdist.shard(build(), "megatron")')
    host = socket.gethostname()
    for path, pooled in (("layers.0.weight", True), ("layers.2.weight", False),
                         ("layers.0.bias", False), ("layers.2.bias", False)):
        got = mlx_nbdist.slices(f"tp.{path}", session=s2)
        np.testing.assert_array_equal(reassemble(got), full[path])
        for sl in got:
            assert (sl.data.nbytes >= transfer.POOL_MIN) is pooled, (path, sl.data.nbytes)
            assert isinstance(buffer_owner(sl.data), Lease) is pooled, path
        # what the ranks answer: a POSIX name for the big one, never a file path
        answers = s2.apply(rpc.slice_of, f"tp.{path}", None, s2.shm_prefix, host,
                           tuple(s2.receiver.routes), s2.receiver.held())
        for _meta, info, values in answers.values():
            if pooled:
                assert info["route"] == "shm" and "path" not in info and values is None
                assert info["name"].startswith("/mlxnb.")
            else:
                assert "route" not in info and isinstance(values, np.ndarray)
        del got, answers, sl
        gc.collect()
    # no /dev/shm file of the Linux route, and no /proc or /dev/shm path opened by
    # mlx_nbdist in the notebook or on a rank
    assert not list(Path("/dev/shm").glob(f"{s2.shm_prefix}-*"))
    assert opened == []
    assert s2.pull("OURS_OPENED") == {0: [], 1: []}
    if sys.platform.startswith("linux"):  # control: the ranks' record does catch a read
        s2.run("from mlx_nbdist import platform as _p\n_p.machine_id({})")  # not portable
        assert {r: [p for p, _f, _n in v] for r, v in s2.pull("OURS_OPENED").items()} == {
            0: [str(platform.BOOT_ID)], 1: [str(platform.BOOT_ID)]}
        s2.run("OURS_OPENED.clear()")


def test_pool_reuse(s2: Session) -> None:
    n = 2**19  # 2 MiB of float32 a rank
    s2.run(f"pool = mx.arange({n}, dtype=mx.float32) + rank * {n}\nmx.eval(pool)")
    want = [np.arange(n, dtype=np.float32) + r * n for r in range(2)]

    def state() -> list[tuple[int, int]]:
        s2.apply(rpc.settle)
        return [(v["busy"], v["free"]) for v in s2.apply(rpc.pool_state).values()]

    gc.collect()
    mlx_nbdist.slices("pool", session=s2)  # nothing held now: earlier segments all free
    base = sum(busy + free for busy, free in state()) // 2
    first = mlx_nbdist.slices("pool", session=s2)
    second = mlx_nbdist.slices("pool", session=s2)  # the first is held: another segment
    for a, b, w in zip(first, second, want, strict=True):
        np.testing.assert_array_equal(a.data, w)
        np.testing.assert_array_equal(b.data, w)
        assert not np.shares_memory(a.data, b.data)
    held = [busy for busy, _free in state()]
    assert held == [2, 2]
    del first, second, a, b
    gc.collect()
    third = mlx_nbdist.slices("pool", session=s2)  # reuses a free segment, makes none
    assert all(isinstance(buffer_owner(sl.data), Lease) for sl in third)
    assert [busy for busy, _free in state()] == [1, 1]
    assert sum(busy + free for busy, free in state()) // 2 == max(base, 2)
    del third
    gc.collect()


def test_a_killed_rank_leaves_no_segment_after_stop() -> None:
    s = Session(2, timeout=60).start()
    try:
        pids = [pid for pid, _ in s.processes()]
        s.run("big = mx.ones(2**19) * rank\nmx.eval(big)")
        # replies the notebook never maps (as if lost): each rank holds a named segment
        got = s.apply(rpc.slice_of, "big", None, s.shm_prefix, socket.gethostname(),
                      (Route.SHM.value,))
        names = [info["name"] for _meta, info, _values in got.values()]
        assert len(names) == 2 and all(map(segment_exists, names))
        assert len(watchdog.registries(s.session_id)) == 2
        assert not list(Path("/dev/shm").glob(f"{s.shm_prefix}-*"))
        rank1 = s.ranks[1].pid
        os.kill(rank1, signal.SIGKILL)
        assert wait_gone([rank1], timeout=10) == []
        assert segment_exists(names[1])  # the dead rank's segment outlives it
    finally:
        s.stop()
    assert not any(map(segment_exists, names))
    assert watchdog.registries(s.session_id) == [] and not watchdog.leftovers(s.session_id)
    assert wait_gone(pids, timeout=10) == [], "stop left processes running"
