"""The rollout controller and everything it needs that is independent of where engines run:
policies, placement, drivers, the `Instance`/`KVPool` interfaces, types, reports, prompts.

Nothing here imports a backend (`seer_jax.rollout.backends`), Ray, Mooncake or JAX: the
controller is driven through the `Instance` interface only (checked by tests/test_layers.py).
"""
