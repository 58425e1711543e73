"""multigpu finetune on a tiny random Llama: LoRA and QLoRA under ddp and zero3, adapters that reload, the
token-normalised loss that makes 1 x 8, 2 x 4 and 2 x 2 x 2 the same step, and a run crashed at step 3 and resumed
that ends bit for bit where the uninterrupted run does, under every strategy."""

import contextlib
import functools
import io
import json
import os
import stat
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file

from multigpu.recipes.common import RUN_RESULT
from tests.dist import multigpu, refusal, run_each_in_processes, run_in_processes


@pytest.fixture(scope="module", autouse=True)
def tiny_model() -> None:
    """Builds the model cache once here, not in two workers at once (the first build converts SmolLM2, ~40 s)."""
    from multigpu.models.lm_models import model_dir

    model_dir("tiny")


ANSWERS = ["Yes.", "No, not today.", "Perhaps, if the weather holds and the roads are dry enough for travel.", "Ay."]
PROBE = torch.tensor([[1, 520, 2138, 314, 29, 905, 71]])


def write_text(path: Path) -> str:
    path.write_text(" ".join(f"Line {i}: to be, or not to be, that is the question." for i in range(200)))
    return str(path)


def write_chat(path: Path) -> str:
    records = [{"instruction": f"Question {i}?", "output": ANSWERS[i % 4] * (1 + i % 3)} for i in range(10)]
    path.write_text("\n".join(json.dumps(r) for r in records))
    return str(path)


def train_and_probe(**options: object) -> dict:
    from multigpu.recipes.finetune import FinetuneConfig, finetune

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = finetune(FinetuneConfig(model="tiny", seq_len=32, batch_size=2, lr=1e-2, log_every=0, **options))
    # No adapter is an FSDP unit of its own: an Identity dropout unit warned of a view of its gathered input.
    assert not [w for w in caught if "view tensor" in str(w.message)], [str(w.message) for w in caught]
    model = result["model"]
    model.eval()
    with torch.no_grad():  # every rank runs the forward: zero3 gathers its shards in it
        logits = model(input_ids=PROBE).logits
    return {"logits": logits, "output": result["output"], "history": result["history"]}


ADAPTERS = [(strategy, method) for strategy in ("ddp", "zero3") for method in ("lora", "qlora")]
# Trained in the same launch, for test_lora_under_deepspeed_zero3_writes_the_adapter_ddp_writes.
DEEPSPEED_LORA = ("deepspeed", "lora")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], tuple[Path, list[dict]]]:
    """Each (strategy, method) of ADAPTERS and DEEPSPEED_LORA trained on two processes, in one launch: its save dir
    and its ranks."""
    root = tmp_path_factory.mktemp("adapters")
    data = write_text(root / "text.txt")
    cells = [*ADAPTERS, DEEPSPEED_LORA]
    runs = [
        {"data": data, "method": method, "multi_gpu": strategy, "max_steps": 3, "resume": "none"}
        | {"save_dir": str(root / f"{strategy}-{method}")}
        | ({"zero_stage": 3} if strategy == "deepspeed" else {})
        for strategy, method in cells
    ]
    ranks = run_each_in_processes("tests.recipes.test_finetune:train_and_probe", 2, runs, timeout=480)
    return {cell: (root / f"{cell[0]}-{cell[1]}", [rank[index] for rank in ranks]) for index, cell in enumerate(cells)}


@pytest.mark.parametrize(("strategy", "method"), ADAPTERS)
def test_adapter_trained_on_two_processes_reloads_with_peft_as_written_and_as_exported(
    adapters: dict, tmp_path: Path, method: str, strategy: str
) -> None:
    from multigpu.models.lm_models import load_model

    run, ranks = adapters[(strategy, method)]
    assert torch.equal(ranks[0]["logits"], ranks[1]["logits"])
    adapter = Path(ranks[0]["output"])
    assert (adapter / "adapter_config.json").is_file()

    weights = load_file(adapter / "adapter_model.safetensors")
    lora_b = [w for name, w in weights.items() if "lora_B" in name]
    assert len(lora_b) == 2 * 7 and all(w.abs().sum() > 0 for w in lora_b)  # trained, never empty
    modes = {file.name: stat.S_IMODE(file.stat().st_mode) for file in adapter.iterdir()}
    assert modes["adapter_model.safetensors"] == modes["adapter_config.json"]  # not 0600 (safetensors 0.8)
    if strategy == "zero3":  # where the checkpoint is sharded: `multigpu export` writes the same adapter
        exported = export_adapter(run, tmp_path / "exported")
        exported_weights = load_file(exported / "adapter_model.safetensors")
        assert exported_weights.keys() == weights.keys()
        assert all(torch.equal(exported_weights[name], weight) for name, weight in weights.items())
        assert adapter_settings(exported) == adapter_settings(adapter)
        adapter = exported  # ...which peft loads as it loads the finetune's
    reloaded = load_model("tiny", method, adapter=str(adapter)).eval()
    with torch.no_grad():
        logits = reloaded(input_ids=PROBE).logits
    torch.testing.assert_close(logits, ranks[0]["logits"], atol=1e-5, rtol=1e-5)
    history = ranks[0]["history"]
    assert [h["step"] for h in history] == [0, 3]


