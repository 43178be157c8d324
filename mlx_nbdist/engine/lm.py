"""mlx-lm models on the ranks: load a local model sharded, generate, LoRA.

Runs inside a rank (a ``%%mlxdist`` cell), on every rank of the group together:
each function issues collectives in the same order on every rank. mlx-lm is an
optional dependency (``pip install 'mlx_nbdist[lm]'``); it is imported only here,
through :mod:`mlx_nbdist.engine._mlx_lm`.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.nn.layers import distributed as mxd
from mlx.utils import tree_flatten

from ..errors import ShardingError
from . import _mlx_lm
from .sharding import shard, tensor_parallel, verify_identical
from .state import current, own_collectives


@dataclass
class Generation:
    """What :func:`generate` produced on this rank.

    Attributes:
        tokens: the generated token ids (the same on every rank: checked).
        text: the decoded text when a tokenizer was given, else ``""``.
        prompt_tokens: tokens in the prompt.
        prefill_tps: prompt tokens per second (time to the first generated token).
        decode_tps: generated tokens per second after the first.
    """

    tokens: list[int]
    text: str
    prompt_tokens: int
    prefill_tps: float
    decode_tps: float
    ranks: int = 1
    timings: dict[str, float] = field(default_factory=dict)

    def __str__(self) -> str:
        return (f"{len(self.tokens)} tokens ({self.prompt_tokens} prompt tokens): prefill "
                f"{self.prefill_tps:.1f} tok/s, decode {self.decode_tps:.1f} tok/s, same "
                f"tokens on all {self.ranks} ranks")

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a ``fully_shard`` wrapper (it hides ``layers``/``make_cache``)."""
    return model.module if isinstance(model, mxd.FullyShardedModule) else model


def generate(
    model: nn.Module,
    prompt: Any,
    *,
    max_tokens: int = 32,
    tokenizer: Any = None,
    sampler: Any = None,
    echo: bool | int = 0,
    group: mx.distributed.Group | None = None,
) -> Generation:
    """Generate from a (sharded or pipelined) mlx-lm model, streaming tokens as they come.

    Greedy unless ``sampler`` is given (``mlx_lm.sample_utils.make_sampler``). Every
    rank runs the model; the tokens are printed by the rank ``echo`` names (rank 0;
    ``True``: every rank) as each one is produced, then one line with prefill and
    decode tokens per second. Every rank must pass the same prompt and ``max_tokens``:
    they are compared before the model runs (one small ``all_gather``), and at the end
    the ranks' tokens are (another): ranks that disagree raise instead of returning
    different text.
    The generation stream is synchronised before returning, so a forward started
    right after reads fresh data (mlx-lm's ``generate_step`` leaves work queued on it).

    Args:
        model: an mlx-lm model (``Model``), sharded, pipelined or FSDP-wrapped.
        prompt: token ids (list or ``mx.array``), or text when ``tokenizer`` is given.
        max_tokens: tokens to generate.
        tokenizer: an mlx-lm tokenizer (``mlx_lm.load``) to encode/decode text.
        sampler: ``sampler(logprobs) -> token``; greedy (argmax) by default.
        echo: which rank prints the tokens (``True`` every rank, ``False`` none).
        group: the group the model is sharded over (the session's world by default).
    """
    lm = _mlx_lm.require("mlx_nbdist.generate")
    group = group or current().world
    tokens_in = _prompt_tokens(prompt, tokenizer)
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
    inner = unwrap(model)
    _in_vocabulary(tokens_in, getattr(getattr(inner, "args", None), "vocab_size", None))
    _same_request(tokens_in, max_tokens, group)
    cache = lm.make_prompt_cache(inner)
    show = echo is True or (echo is not False and group.rank() == int(echo))
    out: list[int] = []
    start = time.perf_counter()
    first = end = start
    try:
        for token, _ in lm.generate_step(tokens_in, model, max_tokens=max_tokens,
                                         sampler=sampler, prompt_cache=cache):
            now = time.perf_counter()
            if not out:
                first = now
            end = now
            out.append(int(token))
            if show:
                _echo(out[-1], tokenizer)
    finally:
        mx.synchronize(lm.generation_stream)
    if show:
        sys.stdout.write("\n")
    _same_on_every_rank(out, max_tokens, group)
    n_prompt = int(tokens_in.size)
    result = Generation(
        tokens=out, text=tokenizer.decode(out) if tokenizer is not None else "",
        prompt_tokens=n_prompt, prefill_tps=n_prompt / max(first - start, 1e-9),
        decode_tps=(len(out) - 1) / max(end - first, 1e-9) if len(out) > 1 else 0.0,
        ranks=group.size(), timings={"prefill_s": first - start, "decode_s": end - first})
    if show:
        print(result, flush=True)
    return result


