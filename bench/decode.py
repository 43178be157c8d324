"""Transformer decode: tokens/s of greedy generation on a tiny mlx-lm qwen2 (random
weights, 512 hidden, 4 layers), 2 ranks, tensor-parallel and pipelined.

In a cell: ``mlx_nbdist.shard(model, "megatron" | "pipeline")`` and
``mlx_nbdist.generate`` (what a user runs). Against: the same model in a plain script
whose 2 ranks are started directly with the environment ``mlx.launch`` gives them
(``mlx.launch`` itself busy-polls its children's pipes, a core's worth on this
2-core machine, see bench/NOTES.md), looping over mlx-lm's ``generate_step`` (the
loop ``stream_generate`` runs, without detokenising), sharded by mlx-lm itself:
``Model.shard(group)`` for TP, ``model.model.pipeline(group)`` for the pipeline (no
mlx_nbdist in the script). Decode tokens/s = (tokens - 1) / (time from the first token
to the last), the same measure on both sides; the tokens must agree.

Both stay up for a block and take turns one generation at a time (the script serves
a generation per line of its stdin, ``common.ServedRanks``), each side first in a
third of the rounds: this VM's speed moves by tens of percent within seconds (one
generation read 65 and 142 tok/s in one cell), so the estimate is the median over
rounds of the cell's tokens/s over the script's, with a 90 % interval from resampling
the rounds (the ratio of the pooled medians beside it). A pair of processes can also stay 10-20 %
faster or slower than another for its whole life (one block of 10 pairs read 0.80x,
the next run 1.10x, same code): each block starts a fresh session and fresh script
ranks, and the blocks' ratios are shown.

A third turn in each round, *bare*, runs in the cell's own processes the script's
loop over ``generate_step`` on the same sharded model with the collectives MLX's own
(mlx_nbdist's tracking and order tags off): cell / bare is what mlx_nbdist's own work
per token costs, free of the processes' placement; bare / script what the engine's
process costs.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from common import ServedRanks, paired, stats

from mlx_nbdist import Session

TOKENS = 64
#: blocks, each with a fresh session and fresh script ranks
BLOCKS = 3
#: rounds a block: a generation of each side (cell, bare, script), one at a time
PAIRS = 10

MODEL = """
import json, time
import mlx.core as mx
from mlx_lm.models import qwen2
from mlx_lm.generate import generate_step, generation_stream

ARGS = dict(model_type="qwen2", hidden_size=512, num_hidden_layers=4,
            intermediate_size=1408, num_attention_heads=8, num_key_value_heads=4,
            rms_norm_eps=1e-5, vocab_size=2048, rope_theta=10000.0,
            tie_word_embeddings=True)
PROMPT = mx.array(list(range(1, 17)))

def build():
    mx.random.seed(0)
    m = qwen2.Model(qwen2.ModelArgs.from_dict(ARGS))
    mx.eval(m.parameters())
    return m

def decode(model, n):  # the loop stream_generate runs: the tokens and decode tokens/s
    out, first, end = [], 0.0, 0.0
    for tok, _ in generate_step(PROMPT, model, max_tokens=n):
        now = time.perf_counter()
        if not out:
            first = now
        end = now
        out.append(int(tok))
    mx.synchronize(generation_stream)
    return {"tps": (len(out) - 1) / (end - first), "tokens": out}
"""

SCRIPT = MODEL + """
import sys
mode = sys.argv[1]
world = mx.distributed.init(backend="ring", strict=True)
model = build()
if mode == "tp":
    model.shard(world)
else:
    model.model.pipeline(world)
mx.eval(model.parameters())

decode(model, 8)
if world.rank() == 0:
    print("READY", flush=True)
while line := sys.stdin.readline():  # one generation a line; the end of input ends it
    got = decode(model, int(line))
    if world.rank() == 0:
        print(json.dumps(got), flush=True)
