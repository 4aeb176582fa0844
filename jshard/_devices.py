"""Simulated CPU devices, so planning, tests and laptops see a multi-device machine."""

from __future__ import annotations

import jax

from jshard._compat import xla_bridge
from jshard._errors import DeviceCountError, api_boundary


@api_boundary
def simulate_devices(n: int) -> list[jax.Device]:
    """Makes JAX's CPU backend expose `n` devices, for planning, tests and demos without accelerators.

    Must run before JAX starts its backend (before the first array is made); calling it again with
    the same count is harmless.

    Args:
      n: how many CPU devices to simulate.

    Returns:
      The CPU devices.

    Raises:
      DeviceCountError: the backend has already started with another number of CPU devices.

    Examples:
      >>> len(simulate_devices(8))
      8
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise TypeError(f"jshard.simulate_devices: n must be a positive int, got {n!r}.")
    if xla_bridge.backends_are_initialized():
        have = len(jax.devices("cpu"))
        if have != n:
            raise DeviceCountError(
                f"jshard.simulate_devices({n}): JAX's backend has already started with {have} CPU "
                f"device(s), and the count cannot change afterwards. Call jshard.simulate_devices({n}) "
                f"before creating any array (first thing in the script or notebook), or set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before starting Python."
            )
        return jax.devices("cpu")
    jax.config.update("jax_num_cpu_devices", n)
    return jax.devices("cpu")
