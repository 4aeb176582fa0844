"""Test setup shared by the suite and the doctests: 8 simulated CPU devices, strict JAX, and XLA's
CPU code generated without LLVM's optimizations."""

import os

# The suite compiles hundreds of small programs and runs each a few steps: LLVM's optimization of the
# generated CPU code is about a third of each compile and buys nothing here (XLA's own passes, the
# partitioning, the collectives and the memory figures the tests read are the same). Before JAX
# starts; subprocesses (workers, notebook kernels) inherit it. Users' programs keep XLA's default.
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

import jax  # noqa: E402

import jshard

jshard.simulate_devices(8)
jax.config.update("jax_numpy_rank_promotion", "raise")
