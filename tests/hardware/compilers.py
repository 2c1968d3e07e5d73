"""Compile tests for accelerators that are not attached: they need the compiler wheels
(`make test-hardware` installs them). Without them the tests skip, saying what is missing;
with SEER_REQUIRE_COMPILERS=1 (set by `make test-hardware`) a missing compiler is a failure."""

import os

import pytest

from seer_jax.hardware.targets import compilers_missing, get_target


def require_compiler(target: str) -> None:
    problem = compilers_missing(get_target(target).platform)
    if not problem:
        return
    if os.environ.get("SEER_REQUIRE_COMPILERS") == "1":
        pytest.fail(f"{target}: {problem} (SEER_REQUIRE_COMPILERS=1)")
    pytest.skip(f"{target}: {problem}; `make test-hardware` installs the compilers")
