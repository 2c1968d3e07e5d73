"""One lock for the engines' device work in a process, and on the CPU no compile beside a
running computation.

Engines stepped on threads (`ConcurrentDriver` with in-process slices) share a process: they
dispatch every piece of device work (steps, cache maintenance, page-table updates, input
unpacking) under `STEP_LOCK`, so no engine dispatches while another compiles.

XLA:CPU has crashed (segfaults in compile, aborts in executable serialization and
deserialization) when a compile ran while computations dispatched by other threads were still
executing. On the CPU, `install_cpu_compile_guard` therefore routes every XLA compile of the
process (the engine's steps and any other jit, which may come from any thread) through
`STEP_LOCK`, after waiting for every array still being computed. TPU and GPU compiles are left
alone; there the engine only waits for the steps it has in flight before compiling a new one
(`model_runner`).
"""

from __future__ import annotations

import functools
import logging
import threading

import jax

logger = logging.getLogger(__name__)

# held while an engine dispatches device work, and (CPU) while anything compiles
STEP_LOCK = threading.RLock()
_installed = False


def quiesce() -> None:
    """Wait until every array of this process is computed: nothing dispatched is running."""
    for x in jax.live_arrays():
        try:
            if not x.is_deleted():
                x.block_until_ready()
        except RuntimeError:  # donated or deleted since it was listed
            pass


def install_cpu_compile_guard() -> bool:
    """Route this process's XLA compiles through `STEP_LOCK` and `quiesce` when the default
    backend is the CPU (idempotent). False where it does not apply (another backend), or where
    this JAX has no `compile_or_get_cached` to wrap (then only the engine's own fence holds)."""
    global _installed
    if _installed:
        return True
    if jax.default_backend() != "cpu":
        return False
    try:
        from jax._src import compiler
    except ImportError:  # pragma: no cover - layout of another JAX
        return False
    original = getattr(compiler, "compile_or_get_cached", None)
    if original is None:  # pragma: no cover - another JAX
        logger.warning("this JAX has no compiler.compile_or_get_cached: XLA:CPU compiles are "
                       "not serialized against running steps")
        return False

    @functools.wraps(original)
    def guarded(*args, **kwargs):
        # a compile from a thread XLA owns (a host callback inside a running computation) must
        # not wait for the computation that is waiting for it
        if isinstance(threading.current_thread(), threading._DummyThread):
            return original(*args, **kwargs)
        with STEP_LOCK:
            quiesce()
            return original(*args, **kwargs)

    compiler.compile_or_get_cached = guarded
    _installed = True
    return True
