"""What the observer seam costs per engine op: entering every observer's watch around one op, in one process.

    python benchmarks/observer_cost.py [--ops 100000]

Prints the time per op for the Engine's registered observers (heartbeat and monitor) and, for comparison, for
the heartbeat's Progress.diagnose alone, which is what the Engine wrapped each op in before the seam existed.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import multigpu as mg
from multigpu.observers.observe import watching
from multigpu.observers.progress import Progress


def per_op(enter: Callable[[], object], ops: int) -> float:
    start = time.perf_counter()
    for _ in range(ops):
        with enter():
            pass
    return (time.perf_counter() - start) / ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=100_000)
    ops = parser.parse_args().ops
    engine = mg.Engine(strategy="single")
    progress = Progress(0, 1, 1800.0)
    seam = per_op(lambda: watching(engine.observers, "forward"), ops)
    alone = per_op(lambda: progress.diagnose("forward"), ops)
    print(f"{len(engine.observers)} observers' watch per op: {seam * 1e6:.2f} us")
    print(f"Progress.diagnose alone per op:  {alone * 1e6:.2f} us")


if __name__ == "__main__":
    main()
