"""Partial rollout across iterations: a rollout that returns once `target_groups` groups are
complete, carrying the rest into the next call.

Off by default (every call waits for every group: on-policy). With a `CarryOver` passed to
`rollout(..., carry=, target_groups=N)`:
- the call stops dispatching once N groups are complete (groups of this call or carried ones);
  the chunks already running end normally (at most one chunk later), then it returns the
  complete groups' responses;
- every other group is carried: its finished responses are held back (a group is returned
  whole), its unfinished requests keep their tokens, logprobs and sampling seed, and their KV
  handle in the pool while the weights stay the same. The next call puts them in its buffer
  behind the new groups' requests (the policy then orders them all): they continue after their
  tokens, from the pool's KV when the weight version did not change, else by re-prefill under
  the new weights (a stale KV is dropped from the pool);
- each response records the weight versions its tokens were generated under
  (`ResponseResult.weight_versions`, [version, tokens] segments); `version_stats` sums how many
  returned tokens are off-policy and how old they are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from seer_jax.rollout.core.journal import RequestRecord
from seer_jax.rollout.core.types import SamplingParams


@dataclasses.dataclass
class CarriedGroup:
    group_id: str
    prompt_ids: tuple[int, ...]
    records: list[RequestRecord]  # one per sample, in sample order (finished or not)
    sampling: list[SamplingParams]  # each sample's own parameters (its seed)
    kv: dict[str, tuple[str, int]]  # request id -> (pool handle, weight version of that KV)
    first_call: int  # the call that started the group


class CarryOver:
    """The groups one partial rollout hands to the next (the state a trainer keeps across
    iterations); `calls` counts the rollouts it has been through."""

    def __init__(self) -> None:
        self.groups: list[CarriedGroup] = []
        self.calls = 0

    def __len__(self) -> int:
        return len(self.groups)

    @property
    def unfinished_requests(self) -> int:
        return sum(r.finish_reason is None for g in self.groups for r in g.records)

    def forget_kv(self) -> None:
        """Drop the KV handles (the pool they name is gone): carried requests re-prefill."""
        for g in self.groups:
            g.kv.clear()

    def new_group_ids(self, n: int) -> list[str]:
        """Ids for this call's new groups, unique across calls."""
        return [f"c{self.calls}g{i}" for i in range(n)]

    def restore_into(self, ctl, weight_version: int, pool) -> None:
        """Put the carried groups' requests into `ctl` (built with them after the new groups)."""
        for g in self.groups:
            for rec, sp in zip(g.records, g.sampling, strict=True):
                handle = None
                kv = g.kv.get(rec.request_id)
                if kv is not None:
                    if kv[1] == weight_version:
                        handle = kv[0]
                    elif pool is not None:  # computed under other weights: useless now
                        pool.delete(rec.request_id)
                ctl.restore(rec, sampling=sp, kv_handle=handle)

    def collect(self, ctl, weight_version: int) -> None:
        """After a call: the groups `ctl` left incomplete become the carried ones."""
        first = {g.group_id: g.first_call for g in self.groups}
        carried = []
        for g in ctl.groups:
            if g.num_finished == len(g.requests):
                continue
            records, sampling, kv = [], [], {}
            for r in g.requests:
                done = r.status == "done"
                records.append(RequestRecord(r.request_id, list(r.output_ids), list(r.logprobs),
                                             [list(s) for s in r.weight_versions],
                                             r.finish_reason if done else None,
                                             r.finished_at or 0.0, r.num_chunks,
                                             list(r.routed_experts)))
                sampling.append(r.sampling)
                if not done and r.kv_handle is not None:
                    kv[r.request_id] = (r.kv_handle, weight_version)
            carried.append(CarriedGroup(g.group_id, tuple(g.requests[0].prompt_ids), records,
                                        sampling, kv, first.get(g.group_id, self.calls)))
        self.groups = carried
        self.calls += 1


def combined_groups(carry: CarryOver, groups: Sequence[Sequence[int]],
                    group_ids: Sequence[str] | None) -> tuple[list, list[str]]:
    """The prompts and ids a carry-over call's controller runs: this call's new groups first
    (so their seeds are those of a call without carry-over), then the carried ones."""
    ids = list(group_ids) if group_ids is not None else carry.new_group_ids(len(groups))
    return ([list(p) for p in groups] + [list(g.prompt_ids) for g in carry.groups],
            ids + [g.group_id for g in carry.groups])


def version_stats(results: Sequence, current_version: int) -> dict:
    """Off-policy share of returned responses' tokens: generated under an older weight version
    than `current_version`, and their age in versions (token-weighted mean and max)."""
    total = off = age_sum = 0
    oldest = 0
    for r in results:
        for version, n in r.weight_versions:
            total += n
            age = current_version - version
            if age > 0:
                off += n
                age_sum += age * n
                oldest = max(oldest, age)
    return {"tokens": total, "off_policy_tokens": off,
            "off_policy_share": off / total if total else 0.0,
            "mean_age_of_off_policy_tokens": age_sum / off if off else 0.0,
            "max_age": oldest,
            "responses_with_mixed_versions": sum(len({v for v, _ in r.weight_versions}) > 1
                                                 for r in results)}
