"""`seer-jax generate`: one prompt through the reference generator."""

from __future__ import annotations

import argparse
import json
import time

from seer_jax.errors import InputError

NAME = "generate"
HELP = "Generate a completion for one prompt (dense reference generator)."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help='"smollm2" or a local path (.gguf, HF dir, Orbax dir)')
    p.add_argument("--tokenizer", default=None, help="tokenizer source if the model has none")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="prompt text")
    g.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise InputError("--prompt-ids is empty")
    return ids


def run(args: argparse.Namespace) -> int:
    from seer_jax.model import load
    from seer_jax.model.generate import generate
    from seer_jax.provenance import run_info
    from seer_jax.rollout.core.types import SamplingParams

    if args.max_tokens < 1:
        raise InputError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                              seed=args.seed)
    sampling.validate()
    # token ids in and out need no tokenizer: without one only the text is left out
    cfg, params, tok = load(args.model, args.dtype, args.tokenizer,
                            tokenizer_required=args.prompt is not None)
    if args.prompt is not None:
        if tok is None:
            raise InputError("this model has no tokenizer: pass --tokenizer or use --prompt-ids")
        if args.chat:
            prompt_ids = tok.encode_chat([{"role": "user", "content": args.prompt}])
        else:
            prompt_ids = tok.encode(args.prompt)
    else:
        if args.chat:
            raise InputError("--chat needs --prompt text, not --prompt-ids")
        prompt_ids = parse_ids(args.prompt_ids)
    eos = tuple(cfg.eos_token_ids) or ((tok.eos_id,) if tok and tok.eos_id is not None else ())
    t0 = time.perf_counter()
    out = generate(params, cfg, [prompt_ids], args.max_tokens, sampling, eos_ids=eos)[0]
    elapsed = time.perf_counter() - t0
    text = tok.decode(out.token_ids) if tok else None
    if args.json:
        print(json.dumps({
            "prompt_ids": prompt_ids, "token_ids": out.token_ids, "logprobs": out.logprobs,
            "text": text, "finish_reason": out.finish_reason,
            "summary": {"num_tokens": len(out.token_ids), "seconds": round(elapsed, 3),
                        "finish_reason": out.finish_reason},
            "run": run_info(),
        }))
    else:
        print(text if text is not None else " ".join(map(str, out.token_ids)))
        print(f"[{len(out.token_ids)} tokens, finish={out.finish_reason}, {elapsed:.2f}s]")
    return 0
