"""Overlapped steps (plan and dispatch step N+1 while step N runs, then commit N) give exactly
what one step at a time gives: tokens, logprobs, finish reasons, returned KV."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from seer_jax.drafting.budget import BudgetConfig, SpeculationBudget
from seer_jax.engine import model_runner
from seer_jax.engine.engine import Engine, EngineConfig
from seer_jax.engine.speculation import Speculator
from seer_jax.model.config import tiny_config
from seer_jax.model.generate import generate
from seer_jax.model.llama import init_params
from seer_jax.rollout.core.types import SamplingParams

CFG = tiny_config(num_heads=4, num_kv_heads=2, eos_token_ids=())
PARAMS = init_params(CFG, seed=11)
RNG = np.random.RandomState(1)
PROMPTS = [RNG.randint(3, 256, n).tolist() for n in (3, 17, 40, 9, 33, 1, 26, 12)]
GREEDY = SamplingParams(temperature=0.0)
BASE = EngineConfig(num_pages=96, page_size=4, max_num_batched_tokens=32, max_num_seqs=8,
                    max_prefill_seqs=2, max_top_logprobs=2)


def run(config: EngineConfig, requests, eos_ids=(), arrive_every=1):
    """Add requests (id, prompt, max_tokens, sampling, keep_kv) one per `arrive_every` steps;
    every output by id."""
    eng = Engine(CFG, PARAMS, config, eos_ids=eos_ids)
    pending, out, step = list(requests), {}, 0
    while pending or eng.has_unfinished():
        if pending and step % arrive_every == 0:
            rid, prompt, n, sp, keep = pending.pop(0)
            eng.add_request(rid, prompt, n, sp, keep_kv=keep)
        for r in eng.step():
            assert r.request_id not in out  # nothing returned twice
            out[r.request_id] = r
        step += 1
    eng.blocks.check()
    assert eng.blocks.num_free + eng.blocks.num_evictable() == eng.blocks.num_pages
    assert not eng.kv.rows.pages.any()
    return eng, out


def assert_same(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for rid in a:
        x, y = a[rid], b[rid]
        assert x.token_ids == y.token_ids, rid
        assert x.finish_reason == y.finish_reason, rid
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
        assert (x.top_logprobs is None) == (y.top_logprobs is None)
        if x.top_logprobs is not None:
            assert [[t for t, _ in row] for row in x.top_logprobs] == \
                   [[t for t, _ in row] for row in y.top_logprobs]
        assert (x.kv is None) == (y.kv is None), rid
        if x.kv is not None:
            assert x.kv.output_ids == y.kv.output_ids
            np.testing.assert_allclose(x.kv.k, y.kv.k, atol=1e-5)
            np.testing.assert_allclose(x.kv.v, y.kv.v, atol=1e-5)


def scenario(name: str):
    ref = generate(PARAMS, CFG, PROMPTS[:1], 12)[0].token_ids
    if name == "greedy_chunked":
        return BASE, [(str(i), p, 20, GREEDY, False) for i, p in enumerate(PROMPTS)], ()
    if name == "seeded_top_logprobs":
        sp = [SamplingParams(temperature=1.0, top_p=0.9, seed=7 + i, top_logprobs=2)
              for i in range(len(PROMPTS))]
        return BASE, [(str(i), p, 16, sp[i], False) for i, p in enumerate(PROMPTS)], ()
    if name == "eos_stop_keep_kv":
        # request 0 ends on EOS (token 6 of its greedy output), 1 on a stop id, the rest on
        # length with their KV returned; short budgets free slots for the waiting ones
        reqs = [("0", PROMPTS[0], 12, GREEDY, False),
                ("1", PROMPTS[0], 12, SamplingParams(temperature=0.0, stop_token_ids=(ref[3],)), False)]
        reqs += [(str(i), p, 3 + i, GREEDY, True) for i, p in enumerate(PROMPTS[1:], start=2)]
        return dataclasses.replace(BASE, max_num_seqs=4), reqs, (ref[6],)
    if name in ("preempt_recompute", "preempt_swap"):
        cfg = dataclasses.replace(BASE, num_pages=24, preemption=name.split("_")[1])
        return cfg, [(str(i), p, 24, GREEDY, False) for i, p in enumerate(PROMPTS)], ()
    raise ValueError(name)


@pytest.mark.parametrize("name", [
    "greedy_chunked", pytest.param("seeded_top_logprobs", marks=pytest.mark.exhaustive),
    "eos_stop_keep_kv", pytest.param("preempt_recompute", marks=pytest.mark.exhaustive),
    "preempt_swap"])
def test_overlap_gives_what_one_step_at_a_time_gives(name):
    cfg, reqs, eos = scenario(name)
    sync_eng, sync = run(dataclasses.replace(cfg, overlap=False), reqs, eos)
    over_eng, over = run(dataclasses.replace(cfg, overlap=True), reqs, eos)
    assert_same(over, sync)
    if name.startswith("preempt"):
        assert over_eng.num_preemptions > 0 and sync_eng.num_preemptions > 0
    if name == "eos_stop_keep_kv":
        assert {over[k].finish_reason for k in over} == {"eos", "stop", "length"}
        kept = [k for k in over if over[k].finish_reason == "length"]
        assert len(kept) >= 3 and all(over[k].kv is not None for k in kept)


def test_weights_held_per_layer_give_what_stacked_weights_give():
    """The engine with per-layer weights (GPUs' default) gives the tokens, logprobs and KV of
    the stacked weights' engine (CPU's default), and trainers still get stacked weights back."""
    from seer_jax.errors import ConfigError
    from seer_jax.model.llama import flat_params

    cfg, reqs, eos = scenario("eos_stop_keep_kv")
    stacked_eng, stacked = run(dataclasses.replace(cfg, layer_weights="stacked"), reqs, eos)
    split_eng, split = run(dataclasses.replace(cfg, layer_weights="per_layer"), reqs, eos)
    assert isinstance(split_eng.runner.params["layers"], tuple)
    assert isinstance(stacked_eng.runner.params["layers"], dict)
    assert_same(split, stacked)
    back, want = flat_params(split_eng.runner.stacked_params()), flat_params(PARAMS)
    assert back.keys() == want.keys()
    for k in want:
        assert np.array_equal(np.asarray(back[k]), np.asarray(want[k])), k
    with pytest.raises(ConfigError, match="layer_weights='unrolled'"):
        Engine(CFG, PARAMS, dataclasses.replace(cfg, layer_weights="unrolled"))


def test_one_transfer_per_step_and_pending_tokens_stay_on_the_device(monkeypatch):
    eng = Engine(CFG, PARAMS, BASE)
    for i, p in enumerate(PROMPTS[:4]):
        eng.add_request(str(i), p, 10, GREEDY)
    eng.step()
    eng.step()  # every prefill done: decode steps from here
    transfers, batches = [], []
    to_host, launch = model_runner.to_host, eng.runner.launch

    def counting_to_host(x):
        transfers.append(x.shape)
        return to_host(x)

    def recording_launch(batch, *a, **k):
        batches.append(batch)
        return launch(batch, *a, **k)

    monkeypatch.setattr(model_runner, "to_host", counting_to_host)
    monkeypatch.setattr(eng.runner, "launch", recording_launch)
    for _ in range(5):
        eng.step()
    assert len(transfers) == 5  # each step's commit brings the previous step's results back once
    for b in batches:  # every decode token is read on the device from the step before
        assert b.token_src is not None and (b.token_src[:b.dec.num] >= 0).all()
    out = eng.run_until_done()
    ref = generate(PARAMS, CFG, PROMPTS[:4], 10)
    assert [out[str(i)].token_ids for i in range(4)] == [r.token_ids for r in ref]


def test_output_lags_one_step_until_drained_and_abort_keeps_committed_tokens():
    ref = generate(PARAMS, CFG, PROMPTS[:2], 12)
    eng = Engine(CFG, PARAMS, BASE)
    eng.add_request("a", PROMPTS[0], 12, GREEDY)
    eng.add_request("b", PROMPTS[1], 12, GREEDY)
    for _ in range(5):
        eng.step()
    a = eng.seqs["a"]
    assert a.pending_row >= 0 and a.num_committed_new == a.num_new - 1  # one token in flight
    eng.drain()
    assert a.pending_row == -1 and a.num_committed_new == a.num_new
    assert a.output == ref[0].token_ids[:len(a.output)]
    eng.step()
    out = eng.abort("b")  # commits the step in flight first
    assert out.finish_reason == "abort" and len(out.token_ids) >= 5
    assert out.token_ids == ref[1].token_ids[:len(out.token_ids)]
    rest = eng.run_until_done()
    assert list(rest) == ["a"] and rest["a"].token_ids == ref[0].token_ids


def _until_last_token_in_flight(eng, rid):
    """Step until request rid's last token is sampled by the step in flight."""
    seq = eng.seqs[rid]
    for _ in range(100):
        if seq.num_new == seq.max_tokens and seq.num_committed_new == seq.max_tokens - 1:
            return
        assert not eng.step()
    raise AssertionError("the request never reached its last token")