"""

SETUP = """
from mlx_nbdist.engine.state import current as _current
from mlx_nbdist.engine.tracker import OPS as _OPS
model = mlx_nbdist.shard(build(), "megatron" if {mode!r} == "tp" else "pipeline")
mlx_nbdist.generate(model, PROMPT, max_tokens=8, echo=False)

def _bare(n):  # the script's loop, with MLX's own collectives (no tracking, no tags)
    tracker = _current().tracker
    ours = {{op: getattr(mx.distributed, op) for op in _OPS if hasattr(mx.distributed, op)}}
    for op in ours:
        setattr(mx.distributed, op, tracker.original(op))
    try:
        return decode(model, n)
    finally:
        for op, fn in ours.items():
            setattr(mx.distributed, op, fn)
"""
CELL = """
_g = mlx_nbdist.generate(model, PROMPT, max_tokens={tokens}, echo=False)
json.dumps({{"tps": _g.decode_tps, "tokens": _g.tokens}})
"""
BARE = "json.dumps(_bare({tokens}))"
SIDES = ("cell", "bare", "script")


def measure(s: Session, ranks: ServedRanks, mode: str, pairs: int) -> dict[str, list[float]]:
    """``pairs`` rounds of one generation a side, the sides' order turning each round."""
    s.run(SETUP.format(mode=mode), timeout=600)
    turns = {
        "cell": lambda: s.run(CELL.format(tokens=TOKENS), timeout=600),
        "bare": lambda: s.run(BARE.format(tokens=TOKENS), timeout=600),
        "script": lambda: ranks.ask(str(TOKENS)),
    }
    tps: dict[str, list[float]] = {side: [] for side in SIDES}
    for i in range(pairs):
        got = {}
        for side in SIDES[i % 3:] + SIDES[: i % 3]:
            r = turns[side]()
            got[side] = json.loads(r if isinstance(r, str) else
                                   r.ranks[0].result_text.strip("'\""))
        for side in SIDES:
            if got[side]["tokens"] != got["script"]["tokens"]:
                raise RuntimeError(f"{mode}: the {side}'s tokens {got[side]['tokens'][:8]}... "
                                   f"differ from the script's {got['script']['tokens'][:8]}...")
            tps[side].append(got[side]["tps"])
    return tps


def _ratios(a: list[float], b: list[float]) -> list[float]:
    return [x / y for x, y in zip(a, b, strict=True)]


def summarise(blocks: list[dict[str, list[float]]]) -> dict:
    """The sides' tokens/s and the paired ratios, over all blocks and block by block."""
    tps = {side: [x for b in blocks for x in b[side]] for side in SIDES}
    out: dict = {side: {**stats(v), "min": min(v), "max": max(v)} for side, v in tps.items()}
    out.update(paired(_ratios(tps["cell"], tps["script"])))
    out["pooled ratio"] = out["cell"]["median"] / out["script"]["median"]
    out["ratio by block"] = [paired(_ratios(b["cell"], b["script"]))["ratio"] for b in blocks]
    for a, b in (("cell", "bare"), ("bare", "script")):
        out[f"{a} / {b}"] = paired(_ratios(tps[a], tps[b]))
    return out


#: per mode, the plain-script starts tried again after MLX's ring failed to connect
init_failures: dict[str, list[str]] = {}


def main(blocks: int = BLOCKS, pairs: int = PAIRS) -> dict:
    runs: dict[str, list[dict[str, list[float]]]] = {"tp": [], "pipeline": []}
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "decode.py"
        script.write_text(SCRIPT)
        for b in range(blocks):
            with Session(2, timeout=600) as s:
                s.run(MODEL)
                for mode in list(runs)[b % 2:] + list(runs)[: b % 2]:
                    failed = init_failures.setdefault(mode, [])
                    with ServedRanks(script, [mode], failed=failed) as ranks:
                        runs[mode].append(measure(s, ranks, mode, pairs))
    return {mode: {**summarise(bl), "script init retries": len(init_failures[mode])}
            for mode, bl in runs.items()}


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
