"""SimulatedInstance: continuous batching with a KV page budget, chunks, pool moves, preemption."""

from __future__ import annotations

import pytest

from seer_jax.errors import ConfigError, SeerError
from seer_jax.rollout.backends.kv_pool import HostKVPool
from seer_jax.rollout.core.instance import Instance, InstanceLostError
from seer_jax.rollout.core.types import ChunkRequest, SamplingParams
from seer_jax.sim.instance import (
    EOS_TOKEN_ID,
    RooflineStepTime,
    SimulatedInstance,
    expected_output,
    pseudo_tokens,
)

PROMPT = tuple(range(10, 42))  # 32 tokens


def chunk(rid, max_new, output=(), original=1000, handle=None, gid="g", prompt=PROMPT, prio=0):
    return ChunkRequest(
        request_id=rid,
        group_id=gid,
        prompt_ids=prompt,
        output_ids=tuple(output),
        max_new_tokens=max_new,
        original_max_tokens=original,
        sampling=SamplingParams(),
        kv_handle=handle,
        priority=prio,
    )


def run(inst):
    out = []
    while inst.has_work():
        out.extend(inst.step().finished)
    return out


def test_is_an_instance_and_pseudo_tokens_are_deterministic():
    inst = SimulatedInstance(0, {})
    assert isinstance(inst, Instance)
    a = pseudo_tokens("r1", 0, 50)
    assert a == pseudo_tokens("r1", 0, 50)
    assert a[10:20] == pseudo_tokens("r1", 10, 10)
    assert a != pseudo_tokens("r2", 0, 50)
    assert EOS_TOKEN_ID not in a and min(a) >= 3


def test_request_runs_to_eos_in_one_chunk():
    inst = SimulatedInstance(0, {"r": 20})
    inst.submit(chunk("r", 100))
    (res,) = run(inst)
    toks, reason = expected_output("r", 20, 1000)
    assert res.new_token_ids == toks and res.finish_reason == reason == "eos"
    assert toks[-1] == EOS_TOKEN_ID and len(res.new_logprobs) == 20
    assert res.ended_at == pytest.approx(inst.now()) and res.ended_at > 0
    assert res.first_token_at is not None and res.first_token_at <= res.ended_at


def test_truncated_at_max_tokens():
    inst = SimulatedInstance(0, {"r": 5000})
    inst.submit(chunk("r", 64, original=64))
    (res,) = run(inst)
    assert res.finish_reason == "length" and len(res.new_token_ids) == 64
    assert EOS_TOKEN_ID not in res.new_token_ids


def test_chunked_request_exports_kv_and_resumes_from_residency_pool_or_reprefill():
    pool = HostKVPool()
    a = SimulatedInstance(0, {"r": 50}, pool=pool)
    b = SimulatedInstance(1, {"r": 50}, pool=pool)
    a.submit(chunk("r", 20))
    (r1,) = run(a)
    assert r1.finish_reason is None and len(r1.new_token_ids) == 20
    assert r1.kv_handle is not None and r1.kv_bytes_exported > 0
    assert a.resident_tokens("r", "g") == len(PROMPT) + 20
    assert b.resident_tokens("r", "g") == 0
    out = list(r1.new_token_ids)
    # chunk 2 on the same instance: resident, no import
    a.submit(chunk("r", 20, output=out, handle=r1.kv_handle))
    (r2,) = run(a)
    assert r2.kv_bytes_imported == 0 and r2.reprefill_tokens == 0
    out += r2.new_token_ids
    # chunk 3 on another instance: pulled from the pool
    b.submit(chunk("r", 20, output=out, handle=r2.kv_handle))
    (r3,) = run(b)
    assert r3.kv_bytes_imported == (len(PROMPT) + 40) * b.kv_bytes_per_token
    assert r3.reprefill_tokens == 0 and r3.finish_reason == "eos"
    out += r3.new_token_ids
    assert out == expected_output("r", 50, 1000)[0]


def test_evicted_pool_entry_falls_back_to_reprefill_with_same_tokens():
    pool = HostKVPool(capacity_bytes=0)  # stores nothing
    a = SimulatedInstance(0, {"r": 30}, pool=pool)
    b = SimulatedInstance(1, {"r": 30}, pool=pool)
    a.submit(chunk("r", 10))
    (r1,) = run(a)
    b.submit(chunk("r", 100, output=r1.new_token_ids, handle=r1.kv_handle))
    (r2,) = run(b)
    assert r2.kv_bytes_imported == 0 and r2.reprefill_tokens == len(PROMPT) + 10
    assert list(r1.new_token_ids) + r2.new_token_ids == expected_output("r", 30, 1000)[0]


