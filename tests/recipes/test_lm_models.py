"""The language models finetune trains: 4-bit layers that stay as quantised, in the run's precision; the cache
directories they are built into, from any rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from multigpu.recipes import lm_models
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
    assert run_in_processes(
        "tests.recipes.test_lm_models:save_on_each_rank", 2, timeout=120, workdir=str(tmp_path)
    ) == [True, True]


def test_an_incomplete_cache_directory_is_replaced(tmp_path: Path) -> None:
    target = tmp_path / "model"
    target.mkdir()
    (target / "tokenizer.json").write_text("{}")  # what such a run left: the tokenizer alone
    lm_models._publish(lambda directory: (directory.mkdir(), (directory / "config.json").write_text("{}")), target)
    assert sorted(p.name for p in target.iterdir()) == ["config.json"]
