"""Tiny mlx-lm models built from a config with random weights (nothing is downloaded).

``LM_COMMON`` is code: the tests run it on the ranks and in the test process, so the
ranks are compared with an independent single-process MLX. The weights are scaled
(x4) so that greedy generation gives varied tokens instead of one repeated token.
"""

from __future__ import annotations

LM_COMMON = '''
import json
import numpy as np
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import gemma, llama, olmo2, qwen2, qwen3, qwen3_moe

_BASE = dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256,
             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
             vocab_size=256, rope_theta=10000.0)
ARCHS = {
    "llama": (llama, dict(model_type="llama", tie_word_embeddings=False)),
    "mistral": (llama, dict(model_type="mistral", tie_word_embeddings=False,
                            head_dim=32)),
    "qwen2": (qwen2, dict(model_type="qwen2", tie_word_embeddings=True)),
    "qwen3": (qwen3, dict(model_type="qwen3", tie_word_embeddings=True, head_dim=32,
                          max_position_embeddings=512)),
    "gemma": (gemma, dict(model_type="gemma", head_dim=32)),
    "olmo2": (olmo2, dict(model_type="olmo2")),
    # experts that the model's own shard() slices in place (SwitchLinear keeps its class)
    "qwen3_moe": (qwen3_moe, dict(model_type="qwen3_moe", num_experts=4,
                                  num_experts_per_tok=2, decoder_sparse_step=1,
                                  mlp_only_layers=[], moe_intermediate_size=64, head_dim=32,
                                  tie_word_embeddings=False, max_position_embeddings=512,
                                  norm_topk_prob=True)),
}


def lm_config(arch, **over):
    return {**_BASE, **ARCHS[arch][1], **over}


def build_lm(arch, seed=0, **over):
    module = ARCHS[arch][0]
    mx.random.seed(seed)
    m = module.Model(module.ModelArgs.from_dict(lm_config(arch, **over)))
    m.update(tree_map(lambda p: p * 4, m.parameters()))
    mx.eval(m.parameters())
    return m


def logits_np(m, tokens):
    return np.array(m(tokens).astype(mx.float32))


def lm_loss(m, tokens):
    logits = m(tokens[:, :-1])
    return nn.losses.cross_entropy(logits, tokens[:, 1:], reduction="mean")


def sgd_step(m, tokens, lr=0.05, average=None):
    loss, grads = nn.value_and_grad(m, lm_loss)(m, tokens)
    if average is not None:
        grads = nn.average_gradients(grads, group=average)
    optim.SGD(learning_rate=lr).update(m, grads)
    mx.eval(m.parameters())
    return float(loss)


def params_np(m):
    return {k: np.array(v) for k, v in tree_flatten(m.parameters())}


def failing_sampler(on_rank, at):
    """Greedy, but raising on rank ``on_rank`` at its ``at``-th token (a fault in a
    generation); ``rank`` is the rank's own name."""
    calls = [0]

    def sample(lp):
        calls[0] += 1
        if rank == on_rank and calls[0] == at:
            raise RuntimeError(f"the sampler fails on rank {on_rank}")
        return mx.argmax(lp, axis=-1)
    return sample


tokens = mx.array([[1, 7, 42, 99, 3, 250, 17, 8]])
prompt = [5, 17, 200, 33]
'''
