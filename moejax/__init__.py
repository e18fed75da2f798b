"""moejax: Mixture-of-Experts inference in JAX with cache-aware routing and expert offloading."""

from moejax.api import Model, Output, load
from moejax.checkpoint import CheckpointError
from moejax.config import SUPPORTED_MODEL_TYPES, ModelConfig, UnsupportedModelError

__version__ = "0.1.0"
__all__ = ["load", "Model", "Output", "ModelConfig", "SUPPORTED_MODEL_TYPES", "CheckpointError",
           "UnsupportedModelError", "__version__"]
