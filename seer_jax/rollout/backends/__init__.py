"""Where engines run and where KV lives between chunks: in-process engine instances
(`engine_instance`), the host KV pool (`kv_pool`), Ray actors (`ray_cluster`, `ray_actor`,
`ray_proxy`, `ray_group`, `ray_pool`) and the Mooncake Store pool (`mooncake_pool`). Each
implements the interfaces of `seer_jax.rollout.core.instance`.
"""
