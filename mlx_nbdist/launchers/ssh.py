"""Engines on the hosts of a placement, started over ssh by ipyparallel's
``SSHEngineSetLauncher``.

It starts ``engines[host]`` engines on each host (``python -m ipyparallel.engine``
through ``ssh host python``, detached, output in the remote profile's ``log``
folder). The controller's connection info, key included, travels in the
``$IPP_CONNECTION_INFO`` environment variable over ssh's stdin, so no connection
file is copied to the hosts.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ..errors import SetupError, StartError
from .base import Job, Launcher

#: ssh options used when the user gives no ssh command of their own: never prompt
#: (a prompt would hang the notebook) and give up on an unreachable host quickly.
SSH_ARGS = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]


def engine_launchers(cluster: Any) -> list[tuple[str, Any]]:
    """``(host name, launcher)`` of every engine ipyparallel started over ssh."""
    out = []
    for es in cluster.engines.values() if cluster is not None else []:
        for ident, lnch in list(getattr(es, "launchers", {}).items()):
            if hasattr(type(lnch), "ssh_sender"):  # the class: the property runs ssh
                out.append((str(ident).rsplit("/", 1)[0], lnch))
    return out


class SSHLauncher(Launcher):
    """One engine per placement entry, on its host, over ssh."""

    name = "ssh"
    summary = "engines on the hosts over ssh (the default with --hosts / --hostfile)"
    needs_hosts = True

    def cluster_kwargs(self, directory: Path) -> dict[str, Any]:
        from traitlets.config import Config

        if self.placement is None:
            raise SetupError("--launcher ssh needs hosts: give --hostfile FILE or --hosts a,b")
        cfg = Config()
        cfg.SSHEngineSetLauncher.engines = self.placement.counts()
        cfg.SSHLauncher.ssh_cmd = self.ssh_cmd or ["ssh"]
        cfg.SSHLauncher.ssh_args = [] if self.ssh_cmd else list(SSH_ARGS)
        cfg.SSHLauncher.scp_cmd = self.scp_cmd or ["scp"]
        cfg.SSHLauncher.scp_args = [] if self.scp_cmd else list(SSH_ARGS)
        cfg.SSHLauncher.remote_python = self.python or sys.executable
        cfg.SSHEngineLauncher.to_send = []
        return {"engines": "ssh", "config": cfg}

    def start_failure(self, cluster: Any, error: str) -> str:
        failed = [h for h, lnch in engine_launchers(cluster) if lnch.state == "before"]
        for es in cluster.engines.values():  # never started: nothing to stop
            for ident, lnch in list(getattr(es, "launchers", {}).items()):
                if getattr(lnch, "state", "") == "before":
                    es.launchers.pop(ident, None)
        assert self.placement is not None
        where = f" on host {', '.join(failed)}" if failed else f" on {self.placement.summary()}"
        return (
            f"could not start the engines{where} ({self.name} launcher): {error}. Check "
            "that `ssh HOST` works without a prompt from this machine and that the hosts "
            f"have this Python environment ({self.python or 'the same path as here'})."
        )

    def stopped_hosts(self, cluster: Any) -> list[str]:
        """Hosts where an engine process this launcher started has exited."""
        return sorted(
            {h for h, lnch in engine_launchers(cluster) if getattr(lnch, "state", "") == "after"}
        )

    def host_pids(self, cluster: Any) -> dict[str, set[int]]:
        pids: dict[str, set[int]] = {}
        for host, lnch in engine_launchers(cluster):
            if getattr(lnch, "pid", None):
                pids.setdefault(host, set()).add(int(lnch.pid))
        return pids

    def assign(self, cluster: Any, probes: dict[int, dict[str, Any]]) -> dict[int, int]:
        """Rank ``i`` is an engine on placement entry ``i``'s host: engines are matched
        to hosts by the PIDs ssh reported, then by addresses and names."""
        from ..hosts import match_host

        p = self.placement
        assert p is not None
        pids = self.host_pids(cluster)
        on: dict[str, list[int]] = {}
        for eid in sorted(probes):
            host = match_host(probes[eid], p.distinct(), pids)
            if host is None:
                pr = probes[eid]
                raise StartError(
                    f"cannot tell which host engine {eid} runs on (pid {pr['pid']}, "
                    f"hostname {pr['hostname']}, addresses {', '.join(pr['addresses'])}); "
                    f"hosts: {p.summary()}"
                )
            on.setdefault(host, []).append(eid)
        order: dict[int, int] = {}
        for host, count in p.counts().items():
            got = on.get(host, [])
            if len(got) != count:
                raise StartError(
                    f"host {host}: {count} ranks placed there but {len(got)} engines "
                    "registered from it"
                )
            order.update(zip(p.ranks_on(host), sorted(got), strict=True))
        return dict(sorted(order.items()))

    def host_of(self, rank: int, probe: dict[str, Any]) -> str:
        assert self.placement is not None
        return self.placement.hosts[rank].name

    def remote_signals(
        self, cluster: Any, targets: dict[int, tuple[str, int]], sig: int
    ) -> list[Job]:
        """``kill -SIG pid`` on each rank's host, through the ssh of the launcher that
        started an engine there."""
        by_host = dict(engine_launchers(cluster))
        jobs: list[Job] = []
        for host, pid in targets.values():
            lnch = by_host.get(host)
            if lnch is not None:
                jobs.append(_remote_kill(lnch, pid, sig))
        return jobs


def _remote_kill(launcher: Any, pid: int, sig: int) -> Job:
    def job() -> None:
        try:
            launcher.ssh_sender.cmd_kill(pid, int(sig))
        except Exception:  # noqa: BLE001 - gone already, or the host is unreachable
            pass

    return job
