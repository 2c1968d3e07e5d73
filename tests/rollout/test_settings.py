"""The rollout config parsed once into typed settings: what `RolloutSettings.from_config` holds,
the errors it names, the journal fingerprint it gives, and that the code below the API reads
settings, not the ConfigDict."""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

from seer_jax.engine.engine import EngineConfig
from seer_jax.errors import ConfigError
from seer_jax.model.sampling_params import SamplingParams
from seer_jax.rollout.config import default_config
from seer_jax.rollout.core.controller_config import ControllerConfig
from seer_jax.rollout.resume import file_identity, rollout_fingerprint
from seer_jax.rollout.settings import (
    FaultSettings,
    JournalSettings,
    PoolSettings,
    PromptSettings,
    RolloutSettings,
)

ROLLOUT = pathlib.Path(__file__).resolve().parents[2] / "seer_jax" / "rollout"


def test_the_default_config_parses_into_typed_settings():
    s = RolloutSettings.from_config(default_config())
    assert s.policies == ("seer",) and s.baseline == "group_round_robin"
    assert s.prompts == PromptSettings(source="natural", num_prompts=8, chat=True)
    assert s.sampling == SamplingParams(temperature=1.0, top_p=1.0, top_k=0, seed=0)
    assert s.controller == ControllerConfig(chunk_size=64)
    assert s.engine == EngineConfig(page_size=16, num_pages=0, kv_memory_gib=1.0, max_num_seqs=32,
                                    max_num_batched_tokens=256, max_prefill_seqs=4,
                                    speculation=False)
    assert (s.backend.kind, s.backend.num_instances, s.backend.tp) == ("inprocess", 2, 1)
    assert s.pool == PoolSettings(kind="host")
    assert s.journal == JournalSettings(directory="", fsync=False)
    assert s.fault is None and s.step_time.step_time(16) is None
    assert s.policy_options["seer"] == default_config().policy.seer.to_dict()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.group_size = 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.backend.tp = 2


def test_every_key_reaches_its_setting():
    c = default_config()
    c.backend, c.ray_step_timeout_s, c.ray_hosts_per_slice, c.ray_pipeline_depth = "ray", 7.0, 1, 1
    c.clock, c.fault_kill_instance, c.fault_after_chunks, c.fault_when = "concurrent", 1, 3, "kv_put"
    c.speculation, c.spec_profile, c.draft_service.max_stale_steps = True, "p.json", 0
    c.controller.chunk_size, c.engine.max_num_seqs, c.journal_dir = 16, 8, "/tmp/j"
    c.time_model = "measured"
    s = RolloutSettings.from_config(c)
    assert s.backend.ray.step_timeout_s == 7.0 and s.backend.ray.pipeline_depth == 1
    assert s.pool == PoolSettings(kind="ray")
    assert s.fault == FaultSettings(instance=1, after_chunks=3, when="kv_put")
    plan = s.fault.plan()
    assert (plan.instance, plan.after_chunks, plan.when) == (1, 3, "kv_put")
    assert plan is not s.fault.plan()  # a fresh plan per rollout: it records when it fired
    assert s.speculation.enabled and s.engine.speculation and s.speculation.profile == "p.json"
    assert s.speculation.draft_service.max_stale_steps == 0
    assert s.controller.chunk_size == 16 and s.engine.max_num_seqs == 8
    assert s.journal.directory == "/tmp/j"


def test_a_roofline_time_model_gives_the_cost_model_of_its_keys():
    c = default_config()
    c.time_model, c.accelerator, c.chips_per_instance = "roofline", "v5e", 4
    model = RolloutSettings.from_config(c).step_time.step_time(page_size=16)
    assert (model.accelerator.name, model.chips, model.page_size) == ("tpu-v5e", 4, 16)


@pytest.mark.parametrize(("key", "value", "match"), [
    ("page_size", 0, r"config\.engine\.page_size=0 is out of range"),
    ("impl", "cuda", r"config\.engine\.impl='cuda': allowed"),
    ("speculation", True, r"config\.engine\.speculation is unknown; allowed keys: .* "
                          r"\(speculation: config\.speculation\)"),
    ("pages", 4, r"config\.engine\.pages is unknown; allowed keys: impl, kv_memory_gib"),
])
def test_a_bad_engine_key_is_named(key, value, match):
    c = default_config()
    c.engine[key] = value
    with pytest.raises(ConfigError, match=match):
        RolloutSettings.from_config(c)


def test_the_journal_fingerprint_keeps_its_keys_and_values(tmp_path):
    """Journals written before the config was parsed into settings resume: the fingerprint is
    the same dict, key for key."""
    (tmp_path / "model.bin").write_bytes(b"weights")
    c = default_config()
    c.policies, c.temperature, c.top_k, c.chat = "seer,request_fcfs", 0.0, 5, False
    c.speculation, c.controller.per_request_seeds = True, False
    assert rollout_fingerprint(RolloutSettings.from_config(c), [[1, 2], [3]], tmp_path) == {
        "model": "smollm2", "model_files": file_identity(tmp_path), "dtype": "float32",
        "prompts": "natural", "num_prompts": 8, "chat": False,
        "prompt_tokens": "2ce1506f23766b649ef41e6bdfe0fdbe", "group_size": 4, "max_tokens": 128,
        "temperature": 0.0, "top_p": 1.0, "top_k": 5, "seed": 0, "per_request_seeds": False,
        "policies": "seer,request_fcfs", "speculation": True}


def test_only_the_edge_reads_the_config_dict():
    """Below `rollout/api.py` the code takes settings: the schema (config.py), its parsing
    (settings.py), the API and the policy-options schema are the only rollout modules that
    import ml_collections."""
    readers = set()
    for path in sorted(ROLLOUT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) else [])
            if any(n and n.split(".")[0] == "ml_collections" for n in names):
                readers.add(path.relative_to(ROLLOUT).as_posix())
    assert readers == {"api.py", "config.py", "settings.py", "core/policies/__init__.py"}


def test_run_rollout_takes_parsed_settings_too():
    from seer_jax.rollout.api import run_rollout
    from seer_jax.rollout.core.carry import CarryOver

    s = RolloutSettings.from_config(default_config())
    with pytest.raises(ConfigError, match=r"carry_over=False is invalid: the carried groups"):
        run_rollout(s, carry={"seer": CarryOver()})
