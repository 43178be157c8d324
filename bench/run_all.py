"""Run every benchmark side by side and write docs/performance.md.

Usage: ``python bench/run_all.py [names...]`` (default: all; ``none`` only rewrites the
doc). Results are also kept as JSON under bench/results/, the last run of each benchmark
in ``<name>.json`` and every run's goal rows in ``history.json`` (with a hash of the
sources measured, so the doc can show how a goal's ratio moved over runs of one code).
"""

from __future__ import annotations

import hashlib
import json
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import collectives  # noqa: E402
import dashboard_cost  # noqa: E402
import decode  # noqa: E402
import live_output  # noqa: E402
import restart  # noqa: E402
import roundtrip  # noqa: E402
import slices  # noqa: E402
import startup  # noqa: E402
import tp_step  # noqa: E402
import trace_cost  # noqa: E402
from common import RESULTS, machine, save  # noqa: E402

BENCHES = {
    "roundtrip": roundtrip,
    "collectives": collectives,
    "slices": slices,
    "startup": startup,
    "tp_step": tp_step,
    "live_output": live_output,
    "trace_cost": trace_cost,
    "restart": restart,
    "decode": decode,
    "dashboard_cost": dashboard_cost,
}
ROOT = Path(__file__).parent.parent
DOC = ROOT / "docs" / "performance.md"
HISTORY = RESULTS / "history.json"


def ms(x: float) -> str:
    return f"{x * 1e3:.2f} ms"


def section_roundtrip(d: dict) -> list[str]:
    out = ["## Cell round trip", "",
           "A trivial cell (`pass`) on every rank; 200 runs of each path, interleaved, same engines.",
           "", "| ranks | path | median | p95 | vs `%%px` |", "|---|---|---|---|---|"]
    for ranks, rows in d.items():
        px = rows["%%px (ipyparallel)"]["median"]
        for path, st in rows.items():
            out.append(f"| {ranks} | {path} | {ms(st['median'])} | {ms(st['p95'])} | "
                       f"{st['median'] / px:.2f}x |")
    return out + [""]


def section_collectives(d: dict) -> list[str]:
    sizes = sorted({int(k) for row in d.values() for k in row})
    out = ["## Collective bandwidth (2 ranks, float32 all_sum, GB/s = bytes / median time)", "",
           "| path | " + " | ".join(f"{s} MB" for s in sizes) + " |",
           "|---|" + "---|" * len(sizes)]
    for name, row in d.items():
        out.append(f"| {name} | " + " | ".join(f"{row.get(str(s), row.get(s, float('nan'))):.3f}"
                                              for s in sizes) + " |")
    for cell_name, script_name in (("%%mlxdist cell, ring", "mlx.launch script, ring"),
                                   ("%%mlxdist cell, ring", "script, ring, ranks started directly"),
                                   ("%%mlxdist cell, mpi", "mpirun script, MLX mpi")):
        cell, plain = d.get(cell_name, {}), d.get(script_name, {})
        if cell and plain:
            ratios = [float(cell[k]) / float(plain[k]) for k in cell if k in plain]
            out += ["", f"{cell_name} / {script_name}, by size: "
                    + ", ".join(f"{r:.2f}" for r in ratios)]
    return out + [""]


def section_slices(d: dict) -> list[str]:
    out = ["## Pulling slices to the notebook (2 ranks x 64 MB)", "",
           "| path | median | p95 | GB/s (median) | of memcpy into new memory |",
           "|---|---|---|---|---|"]
    for name, st in d.items():
        share = f"{st['of memcpy'] * 100:.0f} %" if "of memcpy" in st else "-"
        out.append(f"| {name} | {ms(st['median'])} | {ms(st['p95'])} | {st['GB/s']:.2f} | "
                   f"{share} |")
    by = next((st["by session"] for st in d.values() if "by session" in st), None)
    if by:
        out += ["", f"The shared-memory pool against memcpy into new memory in {len(by)} "
                "sessions, interleaved (the first also interleaves the other routes): "
                + "; ".join(f"{ms(r['median'])} against {ms(r['memcpy median'])}, "
                            f"{r['of memcpy']:.2f}x" for r in by) + "."]
    return out + [""]


