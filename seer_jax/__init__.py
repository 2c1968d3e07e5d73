"""seer_jax: a JAX/Pallas rollout engine for synchronous RL of LLMs."""

from seer_jax.errors import SeerError

__all__ = ["SeerError"]
__version__ = "0.1.0"
