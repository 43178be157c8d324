"""Cell round trip: a trivial %%mlxdist cell versus %%px, view.execute and a broadcast view.

All three paths run against the same engines of one session, interleaved, so the
ratios are measured side by side.
"""

from __future__ import annotations

import io
from contextlib import redirect_stdout

from IPython.core.interactiveshell import InteractiveShell

from common import stats, time_it

from mlx_nbdist import Session, api


def measure(n: int, runs: int = 200) -> dict:
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "mlx_nbdist")
    with Session(n, timeout=60) as s:
        api.set_current_session(s)
        ids = [s.ranks[r].engine_id for r in range(n)]
        view = s.client[ids]
        bview = s.client.broadcast_view(targets=ids)  # one message, fanned out by a scheduler
        view.activate()  # registers %%px for these engines
        paths = {
            "%%mlxdist (magic)": lambda: ip.run_cell_magic("mlxdist", "", "pass"),
            "Session.run": lambda: s.run("pass"),
            "%%px (ipyparallel)": lambda: ip.run_cell_magic("px", "--block", "pass"),
            "view.execute(block=True)": lambda: view.execute("pass", block=True),
            "broadcast_view.execute(block=True)": lambda: bview.execute("pass", block=True),
        }
        samples: dict[str, list[float]] = {k: [] for k in paths}
        sink = io.StringIO()
        with redirect_stdout(sink):
            for _ in range(10):
                for fn in paths.values():
                    fn()
            # the order turns each round: a path that does not wait for the engines'
            # output-idle messages (view.execute) leaves them to the path run after it
            order = list(paths)
            for i in range(runs):
                for k in order[i % len(order):] + order[: i % len(order)]:
                    samples[k].append(time_it(paths[k]))
        api.set_current_session(None)
    return {k: stats(v) for k, v in samples.items()}


def main() -> dict:
    return {f"{n} ranks": measure(n) for n in (2, 4)}


if __name__ == "__main__":
    import json

    print(json.dumps(main(), indent=1))
