"""`multigpu <verb>`: a thin front end; each verb maps its flags one-to-one onto a config dataclass."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from multigpu import __version__
from multigpu.config import Parser, add_config_arguments, config_from_args
from multigpu.engine import EngineConfig
from multigpu.env import DistEnv, check_backend
from multigpu.errors import UsageError
from multigpu.launch import LaunchConfig, launch
from multigpu.recipes.demo import DemoConfig
from multigpu.strategies import resolve_strategy


def exit_on_usage_error(main: Callable[[], int | None]) -> int:
    """Runs `main`; a UsageError becomes one line on stderr and exit code 2."""
    try:
        return main() or 0
    except UsageError as error:
        print(f"multigpu: error: {error}", file=sys.stderr)
        sys.exit(2)


def check_engine_config(config: EngineConfig, nproc: int) -> None:
    """Refuses, before any process starts, what the Engine would refuse in every worker."""
    env = DistEnv(world_size=nproc, local_world_size=nproc)
    resolve_strategy(config.strategy, env, config.cpu_offload, say=lambda _: None)
    if config.backend is not None:
        check_backend(config.backend, env.device)


def _forwarded(args: argparse.Namespace, *configs: type) -> list[str]:
    """The flags of `configs` as given, to hand on to the launched recipe module."""
    argv = []
    for cls in configs:
        for name, value in vars(config_from_args(cls, args)).items():
            flag = "--" + name.replace("_", "-")
            if isinstance(value, bool):
                argv.append(flag if value else "--no-" + flag[2:])
            elif value is not None:
                argv += [flag, str(value)]
    return argv


def cmd_run(args: argparse.Namespace) -> int:
    config = config_from_args(LaunchConfig, args)
    return launch(config, [args.script, *args.script_args], module=args.module)


def cmd_demo(args: argparse.Namespace) -> int:
    engine_config = config_from_args(EngineConfig, args)
    config_from_args(DemoConfig, args)
    check_engine_config(engine_config, args.nproc)
    launch_config = LaunchConfig(nproc=args.nproc)
    return launch(launch_config, ["multigpu.recipes.demo", *_forwarded(args, DemoConfig, EngineConfig)], module=True)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="multigpu", description="One training loop, any number of GPUs.")
    parser.add_argument("--version", action="version", version=f"multigpu {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    run = verbs.add_parser(
        "run",
        help="launch a script in N processes (torch.distributed.run underneath)",
        description="Launch SCRIPT in N processes per node. Plain torch.distributed, accelerate and HF Trainer "
        "scripts run unchanged; the exit code is the failing worker's.",
    )
    add_config_arguments(run, LaunchConfig)
    run.add_argument("-n", dest="nproc", type=int, help="short for --nproc")
    run.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name, as in python -m")
    run.add_argument("script", help="the training script (or module, with -m)")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    run.set_defaults(handler=cmd_run)

    demo = verbs.add_parser(
        "demo",
        help="a short built-in training run (spiral classification) to check a machine end to end",
        description="Train a small MLP on a generated spiral with the Engine, in --nproc processes.",
    )
    demo.add_argument("--nproc", type=int, default=2, help="processes to launch (default: 2)")
    add_config_arguments(demo, DemoConfig)
    add_config_arguments(demo, EngineConfig)
    demo.set_defaults(handler=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return exit_on_usage_error(lambda: args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
