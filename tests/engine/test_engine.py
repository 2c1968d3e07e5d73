"""Paged engine vs the dense reference generator."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from seer_jax.engine import model_runner
from seer_jax.engine.engine import Engine, EngineConfig
from seer_jax.engine.request import RequestStatus
from seer_jax.errors import ConfigError, InputError, SeerError
from seer_jax.model.config import tiny_config
from seer_jax.model.generate import full_forward, generate
from seer_jax.model.llama import init_params
from seer_jax.model.sharding import make_mesh
from seer_jax.rollout.core.types import SamplingParams

CFG = tiny_config(num_heads=4, num_kv_heads=2, eos_token_ids=())
PARAMS = init_params(CFG, seed=11)
RNG = np.random.RandomState(0)
PROMPTS = [RNG.randint(3, 256, n).tolist() for n in (3, 17, 40, 9, 33, 1, 26)]
GREEDY = SamplingParams(temperature=0.0)
SMALL = EngineConfig(num_pages=96, page_size=4, max_num_batched_tokens=32, max_num_seqs=8,
                     max_prefill_seqs=2)


def run_staggered(engine, prompts, max_tokens, sampling, arrive_every=2):
    """Add one request every `arrive_every` steps; returns {index: RequestOutput}."""
    pending = list(enumerate(prompts))
    out, step = {}, 0
    while pending or engine.has_unfinished():
        if pending and step % arrive_every == 0:
            i, p = pending.pop(0)
            s = sampling[i] if isinstance(sampling, list) else sampling
            engine.add_request(str(i), p, max_tokens[i] if isinstance(max_tokens, list) else max_tokens, s)
        for r in engine.step():
            out[int(r.request_id)] = r
        check_rows(engine)
        step += 1
    engine.blocks.check()
    assert not engine.kv.rows.pages.any()  # every row given back and cleared
    return out


def check_rows(engine):
    """The persistent page-table rows mirror every running request's pages, zeros after them."""
    rows = engine.kv.rows.pages
    for s in engine.running:
        assert s.row >= 0
        assert rows[s.row, :len(s.pages)].tolist() == s.pages
        assert not rows[s.row, len(s.pages):].any()
    # the runner's device copy, with the entries logged as written since its last sync (sent
    # with their current values), is the same table
    table, log = engine.runner.page_table, engine.kv.rows._log
    if table is not None and not engine.kv.rows._resized and table.shape == rows.shape:
        synced, flat = np.asarray(table).reshape(-1).copy(), rows.reshape(-1)
        for first, n in log:
            synced[first:first + n] = flat[first:first + n]
        assert (synced.reshape(rows.shape) == rows).all()


@pytest.mark.parametrize("tp", [pytest.param(1, marks=pytest.mark.exhaustive), 2])
@pytest.mark.slow
def test_greedy_equals_reference_staggered_chunked(tp):
    mesh = make_mesh(jax.devices()[:tp]) if tp > 1 else None
    ref = generate(PARAMS, CFG, PROMPTS, 24)
    eng = Engine(CFG, PARAMS, SMALL, mesh=mesh)
    out = run_staggered(eng, PROMPTS, 24, GREEDY)
    assert sum(s.num_prefill_tokens > 0 and s.num_decode_tokens > 0 for s in eng.step_stats) > 0
    for i, r in enumerate(ref):
        assert out[i].token_ids == r.token_ids, i
        np.testing.assert_allclose(out[i].logprobs, r.logprobs, atol=1e-4)
        assert out[i].finish_reason == "length"


def test_logprobs_equal_full_forward_log_softmax():
    eng = Engine(CFG, PARAMS, SMALL)
    out = run_staggered(eng, PROMPTS[:3], 10, GREEDY)
    for i in range(3):
        seq = np.array([PROMPTS[i] + out[i].token_ids])
        logp = np.asarray(jax.nn.log_softmax(full_forward(PARAMS, CFG, seq)[0], axis=-1))
        n = len(PROMPTS[i])
        expect = [logp[n - 1 + j, t] for j, t in enumerate(out[i].token_ids)]
        np.testing.assert_allclose(out[i].logprobs, expect, atol=1e-4)


