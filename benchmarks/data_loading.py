"""How long a data set takes to tokenise, and what a streamed run holds in memory against an in-memory one.

    python benchmarks/data_loading.py [--records 100000,300000] [--seq-len 512] [--batches 20]

The records are real exchanges: each user turn of chitchat's conversations with the assistant turn that answers
it, as {"messages": [user, assistant]} lines of a JSONL file, the conversations repeated in order until there are
enough. For each size, each in a fresh process with SmolLM2's tokenizer and an empty token cache:
- in memory: `lm_data.load` (read with datasets, tokenised by a parallel map, packed), then the first `--batches`
  batches of its loader;
- streamed: the same batches from `--data-streaming`'s TokenStream through the Engine's stream loader.
Each reports its seconds to the first batch and its peak resident memory (Linux's VmHWM). A second in-memory load
reads the token cache: the time every later run pays.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
sys.path.insert(0, HERE)  # data_packing's exchanges


def exchanges(count: int) -> list[dict]:
    """`count` exchanges of chitchat's conversations (data_packing's), repeated in order until there are enough."""
    from data_packing import exchanges as first_exchanges

    records = first_exchanges(10**9)
    return [records[i % len(records)] for i in range(count)]


def peak_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def measure(path: str, mode: str, seq_len: int, batches: int) -> dict:
    """In a fresh process: seconds to the first batch, seconds for `batches` batches, peak memory."""
    import multigpu as mg
    from multigpu.data import lm_data
    from multigpu.models import lm_models

    tokenizer = lm_models.load_tokenizer("smollm2")
    start = time.perf_counter()
    settings = lm_data.DataSettings(data=path, seq_len=seq_len, data_streaming=mode == "streamed")
    data = lm_data.load(settings, tokenizer)
    loaded = time.perf_counter() - start
    engine = mg.Engine("single")
    loader = engine.dataloader(data.train, batch_size=4, collate_fn=data.collate_fn())
    first = None
    for number, _ in enumerate(loader, 1):
        first = first or time.perf_counter() - start
        if number == batches:
            break
    return {"load": loaded, "first": first, "all": time.perf_counter() - start, "peak": peak_mb()}


def run(path: str, mode: str, seq_len: int, batches: int, cache: str) -> dict:
    code = f"import json, sys; sys.path.insert(0, {HERE!r}); import data_loading as d; "
    code += f"print(json.dumps(d.measure({path!r}, {mode!r}, {seq_len}, {batches})))"
    env = {**os.environ, "MULTIGPU_TOKEN_CACHE": cache, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", default="100000,300000", help="data set sizes, comma-separated")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batches", type=int, default=20, help="batches of 4 sequences read after the load")
    args = parser.parse_args()
    print(f"chitchat exchanges as chat records, SmolLM2's tokenizer, --seq-len {args.seq_len}, {os.cpu_count()} cores")
    print(f"{'records':>8} {'MB':>5} {'mode':<20} {'load s':>7} {'first batch s':>13} {'peak MB':>8}")
    with tempfile.TemporaryDirectory() as folder:
        for count in (int(n) for n in args.records.split(",")):
            path = Path(folder, f"exchanges-{count}.jsonl")
            path.write_text("".join(json.dumps(r) + "\n" for r in exchanges(count)))
            size = path.stat().st_size / 2**20
            cache = str(Path(folder, f"tokens-{count}"))
            for mode, label in (("memory", "in memory (tokenise)"), ("memory", "in memory (cached)"),
                                ("streamed", "streamed")):  # fmt: skip
                r = run(str(path), mode, args.seq_len, args.batches, cache)
                print(f"{count:>8,} {size:>5.0f} {label:<20} {r['load']:>7.1f} {r['first']:>13.1f} "
                      f"{r['peak']:>8,.0f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
