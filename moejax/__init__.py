"""moejax: Mixture-of-Experts inference in JAX with cache-aware routing and expert offloading.

Layers, lowest first; a module imports only from its own layer or lower ones (tests/test_layering.py):
``base`` (plumbing) → ``models`` (the decoder, layouts, checkpoints) → ``experts`` (routing, caches, traces)
→ ``runtime`` (simulation, decode, offload, the API, the server) → ``evaluation`` | ``training`` (side by side).
"""

from moejax.base import interrupts as _interrupts

if _interrupts.is_a_command():  # a Ctrl-C while the command imports JAX ends it too (``base.interrupts``)
    _interrupts.exit_cleanly_on_signals()
    # ... once JAX's extension modules exist: an exit raised while one is being created (its initialisation calls
    # back into Python, where the handler runs) crashed the interpreter (a segmentation fault in about one start
    # in four; tests/test_signals.py, SIGTERM-importing); held back, the signal ends the command a moment later
    with _interrupts.deferred():
        import jax  # noqa: F401

from moejax.models.checkpoint import CheckpointError  # noqa: E402 - after the signal handlers
from moejax.models.config import SUPPORTED_MODEL_TYPES, ModelConfig, UnsupportedModelError  # noqa: E402
from moejax.experts import prior, routing  # noqa: E402
from moejax.runtime import offload, simulate  # noqa: E402
from moejax.runtime.api import Model, ModelTooLargeError, Output, load  # noqa: E402

__version__ = "0.1.0"
# the modules a user's calls take their arguments from: ``from moejax import routing, simulate`` (policies,
# CacheConfig), ``offload`` (OffloadConfig), ``prior`` (load_prior)
__all__ = ["load", "Model", "Output", "ModelConfig", "SUPPORTED_MODEL_TYPES", "CheckpointError",
           "UnsupportedModelError", "ModelTooLargeError", "routing", "simulate", "offload", "prior", "__version__"]
