"""One process of an engine slice under `jax.distributed` (run by test_distributed_engine.py).

    python distributed_worker.py OUT.json IMPLS [PROCESS_ID NUM_PROCESSES PORT]

It joins a CPU cluster on 127.0.0.1:PORT (gloo collectives), and the tp mesh spans every
process's devices; without the last three arguments it runs alone on a mesh of its devices.
The test runs the same workload (`run_impls`) in its own process on a tp=2 mesh. For each
engine impl in IMPLS (comma-separated), a greedy workload: staggered arrivals, groups sharing
prompt pages, swap preemption (KV read to the host and written back), a KV export/import, and
(reference impl) a speculative engine; it writes the tokens, logprobs and exported KV
checksums as JSON to OUT.json.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# head_dim 64 and page_size 16: shapes the Pallas kernels lower for; one KV head per tp=2 shard
PAGES = 5  # few enough that the workload preempts (and swaps) sequences
PROMPTS = [np.random.RandomState(1).randint(3, 256, n).tolist() for n in (11, 21)]
NEW = 12


def _workload(impl: str, mesh) -> dict:
    from seer_jax.drafting.budget import BudgetConfig, SpeculationBudget
    from seer_jax.engine.engine import Engine, EngineConfig
    from seer_jax.engine.speculation import Speculator
    from seer_jax.model.config import tiny_config
    from seer_jax.model.llama import init_params
    from seer_jax.model.sampling_params import SamplingParams

    cfg = tiny_config(eos_token_ids=(), head_dim=64, num_heads=4, num_kv_heads=2, num_layers=1)
    params = init_params(cfg, seed=3)
    greedy = SamplingParams(temperature=0.0)
    out: dict = {}
    for name, speculation in (("plain", False), ("spec", True)):
        if speculation and impl != "reference":
            continue
        config = EngineConfig(num_pages=PAGES, page_size=16, max_num_seqs=4,
                              max_num_batched_tokens=32, max_prefill_seqs=1, impl=impl,
                              preemption="swap", speculation=speculation)
        # drafts of at most 3 tokens, one path: verify steps of one shape
        spec = Speculator(budget=SpeculationBudget(config=BudgetConfig(
            gamma_max=3, max_width=1, beta_init=0.9))) if speculation else None
        eng = Engine(cfg, params, config, mesh=mesh, speculator=spec)
        pending = [(f"{g}/{j}", p) for g, p in enumerate(PROMPTS) for j in range(2)]
        done, step = {}, 0
        while pending or eng.has_unfinished():
            if pending and step % 2 == 0:
                rid, p = pending.pop(0)
                eng.add_request(rid, p, NEW, greedy, group_id=rid.split("/")[0])
            for r in eng.step():
                done[r.request_id] = (r.token_ids, [round(x, 4) for x in r.logprobs])
            step += 1
        eng.blocks.check()
        # a chunk ends, its KV leaves on the host and continues in the same engine
        eng.add_request("x", PROMPTS[1], 5, greedy, keep_kv=True)
        first = eng.run_until_done()["x"]
        eng.add_request("x2", PROMPTS[1], 5, greedy, output_ids=first.token_ids, kv=first.kv)
        second = eng.run_until_done()["x2"]
        done["x"] = (first.token_ids + second.token_ids, [])
        out[name] = {"tokens": done, "preemptions": eng.num_preemptions,
                     "spec_accepted": spec.accepted if spec is not None else 0,
                     "kv_sum": float(np.abs(first.kv.k).sum() + np.abs(first.kv.v).sum())}
    return out


def run_impls(impls: list[str], mesh) -> dict:
    # JSON round trip: tuples become lists, as in the file the worker writes
    return json.loads(json.dumps({impl: _workload(impl, mesh) for impl in impls}))


def main(argv: list[str]) -> None:
    path, impls = argv[0], argv[1].split(",")
    if len(argv) > 2:
        process_id, num_processes, port = (int(a) for a in argv[2:5])
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                                   num_processes=num_processes, process_id=process_id)
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()), ("tp",))
    result = {"processes": jax.process_count(), "local_devices": jax.local_device_count(),
              "tp": mesh.shape["tp"], "runs": run_impls(impls, mesh)}
    with open(path, "w") as f:
        json.dump(result, f)
    if len(argv) > 2:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
