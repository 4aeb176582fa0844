"""ViT from Hugging Face transformers, imported unmodified (`FlaxViTForImageClassification`, pinned in
the `test` extra), built from a small config with random weights (no download): 16 x 16 images in 4 x 4
patches, 2 layers of width 64 with 4 heads, a classifier on the class token, the query, key and
value projections without bias (`qkv_bias=False`: the key's bias has a zero gradient, softmax being
shift-invariant, which AdamW turns into an update of the sign of rounding noise, different for
every summation order). Trained as the
library's Flax image-classification example trains it (`run_image_classification_flax.py`, its
`pmap` and `pmean` dropped for `jax.jit`): a `TrainState` with AdamW, `value_and_grad` of the
cross entropy on one-hot labels, `apply_gradients`. Dropout is off (`train=False`), so one device
and every mode compute the same values.

Its expert plan is Megatron's, written as the Flax ecosystem writes it (EasyLM's partition rules, a
regex on each parameter's path, on a `("dp", "mp")` mesh of 2 x 4): the query, key, value and
intermediate dense layers cut by columns over `mp` (the latter's bias with it), the attention output
and output dense layers by rows; the patch embedding, position table, norms and classifier whole;
the optimizer state by the same rules and the images and labels by rows over `dp`, under a plain
`jax.jit`. jshard takes the same rules on the parameters, as tuples given apart or as one shared
`Layout((2, 4), ("dp", "mp"))`."""

import jax
import numpy as np
import optax
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from transformers import FlaxViTForImageClassification, ViTConfig

from tests.clients import partition_rules
from tests.clients.partition_rules import make_mesh as make_mesh

MODEL = FlaxViTForImageClassification
"""The model class, as transformers ships it."""
SIZE, PATCH, CHANNELS, WIDTH, HIDDEN, LAYERS, HEADS, CLASSES, ROWS = 16, 4, 3, 64, 128, 2, 4, 10, 8

PARTITION_RULES = (
    ("attention/attention/(query|key|value)/kernel", P(None, "mp")),
    ("attention/output/dense/kernel", P("mp", None)),
    ("intermediate/dense/kernel", P(None, "mp")),
    ("intermediate/dense/bias", P("mp")),
    ("layer/\\d+/output/dense/kernel", P("mp", None)),
    (".*", P(None)),
)
"""EasyLM's form: the first regex searched in a leaf's `/`-joined path gives its `PartitionSpec`."""


def create(rows: int = ROWS):
    """`(state, batch)`: the small ViT in a `TrainState` (AdamW), and one batch of NCHW images and labels."""
    config = ViTConfig(
        image_size=SIZE,
        patch_size=PATCH,
        num_channels=CHANNELS,
        hidden_size=WIDTH,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=HIDDEN,
        num_labels=CLASSES,
        qkv_bias=False,
    )
    model = MODEL(config, seed=0)
    state = train_state.TrainState.create(apply_fn=model.__call__, params=model.params, tx=optax.adamw(1e-3))
    data = np.random.default_rng(0)
    pixels = data.normal(size=(rows, CHANNELS, SIZE, SIZE)).astype(np.float32)
    return state, {"pixel_values": pixels, "labels": data.integers(0, CLASSES, rows).astype(np.int32)}


def loss_fn(logits, labels):
    return optax.softmax_cross_entropy(logits, jax.nn.one_hot(labels, logits.shape[-1])).mean()


def train_step(state, batch):
    def compute_loss(params):
        logits = state.apply_fn(pixel_values=batch["pixel_values"], params=params, train=False)[0]
        return loss_fn(logits, batch["labels"])

    loss, grad = jax.value_and_grad(compute_loss)(state.params)
    return state.apply_gradients(grads=grad), {"loss": loss}


def expert_shardings(mesh, state):
    """The whole `TrainState` (parameters and AdamW's moments) by `PARTITION_RULES`, the batch by rows."""
    rows = NamedSharding(mesh, P("dp"))
    return partition_rules.shardings(mesh, PARTITION_RULES, state), {"pixel_values": rows, "labels": rows}


def strategies(state, shared: bool):
    """`PARTITION_RULES` as jshard's `in_strategy` for the state: on the parameters, as calls of one
    shared `Layout` (`shared`) or strategy tuples given apart."""
    return partition_rules.strategies(PARTITION_RULES, state, shared)


def batch_strategy(shared: bool):
    """The images' and labels' rows cut over `dp`, in the parameters' form."""
    return {
        "pixel_values": partition_rules.strategy(P("dp"), 4, shared),
        "labels": partition_rules.strategy(P("dp"), 1, shared),
    }


def terms() -> int:
    """The term count for `assert_close`: the widest dots (the patch's 48, the MLP's 128), the rows
    of the mean, two layers' chain."""
    return 4 * HIDDEN + ROWS + 4 * PATCH * PATCH * CHANNELS
