"""What an open dashboard costs: the round trip of a trivial ``%%mlxdist`` cell and a
tensor-parallel step (bench/tp_step.py's Megatron MLP, 2 ranks), with the dashboard
open (polling every 0.5 s, its default, in the kernel) and closed.

A jupyter_client front end runs a ``python3`` kernel with a 2-rank session (the
harness of bench/live_output.py); time = execute_request to execute_reply at the front
end. Blocks of cells alternate closed / open so drift hits both alike.
"""

from __future__ import annotations

import json

from common import stats
from live_output import Frontend
from tp_step import SETUP as TP_SETUP

RANKS = 2
BLOCKS = 8
PER_BLOCK = {"round trip": 25, "tp step": 4}
CELLS = {"round trip": "%%mlxdist\npass", "tp step": "%%mlxdist\nstep()"}
OPEN = "from mlx_nbdist.viz.dashboard import dashboard as _dash\n_d = _dash()"
CLOSE = "_d.close()"


def main() -> dict:
    fe = Frontend()
    try:
        fe.run_ok(f"%load_ext mlx_nbdist\n%mlxdist start -n {RANKS}")
        fe.run_ok("%%mlxdist\n" + TP_SETUP + "\nstep()")
        samples: dict[str, dict[str, list[float]]] = {
            what: {"closed": [], "open": []} for what in CELLS
        }
        for b in range(BLOCKS):
            state = "open" if b % 2 else "closed"
            if state == "open":
                fe.run_ok(OPEN)
            for what, code in CELLS.items():
                for _ in range(PER_BLOCK[what]):
                    took, reply = fe.execute(code)
                    if reply["content"]["status"] != "ok":
                        raise RuntimeError(f"{code!r} failed: {reply['content']}")
                    samples[what][state].append(took)
            if state == "open":
                fe.run_ok(CLOSE)
        fe.run_ok("%mlxdist stop")
    finally:
        fe.close()
    out = {}
    for what, by in samples.items():
        closed, opened = stats(by["closed"]), stats(by["open"])
        out[what] = {"closed": closed, "open": opened, "ratio": opened["median"] / closed["median"]}
    return out


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
