"""Distributed rollout on a local Ray cluster: 2 engine actors stepping at once vs 2 in-process
slices stepped in turn, object-store KV pool transfer rate, and recovery from a killed actor.

Usage (a 2-core box takes about 2.5 minutes at 256 x 4, 4.5 at the default 768 x 6, 9 at 1024 x 8):
  python benchmarks/distributed.py [--hidden 256 --layers 4] [--shared-cores] --json PATH
  python benchmarks/distributed.py --speculation [--model smollm2|random] --json PATH
    (grouped speculation on Ray vs in process: see benchmarks/distributed_spec.py)

Workload: a random model (`--hidden` 768, `--layers` 6 by default: steps of tens of ms, compute-
bound like a device step; at 256 x 4 a step is ~5 ms of host-bound work), `--groups` prompts x
G=4 responses of up to `--max-tokens` greedy tokens, chunks of 16 tokens (seer policy), the
same for every run. Every run is timed after a warm-up run of the same workload (compilation
left out).

What is measured:
- tokens/s: inprocess_in_turn (one process, 2 mesh slices, `clock="wall"`: one step after the
  other), inprocess_threads (`clock="concurrent"`: one thread per slice), ray (2 actors,
  `clock="concurrent"`, steps pipelined `RayBackendConfig.pipeline_depth` deep, and again with
  depth 1). The summary's speedup is ray / inprocess_in_turn. Each slice owns one core unless
  `--shared-cores`: the in-turn baseline runs in a child process pinned to one core, each Ray
  actor is pinned to its own (`RayBackendConfig.pin_cpus`); the in-turn run with XLA spread over
  every core and the threads run are measured as well, in another child process (the driver
  runs no engine itself).
- pool GB/s: KV blobs of several sizes put by one actor and fetched by another through
  `RayKVPool` (directory lookup + object-store get), and the rate the rollout's pool reported;
  the same through `MooncakeKVPool` on a loopback `mooncake_master` (directory lookup + store get
  over TCP + unpickling) when the `mooncake` extra is installed (skipped otherwise).
- recovery: instance 1 killed after 8 chunks: time from the kill until the driver saw it gone,
  re-dispatched chunks, and the makespan against the fault-free run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

if "in_turn_one_core" in sys.argv:  # the pinned baseline's process: one core, before XLA starts
    os.sched_setaffinity(0, {0})
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=2").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from seer_jax.engine.engine import EngineConfig, KVBlob  # noqa: E402
from seer_jax.model.config import tiny_config  # noqa: E402
from seer_jax.model.llama import init_params  # noqa: E402
from seer_jax.provenance import run_info  # noqa: E402
from seer_jax.rollout.backends.engine_instance import make_engine_instances  # noqa: E402
from seer_jax.rollout.backends.kv_pool import HostKVPool  # noqa: E402
from seer_jax.rollout.backends.ray_cluster import RayBackendConfig, ensure_ray  # noqa: E402
from seer_jax.rollout.core.concurrent_driver import FaultPlan  # noqa: E402
from seer_jax.rollout.core.run import rollout  # noqa: E402
from seer_jax.rollout.core.types import SamplingParams  # noqa: E402


def model_config(hidden: int, layers: int):
    """A random Llama-shaped model: `hidden` wide (heads of 32), `layers` deep, 2x MLP."""
    return tiny_config(hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
                       num_heads=hidden // 32, num_kv_heads=hidden // 64, head_dim=32,
                       eos_token_ids=(7,))


CFG = model_config(768, 6)
ENGINE = EngineConfig(num_pages=256, page_size=16, max_num_seqs=16, max_num_batched_tokens=64,
                      max_prefill_seqs=4)
GREEDY = SamplingParams(temperature=0.0)


class PoolProbe:
    """An actor that writes or reads KV blobs through the pool (transfer-rate probe)."""

    def __init__(self, pool):
        self.pool = pool

    def put(self, request_id: str, nbytes: int) -> str:
        n = nbytes // 8  # k and v of float32: 4 bytes each
        blob = KVBlob([1], [], np.ones((1, 1, n // 16, 16), np.float32),
                      np.ones((1, 1, n // 16, 16), np.float32))
        return self.pool.put(request_id, blob, blob.nbytes)

    def get(self, handle: str) -> tuple[float, int]:
        t0 = time.perf_counter()
        blob = self.pool.get(handle)
        return time.perf_counter() - t0, int(blob.nbytes)


def workload(groups: int) -> list[list[int]]:
    rng = np.random.RandomState(0)
    return [rng.randint(8, 256, int(n)).tolist() for n in rng.randint(8, 48, groups)]


def run(instances, pool, prompts, max_tokens, clock, fault=None):
    t0 = time.perf_counter()
    out = rollout(prompts, group_size=4, max_tokens=max_tokens, instances=instances,
                  sampling=GREEDY, policy="seer", pool=pool, config={"chunk_size": 16},
                  clock=clock, fault=fault)
    wall = time.perf_counter() - t0
    rep = out.report
    return out, {"tokens_per_s": rep.output_tokens / wall, "wall_s": wall,
                 "output_tokens": rep.output_tokens, "chunks": rep.chunks,
                 "migrations": rep.migrations, "kv_pool_bytes_moved": rep.kv_pool_bytes_moved,
                 "kv_pool_transfer_gbps": rep.kv_pool_transfer_gbps,
                 "lost_instances": rep.lost_instances,
                 "redispatched_chunks": rep.redispatched_chunks}


def inprocess(params, prompts, max_tokens, clock):
    pool = HostKVPool()
    insts = make_engine_instances(CFG, params, num_instances=2, tp=1, engine_config=ENGINE,
                                  pool=pool, devices=jax.devices()[:2])
    run(insts, pool, prompts, max_tokens, clock)  # warm-up: compile every step shape
    for inst in insts:
        assert not inst.has_work()
    insts = make_engine_instances(CFG, params, num_instances=2, tp=1, engine_config=ENGINE,
                                  pool=(pool := HostKVPool()), devices=jax.devices()[:2])
    return run(insts, pool, prompts, max_tokens, clock)


def pool_transfer(ray, pool, sizes_mib):
    probe = ray.remote(num_cpus=0)(PoolProbe)
    writer, reader = probe.remote(pool), probe.remote(pool)
    rows = []
    for mib in sizes_mib:
        nbytes = mib * 2**20
        handle = ray.get(writer.put.remote(f"probe{mib}", nbytes))
        ray.get(reader.get.remote(handle))  # first touch
        handle = ray.get(writer.put.remote(f"probe{mib}", nbytes))
        secs, got = ray.get(reader.get.remote(handle))
        rows.append({"mib": mib, "get_s": secs, "gbps": got / secs / 1e9})
        pool.delete(f"probe{mib}")
    for a in (writer, reader):
        ray.kill(a)
    return rows


def mooncake_transfer(ray, sizes_mib):
    """`pool_transfer` through Mooncake Store on a loopback master; None when not installed."""
    from seer_jax.errors import ConfigError
    from seer_jax.rollout.backends.mooncake_pool import LoopbackMaster, MooncakeKVPool

    try:
        master = LoopbackMaster()
    except ConfigError as e:
        print(f"mooncake pool transfer: skipped ({e})", flush=True)
        return None
    pool = None
    try:
        pool = MooncakeKVPool.create(master.config, shared=True)
        return pool_transfer(ray, pool, sizes_mib)
    finally:
        if pool is not None:
            pool.shutdown()
        master.stop()


def child(kind: str, args) -> dict:
    """Run the in-process setups `kind` in a fresh process; its runs and token ids."""
    path = f"{args.json or 'distributed'}.{kind}.json"
    subprocess.run([sys.executable, __file__, "--child", kind, "--json", path,
                    "--groups", str(args.groups), "--max-tokens", str(args.max_tokens),
                    "--hidden", str(args.hidden), "--layers", str(args.layers)], check=True)
    with open(path) as f:
        runs = json.load(f)
    os.remove(path)
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--hidden", type=int, default=768, help="model width (heads of 32)")
    ap.add_argument("--layers", type=int, default=6, help="model depth")
    ap.add_argument("--shared-cores", action="store_true",
                    help="do not pin: every process's XLA spreads over all cores")
    ap.add_argument("--child", choices=["in_process", "in_turn_one_core"], default=None,
                    help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None)
    ap.add_argument("--speculation", action="store_true",
                    help="grouped speculation rows instead (see benchmarks/distributed_spec.py)")
    ap.add_argument("--model", choices=["smollm2", "random"], default="smollm2",
                    help="with --speculation: SmolLM2 on natural prompts, or the random model")
    ap.add_argument("--rows", default="inprocess_spec,roofline,ray_spec,ray_plain",
                    help="with --speculation: the rows to run (comma-separated)")
    ap.add_argument("--max-stale-steps", type=int, default=1,
                    help="with --speculation: draft_service.max_stale_steps of the Ray rows")
    ap.add_argument("--temperature", type=float, default=1.0,
                    help="with --speculation --model smollm2: the sampling temperature")
    ap.add_argument("--cost-model", default="smollm2-135m",
                    help="with --speculation --model smollm2: the roofline model of the "
                    "modelled rows")
    args = ap.parse_args(argv)
    global CFG
    CFG = model_config(args.hidden, args.layers)
    params = init_params(CFG, seed=3)
    prompts = workload(args.groups)
    if args.speculation:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import distributed_spec

        return distributed_spec.main(args, (CFG, params, prompts))
    if args.child is not None:  # a child process: in-process runs, results to --json
        if args.child == "in_turn_one_core":
            out, res = inprocess(params, prompts, args.max_tokens, "wall")
            runs = {"in_turn": res}
        else:
            out, res = inprocess(params, prompts, args.max_tokens, "wall")
            runs = {"in_turn": res,
                    "threads": inprocess(params, prompts, args.max_tokens, "concurrent")[1]}
        runs["token_ids"] = [list(r.token_ids) for r in out.results]
        with open(args.json, "w") as f:
            json.dump(runs, f)
        return 0

    # In-process runs go in child processes: a driver that has run engines itself slows the
    # actors down on this 2-core box (its idle XLA runtime still takes CPU time: 214 vs 192
    # tokens/s at 1024 x 8), and a rollout driver does not run engines.
    shared = child("in_process", args)
    in_turn_shared, threads = shared["in_turn"], shared["threads"]
    print(f"in-process in turn (XLA on all cores): {in_turn_shared['tokens_per_s']:.0f} tok/s; "
          f"threads: {threads['tokens_per_s']:.0f} tok/s", flush=True)
    in_turn = in_turn_shared
    if not args.shared_cores:
        # each slice owns one core, as a slice owns its chips: the in-turn baseline runs in a
        # process pinned to one core (one slice computes at a time, on its core), each Ray actor
        # is pinned to its own core (RayBackendConfig.pin_cpus)
        pinned = child("in_turn_one_core", args)
        in_turn = pinned["in_turn"]
        if pinned["token_ids"] != shared["token_ids"]:
            raise SystemExit("the pinned baseline's tokens differ from the in-process run's")
        print(f"in-process in turn (one core): {in_turn['tokens_per_s']:.0f} tok/s", flush=True)
    reference_tokens = shared["token_ids"]

    backend = RayBackendConfig(object_store_mb=400, pin_cpus=not args.shared_cores,
                               env={"XLA_FLAGS": "--xla_force_host_platform_device_count=1"})
    ray = ensure_ray(backend, min_cpus=4)
    from seer_jax.rollout.backends.ray_group import make_ray_instances

    t0 = time.perf_counter()
    group = make_ray_instances(CFG, params, num_instances=2, tp=1, engine_config=ENGINE,
                               backend=backend)
    start_s = time.perf_counter() - t0
    try:
        run(group.instances, group.pool, prompts, args.max_tokens, "concurrent")  # warm-up
        group.reset()
        ray_out, on_ray = run(group.instances, group.pool, prompts, args.max_tokens, "concurrent")
        same = [list(r.token_ids) for r in ray_out.results] == reference_tokens
        print(f"ray: {on_ray['tokens_per_s']:.0f} tok/s (tokens identical: {same})", flush=True)
        group.reset()  # the same with one step per round trip (no step queued on the actors)
        for inst in group.instances:
            inst.pipeline_depth = 1
        unpiped_out, unpiped = run(group.instances, group.pool, prompts, args.max_tokens,
                                   "concurrent")
        for inst in group.instances:
            inst.pipeline_depth = backend.pipeline_depth
        same = same and [list(r.token_ids) for r in unpiped_out.results] == reference_tokens
        print(f"ray, pipeline depth 1: {unpiped['tokens_per_s']:.0f} tok/s", flush=True)
        transfer = pool_transfer(ray, group.pool, [1, 16, 64])
        print("pool transfer:", [f"{r['mib']} MiB {r['gbps']:.2f} GB/s" for r in transfer],
              flush=True)
        mooncake = mooncake_transfer(ray, [1, 16, 64])
        if mooncake is not None:
            print("mooncake pool transfer:",
                  [f"{r['mib']} MiB {r['gbps']:.2f} GB/s" for r in mooncake], flush=True)
        group.reset()
        fault = FaultPlan(instance=1, after_chunks=8)
        fault_out, faulted = run(group.instances, group.pool, prompts, args.max_tokens,
                                 "concurrent", fault=fault)
        fault_same = [list(r.token_ids) for r in fault_out.results] == reference_tokens
    finally:
        group.shutdown()
        ray.shutdown()
    recovery = {"detect_s": fault.detect_s, "killed_at_s": fault.fired_at,
                "redispatched_chunks": faulted["redispatched_chunks"],
                "lost_instances": faulted["lost_instances"],
                "makespan_s": faulted["wall_s"], "fault_free_makespan_s": on_ray["wall_s"],
                "tokens_identical": fault_same}
    print(f"recovery: detected in {fault.detect_s:.3f} s, "
          f"{faulted['redispatched_chunks']} chunks re-dispatched", flush=True)
    summary = {
        "ray_tokens_per_s": on_ray["tokens_per_s"],
        "inprocess_in_turn_tokens_per_s": in_turn["tokens_per_s"],
        "slices_own_cores": not args.shared_cores,
        "inprocess_in_turn_shared_cores_tokens_per_s": in_turn_shared["tokens_per_s"],
        "ray_speedup_vs_in_turn_shared_cores": (on_ray["tokens_per_s"]
                                                / in_turn_shared["tokens_per_s"]),
        "inprocess_threads_tokens_per_s": threads["tokens_per_s"],
        "ray_pipeline_depth": backend.pipeline_depth,
        "ray_depth1_tokens_per_s": unpiped["tokens_per_s"],
        "ray_depth1_speedup_vs_in_turn": unpiped["tokens_per_s"] / in_turn["tokens_per_s"],
        "ray_speedup_vs_in_turn": on_ray["tokens_per_s"] / in_turn["tokens_per_s"],
        "threads_speedup_vs_in_turn": threads["tokens_per_s"] / in_turn["tokens_per_s"],
        "tokens_identical": same,
        "pool_transfer_gbps_64mib": transfer[-1]["gbps"],
        "mooncake_pool_transfer_gbps_64mib": mooncake[-1]["gbps"] if mooncake else None,
        "rollout_pool_transfer_gbps": on_ray["kv_pool_transfer_gbps"],
        "kill_detect_s": fault.detect_s,
        "fault_redispatched_chunks": faulted["redispatched_chunks"],
        "fault_tokens_identical": fault_same,
        "actor_start_s": start_s,
    }
    report = {
        "summary": summary,
        "run": run_info(),
        "workload": {"groups": args.groups, "group_size": 4, "max_tokens": args.max_tokens,
                     "chunk_size": 16, "policy": "seer",
                     "model": f"random hidden {args.hidden} x {args.layers} layers"},
        "runs": {"inprocess_in_turn": in_turn, "inprocess_in_turn_shared_cores": in_turn_shared, "inprocess_threads": threads, "ray": on_ray, "ray_depth1": unpiped,
                 "ray_with_fault": faulted},
        "pool_transfer": transfer,
        "mooncake_pool_transfer": mooncake,
        "recovery": recovery,
    }
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