def test_abort_of_a_request_the_drain_finishes_returns_its_output_once():
    ref = generate(PARAMS, CFG, PROMPTS[:2], 6)
    eng = Engine(CFG, PARAMS, BASE)
    eng.add_request("a", PROMPTS[0], 6, GREEDY)
    eng.add_request("b", PROMPTS[1], 6, GREEDY)
    _until_last_token_in_flight(eng, "a")
    out = eng.abort("a")  # the drain commits a's last token: a finished, not aborted
    assert out.finish_reason == "length" and out.token_ids == ref[0].token_ids
    assert eng.abort("a") is None
    rest = eng.run_until_done()  # a is not returned again, and the next steps run
    assert list(rest) == ["b"] and rest["b"].token_ids == ref[1].token_ids


def test_export_of_a_request_the_drain_finishes_is_refused_and_its_output_kept():
    from seer_jax.engine.engine import RequestFinished

    eng = Engine(CFG, PARAMS, BASE)
    eng.add_request("a", PROMPTS[0], 5, GREEDY)
    _until_last_token_in_flight(eng, "a")
    with pytest.raises(RequestFinished, match=r"request 'a' finished \(length\)"):
        eng.export_kv("a")
    out = eng.step()
    assert [o.request_id for o in out] == ["a"] and len(out[0].token_ids) == 5


