"""CPU demo: a tiny random Llama on 4 fake CPU devices (2 instances x tp2).

`seer-jax check-deploy configs/demo.py` checks it; `--config.model.name=smollm2` switches the
model (pass the SmolLM2 dimensions too, see configs/gpu_8xh200.py for the keys).
"""

from seer_jax.integrations.deploy_config import default_config


def get_config():
    return default_config()
