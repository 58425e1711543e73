"""multigpu finetune on users' own data: every file kind and format trains under zero3 on 2 processes, bad data is
refused before any process starts, and a streamed run resumed at another world size trains every record of the
epoch exactly once.

The files are written here with datasets and pandas, as users' tools write them.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pytest
import torch

from tests.dist import refusal, run_each_in_processes, run_in_processes

QUESTIONS = 24  # records per file: record i asks about i, so its tokens say which record a sequence holds


def chat(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"What is {i} plus {i}?"}, {"role": "assistant", "content": f"{2 * i}."}]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def datasets_of(rows: list[dict]) -> Any:
    import datasets

    return datasets.Dataset.from_list(rows)


def write_all(root: Path) -> dict[str, list[str]]:
    """Each kind of --data, in a different format: name -> the finetune flags that train on it."""
    numbers = range(QUESTIONS)
    messages = [{"messages": chat(i)} for i in numbers]
    alpaca = [{"instruction": f"What is {i} plus {i}?", "input": "", "output": f"{2 * i}."} for i in numbers]
    sharegpt = [{"conversations": [{"from": "human", "value": f"Is {i} odd?"}, {"from": "gpt", "value": "No."}]}
                for i in numbers]  # fmt: skip
    pairs = pd.DataFrame({"prompt": [f"Count to {i}." for i in numbers], "completion": ["Done."] * QUESTIONS})
    text = [{"text": f"Line {i}: to be, or not to be, that is the question. " * 3} for i in numbers]
    datasets_of(messages).to_json(root / "chat.jsonl", lines=True)
    pd.DataFrame(alpaca).to_json(root / "alpaca.json", orient="records")
    datasets_of(sharegpt).to_parquet(root / "sharegpt.parquet")
    pairs.to_csv(root / "pairs.csv", index=False)
    table = pa.Table.from_pylist(text)
    with pa.OSFile(str(root / "text.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    (root / "parts").mkdir()
    for part in range(3):
        write_jsonl(root / "parts" / f"part-{part}.jsonl", messages[part::3])
    import datasets

    split = datasets.DatasetDict({"train": datasets_of(alpaca[:4]), "test": datasets_of(alpaca)})
    split.save_to_disk(str(root / "saved"))
    (root / "snapshot" / "data").mkdir(parents=True)
    datasets_of(messages).to_parquet(root / "snapshot" / "data" / "train-00000-of-00001.parquet")
    return {
        "jsonl chat": ["--data", str(root / "chat.jsonl")],
        "json alpaca": ["--data", str(root / "alpaca.json"), "--data-format", "alpaca"],
        "parquet sharegpt": ["--data", str(root / "sharegpt.parquet")],
        "csv prompt-completion": ["--data", str(root / "pairs.csv")],
        "arrow text": ["--data", str(root / "text.arrow"), "--data-format", "text"],
        "glob of jsonl": ["--data", str(root / "parts" / "*.jsonl")],
        "save_to_disk split": ["--data", str(root / "saved"), "--data-split", "test"],
        "snapshot directory": ["--data", str(root / "snapshot")],
        "streamed parquet": ["--data", str(root / "sharegpt.parquet"), "--data-streaming"],
    }


def flags_to_options(flags: list[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for flag, value in zip(flags, [*flags[1:], "--"], strict=True):
        if flag.startswith("--"):
            options[flag[2:].replace("-", "_")] = True if value.startswith("--") else value
    return options


def finetune_once(name: str, flags: list[str], save_dir: str) -> dict[str, Any]:
    from multigpu.recipes.finetune import FinetuneConfig, finetune

    config = FinetuneConfig(model="tiny", seq_len=48, batch_size=2, max_steps=2, multi_gpu="zero3", log_every=0,
                            save_dir=save_dir, **flags_to_options(flags))  # fmt: skip
    result = finetune(config)
    return {"name": name, "steps": result["steps"], "losses": [h.get("val_loss") for h in result["history"]]}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    return write_all(tmp_path_factory.mktemp("data"))


def test_every_kind_of_file_in_every_format_trains(data: dict[str, list[str]], tmp_path: Path) -> None:
    calls = [{"name": name, "flags": flags, "save_dir": str(tmp_path / str(n))} for n, (name, flags) in
             enumerate(data.items())]  # fmt: skip
    ranks = run_each_in_processes("tests.recipes.test_finetune_data:finetune_once", 2, calls, timeout=240)
    for result in ranks[0]:
        assert result["steps"] == 2, result
        validated = [loss for loss in result["losses"] if loss is not None]
        assert all(math.isfinite(loss) for loss in validated), result
        # A stream holds nothing out, and without --eval-data the run says it has no validation.
        assert len(validated) == (0 if "streamed" in result["name"] else 2), result


@pytest.mark.parametrize(
    ("rows", "flags", "expected"),
    [
        ([{"messages": chat(1)}, {"messages": [{"role": "user", "content": "Hi"}]}], [], r"record 2"),
        ([{"instruction": "Add.", "output": "2"}], ["--data-column", "body", "--data-format", "text"], "body"),
        ([{"question": "a", "answer": "b"}], [], "question"),
        ([{"messages": chat(1)}], ["--data-split", "test"], "test"),
        ([{"messages": chat(1)}], ["--data-streaming"], "--data-streaming reads a stream whose length is unknown"),
    ],
)
def test_bad_data_is_refused_before_any_process_starts(
    tmp_path: Path, rows: list[dict], flags: list[str], expected: str
) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    printed = refusal("finetune", "--model", "tiny", "--nproc", "2", "--data", str(path), *flags)
    message = printed.strip().splitlines()[-1]
    assert message.startswith("multigpu: error:") and expected in message, printed
    assert "bad.jsonl" in message or "--data-streaming" in flags, printed  # a data error names the file


def test_bytes_that_are_not_utf8_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps({"messages": chat(1)}).encode() + b"\n" + b'{"text": "caf\xe9"}\n')
    printed = refusal("finetune", "--model", "tiny", "--data", str(path), "--data-format", "text")
    assert "latin1.jsonl" in printed and "line 2" in printed and "UTF-8" in printed, printed


def stream_part(path: str, steps: int, state: dict | None) -> dict[str, Any]:
    """Trains `steps` steps on the streamed records (from `state`, a saved loader's, if given): the records of the
    global batches in stream order, and the loader's state after."""
    import multigpu as mg
    from multigpu.data import lm_data
    from multigpu.models import lm_models
    from multigpu.recipes.finetune import model_inputs, summed_token_loss

    lm_data.TokenStream.WINDOW = 5  # several windows, one cut by each checkpoint, each packed alone
    engine = mg.Engine("ddp", seed=3)
    tokenizer = lm_models.load_tokenizer("tiny")
    data = lm_data.load(lm_data.DataSettings(data=path, seq_len=64, data_streaming=True), tokenizer)
    model = lm_models.load_model("tiny", "full")
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.0))
    loader = engine.dataloader(data.train, batch_size=2, collate_fn=data.collate_fn())
    if state is not None:
        loader.load_state_dict(state)
    records, done = [], 0
    for batch in loader:
        engine.forward_backward(model, model_inputs(batch), batch["labels"], summed_token_loss)
        rows = torch.full((len(batch["input_ids"]), 4), -1)
        for row, ids in enumerate(batch["input_ids"]):  # a sequence of 64 tokens holds one record
            numbers = [int(n) for n in re.findall(r"What is (\d+) plus", tokenizer.decode(ids))]
            rows[row, : len(numbers)] = torch.tensor(numbers)
        records += [n for n in engine.gather(rows).flatten().tolist() if n >= 0]
        done += engine.step(optimizer)
        if done == steps:
            break
    return {"records": records, "state": loader.state_dict()}