def section_startup(d: dict) -> list[str]:
    out = ["## Start-up to the first collective", "", "| ranks | path | median | runs |",
           "|---|---|---|---|"]
    for ranks, rows in d.items():
        for name, st in rows.items():
            failed = len(st.get("failed", ()))
            runs = f"{st['n']} (+{failed} failed: not every rank ran; retried)" if failed else st["n"]
            if "ring retries" in st:
                runs = f"{runs}; {st['ring retries']} with MLX's 1 s ring retry"
            out.append(f"| {ranks} | {name} | {st['median']:.2f} s | {runs} |")
    return out + ["", "An `mlx.launch` run takes about 1 s longer when a rank connects to a "
                  "peer not listening yet: MLX's ring then sleeps 1 s before it tries again "
                  "(`MLX_RING_VERBOSE=1`: `Attempt 0 waiting 1000 ms`); whether it does is "
                  "a race between the ranks' starts. A session's ranks wait at a barrier "
                  "before they connect, which makes it rarer, not impossible.",
                  "",
                  "`%load_ext mlx_nbdist` starts the engines of a plain `%mlxdist start` "
                  "(2 ranks, ring, local) in the background; a start that finds them up "
                  "only forms the group on them (the row \"started at %load_ext\": they "
                  "came up before the start was asked for, as while a user reads the "
                  "notebook). Run back to back (Run All), the two cost what a start alone "
                  "does.", ""]


def section_tp(d: dict) -> list[str]:
    out = ["## Tensor-parallel step (MLP 1024 -> 4096 -> 1024, batch 64, SGD)", "",
           "| setup | step (median) | p95 | one all_sum of 256 KB | collectives share | speed-up |",
           "|---|---|---|---|---|---|"]
    for name, row in d.items():
        c = row.get("all_sum 256 KB")
        out.append(
            f"| {name} | {ms(row['step']['median'])} | {ms(row['step']['p95'])} | "
            f"{ms(c['median']) if c else '-'} | "
            f"{row['collective share'] * 100:.1f}% |" if c else
            f"| {name} | {ms(row['step']['median'])} | {ms(row['step']['p95'])} | - | - |"
        )
        if "speed-up vs 1 rank" in row:
            out[-1] += f" {row['speed-up vs 1 rank']:.2f}x |"
        else:
            out[-1] += " 1.00x |"
    for name, row in d.items():
        if "ratio by round" in row:
            out += ["", f"{name} / 1 rank, step time by round (a session of each size per round): "
                    + ", ".join(f"{r:.3f}x" for r in row["ratio by round"])]
    return out + [""]


def section_live_output(d: dict) -> list[str]:
    rt, lat = d["round trip"], d["latency"]
    out = ["## Live output (through a real kernel)", "",
           "A jupyter_client front end runs a `python3` kernel with a 2-rank session; `%%px` "
           "targets the same engines. Each rank prints `time.time()` stamps; latency = when "
           "the first iopub message holding a stamp reaches the front end - the stamp. "
           "Cells interleaved, both paths on the same engines.", "",
           "| lines written | path | median | p95 | median / own round trip | "
           "messages per cell |", "|---|---|---|---|---|---|"]
    missing = []
    for cadence, row in lat.items():
        for path in ("%%mlxdist", "%%px --stream"):
            st = row[path]
            out.append(f"| {cadence} | {path} | {ms(st['median'])} | {ms(st['p95'])} | "
                       f"{st['of own round trip']:.2f}x | {st['messages per cell']:.0f} |")
            if st.get("stamps never seen"):
                missing.append(f"{cadence}, {path}: {st['stamps never seen']}")
    if missing:
        out += ["", "Stamps that never reached the front end: " + "; ".join(missing)]
    out += ["", "Where the `%%mlxdist` latency goes (median / p95; timed inside the kernel):", "",
            "| lines written | rank -> kernel's IO thread | IO thread -> live view (poll) | "
            "live view -> front end (throttle, render) | supervisor loop period |",
            "|---|---|---|---|---|"]
    for cadence, row in lat.items():
        legs = row["%%mlxdist legs"]
        cells = [f"{ms(legs[k]['median'])} / {ms(legs[k]['p95'])}" if k in legs else "-"
                 for k in ("rank -> kernel IO thread", "IO thread -> live view (poll)",
                           "live view -> front end")]
        loop = row["supervisor poll period"]
        out.append(f"| {cadence} | " + " | ".join(cells)
                   + f" | {ms(loop['median'])} / {ms(loop['p95'])} |")
    base = "%%px --stream"
    out += ["", f"Round trip of a trivial cell (`pass`), streaming on, {rt[base]['n']} runs of "
            "each path interleaved, execute_request to execute_reply at the front end:", "",
            "| path | median | p95 | vs `%%px --stream` |", "|---|---|---|---|"]
    for path, st in rt.items():
        out.append(f"| {path} | {ms(st['median'])} | {ms(st['p95'])} | "
                   f"{st['median'] / rt[base]['median']:.2f}x |")
    return out + [""]


