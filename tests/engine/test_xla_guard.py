"""On the CPU no XLA compile runs beside a running computation or while an engine on another
thread dispatches device work (`xla_guard`)."""

import threading

import jax
import jax.numpy as jnp

from seer_jax.engine import xla_guard


def _slow(x):
    # a computation that runs for a while, dispatched asynchronously (a chain of matmuls)
    for _ in range(48):
        x = jnp.tanh(x @ x)
    return x


def test_a_compile_first_waits_for_every_running_computation():
    assert xla_guard.install_cpu_compile_guard()  # the suite runs on the CPU
    slow = jax.jit(_slow)
    x = jnp.full((1024, 1024), 1e-3)
    slow(x).block_until_ready()  # compiled
    running = slow(x + 1e-3)  # dispatched, not waited for
    jax.jit(lambda y: y * 3 + 1).lower(jnp.ones(7)).compile()  # a new compile, nothing run
    assert running.is_ready()


def test_a_compile_waits_while_another_thread_holds_the_step_lock():
    assert xla_guard.install_cpu_compile_guard()
    done = threading.Event()

    def compile_new():
        jax.jit(lambda x: x - 5)(jnp.ones(11)).block_until_ready()
        done.set()

    with xla_guard.STEP_LOCK:
        t = threading.Thread(target=compile_new)
        t.start()
        assert not done.wait(1.0)  # cannot compile while the lock is held
    t.join(60)
    assert done.is_set()