def export_adapter(save_dir: Path, out: Path) -> Path:
    """`multigpu export` of a finetune's last checkpoint, in this process; a .safetensors OUT is refused."""
    from multigpu.checkpoint import list_checkpoints
    from multigpu.cli import main

    last = list_checkpoints(save_dir / "checkpoints")[-1]
    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(last), str(out.with_suffix(".safetensors"))])
    assert exit_info.value.code == 2
    assert main(["export", str(last), str(out)]) == 0
    return out


def adapter_settings(adapter: Path) -> dict:
    settings = json.loads((adapter / "adapter_config.json").read_text())
    return {**settings, "target_modules": sorted(settings["target_modules"])}  # a set, saved in any order


def one_step(data: str, strategy: str, batch_size: int, accum: int) -> dict:
    """One optimizer step of LoRA with SGD at lr 1, so the change in each parameter is minus its gradient."""
    import multigpu as mg
    from multigpu.data.lm_data import collate
    from multigpu.recipes.finetune import FinetuneConfig, build, token_loss

    engine = mg.Engine(strategy=strategy, grad_accum_steps=accum, seed=0)
    config = FinetuneConfig(model="tiny", data=data, seq_len=48, batch_size=batch_size, method="lora")
    model, _, tokenizer, lm = build(config, engine)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=1.0)
    loader = engine.dataloader(lm.train, batch_size=batch_size, collate_fn=lambda s: collate(s, tokenizer.pad_token_id))
    before = [p.detach().clone() for p in trainable]
    for batch in loader:
        with engine.accumulate(model):
            engine.backward(*token_loss(model, batch))
        if engine.step(optimizer):
            break
    return {"grads": [b - p.detach() for b, p in zip(before, trainable, strict=True)], "samples": len(lm.train)}


def test_token_normalised_loss_is_the_same_for_1x8_2x4_and_2x2x2(tmp_path: Path) -> None:
    data = write_chat(tmp_path / "chat.jsonl")  # 10 records: 9 train, 1 validation
    kwargs = {"data": data, "timeout": 180}
    (one,) = run_in_processes(
        "tests.recipes.test_finetune:one_step", 1, strategy="single", batch_size=8, accum=1, **kwargs
    )
    steps = [{"data": data, "strategy": "ddp", "batch_size": size, "accum": accum} for size, accum in ((4, 1), (2, 2))]
    ranks = run_each_in_processes("tests.recipes.test_finetune:one_step", 2, steps, timeout=180)
    two, accumulated = ([rank[index] for rank in ranks] for index in range(2))  # 2 x 4, and 2 x 2 x 2
    assert one["samples"] == 9
    changed = [g for g in one["grads"] if g.abs().sum() > 0]
    assert changed, "the step changed nothing"
    for other in (two[0], two[1], accumulated[0], accumulated[1]):
        for reference, grad in zip(one["grads"], other["grads"], strict=True):
            torch.testing.assert_close(grad, reference, atol=1e-5, rtol=0)


