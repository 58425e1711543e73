"""The planner's arithmetic, and its refusals."""

from __future__ import annotations

import json

import pytest

import multigpu as mg
from multigpu.cli import main
from multigpu.core.errors import UsageError
from multigpu.planner import plan
from multigpu.planner.memory import parse_bytes
from multigpu.planner.shapes import BUILTIN, from_transformer

GIB = 2**30


def by_strategy(result) -> dict:
    return {m.strategy: m for m in result.strategies}


def test_seven_billion_fp32_adam_on_two_gpus() -> None:
    """The course's example: 16 bytes per parameter unsharded, divided by 2 only where it is sharded."""
    result = plan("llama-2-7b", gpus=2, gpu_memory="80GB", precision="32", optimizer="adamw", batch_size=1, seq_len=512)
    params = 6_738_415_616
    assert result.params == params
    rows = by_strategy(result)
    assert rows["ddp"].params + rows["ddp"].grads + rows["ddp"].optimizer == 16 * params
    assert rows["zero1"].optimizer == 4 * params  # 8 bytes of Adam state per parameter, halved
    assert rows["zero3"].params + rows["zero3"].grads + rows["zero3"].optimizer == 8 * params
    assert not rows["ddp"].fits and rows["zero3"].fits
    assert result.recommendation == "zero3"


def test_the_recommendation_agrees_with_the_fits_column_when_only_offload_fits() -> None:
    """At batch 2 x 4096 only zero3+offload fits 80 GB: the table says so, and so must the reason, which names the
    flag that allows it; where not even offload fits, --cpu-offload would change nothing and goes unmentioned."""
    settings = {"gpus": 8, "gpu_memory": "80GB", "batch_size": 2, "seq_len": 4096}
    result = plan("llama-3.1-8b", **settings)
    assert [m.strategy for m in result.strategies if m.fits] == ["zero3+offload"]
    assert result.recommendation is None
    assert result.reason.startswith("only zero3+offload fits 80.00 GiB per GPU at batch size 2, and it keeps the ")
    assert "pass --cpu-offload to allow it" in result.reason, result.reason
    assert plan("llama-3.1-8b", **settings, cpu_offload=True).recommendation == "zero3+offload"
    nothing = plan("llama-3.1-8b", **{**settings, "batch_size": 64})  # not even split over all 8 GPUs by cp
    assert not any(m.fits for m in nothing.strategies)
    assert nothing.reason.startswith("nothing fits 80.00 GiB per GPU at batch size 64: lower --batch-size")
    assert "--cpu-offload" not in nothing.reason


def test_where_nothing_fits_the_advice_leaves_out_what_the_command_has_already() -> None:
    """A plan given --activation-checkpointing full, a tp degree and LoRA is not told to add them."""
    settings = {"gpus": 2, "gpu_memory": "24GB", "batch_size": 8, "seq_len": 8192}
    plain = plan("llama-3.1-70b", **settings).reason
    assert plain.endswith(
        "lower --batch-size or --seq-len, add --activation-checkpointing full, more GPUs or "
        "--tp-size/--pp-size/--cp-size, LoRA/QLoRA"
    ), plain
    given = plan("llama-3.1-70b", **settings, activation_checkpointing="full", tp_size=2, lora_r=16).reason
    assert given.startswith("nothing fits") and "--activation-checkpointing" not in given, given
    assert given.endswith("more GPUs or --pp-size/--cp-size, a larger --tp-size, QLoRA (--qlora)"), given
    single = plan("llama-3.1-70b", **{**settings, "batch_size": 1}, activation_checkpointing="offload").reason
    assert "lower --seq-len, more GPUs" in single and "--batch-size" not in single, single


def test_smollm2_config_gives_its_published_parameter_count() -> None:
    assert from_transformer(BUILTIN["smollm2-135m"], "smollm2").params == 134_515_008


def test_lora_and_qlora_count_adapters_only() -> None:
    full = plan("llama-2-7b", precision="bf16-mixed")
    lora = plan("llama-2-7b", precision="bf16-mixed", lora_r=16)
    qlora = plan("llama-2-7b", precision="bf16-mixed", lora_r=16, qlora=True)
    t = BUILTIN["llama-2-7b"]
    adapters = t.layers * sum(16 * (i + o) for i, o in t.linears().values())
    assert lora.trainable == adapters == qlora.trainable
    ddp = {name: by_strategy(p)["ddp"] for name, p in (("full", full), ("lora", lora), ("qlora", qlora))}
    assert ddp["lora"].grads == adapters * 4 and ddp["lora"].optimizer == adapters * 8
    assert ddp["qlora"].params < ddp["lora"].params / 5  # 4-bit base instead of fp32
    assert ddp["lora"].total < ddp["full"].total


