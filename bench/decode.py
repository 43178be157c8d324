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
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from common import run_ranks_directly, stats

from mlx_nbdist import Session

TOKENS = 64
REPS = 5

MODEL = """
import json, time
import mlx.core as mx
from mlx_lm.models import qwen2
from mlx_lm.generate import generate_step

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
"""

SCRIPT = MODEL + """
import sys
from mlx_lm.generate import generation_stream
mode = sys.argv[1]
world = mx.distributed.init(backend="ring", strict=True)
model = build()
if mode == "tp":
    model.shard(world)
else:
    model.model.pipeline(world)
mx.eval(model.parameters())

def once(n):
    out, first, end = [], 0.0, 0.0
    for tok, _ in generate_step(PROMPT, model, max_tokens=n):
        now = time.perf_counter()
        if not out:
            first = now
        end = now
        out.append(int(tok))
    mx.synchronize(generation_stream)
    return out, (len(out) - 1) / (end - first)

once(8)
runs = [once({tokens}) for _ in range({reps})]
if world.rank() == 0:
    print("RESULT " + json.dumps({{"tps": [r[1] for r in runs], "tokens": runs[0][0]}}))
"""

CELL = """
mode = {mode!r}
model = mlx_nbdist.shard(build(), "megatron" if mode == "tp" else "pipeline")
mlx_nbdist.generate(model, PROMPT, max_tokens=8, echo=False)
_runs = [mlx_nbdist.generate(model, PROMPT, max_tokens={tokens}, echo=False)
         for _ in range({reps})]
_out = json.dumps({{"tps": [g.decode_tps for g in _runs], "tokens": _runs[0].tokens}})
_out
"""


def in_cell(s: Session, mode: str) -> dict:
    r = s.run(CELL.format(mode=mode, tokens=TOKENS, reps=REPS), timeout=600)
    return json.loads(r.ranks[0].result_text.strip("'\""))


#: per mode, the plain-script runs started again after MLX's ring failed to connect
init_failures: dict[str, list[str]] = {}


def direct_script(mode: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "decode.py"
        script.write_text(SCRIPT.format(tokens=TOKENS, reps=REPS))
        failed = init_failures.setdefault(mode, [])
        out = run_ranks_directly(script, [mode], failed=failed)[0]
        line = next(x for x in out.splitlines() if x.startswith("RESULT "))
        return json.loads(line[len("RESULT "):])


def main(trials: int = 6) -> dict:
    out: dict = {}
    with Session(2, timeout=600) as s:
        s.run(MODEL)
        for mode in ("tp", "pipeline"):
            cell_tps: list[float] = []
            script_tps: list[float] = []
            for i in range(trials):  # interleaved, each side first in half of them
                if i % 2:
                    p = direct_script(mode)
                    c = in_cell(s, mode)
                else:
                    c = in_cell(s, mode)
                    p = direct_script(mode)
                if c["tokens"] != p["tokens"]:
                    raise RuntimeError(f"{mode}: the cell's tokens {c['tokens'][:8]}... differ "
                                       f"from the script's {p['tokens'][:8]}...")
                cell_tps += c["tps"]
                script_tps += p["tps"]
            cs = {**stats(cell_tps), "min": min(cell_tps), "max": max(cell_tps)}
            ps = {**stats(script_tps), "min": min(script_tps), "max": max(script_tps)}
            out[mode] = {"cell": cs, "script": ps, "ratio": cs["median"] / ps["median"],
                         "script init retries": len(init_failures.get(mode, []))}
    return out


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