def test_seeded_sampling_matches_reference_and_ignores_batch_composition():
    sp = [SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=100 + i) for i in range(len(PROMPTS))]
    ref = generate(PARAMS, CFG, PROMPTS, 16, sp)
    together = run_staggered(Engine(CFG, PARAMS, SMALL), PROMPTS, 16, sp, arrive_every=1)
    alone = Engine(CFG, PARAMS, SMALL)
    alone.add_request("2", PROMPTS[2], 16, sp[2])
    alone_out = alone.run_until_done()["2"]
    assert alone_out.token_ids == together[2].token_ids
    for i, r in enumerate(ref):
        assert together[i].token_ids == r.token_ids
        np.testing.assert_allclose(together[i].logprobs, r.logprobs, atol=1e-4)


def test_group_prefix_sharing_uses_prompt_pages_once():
    prompt = RNG.randint(3, 256, 30).tolist()  # 30 tokens = 7 full pages of 4 + a partial page
    cfg = EngineConfig(num_pages=128, page_size=4, max_num_batched_tokens=64, max_num_seqs=8)
    eng = Engine(CFG, PARAMS, cfg)
    for i in range(8):
        eng.add_request(str(i), prompt, 6, GREEDY)
    eng.step()  # prefill of the first request only; its group-mates wait to share
    assert len(eng.running) == 1
    eng.step()
    assert len(eng.running) == 8
    first = eng.seqs["0"].pages
    shared = first[:7]
    for i in range(1, 8):
        pages = eng.seqs[str(i)].pages
        assert pages[:7] == shared  # the prompt's full pages are the same physical pages
        assert pages[7] != first[7]  # the partial page was copied
    for p in shared:  # 8 requests + the prefix cache entry
        assert eng.blocks.ref[p] == 9
    used = eng.blocks.num_pages - eng.blocks.num_free
    assert used < 2 * 8 + 8  # unshared would need 8 * 8 = 64 pages
    out = eng.run_until_done()
    ref = generate(PARAMS, CFG, [prompt], 6)[0].token_ids
    assert all(out[str(i)].token_ids == ref for i in range(8))
    eng.blocks.clear_prefix_cache()
    assert eng.blocks.num_free == eng.blocks.num_pages


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.slow
def test_tiny_pool_preempts_and_still_matches(mode):
    ref = generate(PARAMS, CFG, PROMPTS, 24)
    cfg = EngineConfig(num_pages=24, page_size=4, max_num_batched_tokens=32, max_num_seqs=8,
                       preemption=mode)
    eng = Engine(CFG, PARAMS, cfg)
    out = run_staggered(eng, PROMPTS, 24, GREEDY, arrive_every=1)
    assert eng.num_preemptions > 0
    assert sum(r.metrics.num_preemptions for r in out.values()) == eng.num_preemptions
    assert sorted(out) == list(range(len(PROMPTS)))
    for i, r in enumerate(ref):
        assert out[i].token_ids == r.token_ids, i


@pytest.mark.parametrize("with_kv", [True, False])
def test_export_import_continues_identically(with_kv):
    ref = generate(PARAMS, CFG, PROMPTS[:3], 20)
    a = Engine(CFG, PARAMS, SMALL)
    for i in range(3):
        a.add_request(str(i), PROMPTS[i], 20, GREEDY)
    for _ in range(8):
        a.step()
    a.drain()  # the step in flight (overlap) commits: every token is on the host
    b = Engine(CFG, PARAMS, SMALL)
    for i in range(3):
        partial = list(a.seqs[str(i)].output)
        blob = a.export_kv(str(i))
        assert blob.output_ids == partial and blob.num_computed == len(PROMPTS[i]) + len(partial) - 1
        b.add_request(str(i), PROMPTS[i], 20 - len(partial), GREEDY, output_ids=partial,
                      kv=blob if with_kv else None)
        out = b.run_until_done()[str(i)]
        assert partial + out.token_ids == ref[i].token_ids
    assert not a.has_unfinished() and a.blocks.num_free + a.blocks.num_evictable() == a.blocks.num_pages


def test_steady_state_does_not_recompile():
    eng = Engine(CFG, PARAMS, SMALL)
    run_staggered(eng, PROMPTS, 12, GREEDY)
    before = model_runner.TRACE_COUNTS["step"]
    run_staggered(eng, PROMPTS, 12, GREEDY)  # same shapes again: all buckets cached
    assert model_runner.TRACE_COUNTS["step"] == before
    layouts_used = len(eng.step_stats)
    assert layouts_used > 20  # many steps, few compiles