def section_trace_cost(d: dict) -> list[str]:
    out = ["## The collective recorder (`%%mlxdist --profile`)", "",
           "Profile off and on, interleaved on the same engines. With the recorder off each "
           "collective pays one attribute test; on, every collective is evaluated where it "
           "is issued (no overlap of compute and communication) and the cell publishes "
           "its record.", "",
           "| ranks | what | off (median / p95) | on (median / p95) | on / off |",
           "|---|---|---|---|---|"]
    for ranks, rows in d.items():
        if not isinstance(rows, dict):
            continue
        for what in ("round trip", "tp step"):
            st = rows.get(what)
            if not st:
                continue
            out.append(f"| {ranks} | {what} | {ms(st['off']['median'])} / {ms(st['off']['p95'])} | "
                       f"{ms(st['on']['median'])} / {ms(st['on']['p95'])} | "
                       f"{st['on / off']:.3f}x |")
        hook = rows.get("recorder-off hook, ns per collective")
        if hook is not None:
            out += ["", f"Recorder off: {hook:.0f} ns per collective (the hook alone, timed "
                        "in one process)."]
        wrapper = rows.get("wrapper, us per collective")
        if wrapper is not None:
            out += ["", f"The tracker's whole wrapper (record, order tag, hold, compactions, "
                        f"tag reads): +{wrapper['wall']:.1f} us wall and +{wrapper['cpu']:.1f} us "
                        "of the calling thread's CPU per collective, over the collective's own "
                        "call (timed in one process on a stand-in for a 2-rank `all_sum` of a "
                        "decoded token's activations; bench/trace_cost.py)."]
        summary = (rows.get("tp step") or {}).get("profiled summary")
        if summary:
            out += ["", f"A profiled TP step reads: `{summary}`"]
    return out + [""]


def section_restart(d: dict) -> list[str]:
    out = ["## Restart after an undrainable failure (2 ranks)", "",
           "Rank 1's process exits in a cell (the session is broken); from there to a "
           "correct `all_sum` on every rank. The first row forms the group on the spare "
           "engines the session keeps warm (the kill waits until the spare is up, as a user "
           "reading the error would); the second starts new engines.", "",
           "| path | median | p95 | runs |", "|---|---|---|---|"]
    idle = d.get("idle spare, % of one core")
    for name, st in d.items():
        if isinstance(st, dict):
            out.append(f"| {name} | {st['median']:.2f} s | {st['p95']:.2f} s | {st['n']} |")
    if idle is not None:
        out += ["", "An idle spare (its controller, schedulers and 2 engines) used "
                f"{idle:.1f} % of one core over 10 s of a session doing nothing."]
    return out + [""]


def section_decode(d: dict) -> list[str]:
    out = ["## Transformer decode (2 ranks, tiny qwen2, greedy, 64 tokens)", "",
           "Decode tokens/s in a `%%mlxdist` cell (`mlx_nbdist.shard` + `mlx_nbdist.generate`) "
           "against the same model in a plain script (ranks started directly, sharded by "
           "mlx-lm's own `shard` / `pipeline`, mlx-lm's `generate_step`); the tokens agree. "
           "The sides take turns one generation at a time, and *bare* (the script's loop "
           "run in the cell's own processes, with mlx_nbdist's tracking and order tags "
           "off) takes a turn too. *Ratio*: the median over rounds of the cell's tokens/s "
           "over the script's, with a 90 % interval from resampling the rounds; each block "
           "has a fresh session and fresh script ranks (a pair of processes can run 10-20 % "
           "off another for its whole life here). *Cell / bare* is what mlx_nbdist's own "
           "work per token costs, in the same processes.", "",
           "| model | cell (median, min-max) | bare | script (median, min-max) | cell / script "
           "(90 % interval) | by block | cell / bare | bare / script |",
           "|---|---|---|---|---|---|---|---|"]
    for mode, row in d.items():
        c, b, p = row["cell"], row["bare"], row["script"]
        lo, hi = row["interval"]
        blocks = ", ".join(f"{x:.3f}x" for x in row["ratio by block"])
        cb, bs = row["cell / bare"], row["bare / script"]
        out.append(f"| {mode} | {c['median']:.1f} ({c['min']:.1f}-{c['max']:.1f}) tok/s | "
                   f"{b['median']:.1f} tok/s | "
                   f"{p['median']:.1f} ({p['min']:.1f}-{p['max']:.1f}) tok/s | "
                   f"{row['ratio']:.3f}x ({lo:.3f}-{hi:.3f}) | {blocks} | "
                   f"{cb['ratio']:.3f}x ({cb['interval'][0]:.3f}-{cb['interval'][1]:.3f}) | "
                   f"{bs['ratio']:.3f}x ({bs['interval'][0]:.3f}-{bs['interval'][1]:.3f}) |")
    return out + [""]


