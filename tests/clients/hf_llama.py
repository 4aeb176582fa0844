"""Llama from Hugging Face transformers, imported unmodified (`FlaxLlamaForCausalLM`, pinned in the
`test` extra), built from a small config with random weights (no download): 2 layers, width 64, 4
query heads sharing 2 key/value heads (grouped-query attention), rotary positions, RMSNorm, a gated
SiLU MLP and an untied output head. Trained as the library's Flax causal-LM example trains a model
(`run_clm_flax.py`): a `TrainState` with AdamW, a loss on the shifted labels, `jax.value_and_grad`
and `apply_gradients`.

Its expert plan is the one the Flax Llama ecosystem writes (EasyLM's `LLaMAConfig.get_partition_rules`,
MaxText's logical rules): Megatron partition rules matched by regex on each parameter's path, on a
`("dp", "mp")` mesh of 2 x 4: the embedding cut by vocabulary, the query, key, value, gate and up
projections and the output head by columns over `mp`, the attention output and down projections by
rows, the norms whole; the optimizer state by the same rules (its paths end in the parameters'),
the batch by rows over `dp`, under a plain `jax.jit` (EasyLM's `match_partition_rules`, in
`partition_rules.py`).

jshard takes the same rules on the parameters (`in_strategy` at the params' place in the
`TrainState`), in either of its two forms: strategy tuples given apart (`(1, 4)`: each its own
device matrix) or one shared `Layout((2, 4), ("dp", "mp"))`."""

import numpy as np
import optax
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from transformers import FlaxLlamaForCausalLM, LlamaConfig

from tests.clients import partition_rules

# run_clm_flax's step serves any causal LM: the same loss and train step as GPT-2's
from tests.clients.hf_gpt2 import loss_fn as loss_fn
from tests.clients.hf_gpt2 import train_step as train_step
from tests.clients.partition_rules import make_mesh as make_mesh

MODEL = FlaxLlamaForCausalLM
"""The model class, as transformers ships it."""
VOCAB, WIDTH, HIDDEN, LAYERS, HEADS, KV_HEADS, LENGTH, ROWS = 256, 64, 128, 2, 4, 2, 16, 8

PARTITION_RULES = (
    ("embed_tokens/embedding", P("mp", None)),
    ("self_attn/(q_proj|k_proj|v_proj)/kernel", P(None, "mp")),
    ("self_attn/o_proj/kernel", P("mp", None)),
    ("mlp/(gate_proj|up_proj)/kernel", P(None, "mp")),
    ("mlp/down_proj/kernel", P("mp", None)),
    ("lm_head/kernel", P(None, "mp")),
    ("(input_layernorm|post_attention_layernorm|norm)/weight", P(None)),
    (".*", P(None)),
)
"""EasyLM's form: the first regex searched in a leaf's `/`-joined path gives its `PartitionSpec`."""


def create(rows: int = ROWS):
    """`(state, batch)`: the small Llama in a `TrainState` (AdamW), and one batch of token ids."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=2 * LENGTH,
    )
    model = MODEL(config, seed=0)
    state = train_state.TrainState.create(apply_fn=model.__call__, params=model.params, tx=optax.adamw(1e-3))
    ids = np.random.default_rng(0).integers(0, VOCAB, (rows, LENGTH)).astype(np.int32)
    return state, {"input_ids": ids, "labels": ids}


def expert_shardings(mesh, state):
    """The whole `TrainState` (parameters and AdamW's moments) by `PARTITION_RULES`, the batch by rows."""
    batch = NamedSharding(mesh, P("dp", None))
    return partition_rules.shardings(mesh, PARTITION_RULES, state), {"input_ids": batch, "labels": batch}


def strategies(state, shared: bool):
    """`PARTITION_RULES` as jshard's `in_strategy` for the state: on the parameters, as calls of one
    shared `Layout` (`shared`) or strategy tuples given apart."""
    return partition_rules.strategies(PARTITION_RULES, state, shared)


def batch_strategy(shared: bool):
    """The batch's rows cut over `dp`, in the parameters' form."""
    cut = partition_rules.strategy(P("dp"), 2, shared)
    return {"input_ids": cut, "labels": cut}


def terms() -> int:
    """The term count for `assert_close`: the widest dots (the MLP's 128, the head's 256 classes), the
    rows of the mean, two layers' chain."""
    return 4 * HIDDEN + ROWS * LENGTH + 2 * VOCAB
