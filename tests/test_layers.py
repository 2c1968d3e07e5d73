"""The package's layers import only downwards, and no two modules import each other.

Layers, lowest first (a module may import its own layer and any lower one):
errors/config_files/provenance -> pallas, costs -> model -> drafting -> engine -> rollout -> sim ->
analysis -> integrations -> hardware -> commands/cli. Inside rollout, `rollout.core` (controller, policies,
drivers) imports nothing else of `rollout` (no backend, no config/api) and none of
ray/mooncake/jax: it drives instances through its `Instance` interface only. Imports under
`if TYPE_CHECKING:` are annotations only and do not count; imports inside functions do.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "seer_jax"
LAYERS = [
    {"errors", "config_files", "provenance", "__init__"},
    {"pallas", "costs"},
    {"model"},
    {"drafting"},
    {"engine"},
    {"rollout"},
    {"sim"},
    {"analysis"},
    {"integrations"},
    {"hardware"},
    {"commands", "cli"},
]


def layer_of(module: str) -> int:
    top = module.split(".")[1] if module.count(".") else "__init__"
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{module}: its top-level part {top!r} is in no layer; add it to LAYERS")


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _type_checking_only(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


CORE = "seer_jax.rollout.core"
CORE_FORBIDDEN_THIRD_PARTY = {"ray", "mooncake", "jax", "jaxlib", "flax"}


def imports_of(tree: ast.AST, package: str | None) -> set[str]:
    """Modules of `package` (every module when None) imported anywhere in `tree` except under
    `if TYPE_CHECKING:`."""
    out: set[str] = set()

    def ours(name: str) -> bool:
        return package is None or name.split(".")[0] == package

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking_only(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if ours(a.name))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if ours(node.module):
                out.add(node.module)
                # `from seer_jax.sim import simulator` imports the submodule
                out.update(f"{node.module}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        found = imports_of(ast.parse(path.read_text()), root.name)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
                  for a, deps in graph.items() for b in deps if layer_of(b) > layer_of(a))


def core_violations(root: pathlib.Path) -> list[str]:
    """Modules of `rollout.core` importing another part of `rollout` (a backend, config, api)
    or a backend library (ray, mooncake, jax)."""
    out = []
    core_dir = root / "rollout" / "core"
    for path in sorted(core_dir.rglob("*.py")) if core_dir.exists() else []:
        name = module_name(path, root)
        found = imports_of(ast.parse(path.read_text()), None)
        # `from a.b import c` also lists a.b.c (c may be a module): report a.b only
        for m in sorted(m for m in found if not any(m.startswith(f + ".") for f in found)):
            top = m.split(".")[0]
            if m.startswith(f"{root.name}.rollout") and not (m == CORE or m.startswith(CORE + ".")):
                out.append(f"{name} imports {m} (rollout.core imports only rollout.core)")
            elif top in CORE_FORBIDDEN_THIRD_PARTY:
                out.append(f"{name} imports {m} (rollout.core imports no backend library)")
    return out


def cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """Strongly connected components with more than one module (import cycles); package
    `__init__` edges to their own submodules are re-exports, not cycles."""
    def deps(m):
        return {d for d in graph[m] if not d.startswith(m + ".")}

    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in deps(v):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(tuple(sorted(comp)))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_layers_import_only_downwards():
    assert layer_violations(import_graph(PACKAGE)) == []


def test_rollout_core_imports_no_backend():
    assert core_violations(PACKAGE) == []


def test_no_import_cycles():
    assert cycles(import_graph(PACKAGE)) == []


def test_the_check_catches_a_backwards_import_and_a_cycle(tmp_path):
    pkg = tmp_path / "seer_jax"
    for sub in ("model", "rollout"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "model" / "generate.py").write_text(
        "def f():\n    from seer_jax.rollout.types import SamplingParams\n")
    (pkg / "rollout" / "types.py").write_text("from seer_jax.model import generate\n")
    (pkg / "rollout" / "hints.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from seer_jax.sim import x\n")
    graph = import_graph(pkg)
    assert layer_violations(graph) == [
        "seer_jax.model.generate (layer 2) imports seer_jax.rollout.types (layer 5)"]
    assert cycles(graph) == [("seer_jax.model.generate", "seer_jax.rollout.types")]
    with pytest.raises(AssertionError, match="'nowhere' is in no layer"):
        layer_of("seer_jax.nowhere.x")


def test_the_check_catches_core_importing_a_backend(tmp_path):
    pkg = tmp_path / "seer_jax"
    for sub in ("rollout", "rollout/core", "rollout/backends"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "rollout" / "backends" / "ray_pool.py").write_text("import ray\n")
    (pkg / "rollout" / "core" / "types.py").write_text("import dataclasses\n")
    (pkg / "rollout" / "core" / "controller.py").write_text(
        "from seer_jax.rollout.core import types\n"
        "def f():\n    from seer_jax.rollout.backends.ray_pool import RayKVPool\n")
    (pkg / "rollout" / "core" / "driver.py").write_text("import jax.numpy as jnp\n")
    (pkg / "rollout" / "core" / "run.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import ray\n"
        "from seer_jax.rollout import config\n")
    assert core_violations(pkg) == [
        "seer_jax.rollout.core.controller imports seer_jax.rollout.backends.ray_pool "
        "(rollout.core imports only rollout.core)",
        "seer_jax.rollout.core.driver imports jax.numpy (rollout.core imports no backend library)",
        "seer_jax.rollout.core.run imports seer_jax.rollout (rollout.core imports only rollout.core)"]


def test_the_controller_simulator_and_configs_import_without_jax():
    """The CLI sets the fake-device count before JAX starts; that only works while the config,
    controller, policy and simulator modules do not import JAX themselves."""
    import subprocess
    import sys

    code = ("import sys, seer_jax.analysis.policies, seer_jax.rollout.api, seer_jax.rollout.config, "
            "seer_jax.rollout.core.run, seer_jax.sim.simulator, "
            "seer_jax.commands.rollout, seer_jax.cli; print('jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
