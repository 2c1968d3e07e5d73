"""`seer-jax` command line: one subcommand per module in `seer_jax.commands`.

Each command module exposes `NAME`, `HELP`, `add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from seer_jax.errors import SeerError

COMMANDS = (
    "seer_jax.commands.generate",
    "seer_jax.commands.fetch_model",
    "seer_jax.commands.rollout",
    "seer_jax.commands.simulate",
    "seer_jax.commands.bench",
    "seer_jax.commands.check_deploy",
)


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    parser = argparse.ArgumentParser(
        prog="seer-jax", description="seer_jax: JAX/Pallas rollout engine for synchronous RL."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name in COMMANDS:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:  # a command not built yet in this checkout
            if e.name != name:
                raise
            continue
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        modules[mod.NAME] = mod
    return parser, modules


def main(argv: list[str] | None = None) -> int:
    parser, modules = build_parser()
    args, unknown = parser.parse_known_args(argv)
    # `--config.key=value` overrides are collected by commands that take a config file.
    overrides = [u for u in unknown if u.startswith("--config.")]
    rest = [u for u in unknown if not u.startswith("--config.")]
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.config_overrides = overrides
    try:
        return int(modules[args.command].run(args) or 0)
    except SeerError as e:
        print(f"seer-jax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
