"""Why two policies' T=1.0 rollouts can differ: re-derive the sampling decision at each position
where their tokens first differ.

A request's n-th token is `categorical(fold_in(PRNGKey(seed), n), logp)`, i.e. the argmax of
logp + Gumbel noise drawn from that key, the same for every policy. Tokens can still differ when
the two largest perturbed scores are nearly tied: the logits of a row depend on the shapes of the
batch it was computed in (XLA:CPU matmuls round differently for different row counts), so a tie
within that rounding can break either way. This script recomputes each differing position's
logits with a full forward pass, redraws the Gumbel noise, and reports the margin between the two
tokens' perturbed scores next to the typical margin between the best two at other positions.

    python benchmarks/token_flips.py --tokens TOKENS.jsonl [--config configs/rollout/bench_structured.py]
        [--json out.json]

TOKENS.jsonl: written by `benchmarks/rollout.py --tokens-out`.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", required=True)
    p.add_argument("--config", default="configs/rollout/bench_structured.py")
    p.add_argument("--baseline-positions", type=int, default=200,
                   help="random positions (of identical responses) whose top-2 margin is reported")
    p.add_argument("--json", dest="json_path", default=None)
    args, overrides = p.parse_known_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from seer_jax.config_files import load_config_file
    from seer_jax.model import load
    from seer_jax.model.generate import full_forward
    from seer_jax.model.sampling import request_keys
    from seer_jax.provenance import run_info
    from seer_jax.rollout.api import build_prompts
    from seer_jax.rollout.core.controller_config import request_seed
    from seer_jax.rollout.settings import PromptSettings

    c = load_config_file(args.config, overrides)
    if c.temperature != 1.0 or c.top_p != 1.0 or c.top_k != 0:
        raise SystemExit("token_flips.py handles temperature 1.0 without top-p/top-k filtering only")
    by_req: dict[str, dict[str, list[int]]] = collections.defaultdict(dict)
    opener = gzip.open if args.tokens.endswith(".gz") else open
    with opener(args.tokens, "rt") as f:
        for line in f:
            o = json.loads(line)
            by_req[o["request_id"]][o["policy"]] = o["token_ids"]
    cfg, params, tok = load(c.model, c.dtype)
    prompts, _ = build_prompts(PromptSettings.from_config(c), tok)

    def scores(rid: str, prefix: list[int], pos: int):
        gi, j = (int(x) for x in rid[1:].split("/"))
        seq = list(prompts[gi]) + prefix
        # right-pad to a multiple of 128 (causal: the last real position is unaffected) so the
        # jitted forward compiles once per bucket, not once per sequence length
        padded = np.zeros((1, -(-len(seq) // 128) * 128), np.int32)
        padded[0, : len(seq)] = seq
        logits = full_forward(params, cfg, padded)[0, len(seq) - 1]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        key = request_keys(jnp.asarray([request_seed(c.seed, gi, j)]), jnp.asarray([pos]))[0]
        g = jax.random.gumbel(key, logp.shape, logp.dtype)
        # the engine's draw, reproduced: categorical(key, logp) == argmax(logp + g)
        assert int(jax.random.categorical(key, logp)) == int(jnp.argmax(logp + g))
        return np.asarray(logp + g)

    flips, same = [], []
    for rid, toks in sorted(by_req.items()):
        pols = sorted(toks)
        ref = toks[pols[0]]
        for pol in pols[1:]:
            other = toks[pol]
            if other == ref:
                continue
            pos = next((i for i, (x, y) in enumerate(zip(ref, other, strict=False)) if x != y), None)
            if pos is None:
                continue  # one is a prefix of the other (a stop decision differs)
            z = scores(rid, ref[:pos], pos)
            a, b = ref[pos], other[pos]
            order = np.argsort(-z)
            flips.append({"request_id": rid, "policies": [pols[0], pol], "position": pos,
                          "tokens": [int(a), int(b)], "score_margin": float(abs(z[a] - z[b])),
                          "top2_here": [int(order[0]), int(order[1])]})
    rng = np.random.default_rng(0)
    identical = [(rid, t[next(iter(t))]) for rid, t in by_req.items() if len({tuple(v) for v in t.values()}) == 1]
    for _ in range(min(args.baseline_positions, len(identical))):
        rid, toks = identical[rng.integers(len(identical))]
        pos = int(rng.integers(len(toks)))
        z = np.sort(scores(rid, toks[:pos], pos))
        same.append(float(z[-1] - z[-2]))
    summary = {
        "responses": len(by_req),
        "responses_that_differ": len({f["request_id"] for f in flips}),
        "flips": flips,
        "flip_score_margin_max": max((f["score_margin"] for f in flips), default=None),
        "typical_top2_margin_median": float(np.median(same)) if same else None,
        "typical_top2_margin_p1": float(np.percentile(same, 1)) if same else None,
    }
    print(json.dumps(summary, indent=1))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"summary": summary, "run": run_info()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
