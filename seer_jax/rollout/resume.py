"""Journaled rollouts for `run_rollout`: the fingerprint a journal must match to be resumed, and
the responses and reports of policies a journal holds finished.

What the fingerprint covers (a resume under a different value is refused, naming the key): the
model (its name, dtype and a sha256 of its files' names and bytes), the prompts (source, count, chat template
and a hash of their token ids), group size, max_tokens, sampling (temperature, top-p, top-k,
seed, per-request seeds), the policies, speculation and whether routed experts are returned. What it leaves out may change between
the crash and the resume, since it does not change any response: the deployment (backend,
instances, tp, Ray and KV pool settings), engine memory, chunk size and placement settings, the
clock and time model.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib

from seer_jax.rollout.core.journal import JournalError, JournalState, RequestRecord
from seer_jax.rollout.core.report import report_from_json
from seer_jax.rollout.core.results import ResponseResult
from seer_jax.rollout.core.run import RolloutOutput
from seer_jax.rollout.settings import RolloutSettings

# sha256 of a file's bytes, by (resolved path, inode, size, mtime_ns): a process that
# fingerprints the same unchanged model again does not read it again
_FILE_HASHES: dict[tuple, str] = {}


def file_sha256(path: pathlib.Path) -> str:
    """The sha256 of a file's bytes, streamed (cached while the file's stat is unchanged)."""
    st = path.stat()
    key = (str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _FILE_HASHES:
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(8 << 20), b""):
                h.update(block)
        _FILE_HASHES[key] = h.hexdigest()
    return _FILE_HASHES[key]


def file_identity(path: str | os.PathLike) -> str:
    """A sha256 over a model file or directory: every file's relative name, size and the
    sha256 of all its bytes."""
    root = pathlib.Path(path)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.relative_to(root) if f != root else f.name}\0{f.stat().st_size}\0"
                 f"{file_sha256(f)}\0".encode())
    return h.hexdigest()[:32]


def rollout_fingerprint(s: RolloutSettings, prompts: list[list[int]],
                        model_path: str | os.PathLike) -> dict:
    """What a journal of this rollout must match to be resumed (see the module docstring)."""
    tokens = hashlib.sha256(json.dumps(prompts, separators=(",", ":")).encode()).hexdigest()[:32]
    fp = {
        "model": str(s.model.name),
        "model_files": file_identity(model_path),
        "dtype": str(s.model.dtype),
        "prompts": str(s.prompts.source),
        "num_prompts": int(s.prompts.num_prompts),
        "chat": bool(s.prompts.chat),
        "prompt_tokens": tokens,
        "group_size": int(s.group_size),
        "max_tokens": int(s.max_tokens),
        "temperature": float(s.sampling.temperature),
        "top_p": float(s.sampling.top_p),
        "top_k": int(s.sampling.top_k),
        "seed": int(s.sampling.seed),
        "per_request_seeds": bool(s.controller.per_request_seeds),
        "policies": ",".join(s.policies),
        "speculation": bool(s.speculation.enabled),
    }
    if s.sampling.return_routed_experts:  # the journal must hold every token's routing
        fp["routed_experts"] = True
    return fp


def restored_output(state: JournalState, policy: str, prompts: list[list[int]], group_size: int,
                    detokenize) -> RolloutOutput:
    """The responses and report of a policy whose rollout the journal holds finished."""
    pj = state.policy(policy)
    results = []
    for gi, prompt in enumerate(prompts):
        for j in range(group_size):
            rid = f"g{gi}/{j}"
            rec = pj.requests.get(rid)
            if rec is None or rec.finish_reason is None:
                raise JournalError(f"{state.path}: policy {policy!r} is recorded done but response "
                                   f"{rid!r} is not finished in the journal")
            results.append(ResponseResult(
                request_id=rid, group_id=f"g{gi}", group_index=gi, sample_index=j,
                prompt_ids=tuple(prompt), token_ids=list(rec.token_ids),
                logprobs=list(rec.logprobs), finish_reason=rec.finish_reason,
                submitted_at=0.0, first_scheduled_at=None, first_token_at=None,
                finished_at=rec.finished_at, num_chunks=rec.num_chunks, instances=[],
                migrations=0, preemptions=0, reprefill_tokens=0,
                text=detokenize(list(rec.token_ids)) if detokenize else None,
                weight_versions=[list(s) for s in rec.weight_versions],
                routed_experts=rec.routed_experts))
    return RolloutOutput(results=results, report=report_from_json(pj.report))


def records_to_restore(state: JournalState | None, policy: str) -> list[RequestRecord]:
    """A policy's journaled requests (finished and unfinished), to restore in its controller."""
    if state is None:
        return []
    return list(state.policy(policy).requests.values())
