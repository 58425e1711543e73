"""Entry point of each process started by tests/dist.py: call the target, save its result by rank."""

import importlib
import os
import pickle
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

target, folder = sys.argv[1], Path(sys.argv[2])
module_name, function_name = target.split(":")
kwargs = pickle.loads((folder / "kwargs.pkl").read_bytes())
result = getattr(importlib.import_module(module_name), function_name)(**kwargs)
(folder / f"rank{os.environ['RANK']}.pkl").write_bytes(pickle.dumps(result))