def test_the_step_after_a_request_ends_is_not_counted_nor_charged():
    """With overlap a request that ended in step N is also in step N+1 (dispatched before N's
    tokens were known): its step counts and its instance's emulated clock equal what one step
    at a time gives."""
    from seer_jax.rollout.backends.engine_instance import EngineInstance
    from seer_jax.rollout.backends.kv_pool import HostKVPool
    from seer_jax.rollout.core.types import ChunkRequest

    def cost(batch, pre, dec, kv):
        return 1e-3 * batch + 1e-4 * (pre + dec) + 1e-6 * kv + 5e-4

    def results(overlap):
        eng = Engine(CFG, PARAMS, dataclasses.replace(BASE, overlap=overlap, max_num_seqs=8),
                     eos_ids=())
        inst = EngineInstance(0, eng, HostKVPool(1 << 30), step_time=cost)
        for i, (p, n) in enumerate(zip(PROMPTS[:4], (3, 7, 5, 9), strict=True)):
            inst.submit(ChunkRequest(request_id=str(i), group_id=str(i), prompt_ids=tuple(p),
                                     output_ids=(), max_new_tokens=n, original_max_tokens=n,
                                     sampling=GREEDY))
        out = {}
        while inst.has_work():
            for r in inst.step().finished:
                out[r.request_id] = r
        return out, inst.now()

    sync, sync_end = results(False)
    over, over_end = results(True)
    assert sorted(over) == sorted(sync) == ["0", "1", "2", "3"]
    for rid in sync:
        a, b = over[rid], sync[rid]
        assert a.new_token_ids == b.new_token_ids
        assert (a.num_steps, a.decode_steps) == (b.num_steps, b.decode_steps), rid
        assert a.ended_at == pytest.approx(b.ended_at, abs=1e-12), rid
    assert over_end == pytest.approx(sync_end, abs=1e-12)


