"""Full train steps from client code (issue 30): a Flax Linen model with an optax AdamW
`TrainState`, pipelined (GPipe and 1F1B) and under gradient accumulation, and GPT-2 imported
unmodified from Hugging Face transformers (its Flax model, random weights from a small config),
parallelized in every mode and pipelined. Every one equals one device, to the dtype's tolerance."""

import functools

import jax
import pytest
from _tolerance import assert_close
from clients import linen_optax, one_device

import jshard as js

hf_gpt2 = pytest.importorskip("clients.hf_gpt2", reason="transformers (the test extra) is not installed")

PIPELINES = {
    "gpipe": {"pipeline": js.Pipelining(2, 4, schedule="gpipe")},
    "1f1b": {"pipeline": js.Pipelining(2, 4, schedule="1f1b")},
}


@functools.cache
def _linen():
    state, batch = linen_optax.create()
    return state, batch, one_device(linen_optax.reference_step, state, batch)


@pytest.mark.parametrize("options", [*PIPELINES.values(), {"accumulation": 4, "devices": 8}],
                         ids=[*PIPELINES, "accumulation"])
def test_linen_optax_train_step_equals_one_device(options):
    state, batch, want = _linen()
    got = js.parallelize(linen_optax.train_step, **options)(state, batch)
    assert_close(got, want, terms=linen_optax.terms())


@pytest.fixture
def rank_promotion():
    """transformers' GPT-2 adds a bias of rank 1 to rank-3 values, as numpy allows (the suite raises)."""
    with jax.numpy_rank_promotion("allow"):
        yield


@functools.cache
def _gpt2():
    state, batch = hf_gpt2.create()
    return state, batch, one_device(hf_gpt2.train_step, state, batch)


@pytest.mark.parametrize("mode", ["data", "semi_auto", "auto"])
def test_transformers_gpt2_train_step_equals_one_device(mode, rank_promotion):
    state, batch, want = _gpt2()
    got = js.parallelize(hf_gpt2.train_step, devices=8, mode=mode)(state, batch)
    assert_close(got, want, terms=hf_gpt2.terms())


def test_transformers_gpt2_pipelined_train_step_equals_one_device(rank_promotion):
    state, batch, want = _gpt2()

    def train_step(state, batch):  # hf_gpt2's step, its gradient function marked for the pipeline
        grad_fn = jax.value_and_grad(lambda params, batch: hf_gpt2.loss_fn(state.apply_fn, params, batch))
        loss, grad = js.accumulate(grad_fn)(state.params, batch)
        return state.apply_gradients(grads=grad), {"loss": loss}

    got = js.parallelize(train_step, **PIPELINES["1f1b"])(state, batch)
    assert_close(got, want, terms=hf_gpt2.terms())