def test_group_prompt_affinity_signal():
    inst = SimulatedInstance(0, {"g/0": 5, "g/1": 5})
    inst.submit(chunk("g/0", 3))
    inst.step()
    assert inst.resident_tokens("g/1", "g") == len(PROMPT)
    assert inst.resident_tokens("g/1", "other") == 0


def test_admission_by_free_pages_and_preemption_when_overcommitted():
    # 4 pages of 16 tokens = 64 tokens; two requests of 32-token prompt each growing to 64
    lengths = {"a": 30, "b": 30}
    inst = SimulatedInstance(0, lengths, kv_capacity_pages=6, page_size=16)
    inst.submit(chunk("a", 30, original=30, gid="ga"))  # different prompts: nothing shared
    inst.submit(chunk("b", 30, original=30, gid="gb"))
    res = {r.request_id: r for r in run(inst)}
    assert inst.peak_used_pages <= 6
    assert inst.total_preemptions >= 1
    assert sum(r.preemptions for r in res.values()) == inst.total_preemptions
    for rid in ("a", "b"):  # recompute preemption does not change the tokens
        assert res[rid].new_token_ids == expected_output(rid, 30, 30)[0]


def test_siblings_share_their_prompt_pages_like_the_engine_prefix_cache():
    # the same two requests as above, but siblings of one group: the prompt's 2 full pages are
    # held once (2 + 2 x 2 own pages = 6), so both fit without preemption
    lengths = {"a": 30, "b": 30}
    inst = SimulatedInstance(0, lengths, kv_capacity_pages=6, page_size=16)
    inst.submit(chunk("a", 30, original=30))
    inst.submit(chunk("b", 30, original=30))
    res = {r.request_id: r for r in run(inst)}
    assert inst.total_preemptions == 0 and inst.peak_used_pages == 6
    assert inst.load().free_kv_pages == 6  # everything released, shared pages included
    for rid in ("a", "b"):
        assert res[rid].new_token_ids == expected_output(rid, 30, 30)[0]
    # without prefix caching every request holds its own copy of the prompt
    inst = SimulatedInstance(0, lengths, kv_capacity_pages=6, page_size=16, prefix_caching=False)
    inst.submit(chunk("a", 30, original=30))
    inst.submit(chunk("b", 30, original=30))
    run(inst)
    assert inst.total_preemptions >= 1


def test_no_preemption_when_budget_suffices():
    lengths = {f"r{i}": 40 for i in range(4)}
    inst = SimulatedInstance(0, lengths, kv_capacity_pages=4 * 5, page_size=16)
    for i in range(4):
        inst.submit(chunk(f"r{i}", 40))
    res = run(inst)
    assert len(res) == 4 and inst.total_preemptions == 0


def test_step_time_grows_with_batch_and_context():
    st = RooflineStepTime()
    assert st(0, 0, 0, 0) == 0.0
    assert st(1, 0, 1, 100) < st(1, 0, 1, 100_000)
    assert st(8, 0, 8, 800) < st(8, 4096, 8, 800)


def test_pluggable_step_time_sets_the_clock():
    inst = SimulatedInstance(0, {"r": 10}, step_time=lambda b, p, d, kv: 0.5)
    inst.submit(chunk("r", 10))
    (res,) = run(inst)
    assert res.ended_at == pytest.approx(10 * 0.5)
    inst.set_now(3.0)  # never moves backwards
    assert inst.now() == pytest.approx(5.0)
    inst.set_now(7.0)
    assert inst.now() == pytest.approx(7.0)


def test_priority_chunks_are_admitted_first():
    inst = SimulatedInstance(0, {"a": 5, "b": 5}, max_batch_size=1)
    inst.submit(chunk("a", 5))
    inst.submit(chunk("b", 5, prio=1))
    first = run(inst)
    assert [r.request_id for r in first] == ["b", "a"]


def test_abort_and_lost_instance():
    inst = SimulatedInstance(0, {"a": 50, "b": 50}, fail_at_s=0.05)
    inst.submit(chunk("a", 50))
    inst.submit(chunk("b", 50))
    inst.step()
    inst.abort("a")
    assert inst.load().running == 1
    with pytest.raises(InstanceLostError):
        while True:
            inst.step()
    with pytest.raises(InstanceLostError):
        inst.submit(chunk("c", 5))


def test_chunk_that_can_never_fit_is_rejected():
    inst = SimulatedInstance(0, {"r": 10}, kv_capacity_pages=2, page_size=16)
    with pytest.raises(SeerError, match="KV pages"):
        inst.submit(chunk("r", 10))
    with pytest.raises(ConfigError, match="page_size"):
        SimulatedInstance(0, {}, page_size=0)
