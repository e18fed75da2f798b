"""moejax: Mixture-of-Experts inference in JAX with cache-aware routing and expert offloading.

Layers, lowest first; a module imports only from its own layer or lower ones (tests/test_layering.py):
``base`` (plumbing) → ``models`` (the decoder, layouts, checkpoints) → ``experts`` (routing, caches, traces)
→ ``runtime`` (simulation, decode, offload, the API, the server) → ``evaluation`` | ``training`` (side by side).
"""

from moejax.models.checkpoint import CheckpointError
from moejax.models.config import SUPPORTED_MODEL_TYPES, ModelConfig, UnsupportedModelError
from moejax.runtime.api import Model, Output, load

__version__ = "0.1.0"
__all__ = ["load", "Model", "Output", "ModelConfig", "SUPPORTED_MODEL_TYPES", "CheckpointError",
           "UnsupportedModelError", "__version__"]
