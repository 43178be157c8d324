"""Run every benchmark side by side and write docs/performance.md.

Usage: ``python bench/run_all.py [names...]`` (default: all). Results are also kept as
JSON under bench/results/.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import collectives  # noqa: E402
import live_output  # noqa: E402
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
}
DOC = Path(__file__).parent.parent / "docs" / "performance.md"


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
    return out + [""]


def section_startup(d: dict) -> list[str]:
    out = ["## Start-up to the first collective", "", "| ranks | path | median | runs |",
           "|---|---|---|---|"]
    for ranks, rows in d.items():
        for name, st in rows.items():
            out.append(f"| {ranks} | {name} | {st['median']:.2f} s | {st['n']} |")
    return out + [""]


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
        summary = (rows.get("tp step") or {}).get("profiled summary")
        if summary:
            out += ["", f"A profiled TP step reads: `{summary}`"]
    return out + [""]


SECTIONS = {
    "roundtrip": section_roundtrip,
    "collectives": section_collectives,
    "slices": section_slices,
    "startup": section_startup,
    "tp_step": section_tp,
    "live_output": section_live_output,
    "trace_cost": section_trace_cost,
}


def write_doc(results: dict, info: dict, notes: str) -> None:
    lines = ["# Performance", "",
             "Measured by `make bench` (bench/run_all.py): every comparison runs side by side in "
             "one run on the same machine. Numbers are medians unless marked.", "",
             "| machine | |", "|---|---|"]  # date: when each section was last measured
    lines += [f"| {k} | {v} |" for k, v in info.items()] + [""]
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
    for name in BENCHES:
        path = RESULTS / f"{name}.json"
        if name in names:
            print(f"== {name}", flush=True)
            try:
                results[name] = BENCHES[name].main()
                save(name, results[name])
                dates[name] = info["date"]
            except Exception:  # noqa: BLE001 - report and continue with the others
                traceback.print_exc()
                return 1
        elif path.exists():
            results[name] = json.loads(path.read_text())
    dates_path.write_text(json.dumps(dates, indent=1) + "\n")
    info["date"] = "; ".join(f"{n} {dates[n]}" for n in BENCHES if n in results and n in dates)
    notes_path = Path(__file__).parent / "NOTES.md"
    write_doc(results, info, notes_path.read_text() if notes_path.exists() else "")
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
