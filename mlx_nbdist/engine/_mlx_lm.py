"""mlx-lm, imported only when a rank needs it (it is the optional ``[lm]`` extra).

One place names the mlx-lm functions mlx_nbdist uses, so an mlx-lm that moves one
shows up here, and a rank without mlx-lm says how to install it.
"""

from __future__ import annotations

from types import SimpleNamespace


def require(what: str) -> SimpleNamespace:
    """The mlx-lm functions mlx_nbdist uses; ImportError naming ``what`` without mlx-lm."""
    try:
        from mlx_lm.generate import generate_step, generation_stream
        from mlx_lm.models.cache import make_prompt_cache
        from mlx_lm.tuner.utils import linear_to_lora_layers
        from mlx_lm.utils import load_model, load_tokenizer
    except ImportError as e:
        raise ImportError(
            f"{what} needs mlx-lm on every rank: pip install 'mlx_nbdist[lm]' "
            f"(or mlx-lm>=0.32) ({e})") from None
    return SimpleNamespace(
        generate_step=generate_step, generation_stream=generation_stream,
        make_prompt_cache=make_prompt_cache, linear_to_lora_layers=linear_to_lora_layers,
        load_model=load_model, load_tokenizer=load_tokenizer)
