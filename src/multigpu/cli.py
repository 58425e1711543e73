"""`multigpu <verb>`: a thin front end built from the table VERBS; each verb's flags come from its settings
dataclasses (and a few functions that add flags of their own), and its handler hands them to a recipe or tool.
Nothing in the package imports this module: what a verb does lives below it, and a UsageError from there becomes
one line and exit code 2 in `multigpu.core.errors.exit_on_usage_error`."""

from __future__ import annotations

import argparse
import errno
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from multigpu import __version__
from multigpu.config import config_file, config_writer
from multigpu.config.flags import Parser, add_config_arguments, config_from_args, finite_float
from multigpu.core.errors import UsageError, exit_on_usage_error, shown_path
from multigpu.core.lazy import imported
from multigpu.launch import stop

# The collectives benchmark's flags that `multigpu bench --collectives` takes; --nproc and --out are bench's own.
COLLECTIVE_FLAGS = ("ops", "min_bytes", "max_bytes", "factor", "iterations")


def cmd_run(args: argparse.Namespace) -> int:
    from multigpu.launch.launcher import LaunchConfig, launch

    return launch(config_from_args(LaunchConfig, args), [args.script, *args.script_args], module=args.module)


def cmd_lighthouse(args: argparse.Namespace) -> int:
    from multigpu.launch import lighthouse

    return lighthouse.serve(config_from_args(lighthouse.LighthouseConfig, args))


def cmd_demo(args: argparse.Namespace) -> int:
    from multigpu.recipes import demo

    return demo.run(config_from_args(demo.DemoRun, args))


def cmd_train(args: argparse.Namespace) -> int:
    from multigpu.recipes import train

    return train.run(config_from_args(train.TrainConfig, args))


def cmd_finetune(args: argparse.Namespace) -> int:
    from multigpu.recipes import finetune

    return finetune.run(config_from_args(finetune.FinetuneConfig, args))


def cmd_generate(args: argparse.Namespace) -> int:
    from multigpu.recipes import generate

    return generate.run(config_from_args(generate.GenerateConfig, args))


def cmd_export(args: argparse.Namespace) -> int:
    from multigpu.recipes import adapter_export, common

    checkpoint, out = Path(args.checkpoint), Path(args.out)
    if adapter_export.holds_adapter(checkpoint, args.key):  # a lora or qlora finetune's: a peft adapter directory
        adapter_export.export_adapter(checkpoint, out, args.key)
    else:
        common.export_checkpoint(checkpoint, out, key=args.key)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from multigpu.planner.memory import PlanConfig
    from multigpu.planner.recommend import plan_shape
    from multigpu.planner.report import print_table, to_json
    from multigpu.planner.shapes import from_counts, load_shape

    config = config_from_args(PlanConfig, args)
    if (args.model is None) == (args.params is None):
        raise UsageError("Give the model as --model (a name, config.json or its directory) or as --params, not both.")
    if args.model is not None:
        shape = load_shape(args.model)
    else:
        shape = from_counts(args.params, args.layers, args.hidden, args.heads, args.vocab)
    result = plan_shape(shape, config)
    if args.json:
        print(to_json(result))
    else:
        print_table(result)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from multigpu.tools import bench, collectives

    config = config_from_args(bench.BenchConfig, args)
    if args.collectives:
        if args.script is not None or config.recipe is not None:
            raise UsageError("--collectives measures the interconnect alone; drop SCRIPT and --recipe.")
        flags = {name: getattr(args, name) for name in COLLECTIVE_FLAGS}
        code = collectives.calibrate(collectives.CollectivesConfig(nproc=max(config.counts), **flags), Path(config.out))
    else:
        bench.run(config, args.script, args.script_args, args.module)
        code = 0
    if code == 0:
        config_writer.save_settings(settings_of(args), Path(config.out) / config_writer.RUN_CONFIG, "bench", "--out")
    return code


def cmd_simulate(args: argparse.Namespace) -> int:
    from multigpu.tools import simulate_request

    return simulate_request.run(config_from_args(simulate_request.SimulateRequest, args), args.json)