def _prompt_tokens(prompt: Any, tokenizer: Any) -> mx.array:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise TypeError("generate: a text prompt needs tokenizer=...; without one, "
                            "pass token ids (a list of ints)")
        prompt = tokenizer.encode(prompt)
    arr = prompt if isinstance(prompt, mx.array) else mx.array(list(prompt))
    if arr.ndim != 1 or arr.size == 0 or not mx.issubdtype(arr.dtype, mx.integer):
        raise TypeError(f"generate: the prompt must be a non-empty 1-D list of token ids, got "
                        f"shape {tuple(arr.shape)} dtype {arr.dtype}")
    return arr


def _in_vocabulary(tokens: mx.array, vocab: Any) -> None:
    """Refuse a token id the model has no embedding for: MLX reads past the table
    without a word (mlx-lm too), and the text generated from it means nothing."""
    if not isinstance(vocab, int):
        return
    bad = [t for t in (int(tokens.min().item()), int(tokens.max().item()))
           if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"generate: token id {bad[0]} of the prompt is outside the model's "
                         f"vocabulary (0 to {vocab - 1}: vocab_size {vocab})")


def _echo(token: int, tokenizer: Any) -> None:
    text = tokenizer.decode([token]) if tokenizer is not None else f"{token} "
    sys.stdout.write(text)
    sys.stdout.flush()


def _rows_unlike_rank_0(row: list[int], group: mx.distributed.Group
                        ) -> tuple[list[list[int]], list[int]]:
    """Every rank's ``row`` (int32, one length on every rank) gathered, and the ranks
    whose row is not rank 0's."""
    with own_collectives():  # a check of ours: not in the rank's totals
        table = mx.distributed.all_gather(mx.array(row, dtype=mx.int32)[None],
                                          group=group).tolist()
    return table, [r for r, got in enumerate(table) if got != table[0]]


def _same_request(tokens: mx.array, max_tokens: int, group: mx.distributed.Group) -> None:
    """Raise on every rank, before the model runs, when the ranks were given other
    prompts or ``max_tokens``: their forwards would pair each other's collectives
    (one generation runs across all the ranks), giving every rank the same tokens from
    no rank's prompt, or a group left out of step."""
    if group.size() == 1:
        return
    digest = hashlib.blake2b(np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=8)
    halves = np.frombuffer(digest.digest(), dtype=np.int32).tolist()
    table, differ = _rows_unlike_rank_0([int(tokens.size), max_tokens, *halves], group)
    if differ:
        said = "; ".join(
            f"rank {r}: {row[0]} prompt tokens, max_tokens {row[1]}"
            + (", other token ids" if r in differ and row[:2] == table[0][:2] else "")
            for r, row in enumerate(table))
        raise ValueError(
            f"generate: ranks {differ} were given another prompt or max_tokens than rank 0 "
            f"({said}): the ranks run one generation together, so every rank must pass the "
            "same prompt and max_tokens")


def _same_on_every_rank(tokens: list[int], max_tokens: int, group: mx.distributed.Group
                        ) -> None:
    """Raise on every rank when any rank generated other tokens than rank 0."""
    if group.size() == 1:
        return
    # padded to one length on every rank, so the check itself is never a mismatched
    # collective (a rank that stopped early at an end token has fewer)
    table, differ = _rows_unlike_rank_0(
        [len(tokens), *tokens, *[-1] * (max_tokens - len(tokens))], group)
    if differ:
        raise RuntimeError(
            f"generate: ranks {differ} produced other tokens than rank 0 ({table[0][1:]} vs "
            f"{[table[r][1:] for r in differ]}): the ranks' models or samplers differ "
            "(sharded from different weights? a sampler that draws at random needs the same "
            "mx.random.seed on every rank), so no rank's text can be trusted")


def load(
    path: str | os.PathLike[str],
    sharding: str | None = "megatron",
    *,
    group: mx.distributed.Group | None = None,
    tokenizer: bool = False,
) -> Any:
    """Load a local mlx-lm model directory (``config.json`` + ``*.safetensors``), sharded.

    The weights are read lazily: the model is built, sharded (``"megatron"``: tensor
    parallel; ``"pipeline"``: each rank keeps its layers; ``None``: whole), and only
    then evaluated, so each rank materialises just its own shard.

    Returns:
        The model, or ``(model, tokenizer)`` with ``tokenizer=True``.
    """
    lm = _mlx_lm.require("mlx_nbdist.load")
    group = group or current().world
    try:
        model_dir = _model_dir(path)
        model, _config = lm.load_model(model_dir, lazy=True)
        model.nbdist_source = str(model_dir)  # a checkpoint keeps its config.json
        failed = ""
    except Exception as e:  # noqa: BLE001 - told to every rank below, then re-raised
        failed, error = f"{type(e).__name__}: {e}", e
    _all_or_none(bool(failed), group, "load")
    if failed:
        raise error
    whole = _nbytes(model)
    before = mx.get_active_memory()  # what the rank held already (other models, arrays)
    mx.reset_peak_memory()
    if sharding is not None:
        # compared after sharding: before, it would materialise the whole model
        model = shard(model, sharding, group=group, check_identical=False)
    for _, layer in tree_flatten(model.leaf_modules(), is_leaf=lambda m: isinstance(
            m, nn.Module)):
        mx.eval(layer.parameters())  # one layer at a time: the peak stays near the shard
    if group.size() > 1:
        verify_identical(model, group)  # the replicated parameters: same files everywhere
    held, peak = _nbytes(model), max(mx.get_peak_memory() - before, 0)
    print(f"rank {group.rank()}: loaded {model_dir.name} ({sharding or 'whole'}): holds "
          f"{_mib(held)} of the model's {_mib(whole)}; peak memory while loading "
          f"{_mib(peak)}", flush=True)
    if tokenizer:
        return model, lm.load_tokenizer(model_dir)
    return model


