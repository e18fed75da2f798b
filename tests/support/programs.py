"""Counting what JAX compiles: a test of "compiles nothing" counts compilations rather than timing them."""

from __future__ import annotations

import contextlib

@contextlib.contextmanager
def compile_events():
    """A list that receives the function name of every XLA backend compilation inside the block (JAX's
    ``/jax/core/compile/backend_compile_duration`` events): what a test of "compiles nothing" counts, rather than
    timing it."""
    import jax.monitoring

    names = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            names.append(kwargs.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