def test_finetune_cli_resumes_and_merges(tmp_path: Path) -> None:
    data, run = write_text(tmp_path / "text.txt"), tmp_path / "run"
    common = ["finetune", "--model", "tiny", "--data", data, "--seq-len", "32", "--batch-size", "2"]
    common += ["--save-dir", str(run), "--log-every", "0"]
    # One process: what is tested is the run's own config.yaml continuing it (2 processes record their launch as
    # well: tests/recipes/test_train.py's restarts). LoRA's rank 64 makes 4,096-value adapters, whose states the
    # 8-bit AdamW quantises.
    first = multigpu(
        *common, "--max-steps", "2", "--activation-checkpointing", "selective", "--resume", "none",
        "--optimizer", "adamw-8bit", "--lora-r", "64",
    )  # fmt: skip
    assert first.returncode == 0, first.stdout
    # The run's own config.yaml continues it (started from --resume none, it records auto); a new --max-steps and
    # --lr are honoured (the schedule is planned anew from the samples done), and AdamW takes the 8-bit states.
    again = ["finetune", "--config", str(run / "config.yaml")]
    second = multigpu(*again, "--max-steps", "4", "--lr", "1e-3", "--merge", "--optimizer", "adamw", timeout=240)
    assert second.returncode == 0, second.stdout
    assert "resumed from" in second.stdout and "step-00000002" in second.stdout
    assert second.stdout.count("resume: optimizer states converted from adamw-8bit to adamw (exact)") == 1
    assert "the lr schedule follows --max-steps 4" in second.stdout and "step 4: validation loss" in second.stdout
    assert "the lr schedule follows --lr 0.001: peak lr 0.001 (planned: 0.0002)" in second.stdout
    assert (run / "merged" / "config.json").is_file()
    # What cannot continue the run is one sentence before anything starts, naming the flag and the run's value:
    # other data, another optimizer's states, other weights or another data order.
    assert f"--data {tmp_path / 'other.txt'} differs from {data}" in refusal(
        *again, "--data", write_text(tmp_path / "other.txt")
    )
    wrote = f"which the run that wrote {run / 'checkpoints' / 'step-00000004'}"
    for change, run_had, why in (
        (["--optimizer", "muon"], "adamw", "trained with, and its checkpoint holds adamw's states"),
        (["--method", "full", "--no-merge"], "lora", "trained with, and its checkpoint holds that run's weights"),
        (["--lora-r", "8"], "64", "trained with"),
        (["--seed", "1"], "0", "drew its data order from"),
    ):
        refused = refusal(*again, *change)
        assert f"{change[0]} {change[1]} differs from {run_had}, {wrote} {why}" in refused, refused
        assert f"pass {change[0]} {run_had}" in refused and refused.count("\n") == 1, refused
    assert "--merge merges an adapter" in refusal("finetune", "--method", "full", "--merge")


def test_lora_under_deepspeed_zero3_writes_the_adapter_ddp_writes(adapters: dict) -> None:
    written = {
        strategy: load_file(Path(adapters[strategy, "lora"][1][0]["output"]) / "adapter_model.safetensors")
        for strategy in ("ddp", "deepspeed")
    }
    assert set(written["ddp"]) == set(written["deepspeed"])
    for name, weight in written["ddp"].items():
        torch.testing.assert_close(written["deepspeed"][name], weight, atol=1e-5, rtol=1e-5)
    assert any(w.abs().sum() > 0 for name, w in written["ddp"].items() if "lora_B" in name)


def first_steps(data: str, strategy: str, batch_size: int) -> dict:
    """For full and LoRA finetuning: the first step's token-mean loss and the whole gradient of every trainable
    parameter, with the model built from its config on the meta device and filled from its safetensors in setup."""
    import multigpu as mg
    from multigpu.data.lm_data import collate
    from multigpu.recipes.finetune import FinetuneConfig, build, token_loss

    out = {}
    for method in ("full", "lora"):
        engine = mg.Engine(strategy=strategy, seed=0)
        config = FinetuneConfig(model="tiny", data=data, seq_len=48, batch_size=batch_size, method=method)
        model, _, tokenizer, lm = build(config, engine)
        collate_fn = functools.partial(collate, pad_id=tokenizer.pad_token_id)
        loader = engine.dataloader(lm.train, batch_size=batch_size, collate_fn=collate_fn)
        loss, count = token_loss(model, next(iter(loader)))
        engine.backward(loss, count)
        trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        out[method] = {
            "loss": float(engine.reduce(loss.detach(), "sum") / engine.reduce(count.float(), "sum")),
            "grads": {name: getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for name, p in trainable},
            # Each rank held only its rows of every parameter from setup on, never the whole model.
            "local_rows": {
                name: p.to_local().shape[0] for name, p in model.named_parameters() if hasattr(p, "to_local")
            },
        }
    return out