def test_checkpointing_lowers_activations_and_raises_the_batch_that_fits() -> None:
    plain = by_strategy(plan("llama-3.1-8b", gpus=8, gpu_memory="80GB", seq_len=8192))["zero3"]
    ckpt = by_strategy(plan("llama-3.1-8b", gpus=8, gpu_memory="80GB", seq_len=8192, activation_checkpointing="full"))
    assert ckpt["zero3"].activations < plain.activations / 3
    assert ckpt["zero3"].max_batch_size > plain.max_batch_size


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("80GB", 80 * GIB),
        ("24GiB", 24 * GIB),
        ("512m", 512 * 2**20),
        (" 80 gb ", 80 * GIB),
        ("2T", 2 * 2**40),
        ("1.5e10", 1.5e10),  # a bare number is bytes where it can be a GPU's memory
        ("100B", 100),  # a unit says what is meant, however small
        (16 * GIB, 16 * GIB),
    ],
)
def test_parse_bytes(text: str, value: float) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("80", "--gpu-memory 80 has no unit, so it would mean 80 bytes; write 80GB or 80GiB."),
        ("1e9", "--gpu-memory 1e9 has no unit"),
        (80, "--gpu-memory 80 has no unit"),
        ("0GB", "--gpu-memory must be positive and finite (got 0GB)"),
        ("0", "--gpu-memory must be positive and finite"),
        ("-8GB", "--gpu-memory must be positive and finite"),
        ("inf", "--gpu-memory must be positive and finite (got inf)"),
        ("nanGB", "--gpu-memory must be positive and finite"),
        (float("nan"), "--gpu-memory must be positive and finite"),
        (True, "--gpu-memory must be a size"),
        ("80ib", "Cannot read the size '80ib'"),
    ],
)
def test_parse_bytes_refuses_what_cannot_be_a_gpus_memory(text: str | float, message: str) -> None:
    with pytest.raises(UsageError) as refused:
        parse_bytes(text)
    assert message in str(refused.value)


def test_json_output(capsys: pytest.CaptureFixture) -> None:
    main(["plan", "--model", "smollm2-135m", "--gpus", "2", "--gpu-memory", "24GB", "--batch-size", "4", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert [s["strategy"] for s in data["strategies"]] == [
        *("ddp", "zero1", "zero2", "zero3", "zero3+offload"),
        *("deepspeed1", "deepspeed2", "deepspeed3"),
    ]
    assert data["recommendation"] == "ddp"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/no/such/model"], "--model /no/such/model does not exist; pass a built-in (llama-2-7b"),
        (["--params=-7e9"], "--params must be positive"),
        (["--params", "nan"], "argument --params: takes a finite number, not nan"),
        (["--params", "7e9", "--layers", "32"], "--layers, --hidden, --heads and --vocab go together"),
        (["--model", "smollm2-135m", "--batch-size", "-1"], "--batch-size must be 1 or more (got -1)"),
        (["--model", "smollm2-135m", "--gpu-memory", "lots"], "Cannot read the size 'lots'"),
        (["--model", "smollm2-135m", "--gpu-memory=-8GB"], "--gpu-memory must be positive"),
        (["--model", "smollm2-135m", "--gpu-memory", "80"], "--gpu-memory 80 has no unit, so it would mean 80 bytes"),
        (["--model", "smollm2-135m", "--gpu-memory", "inf"], "--gpu-memory must be positive and finite (got inf)"),
    ],
)
def test_bad_input(args: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_config_without_the_needed_fields(tmp_path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "model_type": "llama"}))
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "lacks num_hidden_layers, num_attention_heads, intermediate_size, vocab_size" in capsys.readouterr().err