def section_dashboard(d: dict) -> list[str]:
    out = ["## An open dashboard (through a real kernel, 2 ranks)", "",
           "The same cells with the dashboard closed and open (polling every 0.5 s), in "
           "alternating blocks; execute_request to execute_reply at the front end. "
           "*Paired*: the median over pairs of blocks (a closed block, then an open one) "
           "of the ratio of their medians, with a 90 % interval from resampling the "
           "pairs; *pooled*: the ratio of the medians of all open and all closed cells. "
           "*Refreshes*: the polling thread's CPU time in refreshes over the time the "
           "dashboard was open, and its wall-clock time in them (waits for the GIL or a "
           "core included): a refresh takes from a cell at most what it runs, so the CPU "
           "share bounds what it costs a cell much longer than one refresh (about 1 ms); "
           "*kernel CPU*: the kernel process's CPU (every thread, cores busy) per second "
           "open minus closed, opening and closing left out: it counts what the refresh "
           "thread's CPU leaves out (the iopub thread's sends of its messages), but within "
           "this VM's noise.",
           "",
           "| cell | closed (median / p95) | open (median / p95) | pooled | paired "
           "(90 % interval) | refreshes: CPU / wall | kernel CPU, open - closed |",
           "|---|---|---|---|---|---|---|"]
    for what, row in d.items():
        c, o = row["closed"], row["open"]
        out.append(f"| {what} | {ms(c['median'])} / {ms(c['p95'])} | "
                   f"{ms(o['median'])} / {ms(o['p95'])} | {row['pooled ratio']:.3f}x | "
                   f"{row['ratio']:.3f}x ({row['interval'][0]:.3f}-{row['interval'][1]:.3f}, "
                   f"{row['pairs']} pairs) | {row['refresh cpu share'] * 100:.2f} % / "
                   f"{row['refresh time share'] * 100:.2f} % | "
                   f"{row['kernel cpu open - closed'] * 100:+.2f} % |")
    return out + [""]


@dataclass
class Goal:
    """One row of the goals table: a goal, what one run measured, and whether it is met."""

    bench: str  #: the benchmark that measures it
    goal: str
    text: str  #: the measured value as shown ("not measured" when it was not)
    met: bool | None  #: None: not measured
    noise: str
    label: str = ""  #: how "met" reads when met ("met" unless said)


def _goal(rows: list[Goal], bench: str, goal: str, value: float | None, limit: float,
          fmt: str, noise: str, lower_is_better: bool = True) -> None:
    if value is None:
        rows.append(Goal(bench, goal, "not measured", None, "-"))
        return
    met = value <= limit if lower_is_better else value >= limit
    rows.append(Goal(bench, goal, fmt.format(value), met, noise))