def test_eos_stop_and_top_logprobs():
    ref = generate(PARAMS, CFG, PROMPTS[:1], 12)[0].token_ids
    stop = ref[4]
    eng = Engine(CFG, PARAMS, EngineConfig(num_pages=64, page_size=4, max_top_logprobs=3),
                 eos_ids=(ref[6],))
    eng.add_request("s", PROMPTS[0], 12, SamplingParams(temperature=0.0, stop_token_ids=(stop,), top_logprobs=3))
    eng.add_request("e", PROMPTS[0], 12, GREEDY)
    out = eng.run_until_done()
    assert out["s"].finish_reason == "stop" and out["s"].token_ids == ref[: ref.index(stop) + 1]
    assert out["e"].finish_reason == "eos" and out["e"].token_ids == ref[: ref.index(ref[6]) + 1]
    tops = out["s"].top_logprobs
    assert len(tops) == len(out["s"].token_ids)
    assert all(t[0][0] == tok and t[0][1] >= t[1][1] >= t[2][1] for t, tok in zip(tops, out["s"].token_ids, strict=True))


@pytest.mark.parametrize("kwargs, msg", [
    (dict(prompt_ids=[]), "empty prompt"),
    (dict(max_tokens=2000), "exceeds the context"),
    (dict(sampling=SamplingParams(stop_token_ids=(9999,))), "stop_token_ids"),
    (dict(sampling=SamplingParams(temperature=-0.5)), "temperature"),
    (dict(sampling=SamplingParams(top_p=0.0)), "top_p"),
    (dict(prompt_ids=[1, 300]), "outside"),
])
def test_bad_input_rejected_engine_keeps_serving(kwargs, msg):
    eng = Engine(CFG, PARAMS, SMALL)
    eng.add_request("ok", PROMPTS[1], 5, GREEDY)
    args = dict(request_id="bad", prompt_ids=PROMPTS[0], max_tokens=5, sampling=GREEDY) | kwargs
    with pytest.raises(InputError, match=msg):
        eng.add_request(**args)
    out = eng.run_until_done()
    assert list(out) == ["ok"] and out["ok"].token_ids == generate(PARAMS, CFG, PROMPTS[1:2], 5)[0].token_ids


def test_step_stats_and_compiled_steps_are_bounded():

    cfg = tiny_config()
    eng = Engine(cfg, init_params(cfg, 0), EngineConfig(num_pages=32, page_size=8,
                                                        max_step_stats=3))
    eng.add_request("r", [1, 2, 3], 6, SamplingParams(temperature=0.0))
    eng.run_until_done()
    assert eng.step_count >= 6 and len(eng.step_stats) == 3
    assert [s.step for s in eng.step_stats] == list(range(eng.step_count - 3, eng.step_count))
    assert len(model_runner._EXECUTABLES) <= model_runner.MAX_EXECUTABLES
    with pytest.raises(ConfigError, match="max_step_stats"):
        EngineConfig(max_step_stats=0).validate()


def test_request_states_follow_the_state_machine_and_steps_record_phases():
    eng = Engine(CFG, PARAMS, EngineConfig(num_pages=32, page_size=4, max_num_seqs=1))
    for name, p in zip("abc", PROMPTS, strict=False):
        eng.add_request(name, p, 4, GREEDY)
    a, b, c = (eng.seqs[k] for k in "abc")
    assert {s.status for s in (a, b, c)} == {RequestStatus.WAITING}
    eng.step()
    assert a.status is RequestStatus.RUNNING and b.status is RequestStatus.WAITING  # one slot
    assert eng.running == [a] and list(eng.waiting) == [b, c]
    assert eng.abort("b").finish_reason == "abort"
    assert b.status is RequestStatus.FINISHED and list(eng.waiting) == [c]
    with pytest.raises(SeerError, match="finished -> running is not a valid transition"):
        b.to(RequestStatus.RUNNING)
    out = eng.run_until_done()
    assert sorted(out) == ["a", "c"] and a.status is c.status is RequestStatus.FINISHED
    assert eng.blocks.num_free + eng.blocks.num_evictable() == eng.blocks.num_pages
    last = eng.step_stats[-1]
    assert last.device_s > 0 and last.compile_s == 0
    assert min(last.plan_s, last.h2d_s, last.d2h_s, last.commit_s) >= 0
