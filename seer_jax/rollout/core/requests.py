"""The requests of a rollout as the controller keeps them: built from the groups
(`build_groups`), a chunk's result added to its request and to the rollout's stats
(`account_chunk`), tokens restored from a record (`restore_tokens`), and the response handed back
(`response_result`). Where chunks run (dispatch, placement) is the controller's."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from seer_jax.errors import InputError
from seer_jax.rollout.core.controller_config import request_seed
from seer_jax.rollout.core.journal import RequestRecord, add_segment
from seer_jax.rollout.core.policies import GroupState, RequestState
from seer_jax.rollout.core.results import ControllerStats, ResponseResult
from seer_jax.rollout.core.types import ChunkResult, SamplingParams


def build_groups(groups: Sequence[Sequence[int]], group_ids: Sequence[str], *, group_size: int,
                 max_tokens: int, sampling: SamplingParams, per_request_seeds: bool,
                 capacity: int) -> tuple[list[GroupState], dict[str, RequestState]]:
    """One `GroupState` per prompt with its `group_size` requests ("<group id>/<sample>"), and
    every request by id. per_request_seeds: each request samples with its own seed derived from
    (seed, group index, sample index). capacity: the largest instance's KV tokens (a prompt plus
    max_tokens must fit it)."""
    out: list[GroupState] = []
    requests: dict[str, RequestState] = {}
    for gi, (gid, prompt) in enumerate(zip(group_ids, groups, strict=True)):
        prompt = tuple(int(t) for t in prompt)
        if not prompt:
            raise InputError(f"group {gid!r} has an empty prompt")
        if len(prompt) + max_tokens > capacity:
            raise InputError(
                f"group {gid!r}: prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) "
                f"exceeds the largest instance KV capacity ({capacity} tokens)"
            )
        g = GroupState(group_id=gid, index=gi, max_tokens=max_tokens)
        for j in range(group_size):
            sp = sampling
            if per_request_seeds:
                sp = dataclasses.replace(sampling, seed=request_seed(sampling.seed, gi, j))
            r = RequestState(
                request_id=f"{gid}/{j}",
                group=g,
                sample_index=j,
                prompt_ids=prompt,
                sampling=sp,
                max_tokens=max_tokens,
            )
            g.requests.append(r)
            requests[r.request_id] = r
        out.append(g)
    return out, requests


def account_chunk(req: RequestState, stats: ControllerStats, res: ChunkResult,
                  weight_version: int) -> None:
    """Add an ended chunk's tokens, logprobs and counters to its request and to the stats."""
    req.output_ids.extend(map(int, res.new_token_ids))
    req.logprobs.extend(map(float, res.new_logprobs))
    if res.new_routed_experts is not None:
        req.routed_experts.extend(res.new_routed_experts)
    add_segment(req.weight_versions, weight_version, len(res.new_token_ids))
    req.num_chunks += 1
    req.preemptions += res.preemptions
    req.reprefill_tokens += res.reprefill_tokens
    req.decode_steps += res.decode_steps
    req.spec_proposed += res.spec_proposed
    req.spec_accepted += res.spec_accepted
    req.kv_bytes_imported += res.kv_bytes_imported
    req.kv_bytes_exported += res.kv_bytes_exported
    stats.chunks += 1
    stats.preemptions += res.preemptions
    stats.reprefill_tokens += res.reprefill_tokens
    stats.reprefill_chunks += int(res.reprefill_tokens > 0)
    stats.decode_steps += res.decode_steps
    stats.spec_proposed += res.spec_proposed
    stats.spec_accepted += res.spec_accepted
    stats.kv_bytes_imported += res.kv_bytes_imported
    stats.kv_bytes_exported += res.kv_bytes_exported


def restore_tokens(req: RequestState, rec: RequestRecord, sampling: SamplingParams | None) -> None:
    """Give `req` the tokens, logprobs, weight versions and chunk count `rec` holds (InputError
    when they do not fit it); `sampling`: its own parameters when given."""
    n = len(rec.token_ids)
    if n > req.max_tokens or (rec.logprobs and len(rec.logprobs) != n) or \
            sum(k for _, k in rec.weight_versions) != n:
        raise InputError(f"restore: {rec.request_id!r} has {n} tokens, {len(rec.logprobs)} "
                         f"logprobs, weight-version segments {rec.weight_versions} "
                         f"(max_tokens {req.max_tokens})")
    routed = len(rec.routed_experts or [])
    if (sampling or req.sampling).return_routed_experts and routed != n:
        raise InputError(f"restore: {rec.request_id!r} has {n} tokens but the routed experts of "
                         f"{routed}; the rollout returns routed experts, so every restored "
                         "token needs them (was the journal written without them?)")
    req.output_ids = [int(t) for t in rec.token_ids]
    req.logprobs = [float(x) for x in rec.logprobs]
    req.routed_experts = list(rec.routed_experts or [])
    req.weight_versions = [list(s) for s in rec.weight_versions]
    req.num_chunks = rec.num_chunks
    if sampling is not None:
        req.sampling = sampling


def response_result(r: RequestState,
                    detokenize: Callable[[list[int]], str] | None = None) -> ResponseResult:
    """The response of a finished request (its text when `detokenize` is given)."""
    g = r.group
    return ResponseResult(
        request_id=r.request_id,
        group_id=g.group_id,
        group_index=g.index,
        sample_index=r.sample_index,
        prompt_ids=r.prompt_ids,
        token_ids=list(r.output_ids),
        logprobs=list(r.logprobs),
        finish_reason=r.finish_reason,
        submitted_at=r.submitted_at,
        first_scheduled_at=r.first_scheduled_at,
        first_token_at=r.first_token_at,
        finished_at=r.finished_at,
        num_chunks=r.num_chunks,
        instances=list(r.instances_visited),
        migrations=r.migrations,
        preemptions=r.preemptions,
        reprefill_tokens=r.reprefill_tokens,
        text=detokenize(list(r.output_ids)) if detokenize else None,
        weight_versions=[list(s) for s in r.weight_versions],
        routed_experts=([list(x) for x in r.routed_experts]
                        if r.sampling.return_routed_experts else None),
    )