def goal_rows(results: dict) -> list[Goal]:
    """Issue #19's goals against the measured numbers."""
    rows: list[Goal] = []
    rt = results.get("roundtrip", {})
    for ranks in ("2 ranks", "4 ranks"):
        r = rt.get(ranks)
        v = n = None
        if r:
            px = r["%%px (ipyparallel)"]
            m = r["%%mlxdist (magic)"]
            v, n = m["median"] / px["median"], f"p95 {m['p95'] / px['p95']:.2f}x"
        _goal(rows, "roundtrip", f"round trip, magic vs `%%px`, {ranks}", v, 1.00, "{:.2f}x",
              n or "-")
    lo = results.get("live_output", {}).get("latency", {})
    for cadence in ("every 0.2 s, flush=True", "every 0.02 s, flush=True"):
        st = (lo.get(cadence) or {}).get("%%mlxdist")
        _goal(rows, "live_output", f"live output latency / round trip ({cadence})",
              st["of own round trip"] if st else None, 2.0, "{:.2f}x",
              f"p95 {ms(st['p95'])}" if st else "-")
    rs = results.get("restart", {})
    ours = rs.get("Session.restart() after a rank died + first all_sum")
    _goal(rows, "restart", "restart (2 ranks) to the first correct all_sum",
          ours and ours["median"], 1.5, "{:.2f} s", f"p95 {ours['p95']:.2f} s" if ours else "-")
    su = results.get("startup", {}).get("2 ranks", {})
    if su:
        a, b = su["%mlxdist start + first all_sum"], su["mlx.launch empty script"]
        _goal(rows, "startup", "`%mlxdist start` vs `mlx.launch` of an empty script (2 ranks)",
              a["median"] / b["median"], 2.0, "{:.2f}x", f"p95 {a['p95'] / b['p95']:.2f}x")
        clean = b.get("median without ring retry")
        if "ring retries" in b:
            _goal(rows, "startup", "... vs the `mlx.launch` runs without MLX's 1 s ring retry",
                  clean and a["median"] / clean, 2.0, "{:.2f}x",
                  f"{b['n'] - b['ring retries']} of {b['n']} runs")
        w = su.get(startup.AHEAD)
        if w:
            _goal(rows, "startup", "`%mlxdist start` on the engines `%load_ext` started, vs "
                  "`mlx.launch` of an empty script (2 ranks)", w["median"] / b["median"], 2.0,
                  "{:.2f}x", f"p95 {w['p95'] / b['p95']:.2f}x")
            if clean:  # (a name of its own: the history keys goals by name)
                _goal(rows, "startup", "... on the engines `%load_ext` started, vs the "
                      "`mlx.launch` runs without MLX's 1 s ring retry", w["median"] / clean,
                      2.0, "{:.2f}x",
                      f"{b['n'] - b['ring retries']} of {b['n']} runs")
    tp = results.get("tp_step", {})
    one, two = tp.get("1 rank, unsharded"), tp.get("2 ranks, Megatron")
    noise = "-"
    if one and two:
        noise = f"p95 {two['step']['p95'] / one['step']['p95']:.3f}x"
        if "ratio by round" in two:
            by = two["ratio by round"]
            noise += f"; by round {min(by):.3f}x-{max(by):.3f}x ({len(by)} rounds)"
    _goal(rows, "tp_step", "TP step on 2 ranks / 1-rank step",
          two["step"]["median"] / one["step"]["median"] if one and two else None, 0.55,
          "{:.3f}x", noise)
    for mode, row in results.get("decode", {}).items():
        noise = (f"90 % interval {row['interval'][0]:.3f}-{row['interval'][1]:.3f}x; "
                 f"by block {min(row['ratio by block']):.3f}-"
                 f"{max(row['ratio by block']):.3f}x; cell / bare "
                 f"{row['cell / bare']['ratio']:.3f}x")
        _goal(rows, "decode", f"decode tokens/s, cell vs script ({mode})", row["ratio"], 0.95,
              "{:.3f}x", noise, lower_is_better=False)
    for what, row in results.get("dashboard_cost", {}).items():
        lo, hi = ((x - 1) * 100 for x in row["interval"])
        timed = (row["ratio"] - 1) * 100
        share = row["refresh time share"] * 100
        cpu = row["refresh cpu share"] * 100
        # timed open vs closed cannot resolve 1 % here: the refreshes' CPU share of the
        # time bounds the cost; met when it is under 1 % and the timing does not exclude it
        rows.append(Goal("dashboard_cost", f"open dashboard, {what}",
                         f"{timed:+.1f} % timed; refreshes {cpu:.2f} % CPU "
                         f"({share:.2f} % wall)",
                         cpu <= 1.0 and lo <= 1.0,
                         f"timed: 90 % interval {lo:+.1f} to {hi:+.1f} % (paired blocks); "
                         f"kernel CPU {row['kernel cpu open - closed'] * 100:+.2f} % of a core",
                         label="met (refreshes)"))
    sl = results.get("slices", {}).get("slices(), shared-memory pool")
    noise = "-"
    if sl:
        noise = f"p95 {ms(sl['p95'])}"
        if "by session" in sl:
            noise += "; by session " + ", ".join(f"{r['of memcpy']:.2f}x" for r in sl["by session"])
    _goal(rows, "slices", "slices of 2 x 64 MB vs memcpy into new memory",
          sl and sl["of memcpy"], 0.75, "{:.3f}x", noise, lower_is_better=False)
    return rows