@pytest.fixture(scope="module")
def first_step_one_process(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """The chat data of the zero3 test below, and the first step one process takes on it (full and LoRA)."""
    data = write_chat(tmp_path_factory.mktemp("chat") / "chat.jsonl")  # 9 training records, 6 per global batch
    (one,) = run_in_processes(
        "tests.recipes.test_finetune:first_steps", 1, timeout=180, data=data, strategy="single", batch_size=6
    )
    return data, one


@pytest.mark.parametrize("processes", [3])
def test_finetune_from_safetensors_under_zero3_takes_the_one_process_first_step(
    first_step_one_process: tuple[str, dict], processes: int
) -> None:
    """zero3 builds the model on the meta device and streams the checkpoint into the shards; the first step must
    be the single process's: the same loss and gradients, full finetuning and LoRA alike. fp32: only the order
    of the sums over ranks differs (the gradient's reduce-scatter, the loss's all-reduce), ~1e-7 relative. On 3
    processes, an odd count (2 run throughout the suite, on the tiny models)."""
    data, one = first_step_one_process
    ranks = run_in_processes(
        "tests.recipes.test_finetune:first_steps",
        processes,
        timeout=240,
        data=data,
        strategy="zero3",
        batch_size=6 // processes,
    )
    for method in ("full", "lora"):
        reference, sharded = one[method], ranks[0][method]
        assert sharded["loss"] == pytest.approx(reference["loss"], rel=1e-6)
        assert sharded["grads"].keys() == reference["grads"].keys()
        for name, grad in reference["grads"].items():
            torch.testing.assert_close(sharded["grads"][name], grad, atol=1e-5, rtol=1e-5, msg=name)
        assert any(grad.abs().sum() > 0 for grad in reference["grads"].values())
        # Rank 1 held only its rows of the 49152-token embedding from setup on.
        embedding = {"full": "", "lora": "base_model.model."}[method] + "model.embed_tokens.weight"
        assert ranks[1][method]["local_rows"][embedding] == -(-49152 // processes)


def test_chunked_loss_finetunes_as_the_plain_one(tmp_path: Path) -> None:
    """--loss chunked, full and LoRA (a frozen head: the hidden states' gradient only), lands where --loss plain
    does: in fp32 only the order of the sums over tokens differs (measured 1e-7 relative), while a token counted
    twice or a gradient of the wrong scale moves these losses by 1e-2 or more."""
    data = write_text(tmp_path / "text.txt")
    runs = [{"loss": loss, "method": method} for method in ("full", "lora") for loss in ("plain", "chunked")]
    calls = [
        {"data": data, "max_steps": 3, "resume": "none", "save_dir": str(tmp_path / f"{r['method']}-{r['loss']}"), **r}
        for r in runs
    ]
    (results,) = run_each_in_processes("tests.recipes.test_finetune:train_and_probe", 1, calls, timeout=240)
    found = {(run["method"], run["loss"]): result for run, result in zip(runs, results, strict=True)}
    # 2 pipeline stages of 2 processes, the loss on the last one's hidden states with the head it holds (tied to
    # the first one's embeddings): the one-process bound of tests/strategies/test_model_parallel.py.
    pipeline = {**calls[1], "save_dir": str(tmp_path / "pp-chunked"), "multi_gpu": "pp"}
    (two, _) = run_in_processes("tests.recipes.test_finetune:history", 2, timeout=240, **pipeline)
    assert [h["val_loss"] for h in two] == pytest.approx(
        [h["val_loss"] for h in found["full", "plain"]["history"]], rel=1e-4
    )
    for method in ("full", "lora"):
        plain, chunked = found[method, "plain"], found[method, "chunked"]
        assert [h["val_loss"] for h in chunked["history"]] == pytest.approx(
            [h["val_loss"] for h in plain["history"]], rel=1e-6
        )
        assert plain["history"][-1]["val_loss"] < plain["history"][0]["val_loss"] - 0.05  # it trained
        # Generation after training sees logits again: the head hands its input through only inside the loss.
        torch.testing.assert_close(chunked["logits"], plain["logits"], rtol=1e-4, atol=1e-4)


def history(**options: object) -> list[dict]:
    """A finetune's validation losses, as train_and_probe trains it (under pp, where the model is not called whole)."""
    from multigpu.recipes.finetune import FinetuneConfig, finetune

    config = FinetuneConfig(model="tiny", seq_len=32, batch_size=2, lr=1e-2, log_every=0, **options)
    return finetune(config)["history"]


@pytest.mark.parametrize(
    ("flags", "sentence"),
    [
        (
            ["--seq-len", "100000"],
            "--seq-len 100000 is longer than the 2048 positions --model tiny has (max_position_embeddings in its "
            "config.json); pass a --seq-len of 2048 or less.",
        ),
        (["--batch-size", "10000000"], "--batch-size 10000000 at --seq-len 256 needs about "),
    ],
)
def test_a_sequence_or_batch_the_model_cannot_take_is_refused_before_any_worker_starts(
    flags: list[str], sentence: str, tmp_path: Path
) -> None:
    """Read from the model's config.json (positions) and the planner's count of one micro-batch's activations, which
    no device holds: otherwise a run that can only fail, or train past the positions, once the model is loaded."""
    printed = refusal("finetune", "--model", "tiny", "--save-dir", str(tmp_path), *flags)
    assert printed.count(sentence) == 1 and printed.count("\n") == 1, printed


def test_fused_loss_and_liger_are_refused_on_cpu_before_any_worker_starts() -> None:
    for flag in (["--loss", "fused"], ["--liger"]):
        printed = refusal("finetune", "--model", "tiny", "--nproc", "2", *flag)
        assert "use loss chunked on CPU (--loss chunked) and drop liger." in printed


def test_a_full_disk_while_the_adapter_or_its_export_is_written_is_one_sentence_and_a_rerun_writes_it(
    tmp_path: Path,
) -> None:
    """The disk fills (RLIMIT_FSIZE: no file past 64 KiB) as the adapter is written after the last checkpoint: exit 2,
    one sentence, nothing under the adapter's name; the same command then writes it from that checkpoint."""
    run = tmp_path / "run"
    args = ["finetune", "--model", "tiny", "--data", write_text(tmp_path / "text.txt"), "--seq-len", "32"]
    args += ["--batch-size", "2", "--max-steps", "2", "--log-every", "0", "--save-dir", str(run)]
    full = {"MULTIGPU_FAULT": "disk-full-result,bytes=65536"}
    failed = multigpu(*args, env=full, timeout=180)
    errors = [line for line in failed.stdout.splitlines() if line.startswith("multigpu: error:")]
    assert failed.returncode == 2 and "Traceback" not in failed.stdout, failed.stdout
    assert errors == [f"multigpu: error: Could not write {run / 'adapter'}: File too large; " + RUN_RESULT], errors
    assert not (run / "adapter").exists() and not (run / ".adapter.partial").exists()
    rerun = multigpu(*args, timeout=180)
    assert rerun.returncode == 0 and "writing it from the last checkpoint, without training" in rerun.stdout
    assert "step 1" not in rerun.stdout and load_file(run / "adapter" / "adapter_model.safetensors")
    out, checkpoint = tmp_path / "exported", str(run / "checkpoints" / "step-00000002")
    refused = multigpu("export", checkpoint, str(out), env=full, timeout=120)
    assert refused.returncode == 2 and refused.stdout.count("multigpu: error: Could not write") == 1, refused.stdout
    assert "Traceback" not in refused.stdout and not out.exists() and not (tmp_path / ".exported.partial").exists()
    from multigpu.cli import main

    assert main(["export", checkpoint, str(out)]) == 0  # the rerun, in this process: `export` as typed is refused's
    written = load_file(run / "adapter" / "adapter_model.safetensors")
    assert load_file(out / "adapter_model.safetensors").keys() == written.keys()


# Crashed at optimizer step 3 (the checkpoint of step 2 the newest) of 6, inside a warm-up of 10, and resumed: each
# cell's final weights must be the uninterrupted run's, bit for bit. Logged every step, as the MFU's FLOP count on a
# process's second step once changed that step's arithmetic (a resume at step 2 counted step 4 where the
# uninterrupted run counted step 2). Cell -> (processes, settings); the global batch is 4 rows.
# One process and plain ddp are in these cells' layouts (an epoch boundary; ddp accumulating), not cells of their own.
RESUMED: dict[str, tuple[int, dict]] = {
    # 9 training records in batches of 3: the crash at step 4 resumes at step 3, the end of the first epoch.
    "single-epoch-boundary": (
        1,
        {"multi_gpu": "single", "batch_size": 3, "epochs": 3, "crash_at": 4, "chat": True, "seq_len": 64},
    ),
    "ddp-accumulate-2": (2, {"multi_gpu": "ddp", "batch_size": 1, "grad_accum_steps": 2}),
    "zero3": (2, {"multi_gpu": "zero3", "batch_size": 2}),
    "tp": (2, {"multi_gpu": "tp"}),
    "pp": (2, {"multi_gpu": "pp"}),
    "cp": (2, {"multi_gpu": "ddp", "cp_size": 2}),
    "ep": (2, {"multi_gpu": "ddp", "batch_size": 2, "ep_size": 2, "model": "tiny-moe"}),
}


COMPLETED = "ddp-accumulate-2"  # run once more when complete


def crash_and_resume(workdir: str, name: str) -> str | None:
    """RESUMED[name] run uninterrupted in workdir/name/whole, then crashed (every rank at once, through the fault
    hook, so that the launch lives on for the next cell) and resumed in workdir/name/resumed; the COMPLETED cell's
    resumed run is then run once more, complete: what it printed."""
    from multigpu.recipes.finetune import FinetuneConfig, finetune

    options = {"batch_size": 4, "model": "tiny", **RESUMED[name][1]}
    crash_at, chat = options.pop("crash_at", 3), options.pop("chat", False)
    data = write_chat(Path(workdir) / f"{name}.jsonl") if chat else write_text(Path(workdir) / f"{name}.txt")
    common = {"method": "full", "max_steps": 6, "warmup_steps": 10, "save_every": 1, "log_every": 1, "lr": 3e-3}
    config = {**common, "seq_len": 32, "data": data, "resume": "auto", **options}
    # The uninterrupted run checkpoints only at its end: its checkpoints are never read, and a save that changed the
    # steps after it would show here as a difference.
    finetune(FinetuneConfig(save_dir=f"{workdir}/{name}/whole", **{**config, "save_every": 0}))
    fault = {"MULTIGPU_FAULT": f"crash,step={crash_at},rank={os.environ['RANK']}"}
    with mock.patch.dict(os.environ, fault), pytest.raises(RuntimeError, match="injected crash"):
        finetune(FinetuneConfig(save_dir=f"{workdir}/{name}/resumed", **config))
    finetune(FinetuneConfig(save_dir=f"{workdir}/{name}/resumed", **config))
    if name != COMPLETED:
        return None
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        finetune(FinetuneConfig(save_dir=f"{workdir}/{name}/resumed", **config))
    return printed.getvalue()


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every cell of RESUMED, in one launch per number of processes; the COMPLETED cell's second run beside."""
    workdir = tmp_path_factory.mktemp("resumed")
    for processes in (1, 2):
        names = [name for name, (n, _) in RESUMED.items() if n == processes]
        calls = [{"workdir": str(workdir), "name": name} for name in names]
        ranks = run_each_in_processes("tests.recipes.test_finetune:crash_and_resume", processes, calls, timeout=600)
        if COMPLETED in names:
            (workdir / "completed.txt").write_text(ranks[0][names.index(COMPLETED)])
    return workdir


def test_a_complete_run_started_again_trains_nothing_and_keeps_what_it_wrote(resumed: Path) -> None:
    """The COMPLETED cell's resumed run, run again as it stands: it says so, trains nothing and writes nothing."""
    printed = (resumed / "completed.txt").read_text()
    complete = f"The run in {resumed / COMPLETED / 'resumed'} is complete at step 6; nothing to train"
    assert complete in printed, printed
    assert "validation loss" not in printed and "wrote " not in printed, printed


@pytest.mark.parametrize("name", RESUMED)
def test_a_run_crashed_at_step_3_resumes_bit_for_bit(resumed: Path, name: str) -> None:
    whole, again = (load_file(resumed / name / run / "model" / "model.safetensors") for run in ("whole", "resumed"))
    assert whole.keys() == again.keys()
    assert [key for key, tensor in whole.items() if not torch.equal(tensor, again[key])] == []
    first, second = (
        json.loads((resumed / name / run / "metrics.jsonl").read_text().splitlines()[-1])
        for run in ("whole", "resumed")
    )
    assert second["val_loss"] == first["val_loss"]
