"""Counting XLA's backend compiles (a test's check that a program is compiled once)."""

import contextlib

import jax


@contextlib.contextmanager
def compiles():
    """Counts XLA's backend compiles inside the block: yields a list whose length is the count."""
    seen: list[float] = []

    def listen(event: str, seconds: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
