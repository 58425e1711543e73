"""Float8 training (torchao's Float8Linear, emulated on this CPU): which layers are converted, that float8 is
really applied, that it composes with every precision, and that every strategy trains what one process trains."""

from __future__ import annotations

import contextlib
import importlib.util
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import multigpu as mg
from multigpu.core.errors import UsageError
from multigpu.transforms.float8 import check_float8, check_rows, convert_linears, left_out
from tests.dist import refusal, run_each_in_processes

WIDTH, CLASSES, ROWS, STEPS = 32, 16, 16, 6
# torchao's float8 layer, and the weight it wraps for FSDP's all-gather in float8, by name (not public torchao names).
LAYER, CAST = "Float8Linear", "WeightWithDynamicFloat8CastTensor"
CONVERTED = ["blocks.0.down", "blocks.0.up", "blocks.1.down", "blocks.1.up"]

# Tolerances, each relative, on every step's loss (STEPS steps of AdamW), measured on this model:
# - float8 against the plain model in one process. e4m3 keeps 3 mantissa bits, so each cast rounds an operand by
#   up to 2^-4 relatively; over sums of 32 to 64 products the losses moved by up to 1.5e-3 (32), 2.4e-3 (bf16-true)
#   after 6 steps. 1e-2 bounds that; float8 not applied at all is caught by FP32_NOISE below.
FLOAT8_VS_PLAIN = 1e-2
# - Where the scales are the same as one process's, and only the order of fp32 sums differs: rowwise scales (one per
#   row: a row's scale does not depend on the other rows of the batch) and tp (a split weight's scale comes from its
#   whole tensor's amax, all-reduced, and every tp process sees the whole batch). The sums' order still matters once:
#   a value a unit in the last place from an e4m3 rounding boundary rounds the other way (2^-4 of it), and AdamW
#   carries that on. Measured: 8e-8 (tp tensorwise: no such element), and 4.2e-4 for every rowwise cell where one
#   element flipped at step 4 (tp with AVX2 kernels; zero3 and zero2 x pp with ATEN_CPU_CAPABILITY=default, whose
#   GEMMs over 8 rows and 16 add in other orders; all N-process runs agree, the one process differs). 1e-3 bounds
#   it, below the 1.6e-3 that scales taken from each process's own slice cost (the split rows below).
SAME_SCALES = 1e-3
# - tensorwise with the batch split over processes (ddp, zero, hsdp, pp's micro-batches): each process scales its
#   own slice of the activations by that slice's amax, so other elements round the other way. Measured 1.6e-3 (ddp,
#   zero2, zero3), 1.3e-3 (hsdp), 1.1e-3 (zero3 x tp), 9e-4 (pp), 2.4e-3 (zero3 bf16-mixed); 5e-3 is twice the
#   largest, and a batch of 15 rows instead of 16 moves the losses by 3e-2.
SPLIT_SCALES = 5e-3
# fp32's own noise between two runs of the same arithmetic is ~1e-7: float8 applied moves the losses by far more.
FP32_NOISE = 1e-5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class Net(nn.Module):
    """Two blocks float8 takes (4 linear layers), an input layer it cannot (8 inputs) and the output head."""

    def __init__(self) -> None:
        super().__init__()
        self.tp_plan = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
        self.pp_layers = ["embed", "blocks.*", "head"]
        self.embed = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def data(rows: int = ROWS * STEPS) -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    inputs = torch.randn(rows, 8, generator=generator)
    return TensorDataset(inputs, torch.randint(0, CLASSES, (rows,), generator=generator))


