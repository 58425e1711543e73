"""The language models finetune trains: 4-bit layers that stay as quantised, in the run's precision; the cache
directories they are built into, from any rank; model and adapter directories refused in one sentence where they
would fail or load wrongly."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
from pathlib import Path

import pytest
import torch

from multigpu.core.errors import UsageError
from multigpu.models import lm_models
from tests.dist import run_in_processes

PROBE = torch.tensor([[1, 520, 2138, 314, 29, 905]])


@pytest.fixture(scope="module", autouse=True)
def tiny_model() -> None:
    lm_models.model_dir("tiny")


def four_bit_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from bitsandbytes.nn import Linear4bit

    return [module for module in model.modules() if isinstance(module, Linear4bit)]


def test_an_evaluation_pass_leaves_the_4bit_weights_as_they_were(monkeypatch) -> None:
    """On a CPU with AVX512-BF16, bitsandbytes 0.50 repacks 4-bit weights for good at the first eval-mode forward
    without gradients. The CPU is faked here, so the test fails on every machine if that path is ever taken."""
    import bitsandbytes.nn.modules as bnb_modules

    def repacked(*args, **kwargs):
        raise AssertionError("a 4-bit weight was repacked for the AVX512-BF16 kernel")

    monkeypatch.setattr(bnb_modules, "has_avx512bf16", lambda: True)  # read when the layers are built
    monkeypatch.setattr(bnb_modules, "_convert_weight_packed_for_cpu", repacked)
    model = lm_models.load_model("tiny", "qlora")
    layers = four_bit_layers(model)
    assert layers
    # Packed codes read as bf16 include NaN patterns: compare bytes, not values.
    before = [layer.weight.detach().view(torch.uint8).clone() for layer in layers]
    with torch.no_grad():
        training = model(input_ids=PROBE).logits
    model.eval()
    with torch.no_grad():
        evaluation = model(input_ids=PROBE).logits
    model.train()
    with torch.no_grad():
        after = model(input_ids=PROBE).logits
    assert all(torch.equal(b, layer.weight.detach().view(torch.uint8)) for b, layer in zip(before, layers, strict=True))
    assert torch.equal(training, evaluation) and torch.equal(training, after)


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [
        ("32", torch.float32),
        ("bf16-mixed", torch.bfloat16),
        ("bf16-true", torch.bfloat16),
        ("fp16-mixed", torch.float16),
    ],
)
def test_4bit_layers_compute_in_the_runs_precision(precision: str, dtype: torch.dtype) -> None:
    layers = four_bit_layers(lm_models.load_model("tiny", "qlora", precision=precision))
    assert {layer.compute_dtype for layer in layers} == {dtype}


def save_on_each_rank(workdir: str) -> bool:
    """Each rank writes a tied tiny Llama's files and reads them back: whether every weight came back."""
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    dist.init_process_group("gloo")  # what turns save_pretrained off on rank 1
    directory = Path(workdir) / f"rank{dist.get_rank()}"
    lm_models.save_model_files(model, directory)
    loaded = LlamaForCausalLM.from_pretrained(directory)
    same = all(torch.equal(v, loaded.state_dict()[k]) for k, v in model.state_dict().items())
    dist.destroy_process_group()
    return same and loaded.lm_head.weight is loaded.model.embed_tokens.weight


def test_every_rank_writes_the_model_files_of_a_cache_it_builds(tmp_path: Path) -> None:
    """transformers' save_pretrained writes nothing on rank 1 of a process group: a first run on several processes
    could then publish a cache directory without its model, and every later run would rebuild it inside the
    meta-device context and fail."""
    assert run_in_processes("tests.models.test_lm_models:save_on_each_rank", 2, timeout=120, workdir=str(tmp_path)) == [
        True,
        True,
    ]


def test_an_incomplete_cache_directory_is_replaced(tmp_path: Path) -> None:
    target = tmp_path / "model"
    target.mkdir()
    (target / "tokenizer.json").write_text("{}")  # what such a run left: the tokenizer alone
    lm_models._publish(lambda directory: (directory.mkdir(), (directory / "config.json").write_text("{}")), target)
    assert sorted(p.name for p in target.iterdir()) == ["config.json"]


