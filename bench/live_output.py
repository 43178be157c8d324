"""Live output through a real kernel: how long a rank's line takes to reach the front
end, ``%%mlxdist`` (one display per rank, updated in place) against ipyparallel's
``%%px --stream``, and the round trip of a trivial cell with streaming on.

A jupyter_client front end runs a ``python3`` kernel, which starts a 2-rank session
with ``%mlxdist start -n 2`` and activates ``%%px`` on the same engines. Each rank
prints ``time.time()`` stamps; the front end notes (``time.time()``, same machine
clock) when the first iopub message holding each stamp arrives. In the kernel,
``%%px --stream`` publishes ``display_data`` / ``update_display_data`` messages (one
display per engine and stream), not ``stream`` messages, so for both paths the stamp
is looked for in any message's text.

For ``%%mlxdist`` the kernel also notes, per stamp, when ipyparallel's IO thread
handed the message to the session (``CellStreams.feed``) and when the magic's live
view got the event (``LiveOutput.__call__``, on the supervisor's poll), which splits
the latency into its three legs.
"""

from __future__ import annotations

import json
import re
import time
from itertools import pairwise
from typing import Any

import psutil
import zmq
from jupyter_client.manager import KernelManager

from common import stats

RANKS = 2
STAMP = re.compile(r"@(\d+):(\d+):(\d+\.\d+)")

# name: (lines, the sleep after line i (an expression), flush after each print,
# which lines are measured, runs of each path)
CADENCES: dict[str, tuple[int, str, bool, str, int]] = {
    "every 0.2 s, flush=True": (20, "0.2", True, "all", 3),
    "every 0.02 s, flush=True": (50, "0.02", True, "all", 3),
    # (not 0.2 s: in step with the flush interval, a line often rides out with the next)
    "every 0.3 s, no flush": (14, "0.3", False, "all", 2),
    # a line 0.03 s after another, then 0.4 s of quiet: the second is throttled
    "pairs 0.03 s apart, 2nd line": (16, "0.03 if i % 2 == 0 else 0.4", True, "odd", 2),
}

SETUP = f"""\
%load_ext mlx_nbdist
%mlxdist start -n {RANKS}
import ipyparallel, mlx_nbdist
s = mlx_nbdist.current_session()
_view = s.client[[s.ranks[r].engine_id for r in range({RANKS})]]
_view.block = True  # %%px waits for the cell, as %%mlxdist does (a view's default: no)
_view.activate()
"""

# the kernel notes when each stamp reached the session (IO thread) and the live view
PROBE = r"""
import re as _re, time as _time
from mlx_nbdist.streams import CellStreams as _CS
from mlx_nbdist.viz.live import LiveOutput as _LO
_STAMP = _re.compile(r"@(\d+):(\d+):(\d+\.\d+)")
from mlx_nbdist.supervise import Supervisor as _SV
_probe = {"feed": {}, "view": {}, "loop": []}
def _note(where, text):
    t = _time.time()
    for m in _STAMP.finditer(text):
        _probe[where].setdefault(m.group(1) + ":" + m.group(2), (t, float(m.group(3))))
_feed0, _call0 = _CS.feed, _LO.__call__
def _feed(self, rank, msg):
    _note("feed", str((msg.get("content") or {}).get("text", "")))
    return _feed0(self, rank, msg)
def _call(self, ev):
    _note("view", ev.text)
    return _call0(self, ev)
_tick0 = _SV._tick
def _tick(self):
    _probe["loop"].append(_time.monotonic())
    return _tick0(self)
_CS.feed, _LO.__call__, _SV._tick = _feed, _call, _tick
"""


def cell_body(lines: int, sleep: str, flush: bool) -> str:
    end = ", flush=True" if flush else ""
    return (
        "import time\n"
        f"for i in range({lines}):\n"
        f"    print(f'@{{rank}}:{{i}}:{{time.time():.6f}}'{end})\n"
        f"    time.sleep({sleep})\n"
    )


