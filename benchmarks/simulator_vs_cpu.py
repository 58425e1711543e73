"""Checks `multigpu simulate` against measured 1-, 2- and 3-process runs on this machine (target: within 20%).

Calibrates the link with `multigpu bench --collectives` (2 processes), measures benchmarks/wide_mlp.py with
`multigpu bench` at 1, 2 and 3 processes, feeds the 1-process step time and the link to the simulator, and prints
predicted against measured step times. Run: python benchmarks/simulator_vs_cpu.py [--strategies ddp,zero2]
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from multigpu.planner.simulate import simulate
from multigpu.tools.simulate_request import SimulateRequest, resolve

SCRIPT = Path(__file__).with_name("wide_mlp.py")


def multigpu(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "multigpu", *args], check=True, stdout=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategies", default="ddp,zero2,zero3")
    parser.add_argument("--repeats", default="3")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out", default="bench/simulator-cpu", help="where the measurements are kept")
    parser.add_argument("--reuse", action="store_true", help="predict from the measurements already in --out")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    params = args.layers * (args.width * args.width + args.width) + args.width * 10 + 10
    tmp = args.out
    if not args.reuse:
        multigpu("bench", "--collectives", "--nproc", "2", "--max-bytes", str(64 * 2**20), "--out", tmp)
        multigpu(
            "bench", "--nproc", "1,2,3", "--strategies", args.strategies, "--steps", "20", "--repeats", args.repeats,
            "--no-comm-share", "--baseline", "same", "--out", tmp,
            str(SCRIPT), "--width", str(args.width), "--layers", str(args.layers),
        )  # fmt: skip
    report = json.loads(Path(tmp, "bench.json").read_text())
    print(f"{cores} cores, {params:,} parameters; links fitted per collective from 2-process timings")
    print(
        f"{'strategy':>9} {'procs':>5} {'measured ms':>12} {'overlap ms':>11} {'error':>7} "
        f"{'no overlap':>11} {'error':>7}"
    )
    for strategy in args.strategies.split(","):
        predicted = {}
        for overlap in (True, False):
            request = SimulateRequest(
                overlap=overlap,
                params=params,
                layers=args.layers + 1,
                gpus="1,2,3",
                gpus_per_node=3,
                strategy=strategy,
                bench=str(Path(tmp, "bench.json")),
                grad_bytes=4,
                param_bytes=4,
                compute_slots_per_node=cores,
                calibration=str(Path(tmp, "collectives.json")),
            )
            config, intra, inter = resolve(request)
            predicted[overlap] = {p.gpus: p.step_s for p in simulate(config, intra, inter)}
        for cell in report["cells"]:
            if cell["strategy"] == strategy:
                measured, n = cell["step_time_s"]["median"], cell["nproc"]
                columns = [
                    f"{predicted[o][n] * 1e3:>11.1f} {predicted[o][n] / measured - 1:>+7.1%}" for o in (True, False)
                ]
                print(f"{strategy:>9} {n:>5} {measured * 1e3:>12.1f} {' '.join(columns)}")


if __name__ == "__main__":
    main()