def llama(extra: str) -> str:
    """A config.json's text: the fields the planner needs but num_hidden_layers, and `extra`."""
    return '{"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 512, ' + extra + "}"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (llama('"num_hidden_layers": true'), "config.json: num_hidden_layers is true, but an integer"),
        (llama('"num_hidden_layers": 2.5'), "config.json: num_hidden_layers is 2.5, but an integer"),
        (llama('"num_hidden_layers": NaN'), "config.json: num_hidden_layers is NaN, but a finite"),
        (llama('"num_hidden_layers": 2, "tie_word_embeddings": "no"'), "tie_word_embeddings is"),
        ("[64, 2]", "config.json: the top level is a list, but an object is expected"),
        ("not json", "config.json is not valid JSON"),
    ],
)
def test_config_of_the_wrong_shape(tmp_path, text: str, message: str, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", str(tmp_path)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_model_paths_of_the_wrong_kind(tmp_path, capsys: pytest.CaptureFixture) -> None:
    """A directory whose config.json is a directory, and one with no config.json at all."""
    (tmp_path / "odd" / "config.json").mkdir(parents=True)
    (tmp_path / "empty").mkdir()
    for model, message in [
        ("odd", "/odd/config.json is a directory, but a config.json is expected; pass the file's path."),
        ("empty", "/empty/config.json does not exist; pass a built-in"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(["plan", "--model", str(tmp_path / model)])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_plan_accepts_a_module() -> None:
    from torch import nn

    model = nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 10))
    result = mg.plan(model, precision="32")
    assert result.params == 100 * 100 + 100 + 100 * 10 + 10


def test_auto_picks_the_fastest_strategy_that_fits() -> None:
    from torch import nn

    from multigpu.planner import choose_strategy

    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(16)])  # 16.8M parameters: 269 MB of model states
    pick = lambda memory: choose_strategy(model, "adamw", 2, 1, memory, "32", offload_possible=True)[0]  # noqa: E731
    # 1 GiB of framework overhead, then ddp 269 MB of states + 67 MB of buckets; zero1 shards 134 MB of Adam state;
    # zero2 keeps 67 MB of gathered weights; zero3 only two layers (8 MB).
    assert pick(4 * GIB) == "ddp"
    assert pick(1.3 * GIB) == "zero1"
    assert pick(1.22 * GIB) == "zero2"
    assert pick(1.16 * GIB) == "zero3"
    assert pick(1.1 * GIB) == "zero3+offload"


@pytest.mark.parametrize(
    ("optimizer", "bytes_per_param"),
    [("adamw", 8), ("adamw-bf16", 4), ("adamw-8bit", 2 * (1 + 4 / 256)), ("adamw-4bit", 2 * (0.5 + 4 / 128))],
)
def test_the_optimizer_states_shrink_with_their_bits(optimizer: str, bytes_per_param: float) -> None:
    """`plan --optimizer adamw-8bit`: the states' bytes per parameter (codes and each block's float32 scale), halved
    where zero shards them; their measured bytes: tests/optimizers/test_low_bit.py."""
    rows = by_strategy(plan("llama-2-7b", gpus=2, precision="bf16-mixed", optimizer=optimizer))
    params = 6_738_415_616
    assert rows["ddp"].optimizer == pytest.approx(params * bytes_per_param)
    assert rows["zero3"].optimizer == pytest.approx(params * bytes_per_param / 2)


def test_muon_keeps_one_state_for_the_hidden_matrices_and_adamws_two_for_the_rest() -> None:
    shape = BUILTIN["smollm2-135m"]
    result = plan("smollm2-135m", gpus=1, precision="32", optimizer="muon")
    model = from_transformer(shape, "smollm2-135m")
    matrices = model.linear_params  # the hidden linear layers: not the (tied) embeddings and head
    want = matrices * 4 + (result.params - matrices) * 8
    assert by_strategy(result)["single"].optimizer == pytest.approx(want)
    assert 0 < matrices < result.params


@pytest.mark.parametrize(
    ("optimizer", "refused"),
    [
        ("muon", ("deepspeed1", "deepspeed2", "deepspeed3", "zero3+offload")),
        ("adamw-8bit", ("deepspeed1", "deepspeed2", "deepspeed3")),
        ("adamw", ()),
    ],
)
def test_rows_a_run_of_the_optimizer_refuses_are_left_out_with_the_reason(optimizer: str, refused: tuple) -> None:
    """DeepSpeed cannot step Muon or the low-bit states, nor zero3's offload Muon (EngineConfig refuses those runs):
    the plan neither shows nor recommends them, and says why. Where only offload would fit, Muon's plan names no
    --cpu-offload, which its run would refuse."""
    result = plan("llama-2-7b", gpus=8, gpu_memory="80GB", precision="bf16-mixed", optimizer=optimizer)
    shown = set(by_strategy(result))
    assert not shown & set(refused) and {"ddp", "zero3"} <= shown
    assert all(name in result.left_out for name in refused) and (result.left_out == "") == (not refused)
    if optimizer != "adamw-8bit":  # the README's plan, where only zero3+offload fits AdamW's states
        tight = plan("llama-3.1-8b", gpus=8, gpu_memory="80GB", batch_size=2, seq_len=4096, optimizer=optimizer)
        assert ("--cpu-offload" in tight.reason) == ("zero3+offload" not in refused), tight.reason