def cmd_verify(args: argparse.Namespace) -> int:
    from multigpu.tools.verify import VerifyConfig, print_verdict, verify

    config = config_from_args(VerifyConfig, args)
    verdict = verify(config, [args.script, *args.script_args], module=args.module)
    print_verdict(verdict, args.json)
    return 0 if verdict.passed else 1


def cmd_env(args: argparse.Namespace) -> int:
    from multigpu.tools import preflight

    return preflight.run(config_from_args(preflight.EnvConfig, args), args.json)


def cmd_config(args: argparse.Namespace) -> int:
    verb = config_file.verb_parsers(build_parser())[args.target]
    ask = sys.stdin.isatty() if args.ask is None else args.ask
    config_writer.write_config(verb, args.out, args.format, args.force, ask, answer_check(args.target, verb))
    return 0


def answer_check(verb: str, parser: argparse.ArgumentParser) -> Callable[[dict[str, Any]], None] | None:
    """What checks an answer of `multigpu config VERB`: the verb's config dataclasses, built as a run builds them;
    None where the defaults alone do not build (generate needs --prompts), leaving the type and choice checks."""

    def check(values: dict[str, Any]) -> None:
        for cls in VERBS[verb].configs:
            config_from_args(cls, argparse.Namespace(**values))

    try:
        check(config_file.defaults(parser))
    except UsageError:
        return None
    return check


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed settings of a verb, as its config file holds them."""
    return {name: value for name, value in vars(args).items() if name not in ("verb", "handler", "config")}


def add_script_arguments(parser: argparse.ArgumentParser, optional: bool = False) -> None:
    parser.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name, as in python -m")
    parser.add_argument("script", nargs="?" if optional else None, help="the training script (or module, with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def add_json_flag(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--json", action="store_true", help=f"print {what} as JSON")


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", dest="nproc", type=int, help="short for --nproc")
    add_script_arguments(parser)


def add_demo_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=2, help="processes to launch (default: 2)")


def add_plan_flags(parser: argparse.ArgumentParser) -> None:
    from multigpu.planner.shapes import BUILTIN

    parser.add_argument("--model", help=f"a built-in ({', '.join(BUILTIN)}), a config.json, or a directory with one")
    parser.add_argument("--params", type=finite_float, help="parameter count instead of --model, e.g. 7e9")
    for dim in ("layers", "hidden", "heads", "vocab"):
        parser.add_argument(f"--{dim}", type=int, help=f"with --params: the transformer's {dim} (for activations)")
    add_json_flag(parser, "the plan")


def add_bench_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--collectives", action="store_true", help="measure the collectives' bandwidth instead of a script"
    )
    from multigpu.tools.collectives import CollectivesConfig

    others = tuple(f.name for f in fields(CollectivesConfig) if f.name not in COLLECTIVE_FLAGS)
    add_config_arguments(parser, CollectivesConfig, skip=others)
    add_script_arguments(parser, optional=True)


def add_export_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a checkpoint directory (e.g. checkpoints/run/checkpoints/step-00000100)")
    parser.add_argument("out", help="the .safetensors file to write (a LoRA checkpoint: the adapter directory)")
    parser.add_argument("--key", default="model", help="the model's key in the saved state (default: model)")


@dataclass(frozen=True)
class Verb:
    """One verb: what --help says of it, what makes its flags, in order (a config dataclass's fields, named
    "module:Class" and imported when the verb is used, or a function that adds the flags that are no setting),
    and what runs it."""

    help: str
    description: str
    parts: tuple[str | Callable[[argparse.ArgumentParser], None], ...]
    handler: Callable[[argparse.Namespace], int]

    @property
    def configs(self) -> tuple[type, ...]:
        """The config dataclasses the verb builds from its flags (they check `multigpu config VERB --ask`)."""
        return tuple(imported(part) for part in self.parts if isinstance(part, str))


VERBS: dict[str, Verb] = {
    "run": Verb(
        "launch a script in N processes (torch.distributed.run underneath)",
        "Launch SCRIPT in N processes per node. Plain torch.distributed, accelerate and HF Trainer scripts run "
        "unchanged; the exit code is the failing worker's.",
        ("multigpu.launch.launcher:LaunchConfig", add_run_flags),
        cmd_run,
    ),
    "lighthouse": Verb(
        "where the replica groups of a fault-tolerant run meet (torchft's lighthouse), for a cluster",
        "Serve torchft's lighthouse until Ctrl-C or SIGTERM: the replica groups of a run (one `multigpu run "
        "--replica-groups N --replica-id I --lighthouse HOST:PORT` per node) agree on each step's quorum there. "
        "On one machine, `multigpu run --replica-groups N` starts one itself.",
        ("multigpu.launch.lighthouse:LighthouseConfig",),
        cmd_lighthouse,
    ),
    "demo": Verb(
        "a short built-in training run (spiral classification) to check a machine end to end",
        "Train a small MLP on a generated spiral with the Engine, in --nproc processes.",
        (
            add_demo_flags,
            "multigpu.recipes.demo:DemoLaunch",
            "multigpu.recipes.demo:DemoConfig",
            "multigpu.engine.config:EngineConfig",
        ),
        cmd_demo,
    ),
    "train": Verb(
        "train the sensor-activity classifier (smartwatch IMU data) on any strategy",
        "Train an activity classifier on windows of inertial-sensor data. Runs in this process, or launches --nproc "
        "processes itself; also runs under multigpu run / torchrun.",
        ("multigpu.recipes.train:TrainConfig",),
        cmd_train,
    ),
    "finetune": Verb(
        "full, LoRA or QLoRA fine-tuning of a causal language model (default: SmolLM2 on Shakespeare)",
        "Fine-tune a local Hugging Face causal LM (or the built-in SmolLM2-135M-Instruct) on packed text or chat "
        "records, with a token-normalised loss over the global batch, on any strategy. Writes a peft adapter (lora, "
        "qlora) or a model directory (full) to --save-dir.",
        ("multigpu.recipes.finetune:FinetuneConfig",),
        cmd_finetune,
    ),
    "generate": Verb(
        "batched generation from a causal LM (with a peft adapter), prompts split over N processes",
        'Generate continuations for a JSONL file of prompts ({"prompt": ...} or {"messages": [...]}); each process '
        "takes every N-th prompt; rank 0 writes the outputs in input order. --device-map splits one model's layers "
        "over this machine's GPUs instead (one process).",
        ("multigpu.recipes.generate:GenerateConfig",),
        cmd_generate,
    ),
    "plan": Verb(
        "memory per GPU for every strategy, and the fastest that fits",
        "Predict memory per GPU (parameters, gradients, optimizer states, activations, buffers) for every strategy, "
        "without loading weights; recommend the fastest that fits.",
        (add_plan_flags, "multigpu.planner.plan_config:PlanConfig"),
        cmd_plan,
    ),
    "env": Verb(
        "pre-flight checklist: versions, GPUs, topology, variables, an all-reduce smoke test (one node or several)",
        "Check this machine before a run; exits 1 with advice when something is wrong. Run on each node of a "
        "multi-node run (--nnodes, --node-rank, --master-addr, --master-port), it says each node's interface and "
        "address and measures the all-reduce bandwidth over every node and within each; --links-out saves both "
        "links for `multigpu simulate`.",
        ("multigpu.tools.preflight:EnvConfig", functools.partial(add_json_flag, what="the findings")),
        cmd_env,
    ),
    "bench": Verb(
        "throughput, speedup, efficiency, memory and communication share over process counts and strategies",
        "Benchmark an Engine SCRIPT (or --recipe train|finetune) at each --nproc and strategy: samples/s and "
        "tokens/s, step time median and p90, speedup and scaling efficiency over 1 process, peak memory per rank and "
        "the share of the step spent on gradient communication. Writes OUT/bench.json, speedup.png and memory.png. "
        "With --collectives: all-reduce / all-gather / reduce-scatter bus bandwidth and latency over message sizes "
        "at the largest --nproc, as nccl-tests reports them.",
        ("multigpu.tools.bench:BenchConfig", add_bench_flags),
        cmd_bench,
    ),
    "simulate": Verb(
        "predict step time, throughput and scaling efficiency on 1 to thousands of GPUs",
        "An alpha-beta model of each strategy's collectives (ring and tree all-reduce, all-gather, reduce-scatter; "
        "intra- and inter-node links; overlap with backward; FSDP prefetch) on top of one step's compute time, "
        "measured (--bench), given (--compute-s) or derived (--tflops, --mfu). Calibrate links with `multigpu bench "
        "--collectives`.",
        ("multigpu.tools.simulate_request:SimulateRequest", functools.partial(add_json_flag, what="the predictions")),
        cmd_simulate,
    ),
    "verify": Verb(
        "check that N processes compute what 1 process computes, step by step",
        "Run an Engine script in 1 process and in N on the same global batches; compare the loss of every step and "
        "the final parameters. Exits 0 on PASS, 1 on FAIL.",
        (
            "multigpu.tools.verify:VerifyConfig",
            functools.partial(add_json_flag, what="the comparison"),
            add_script_arguments,
        ),
        cmd_verify,
    ),
    "export": Verb(
        "consolidate a sharded checkpoint's model into one safetensors file (or a LoRA one into an adapter)",
        "Read every shard of CHECKPOINT's model in one process and write OUT (.safetensors). A lora or qlora "
        "finetune's checkpoint becomes a peft adapter directory OUT instead, as the finetune writes SAVE_DIR/adapter "
        "at its end. OUT must not exist yet.",
        (add_export_flags,),
        cmd_export,
    ),
}


def add_config_verb(verbs: argparse._SubParsersAction) -> None:
    """`multigpu config VERB`: a commented config file of VERB's settings."""
    parser = verbs.add_parser(
        "config",
        help="write a commented config file of a verb's settings, for VERB --config FILE",
        description="Write VERB's settings, each under its help, with the defaults as values (or your answers, with "
        "--ask), to a YAML or TOML file that `multigpu VERB --config FILE` reads.",
    )
    parser.add_argument("target", metavar="VERB", choices=tuple(VERBS), help="the verb to configure")
    parser.add_argument(
        "--out", metavar="FILE", help="the file to write, .yaml, .yml or .toml; - for stdout (default: VERB.yaml)"
    )
    parser.add_argument("--format", choices=("yaml", "toml"), help="default: --out's extension, else yaml")
    parser.add_argument("--force", action="store_true", help="overwrite an existing file")
    parser.add_argument(
        "--ask",
        action=argparse.BooleanOptionalAction,
        help="ask for the settings most often changed (default: when stdin is a terminal)",
    )
    parser.set_defaults(handler=cmd_config)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole CLI, or with `only` the one verb a command line uses (its flags are all it imports)."""
    parser = Parser(prog="multigpu", description="One training loop, any number of GPUs.")
    parser.add_argument("--version", action="version", version=f"multigpu {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for name, verb in VERBS.items():
        if only not in (None, name):
            continue
        sub = verbs.add_parser(name, help=verb.help, description=verb.description)
        for part in verb.parts:
            if isinstance(part, str):
                add_config_arguments(sub, imported(part))
            else:
                part(sub)
        sub.set_defaults(handler=verb.handler)
        config_file.add_config_flag(sub)
    if only in (None, "config"):
        add_config_verb(verbs)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The CLI. A run in this process stopped by Ctrl-C or SIGTERM ends with one line naming the last complete
    checkpoint and exit code 130 or 143 (launched workers are stopped by `multigpu.launch.launcher` the same way)."""
    words = sys.argv[1:] if argv is None else argv
    parser = build_parser(words[0] if words and words[0] in (*VERBS, "config") else None)
    with stop.raising_stopped():
        try:
            return exit_on_usage_error(lambda: run_verb(parser, argv))
        except BaseException as error:
            signum = stop.stop_signal(error)
            if signum is None:
                raise
            print(stop.stopped_line(signum), file=sys.stderr)
            return 128 + signum


def run_verb(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    args = config_file.parse_args(parser, argv)
    try:
        return args.handler(args)
    except OSError as error:
        # A path given longer than the file system takes, wherever a verb first touches it (the readers that
        # check their paths name the flag as well).
        if error.errno != errno.ENAMETOOLONG:
            raise
        raise UsageError(
            f"The path {shown_path(error.filename)} is longer than the file system allows ({error.strerror}); "
            "pass a shorter one."
        ) from None


if __name__ == "__main__":
    sys.exit(main())