def _all_or_none(failed: bool, group: mx.distributed.Group, what: str) -> None:
    """Raise on the ranks that did not fail when any rank failed (one all_sum), so a
    failure on one host never leaves the others waiting in the next collective."""
    if group.size() == 1:
        return
    with own_collectives():
        flags = mx.distributed.all_gather(mx.array([int(failed)], dtype=mx.int32), group=group)
        bad = [r for r, f in enumerate(flags.tolist()) if f]
    if bad and not failed:
        raise RuntimeError(f"{what} failed on rank(s) {bad} (their error says why); this rank "
                           "stopped too, so no rank waits for the others")


def _nbytes(model: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _model_dir(path: str | os.PathLike[str]) -> Any:
    from pathlib import Path

    p = Path(path).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(
            f"load: {str(p)!r} is not a directory on rank {current().rank} (mlx_nbdist.load "
            "takes a local MLX model directory: config.json and *.safetensors; it downloads "
            "nothing)")
    missing = [n for n in ("config.json",) if not (p / n).is_file()]
    if missing or not list(p.glob("model*.safetensors")):
        raise FileNotFoundError(
            f"load: {str(p)!r} on rank {current().rank} has no "
            f"{'config.json' if missing else 'model*.safetensors'}: an MLX model directory "
            "holds config.json and model*.safetensors (mlx_lm.convert / mlx_lm.utils.save)")
    return p


def lora(model: nn.Module, num_layers: int = -1, config: dict[str, Any] | None = None
         ) -> int:
    """``mlx_lm.tuner.utils.linear_to_lora_layers`` with a clear error instead of nothing.

    mlx-lm's LoRA converts only plain ``Linear``/``QuantizedLinear`` layers and silently
    skips the tensor-parallel ones, leaving 0 trainable parameters. This refuses that
    case, naming the layers, and returns the number of trainable parameters otherwise.
    Data-parallel LoRA: keep the model whole on every rank, call this, and average the
    gradients with ``nn.average_gradients``.
    """
    lm = _mlx_lm.require("mlx_nbdist.lora")
    if not isinstance(num_layers, int) or num_layers == 0 or num_layers < -1:
        raise ValueError(f"lora: num_layers must be a positive int or -1 (all layers), got "
                         f"{num_layers!r}")
    config = {"rank": 8, "scale": 20.0, "dropout": 0.0, **(config or {})}
    inner = unwrap(model)
    if inner is not model:
        raise ShardingError("lora: the model is wrapped by fully_shard (fsdp); LoRA needs "
                            "the layers themselves: use data parallel (whole model per rank)")
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ShardingError(f"lora: {type(inner).__name__} has no .layers (mlx-lm's LoRA "
                            "adapts the last num_layers transformer layers)")
    chosen = [x for x in layers if x is not None]
    chosen = chosen if num_layers < 0 else chosen[-num_layers:]
    tp = sorted({f"{type(m).__name__}" for layer in chosen for _, m in layer.named_modules()
                 if tensor_parallel(m)})
    if tp:
        raise ShardingError(
            f"lora: the layers to adapt are tensor-parallel ({', '.join(tp)}); mlx-lm's LoRA "
            "converts only plain Linear/QuantizedLinear layers and would leave 0 trainable "
            "parameters. Use data-parallel LoRA (load the model whole on every rank, "
            "mlx_nbdist.lora(model), then nn.average_gradients(grads)) or full fine-tuning "
            "of the sharded model")
    inner.freeze()
    lm.linear_to_lora_layers(inner, num_layers if num_layers >= 0 else len(chosen), config)
    trainable = sum(v.size for _, v in tree_flatten(inner.trainable_parameters()))
    if trainable == 0:
        raise ShardingError("lora: no layer was converted (0 trainable parameters): the "
                            "chosen layers hold no Linear/QuantizedLinear with the names in "
                            f"config['keys'] ({config.get('keys', 'default keys')})")
    return trainable
