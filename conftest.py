"""Test setup shared by the suite and the doctests: 8 simulated CPU devices, strict JAX."""

import jax

import jshard

jshard.simulate_devices(8)
jax.config.update("jax_numpy_rank_promotion", "raise")