class Frontend:
    """A jupyter_client front end that times iopub messages and execute replies."""

    def __init__(self) -> None:
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel()
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)
        self.poller = zmq.Poller()
        self.poller.register(self.kc.iopub_channel.socket, zmq.POLLIN)
        self.poller.register(self.kc.shell_channel.socket, zmq.POLLIN)

    def execute(self, code: str, on_iopub: Any = None, timeout: float = 180) -> tuple[float, dict]:
        """Run ``code``; ``(seconds from sending the request to the reply's arrival,
        reply)``. Every iopub message of the request (until the kernel is idle) goes
        to ``on_iopub(msg, arrival time.time())``."""
        t0 = time.perf_counter()
        msg_id = self.kc.execute(code)
        reply, took, idle = None, 0.0, False
        deadline = time.monotonic() + timeout
        while reply is None or not idle:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no reply to {code[:60]!r} in {timeout} s")
            for sock, _ in self.poller.poll(left * 1e3):
                if sock is self.kc.shell_channel.socket:
                    msg = self.kc.shell_channel.get_msg(timeout=0)
                    if msg["parent_header"].get("msg_id") == msg_id:
                        took, reply = time.perf_counter() - t0, msg
                else:
                    msg = self.kc.iopub_channel.get_msg(timeout=0)
                    if msg["parent_header"].get("msg_id") != msg_id:
                        continue
                    if on_iopub is not None:
                        on_iopub(msg, time.time())
                    if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                        idle = True
        assert reply is not None
        return took, reply

    def run_ok(self, code: str, timeout: float = 180) -> str:
        """Run ``code``, raise if it failed; its text output."""
        out: list[str] = []

        def hook(msg: dict, _t: float) -> None:
            c = msg["content"]
            if msg["msg_type"] == "stream":
                out.append(c["text"])
            elif msg["msg_type"] in ("display_data", "execute_result", "update_display_data"):
                out.append(str(c["data"].get("text/plain", "")) + "\n")
            elif msg["msg_type"] == "error":
                out.append(f"{c['ename']}: {c['evalue']}\n")

        _, reply = self.execute(code, hook, timeout)
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"{code[:80]!r} failed in the kernel:\n{''.join(out)[-3000:]}")
        return "".join(out)

    def close(self) -> None:
        try:
            self.kc.stop_channels()
        finally:
            self.km.shutdown_kernel(now=False)


def text_of(msg: dict) -> str:
    c = msg["content"]
    if msg["msg_type"] == "stream":
        return str(c.get("text", ""))
    if msg["msg_type"] in ("display_data", "update_display_data", "execute_result"):
        return str(c.get("data", {}).get("text/plain", ""))
    return ""


def latency_run(fe: Frontend, head: str, body: str, probe: bool) -> dict[str, Any]:
    """One latency cell: per stamp (rank:i) its stamp and the front end's arrival."""
    seen: dict[str, tuple[float, float]] = {}
    n_msgs = {"n": 0}

    def hook(msg: dict, t: float) -> None:
        text = text_of(msg)
        if text:
            n_msgs["n"] += 1
        for m in STAMP.finditer(text):
            seen.setdefault(f"{m.group(1)}:{m.group(2)}", (t, float(m.group(3))))

    if probe:
        fe.run_ok('_probe = {"feed": {}, "view": {}, "loop": []}')
    took, reply = fe.execute(f"{head}\n{body}", hook)
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"latency cell {head!r} failed: {reply['content']}")
    out: dict[str, Any] = {"front end": seen, "messages": n_msgs["n"], "cell": took}
    if probe:
        out.update(json.loads(fe.run_ok("print(__import__('json').dumps(_probe))")))
    return out