def code_key(name: str, root: Path = ROOT) -> str:
    """What a benchmark's numbers belong to: a hash of the package's sources and of the
    benchmark's own (``bench/<name>.py`` and ``bench/common.py``) under ``root``."""
    h = hashlib.sha256()
    files = sorted((root / "mlx_nbdist").rglob("*.py"))
    files += [root / "bench" / f"{name}.py", root / "bench" / "common.py"]
    for f in files:
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def record(history: list[dict], name: str, results: dict, date: str, key: str) -> None:
    """Add what one run of benchmark ``name`` measured against the goals to ``history``."""
    rows = [g for g in goal_rows({name: results}) if g.bench == name and g.met is not None]
    if rows:
        history.append({"date": date, "bench": name, "code": key,
                        "goals": {g.goal: [g.text, g.met] for g in rows}})


def section_goals(results: dict, history: list[dict] | None = None) -> list[str]:
    """The goals table: this run's numbers, and every recorded run of the same code."""
    keys: dict[str, str] = {}
    out = ["## Goals (issue #19)", "",
           "The last run of each benchmark; *runs of this code*: every run recorded in "
           "bench/results/history.json of the same sources (the package's and the "
           "benchmark's), oldest first: on this shared 2-core VM a ratio moves from run "
           "to run, sometimes across its goal.", "",
           "| goal | measured (median) | | noise | runs of this code |", "|---|---|---|---|---|"]
    for g in goal_rows(results):
        status = "-" if g.met is None else (g.label or "met") if g.met else "**not met**"
        if g.bench not in keys:
            keys[g.bench] = code_key(g.bench)
        runs = [h["goals"][g.goal] for h in history or ()
                if h["bench"] == g.bench and h["code"] == keys[g.bench] and g.goal in h["goals"]]
        seen = "-"
        if len(runs) > 1:
            short = [t.split(" timed")[0] for t, _ in runs]  # the dashboard's timed part
            seen = f"{', '.join(short)}: met in {sum(m for _, m in runs)} of {len(runs)}"
        out.append(f"| {g.goal} | {g.text} | {status} | {g.noise} | {seen} |")
    return out + [""]


SECTIONS = {
    "roundtrip": section_roundtrip,
    "collectives": section_collectives,
    "slices": section_slices,
    "startup": section_startup,
    "tp_step": section_tp,
    "live_output": section_live_output,
    "trace_cost": section_trace_cost,
    "restart": section_restart,
    "decode": section_decode,
    "dashboard_cost": section_dashboard,
}


def write_doc(results: dict, info: dict, notes: str, history: list[dict]) -> None:
    lines = ["# Performance", "",
             "Measured by `make bench` (bench/run_all.py): every comparison runs side by side in "
             "one run on the same machine. Numbers are medians unless marked.", "",
             "| machine | |", "|---|---|"]  # date: when each section was last measured
    lines += [f"| {k} | {v} |" for k, v in info.items()] + [""]
    lines += section_goals(results, history)
    for name, fn in SECTIONS.items():
        if name in results:
            lines += fn(results[name])
    if notes:
        lines += ["## Reading the numbers", "", notes.strip(), ""]
    DOC.write_text("\n".join(lines))


def main(argv: list[str]) -> int:
    names = argv or list(BENCHES)
    info = machine()
    results = {}
    dates_path = RESULTS / "dates.json"
    dates = json.loads(dates_path.read_text()) if dates_path.exists() else {}
    history = json.loads(HISTORY.read_text()) if HISTORY.exists() else []
    for name in BENCHES:
        path = RESULTS / f"{name}.json"
        if name in names:
            print(f"== {name}", flush=True)
            try:
                results[name] = BENCHES[name].main()
                save(name, results[name])
                dates[name] = info["date"]
                record(history, name, results[name], info["date"], code_key(name))
                # now: a later bench that fails must not leave this one's old date
                dates_path.write_text(json.dumps(dates, indent=1) + "\n")
                HISTORY.write_text(json.dumps(history, indent=1) + "\n")
            except Exception:  # noqa: BLE001 - report and continue with the others
                traceback.print_exc()
                return 1
        elif path.exists():
            results[name] = json.loads(path.read_text())
    dates_path.write_text(json.dumps(dates, indent=1) + "\n")
    info["date"] = "; ".join(f"{n} {dates[n]}" for n in BENCHES if n in results and n in dates)
    notes_path = Path(__file__).parent / "NOTES.md"
    write_doc(results, info, notes_path.read_text() if notes_path.exists() else "", history)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
