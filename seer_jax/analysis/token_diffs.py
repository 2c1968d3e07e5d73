"""Where two policies' responses to the same prompts and seeds differ, token by token."""

from __future__ import annotations


def token_differences(results_by_policy) -> list[dict]:
    """Responses whose tokens differ from the first policy's: request id, policy, the first
    position that differs, both lengths, and the first policy's logprob there."""
    pols = list(results_by_policy)
    ref = {r.request_id: r for r in results_by_policy[pols[0]]}
    out = []
    for pol in pols[1:]:
        for r in results_by_policy[pol]:
            a, b = list(ref[r.request_id].token_ids), list(r.token_ids)
            if a == b:
                continue
            pos = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            lp = ref[r.request_id].logprobs
            out.append({"request_id": r.request_id, "policy": pol, "vs": pols[0],
                        "first_diff_position": pos, "lengths": [len(a), len(b)],
                        "ref_logprob_at_diff": float(lp[pos]) if pos < len(lp) else None})
    return out