def train(
    strategy: str,
    float8: str = "none",
    precision: str = "32",
    meta: bool = False,
    save_at: str | None = None,
    resume: str | None = None,
    **settings: object,
) -> dict:
    """STEPS optimizer steps of ROWS rows each (the last 3 after `resume`, a checkpoint `save_at` wrote after step
    3): each step's loss over the whole batch, which layers are Float8Linear, how many weights FSDP all-gathers in
    float8, and how many of those hold a scale worked out after the last step."""
    engine = mg.Engine(strategy, float8=float8, precision=precision, seed=0, **settings)
    with engine.init_module(meta=True) if meta else contextlib.nullcontext():
        model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = engine.setup(model, optimizer)
    loader = engine.dataloader(data(), batch_size=ROWS // engine.data_parallel_size)
    state = {"model": model, "optimizer": optimizer, "loader": loader}
    if resume:
        engine.load(resume, state)
    losses = []
    for x, y in loader:
        loss = engine.forward_backward(model, x, y, F.cross_entropy)
        engine.step(optimizer)
        losses.append(engine.reduce(float(loss)))
        if save_at and len(losses) == 3:
            engine.save(save_at, state)
    gathered = [p._local_tensor for p in model.parameters() if type(getattr(p, "_local_tensor", None)).__name__ == CAST]
    return {
        "losses": losses,
        "float8": sorted(
            name.removeprefix("module.") for name, m in model.named_modules() if type(m).__name__ == LAYER
        ),
        "gathered_in_float8": len(gathered),
        "scaled_after_step": sum(t._precomputed_scale is not None for t in gathered),
    }


def deviation(found: list[float], expected: list[float]) -> float:
    assert len(found) == len(expected) == STEPS
    return max(abs(a - b) / abs(b) for a, b in zip(found, expected, strict=True))


# -- which layers, and the refusals ---------------------------------------------------------------------------------
def test_the_layers_float8_cannot_take_are_left_out_and_named() -> None:
    model = Net()
    model.blocks[1].down.weight = model.blocks[0].down.weight
    assert left_out(model) == {
        "embed": "8 x 32, not multiples of 16",
        "blocks.0.down": "its weight is tied to another layer's",
        "blocks.1.down": "its weight is tied to another layer's",
        "head": "the output head",
    }
    # A Hugging Face model names its head (lm_head); a subclass of nn.Linear (bitsandbytes' 4-bit layers) stays.
    model.get_output_embeddings = lambda: model.blocks[1].up
    model.head = type("Linear4bit", (nn.Linear,), {})(WIDTH, CLASSES)
    assert left_out(model)["blocks.1.up"] == "the output head"
    assert left_out(model)["head"] == "a Linear4bit, not a plain nn.Linear"


def test_conversion_says_what_it_did_and_keeps_the_optimizer_on_the_weights() -> None:
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    said = convert_linears(model, optimizer, "tensorwise", torch.device("cpu"), all_gather=True)
    assert said == (
        "float8 tensorwise (emulated off the GPU): 4 of 6 linear layers, their weights all-gathered in float8; "
        "left out: embed (8 x 32, not multiples of 16), head (the output head)"
    )
    # float8 all-gather wraps each converted weight in a new Parameter: the optimizer must step those.
    assert {id(p) for p in optimizer.param_groups[0]["params"]} == {id(p) for p in model.parameters()}
    assert convert_linears(Net(), None, "none", torch.device("cpu")) is None


def test_a_model_with_no_layer_float8_can_take_is_refused() -> None:
    engine = mg.Engine("single", float8="rowwise")
    with pytest.raises(UsageError, match=r"float8 rowwise finds none of Sequential's 2 linear layer\(s\)"):
        engine.setup(nn.Sequential(nn.Linear(8, 20), nn.Linear(20, 4)))


def test_a_gpu_micro_batch_of_rows_float8_cannot_multiply_is_refused() -> None:
    layer = nn.Linear(WIDTH, WIDTH)
    check_rows(layer, (torch.randn(2, 8, WIDTH),))  # 16 tokens
    with torch.no_grad():
        check_rows(layer, (torch.randn(3, WIDTH),))  # evaluation: no weight gradient
    with pytest.raises(UsageError, match="this process's micro-batch has 10; pad each batch to a multiple of 16"):
        check_rows(layer, (torch.randn(2, 5, WIDTH),))


def gpu(capability: tuple[int, int]) -> contextlib.ExitStack:
    """This process sees one CUDA GPU of `capability` (an A100's name)."""
    stack = contextlib.ExitStack()
    for name, value in [
        ("is_available", True),
        ("device_count", 1),
        ("get_device_capability", capability),
        ("get_device_name", "NVIDIA A100-SXM4-80GB"),
    ]:
        stack.enter_context(mock.patch(f"torch.cuda.{name}", return_value=value))
    return stack


def test_gpus_without_float8_are_refused_before_any_worker_starts() -> None:
    with gpu((8, 0)):
        printed = refusal("demo", "--float8", "tensorwise", "--nproc", "2")
    assert (
        "float8 tensorwise needs a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell), and this NVIDIA "
        "A100-SXM4-80GB has 8.0; drop --float8 or train on such a GPU." in printed
    )
    with gpu((8, 9)):
        check_float8("rowwise", torch.device("cuda", 0))  # an L4 or RTX 4090 has float8
    check_float8("tensorwise", torch.device("cpu"))  # emulated


# -- one process ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["32", "bf16-mixed", "bf16-true"])
def test_float8_is_applied_and_trains_close_to_plain(precision: str) -> None:
    plain = train("single", precision=precision)
    for recipe in ("tensorwise", "rowwise"):
        found = train("single", recipe, precision)
        assert found["float8"] == CONVERTED
        assert FP32_NOISE < deviation(found["losses"], plain["losses"]) < FLOAT8_VS_PLAIN, recipe


# -- 1 process against 2 and 4 ---------------------------------------------------------------------------------------
# (name, processes, settings): one launch per process count runs its cells one after another. rowwise scales do not
# depend on the split, so it is checked where the split differs most (zero3, tp, zero2 x pp); zero1 shards only the
# optimizer, which float8 leaves alone.
CELLS = [
    ("ddp", 2, {"strategy": "ddp", "float8": "tensorwise"}),
    ("zero2", 2, {"strategy": "zero2", "float8": "tensorwise"}),
    ("zero3", 2, {"strategy": "zero3", "float8": "tensorwise"}),
    ("zero3-rowwise", 2, {"strategy": "zero3", "float8": "rowwise"}),
    ("zero3-bf16-mixed", 2, {"strategy": "zero3", "float8": "tensorwise", "precision": "bf16-mixed"}),
    ("zero3-meta", 2, {"strategy": "zero3", "float8": "tensorwise", "meta": True}),
    ("tp", 2, {"strategy": "tp", "float8": "tensorwise"}),
    ("tp-rowwise", 2, {"strategy": "tp", "float8": "rowwise"}),
    ("pp", 2, {"strategy": "pp", "float8": "tensorwise"}),
    ("hsdp", 4, {"strategy": "hsdp", "float8": "tensorwise", "replicate": 2}),
    ("zero3-x-tp", 4, {"strategy": "zero3", "float8": "tensorwise", "tp_size": 2}),
    ("zero2-x-pp-rowwise", 4, {"strategy": "zero2", "float8": "rowwise", "pp_size": 2}),
]
if importlib.util.find_spec("deepspeed") is not None:  # an optional extra
    CELLS.append(("deepspeed-stage3", 2, {"strategy": "deepspeed", "float8": "tensorwise", "zero_stage": 3}))


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Every cell's outcome, and a zero3 run that saves after step 3 and one that resumes from there."""
    saved = str(tmp_path_factory.mktemp("float8") / "step-3")
    found = {}
    for nproc in (2, 4):
        cells = [(name, settings) for name, count, settings in CELLS if count == nproc]
        if nproc == 2:  # the save comes before the resume, in the same launch
            cells += [
                (name, {"strategy": "zero3", "float8": "tensorwise", name: saved}) for name in ("save_at", "resume")
            ]
        results = run_each_in_processes(f"{__name__}:train", nproc, [settings for _, settings in cells], timeout=240)
        found.update({name: result for (name, _), result in zip(cells, results[0], strict=True)})
    found["save"], found["resume"] = found.pop("save_at"), found.pop("resume")
    return found


@pytest.fixture(scope="module")
def one_process() -> dict[tuple[str, str], dict]:
    return {
        (recipe, precision): train("single", recipe, precision)
        for recipe in ("tensorwise", "rowwise")
        for precision in ("32", "bf16-mixed")
    }


@pytest.mark.parametrize("name", [name for name, _, _ in CELLS])
def test_every_strategy_trains_what_one_process_trains(outcomes: dict, one_process: dict, name: str) -> None:
    settings = next(settings for cell, _, settings in CELLS if cell == name)
    found = outcomes[name]
    expected = one_process[settings["float8"], settings.get("precision", "32")]
    # A pipeline rank holds its stage's layers only: 2 of the 4 on each of 2 stages.
    assert found["float8"] == (CONVERTED[:2] if "pp" in name else CONVERTED)
    split = settings["float8"] == "tensorwise" and not name.startswith("tp")
    assert deviation(found["losses"], expected["losses"]) < (SPLIT_SCALES if split else SAME_SCALES)
    # zero2, zero3 and hsdp all-gather each tensorwise weight they shard in float8, its scale from the post-step hook.
    gathers = settings["strategy"] in ("zero2", "zero3", "hsdp") and settings["float8"] == "tensorwise"
    assert found["gathered_in_float8"] == found["scaled_after_step"] == (len(found["float8"]) if gathers else 0)


def test_a_float8_checkpoint_resumes_bit_for_bit(outcomes: dict) -> None:
    # The same weights, optimizer state and batches; the first forward after the load works out each all-gathered
    # weight's scale itself, the same float64 division of the same global amax as the post-step hook's.
    assert outcomes["save"]["losses"] == outcomes["zero3"]["losses"]
    assert outcomes["resume"]["losses"] == outcomes["save"]["losses"][3:]
    assert outcomes["resume"]["gathered_in_float8"] == outcomes["resume"]["scaled_after_step"] == 4