def test_no_step_is_dispatched_while_another_thread_compiles(monkeypatch):
    """Engines stepped on threads share the executable cache and the compile fence: while one
    compiles a new step shape, another's launch waits."""
    import threading

    a = Engine(CFG, PARAMS, dataclasses.replace(BASE, max_top_logprobs=3))
    b = Engine(CFG, PARAMS, BASE)
    b.add_request("b", PROMPTS[1], 8, GREEDY)
    b.step()
    b.step()  # b's prefill and decode step shapes are compiled (and cached) now
    a.add_request("a", PROMPTS[2], 4, GREEDY)
    entered, b_done = threading.Event(), threading.Event()
    seen = {}
    lower = model_runner.ModelRunner.lower_step

    def slow_lower(self, fn, dev, **static):
        if self is a.runner and not entered.is_set():
            entered.set()
            th = threading.Thread(target=lambda: (b.step(), b_done.set()))
            th.start()
            th.join(timeout=3.0)  # b's launch must wait for this compile to end
            seen["b_finished_during_compile"] = b_done.is_set()
            seen["thread"] = th
        return lower(self, fn, dev, **static)

    monkeypatch.setattr(model_runner.ModelRunner, "lower_step", slow_lower)
    a.step()  # a new step shape (3 top logprobs): compiled while b tries to step
    assert entered.is_set() and seen["b_finished_during_compile"] is False
    seen["thread"].join()
    assert b_done.is_set()
    a.run_until_done()
    b.run_until_done()


class TwoOnTwoOff(SpeculationBudget):
    """Speculates in two steps of every four (drafts always pay when on): overlapped engines
    then run both verify steps and sample steps whose tokens stay on the device."""

    def __init__(self):
        super().__init__(step_time=lambda b, g: 1.0, config=BudgetConfig(beta_init=0.9))
        self.steps = 0

    def plan(self, batch_size, relax=True):
        on = self.steps // 2 % 2 == 0
        self.steps += relax
        plan = super().plan(batch_size, relax)
        return plan if on else dataclasses.replace(plan, total_tokens=0)


def test_overlap_with_speculation_gives_the_greedy_tokens_of_one_step_at_a_time(monkeypatch):
    """Grouped speculation with overlap on: verify steps are committed before the next plan,
    the steps between them overlap (their tokens read on the device), and every request gets
    the tokens, logprobs and finish reason it gets one step at a time."""
    ref = generate(PARAMS, CFG, PROMPTS[:2], 14)
    stop = SamplingParams(temperature=0.0, stop_token_ids=(ref[1].token_ids[8],))
    reqs = [(f"{g}/{j}", PROMPTS[g], 14 - 3 * j, stop if (g, j) == (1, 1) else GREEDY, False)
            for j in range(2) for g in range(2)]
    outs, batches = {}, []
    for overlap in (False, True):
        eng = Engine(CFG, PARAMS, dataclasses.replace(BASE, overlap=overlap, speculation=True),
                     speculator=Speculator(budget=TwoOnTwoOff()))
        monkeypatch.setattr(eng.runner, "launch", lambda b, *a, launch=eng.runner.launch, **k:
                            batches.append(b) or launch(b, *a, **k))
        group = {rid: rid.split("/")[0] for rid, *_ in reqs}
        pending, out, step = list(reqs), {}, 0
        while pending or eng.has_unfinished():
            while pending:
                rid, prompt, n, sp, _ = pending.pop(0)
                eng.add_request(rid, prompt, n, sp, group_id=group[rid])
            out.update((r.request_id, r) for r in eng.step())
            step += 1
        eng.blocks.check()
        assert eng.spec.accepted > 0
        outs[overlap] = out
    assert_same(outs[True], outs[False])
    for rid, r in outs[True].items():
        assert r.token_ids == ref[int(rid[0])].token_ids[:len(r.token_ids)], rid
    assert outs[True]["1/1"].finish_reason == "stop"
    overlapped = batches[len(batches) // 2:]  # (the second engine's)
    assert any(b.draft is not None for b in overlapped)
    assert any(b.token_src is not None for b in overlapped)