def latency(fe: Frontend) -> dict[str, Any]:
    paths = {"%%mlxdist": "%%mlxdist", "%%px --stream": "%%px --stream"}
    result: dict[str, Any] = {}
    for name, (lines, sleep, flush, which, runs) in CADENCES.items():
        body = cell_body(lines, sleep, flush)
        measured = [i for i in range(lines) if which == "all" or i % 2 == 1]
        samples: dict[str, list[float]] = {p: [] for p in paths}
        loop: list[float] = []  # the supervisor's loop: time from one poll to the next
        legs: dict[str, list[float]] = {"rank -> kernel IO thread": [],
                                        "IO thread -> live view (poll)": [],
                                        "live view -> front end": []}
        msgs: dict[str, list[int]] = {p: [] for p in paths}
        missing = dict.fromkeys(paths, 0)
        for _ in range(runs):
            for p, head in paths.items():
                r = latency_run(fe, head, body, probe=p == "%%mlxdist")
                msgs[p].append(r["messages"])
                loop += [b - a for a, b in pairwise(r.get("loop", []))]
                expected = {f"{k}:{i}" for k in range(RANKS) for i in measured}
                missing[p] += len(expected - set(r["front end"]))
                for key, (arrival, stamp) in r["front end"].items():
                    if key not in expected:
                        continue
                    samples[p].append(arrival - stamp)
                    if "feed" in r and key in r["feed"] and key in r["view"]:
                        fed, viewed = r["feed"][key][0], r["view"][key][0]
                        legs["rank -> kernel IO thread"].append(fed - stamp)
                        legs["IO thread -> live view (poll)"].append(viewed - fed)
                        legs["live view -> front end"].append(arrival - viewed)
        result[name] = {
            **{p: {**stats(v), "messages per cell": sum(msgs[p]) / len(msgs[p]),
                   "stamps never seen": missing[p]} for p, v in samples.items()},
            "%%mlxdist legs": {k: stats(v) for k, v in legs.items() if v},
            "supervisor poll period": stats(loop),
        }
    return result


def roundtrip(fe: Frontend, runs: int = 50, warmup: int = 5) -> dict[str, Any]:
    paths = {
        "%%mlxdist": "%%mlxdist\npass",
        "%%px --stream": "%%px --stream\npass",
        "%%px (default: streams in a kernel)": "%%px\npass",
        "%%px --no-stream": "%%px --no-stream\npass",
    }
    samples: dict[str, list[float]] = {k: [] for k in paths}
    for i in range(warmup + runs):
        for k, code in paths.items():
            took, reply = fe.execute(code)
            if reply["content"]["status"] != "ok":
                raise RuntimeError(f"{code!r} failed: {reply['content']}")
            if i >= warmup:
                samples[k].append(took)
    return {k: stats(v) for k, v in samples.items()}


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _mentioning(folder: str) -> list[psutil.Process]:
    """Processes whose command line names the session's folder (only this session's)."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        if folder and any(folder in a for a in p.info["cmdline"] or []):
            out.append(p)
    return out


def main() -> dict:
    fe = Frontend()
    kernel_pid = fe.km.provisioner.pid  # type: ignore[union-attr]
    started: list[psutil.Process] = []  # what the kernel started: ended if left behind
    try:
        fe.run_ok(SETUP, timeout=300)
        folder = fe.run_ok("print(s.directory)").strip()
        started = _descendants(kernel_pid) + _mentioning(folder)  # the watchdog is detached
        fe.run_ok(PROBE)
        rt = roundtrip(fe)
        lat = latency(fe)
    finally:
        try:
            fe.run_ok("%mlxdist stop", timeout=120)
        finally:
            fe.close()
            _reap(started)
    base = rt["%%px --stream"]["median"]
    for row in rt.values():
        row["vs %%px --stream"] = row["median"] / base
    mlx_rt = rt["%%mlxdist"]["median"]
    for row in lat.values():
        for p in ("%%mlxdist", "%%px --stream"):
            row[p]["of %%mlxdist round trip"] = row[p]["median"] / mlx_rt
            row[p]["of own round trip"] = row[p]["median"] / rt[p]["median"]
    return {"latency": lat, "round trip": rt}


def _reap(procs: list[psutil.Process], wait: float = 10.0) -> None:
    """End what the kernel started and left behind (by PID, only those)."""
    _, alive = psutil.wait_procs(procs, timeout=wait)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    if alive:
        print(f"live_output: killed {len(alive)} leftover processes", flush=True)


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
