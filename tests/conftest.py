"""Test setup, before jax is imported: 8 fake CPU devices for sharding tests; the engine's
scatter-uniqueness check on; and one Ray cluster per test process for the modules that need one.

No persistent compilation cache in the test processes or the processes they start, but for the
Ray actors (`tests.subprocess_env.compilation_cache_env`, one engine per actor process).
Serializing and loading XLA:CPU executables crashed an xdist worker twice in CI (an abort in
`executable.serialize()` and a segfault in `deserialize_executable`, each while the test's
engines ran steps on other threads), which a test process cannot survive."""

import os

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# every scatter the engine sends is checked for repeated indices (whose order TPUs and GPUs
# leave unspecified); inherited by the processes the tests start
os.environ.setdefault("SEER_CHECK_SCATTERS", "1")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def ray_cluster():
    """A local loopback Ray cluster, started once per test process and shut down at its end:
    Ray is never initialised again in a process that shut it down. The modules that use it are
    marked `xdist_group("ray")`, so that under `--dist loadgroup` (`make test`) they share one
    worker and one cluster."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'seer-jax[ray]')")
    from seer_jax.rollout.backends.ray_cluster import RayBackendConfig, ensure_ray

    ensure_ray(RayBackendConfig(object_store_mb=200, num_cpus=8))
    yield ray
    ray.shutdown()


# ------------------------------------------------------------------------- worker crashes
#
# An xdist worker that dies (a segfault or abort in native code, or a kill) takes its test with
# it. Each worker writes a fault log (faulthandler: every thread's stack at a fatal signal) and
# the test it is running with its resident memory; when a worker dies, the controller puts both
# into the crashed test's report and the session summary. A crashed test runs once more, in a
# fresh worker (`--max-worker-restart` must allow it): it passes only if it then passes, and
# the crash stays in the summary as a rerun. A test that crashes twice fails.

_FAULT_DIR = "SEER_TEST_FAULT_DIR"
_crashes: dict[str, int] = {}
_crash_notes: list[str] = []


def _worker_files(worker_id: str) -> tuple[str, str]:
    d = os.environ[_FAULT_DIR]
    return os.path.join(d, f"{worker_id}.fault"), os.path.join(d, f"{worker_id}.running")


def _rss_mb() -> tuple[float, float]:
    import resource

    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.hookimpl(trylast=True)  # after pytest's faulthandler plugin, which logs to stderr
def pytest_configure(config):
    import faulthandler
    import tempfile

    worker = getattr(config, "workerinput", None)
    if worker is None:  # the controller, or a run without workers
        if not os.environ.get(_FAULT_DIR):
            os.environ[_FAULT_DIR] = config._seer_fault_dir = tempfile.mkdtemp(
                prefix="seer_test_faults_")
        return
    if os.environ.get(_FAULT_DIR):
        fault, _ = _worker_files(worker["workerid"])
        config._seer_fault_log = open(fault, "w")  # noqa: SIM115 - open until the process ends
        faulthandler.enable(file=config._seer_fault_log, all_threads=True)


def pytest_unconfigure(config):
    import shutil

    made = getattr(config, "_seer_fault_dir", None)  # the controller's, after its summary
    if made:
        shutil.rmtree(made, ignore_errors=True)


def pytest_runtest_logstart(nodeid, location):
    if not (os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get(_FAULT_DIR)):
        return
    _, running = _worker_files(os.environ["PYTEST_XDIST_WORKER"])
    rss, peak = _rss_mb()
    with open(running, "w") as f:
        f.write(f"{nodeid} started with {rss:.0f} MB resident (peak {peak:.0f} MB)\n")


def _read_tail(path: str, limit: int = 6000) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    return text[-limit:]


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    """xdist: a worker died while running `crashitem`."""
    worker = report.node.gateway.id
    fault, running = _worker_files(worker) if os.environ.get(_FAULT_DIR) else ("", "")
    log = _read_tail(fault).strip()
    where = _read_tail(running).strip()
    details = (f"worker {worker}: {where or 'no record of the running test'}\n"
               + (f"fault log:\n{log}" if log else
                  "no fault log (no fatal signal was caught: killed, e.g. out of memory?)"))
    _crashes[crashitem] = _crashes.get(crashitem, 0) + 1
    from xdist.scheduler import LoadScheduling, LoadScopeScheduling

    rerun = _crashes[crashitem] == 1 and isinstance(sched, LoadScheduling | LoadScopeScheduling)
    if rerun:
        if isinstance(sched, LoadScheduling):
            sched.mark_test_pending(crashitem)
        # (LoadScopeScheduling and its subclasses put the crashed test's unit back themselves)
        report.outcome = "rerun"
    _crash_notes.append(f"{crashitem}: {'runs again' if rerun else 'failed'}\n{details}")
    report.longrepr = f"{report.longrepr} (see the worker crashes section of the summary)"


def pytest_report_teststatus(report, config):
    if report.outcome == "rerun":
        return "rerun", "R", ("RERUN", {"yellow": True})
    return None


def pytest_terminal_summary(terminalreporter):
    if _crash_notes:
        terminalreporter.section("worker crashes", sep="=", red=True)
        for note in _crash_notes:
            terminalreporter.write_line(note)