# -- model and adapter directories that do not fit together: one sentence naming the file and the tensor --------
def model_copy(directory: Path, change=None) -> Path:
    """The tiny model's directory under `directory`: its config.json copied (to be changed), the rest linked;
    `change(directory)` then damages it as a user's copy might be."""
    directory.mkdir()
    for file in lm_models.model_dir("tiny").iterdir():
        if file.name == "config.json":
            (directory / file.name).write_text(file.read_text())
        else:
            (directory / file.name).symlink_to(file)
    if change is not None:
        change(directory)
    return directory


def edit_config(directory: Path, **changes: object) -> None:
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **changes}))


def cut_short(file: Path) -> None:
    data = file.read_bytes()
    file.unlink()  # a link to the cache: replaced by a copy, never written through
    file.write_bytes(data[: len(data) // 2])


MODEL_FAULTS = {
    "shapes that differ from the config": (
        lambda d: edit_config(d, intermediate_size=256),
        r"model\.layers\.0\.mlp\.gate_proj\.weight is \[128, 64\] in {d}/model\.safetensors but \[256, 64\] by "
        r"{d}/config\.json; pass the config\.json saved with these weights\.",
    ),
    "a truncated safetensors file": (
        lambda d: cut_short(d / "model.safetensors"),
        r"{d}/model\.safetensors is cut short: 6,440,628 of the 12,881,256 bytes its header describes are there; "
        r"copy or save it again\.",
    ),
    "a config.json that is not JSON": (
        lambda d: (d / "config.json").write_text('{"model_type": "llama",'),
        r"{d}/config\.json is not valid JSON \(Expecting property name enclosed in double quotes at line 1\); "
        r"fix it\.",
    ),
    "a config.json transformers cannot build": (
        lambda d: edit_config(d, num_attention_heads=3),
        r"{d}/config\.json does not describe a causal language model transformers can build \(.*The hidden size "
        r"\(64\) is not a multiple of the number of attention heads \(3\)\); pass a directory that save_pretrained "
        r"wrote\.",
    ),
    "no weights": (
        lambda d: (d / "model.safetensors").unlink(),
        r"--model {d} holds no weights \(model\.safetensors\); pass a directory that save_pretrained wrote, "
        r"weights included\.",
    ),
}


@pytest.mark.parametrize("fault", MODEL_FAULTS)
def test_a_model_directory_that_would_fail_or_load_wrongly_is_one_sentence(tmp_path: Path, fault: str) -> None:
    change, message = MODEL_FAULTS[fault]
    directory = model_copy(tmp_path / "model", change)
    with pytest.raises(UsageError) as refused:
        lm_models.check(str(directory))
    assert re.fullmatch(message.format(d=re.escape(str(directory))), str(refused.value))


def test_a_whole_model_directory_passes_its_check(tmp_path: Path) -> None:
    lm_models.check(str(model_copy(tmp_path / "model")))


def write_adapter(directory: Path, model: torch.nn.Module, base: str) -> Path:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=lm_models.lora_targets(model), task_type="CAUSAL_LM")
    get_peft_model(model, config).save_pretrained(directory)
    edit_adapter_config(directory, base_model_name_or_path=base)
    return directory


def edit_adapter_config(directory: Path, **changes: object) -> None:
    config = json.loads((directory / "adapter_config.json").read_text())
    (directory / "adapter_config.json").write_text(json.dumps({**config, **changes}))


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An adapter of the tiny model, and one of a smaller Llama (hidden size 32, not 64)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("adapters")
    smaller = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    return {
        "tiny": write_adapter(root / "tiny", lm_models.load_model("tiny"), str(lm_models.model_dir("tiny"))),
        "smaller": write_adapter(root / "smaller", LlamaForCausalLM(smaller), "/models/smaller-llama"),
    }


ADAPTER_FAULTS = {
    "trained on a model of other shapes": (
        "smaller",
        None,
        r"base_model\.model\.model\.layers\.0\.mlp\.down_proj\.lora_A\.weight is \[4, 64\] in "
        r"{d}/adapter_model\.safetensors but \[4, 128\] for --model tiny \({d}/adapter_config\.json names "
        r"/models/smaller-llama as its base\); pass the --model it was trained on\.",
    ),
    "for modules the model does not have": (
        "tiny",
        lambda d: edit_adapter_config(d, target_modules=["fc1"]),
        r"--adapter {d} does not fit --model tiny \({d}/adapter_config\.json names .*tiny-llama as its base\): "
        r"Target modules \{{'fc1'\}} not found in the base model; pass the --model it was trained on\.",
    ),
    "without weights": (
        "tiny",
        lambda d: (d / "adapter_model.safetensors").unlink(),
        r"--adapter {d} holds no adapter weights \(adapter_model\.safetensors\); pass the whole directory peft "
        r"saved \(a finetune writes SAVE_DIR/adapter\)\.",
    ),
    "with its weights cut short": (
        "tiny",
        lambda d: cut_short(d / "adapter_model.safetensors"),
        r"{d}/adapter_model\.safetensors is cut short: [\d,]+ of the [\d,]+ bytes its header describes are there; "
        r"copy or save it again\.",
    ),
    "with an adapter_config.json that is not JSON": (
        "tiny",
        lambda d: (d / "adapter_config.json").write_text("{"),
        r"{d}/adapter_config\.json is not valid JSON \(.*\); fix it\.",
    ),
}


@pytest.mark.parametrize("fault", ADAPTER_FAULTS)
def test_an_adapter_peft_would_fail_on_or_load_wrongly_is_one_sentence(
    adapters: dict[str, Path], tmp_path: Path, fault: str
) -> None:
    source, change, message = ADAPTER_FAULTS[fault]
    directory = Path(shutil.copytree(adapters[source], tmp_path / "adapter"))
    if change is not None:
        change(directory)
    with pytest.raises(UsageError) as refused:
        lm_models.check_adapter(str(directory), "tiny")
    assert re.fullmatch(message.format(d=re.escape(str(directory))), str(refused.value))


def test_an_adapter_of_the_model_passes_its_check(adapters: dict[str, Path]) -> None:
    lm_models.check_adapter(str(adapters["tiny"]), "tiny")


def test_a_bad_model_directory_is_refused_before_any_worker_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from multigpu.cli import main

    directory = model_copy(tmp_path / "model", lambda d: edit_config(d, intermediate_size=256))
    with pytest.raises(SystemExit) as exit_info:  # a launch would start 2 workers, each failing its own way
        main(["finetune", "--model", str(directory), "--nproc", "2", "--save-dir", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"multigpu: error: model.layers.0.mlp.gate_proj.weight is [128, 64] in {directory}/model.safetensors but "
        f"[256, 64] by {directory}/config.json; pass the config.json saved with these weights."
    ]
    assert not (tmp_path / "run").exists()


def test_the_model_files_written_get_the_mode_the_umask_gives(tmp_path: Path) -> None:
    """safetensors 0.8 writes its files 0o600 (through a temporary file); every other file is 0o666 less the umask."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    previous = os.umask(0o027)
    try:
        lm_models.save_model_files(LlamaForCausalLM(config), tmp_path / "model")
    finally:
        os.umask(previous)
    modes = {file.name: stat.S_IMODE(file.stat().st_mode) for file in (tmp_path / "model").iterdir()}
    assert modes == {"config.json": 0o640, "generation_config.json": 0o640, "model.safetensors": 0o640}


@pytest.mark.parametrize(
    ("changes", "named"),
    [({"final_logit_softcapping": 30.0}, "final_logit_softcapping"), ({"logit_scale": 0.5}, "logit_scale")],
)
def test_a_model_that_changes_its_logits_after_the_head_is_refused_for_the_chunked_loss(
    tmp_path: Path, changes: dict, named: str
) -> None:
    directory = model_copy(tmp_path / "model", lambda d: edit_config(d, **changes))
    with pytest.raises(UsageError, match=rf"\({named}\), which --loss chunked leaves out; use --loss plain\."):
        lm_models.check_plain_head(str(directory), "chunked")
    lm_models.check_plain_head(str(model_copy(tmp_path / "plain")), "chunked")


@pytest.mark.parametrize(
    ("logger", "line"),
    [
        (
            "bitsandbytes.backends.cpu.ops",
            "Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'. Please make sure "
            "you already `pip install kernels` and the kernels >= 0.11.1",
        ),
        ("DeepSpeed", "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."),
    ],
)
def test_library_lines_with_nothing_to_act_on_are_left_out(logger: str, line: str) -> None:
    """bitsandbytes' import on CPUs with AVX512-BF16 (kernels from the Hub, a package these recipes never use) and
    DeepSpeed's as a model is written on a machine without GPUs: those lines alone go, their other warnings pass.
    (The logger's own filter is asked: DeepSpeed's logger, once imported, does not propagate to pytest's capture.)"""
    import multigpu.recipes  # noqa: F401  (where the filters are set)

    kept = [logging.getLogger(logger).filter(logging.makeLogRecord({"msg": msg})) for msg in (line, "another")]
    assert [bool(keep) for keep in kept] == [False, True]