def test_a_streamed_run_resumed_at_another_world_size_trains_each_record_once(tmp_path: Path) -> None:
    """3 steps at 2 processes then 3 at 3 (and 3 then 2) hand out more sequences than an epoch holds: the first
    QUESTIONS records, in stream order, are each record once (epoch 0), and the rest start epoch 1 without repeats.
    Three launches: 2 processes from the start; 3 resuming the 2's and from the start; 2 resuming the 3's."""
    path = str(write_jsonl(tmp_path / "chat.jsonl", [{"messages": chat(i)} for i in range(QUESTIONS)]))
    target = "tests.recipes.test_finetune_data:stream_part"
    two = run_in_processes(target, 2, timeout=120, path=path, steps=3, state=None)[0]
    calls = [{"path": path, "steps": 3, "state": two["state"]}, {"path": path, "steps": 3, "state": None}]
    two_then_three, three = run_each_in_processes(target, 3, calls, timeout=120)[0]
    three_then_two = run_in_processes(target, 2, timeout=120, path=path, steps=3, state=three["state"])[0]
    for first, second in ((two, two_then_three), (three, three_then_two)):
        order = first["records"] + second["records"]
        assert len(order) > QUESTIONS, order
        assert sorted(order[:QUESTIONS]) == list(range(QUESTIONS)), order
        assert len(set(order[QUESTIONS:])) == len(order[QUESTIONS:]), order
