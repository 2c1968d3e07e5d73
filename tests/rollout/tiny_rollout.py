"""The tiny model, prompts and engine settings the real-engine rollout tests share (in-process,
threaded and Ray backends must agree on the same workload)."""

import numpy as np

from seer_jax.engine.engine import EngineConfig
from seer_jax.model.config import tiny_config
from seer_jax.model.llama import init_params

CFG = tiny_config(eos_token_ids=(7,))
PARAMS = init_params(CFG, seed=11)
GROUPS = [np.random.RandomState(0).randint(8, 256, n).tolist() for n in (5, 19, 11, 3)]
ENGINE = EngineConfig(num_pages=48, page_size=8, max_num_seqs=8, max_num_batched_tokens=16,
                      max_prefill_seqs=2)
