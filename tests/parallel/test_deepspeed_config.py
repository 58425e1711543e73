"""The DeepSpeed config file: a bad key or value is one sentence naming it, before DeepSpeed reads the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from multigpu.core.errors import UsageError
from multigpu.parallel.deepspeed_config import read_config


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"train_micro_batch_size_per_gpu": NaN}', "train_micro_batch_size_per_gpu is NaN, but a finite number"),
        ('{"gradient_clipping": Infinity}', "gradient_clipping is Infinity, but a finite number"),
        ('{"train_batch_size": "32"}', 'train_batch_size is "32", but an integer of 1 or more or "auto" is expected'),
        ('{"gradient_accumulation_steps": 0}', "gradient_accumulation_steps is 0, but an integer of 1 or more"),
        ('{"train_micro_batch_size_per_gpu": true}', "train_micro_batch_size_per_gpu is true, but an integer"),
        ('{"zero_optimization": [2]}', "zero_optimization is a list, but an object is expected"),
        ('{"zero_optimization": {"stage": "3"}}', 'zero_optimization.stage is "3", but an integer from 0 to 3'),
        ('{"zero_optimization": {"stage": 4}}', "zero_optimization.stage is 4, but an integer from 0 to 3"),
        ('{"zero_optimization": {"offload_optimizer": "cpu"}}', 'zero_optimization.offload_optimizer is "cpu", but an'),
        ('{"bf16": true}', 'bf16 is true, but an object or "auto" is expected'),
        ('{"fp16": {"enabled": "yes"}}', 'fp16.enabled is "yes", but true or false or "auto" is expected'),
        ('{"optimizer": "adam"}', 'optimizer is "adam", but an object is expected'),
        ("[]", "the top level is an empty list, but an object is expected"),
    ],
)
def test_a_bad_config_file_is_one_sentence_naming_the_key(tmp_path: Path, text: str, message: str) -> None:
    file = tmp_path / "ds.json"
    file.write_text(text)
    with pytest.raises(UsageError) as refused:
        read_config(str(file))
    assert str(refused.value).startswith(f"{file}: {message}")


def test_a_config_path_of_the_wrong_kind_is_named(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"--deepspeed-config \S+ is a directory, but a DeepSpeed config is expected"):
        read_config(str(tmp_path))
    with pytest.raises(UsageError, match=r"--deepspeed-config \S+ does not exist; pass the path of a DeepSpeed"):
        read_config(str(tmp_path / "none.json"))
    auto = {"train_batch_size": "auto", "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3}}
    (tmp_path / "auto.json").write_text(json.dumps(auto))
    assert read_config(str(tmp_path / "auto.json")) == auto  # Hugging Face's "auto" values are valid
