"""The paths that only a GPU takes: each one was wrong by reading before it was ever run (see the issue list).

One GPU means NCCL with world size 1; what needs two GPUs is skipped below that.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import multigpu as mg
from multigpu.observers.monitor import peak_tflops
from tests.dist import multigpu, run_command, run_in_processes
from tests.recipes.test_train import write_uci_har
from tests.reference import TinyNet, dataset

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
# A GPU image without internet may lack these (scripts/gpu_check.sh then says which were there).
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
needs_bitsandbytes = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")


def test_train_recipe_accumulates_its_loss_on_the_gpu(tmp_path: Path) -> None:
    """recipes/train.py summed a CUDA loss into a CPU accumulator."""
    har = write_uci_har(tmp_path / "har", {"train": 64, "test": 32}, {"train": [1, 3], "test": [2]})
    args = ["train", "--data", str(har), "--epochs", "2", "--batch-size", "8", "--save-dir", str(tmp_path / "run")]
    result = multigpu(*args, "--precision", "bf16-mixed", timeout=300)
    assert result.returncode == 0, result.stdout
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["train_loss"] < records[0]["train_loss"]


def offload_and_async_save(save_to: str) -> dict:
    """zero3 with cpu_offload and clipping (a CPU gradient norm), then a background save in a one-process group."""
    engine = mg.Engine(strategy="zero3", cpu_offload=True, max_grad_norm=0.5, precision="bf16-mixed")
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = engine.setup(model, optimizer)
    for x, y in engine.dataloader(dataset(16), batch_size=4):
        engine.backward(nn.functional.cross_entropy(model(x), y))
        engine.step(optimizer)
    engine.save(save_to, {"model": model, "optimizer": optimizer}, async_save=True)
    engine.wait_for_checkpoint()
    return {"backend": str(torch.distributed.get_backend()), "norm": engine.last_grad_norm}


def test_cpu_offload_and_async_save_use_gloo_beside_nccl(tmp_path: Path) -> None:
    (result,) = run_in_processes(
        "tests.gpu.test_gpu_paths:offload_and_async_save", 1, timeout=300, save_to=str(tmp_path / "step-1")
    )
    assert "nccl" in result["backend"] and "gloo" in result["backend"], result
    assert result["norm"] is not None and (tmp_path / "step-1" / ".metadata").is_file()


@needs_deepspeed
def test_deepspeed_under_srun_finds_its_local_rank() -> None:
    from tests.strategies.test_deepspeed import ONE_STEP

    variables = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": "11"}
    result = run_command([sys.executable, "-c", ONE_STEP], env=variables, timeout=300)
    assert result.returncode == 0 and "launcher slurm" in result.stdout, result.stdout


def test_gpu_ids_index_the_visible_gpus_and_oversubscription_is_refused(tmp_path: Path) -> None:
    script = tmp_path / "which.py"
    script.write_text(
        "import os, torch; print('visible', os.environ['CUDA_VISIBLE_DEVICES'], torch.cuda.device_count())"
    )
    last = str(torch.cuda.device_count() - 1)
    result = multigpu("run", "--gpu-ids", "0", str(script), env={"CUDA_VISIBLE_DEVICES": last}, timeout=120)
    assert result.returncode == 0 and f"visible {last} 1" in result.stdout, result.stdout
    too_many = str(torch.cuda.device_count() + 1)
    refused = multigpu("run", "--nproc", too_many, str(script), timeout=60)
    assert refused.returncode == 2 and "each needs a GPU of its own" in refused.stdout, refused.stdout


def test_this_gpu_has_a_peak_figure_or_says_it_has_none(capsys: pytest.CaptureFixture) -> None:
    name = torch.cuda.get_device_name()
    peak = peak_tflops(name, "bf16-mixed")
    mg.Engine(strategy="single", precision="bf16-mixed", log_every=1)
    said = capsys.readouterr().out
    assert (peak is not None) or (f"no peak FLOPS known for {name!r}" in said), said


def nccl_records_collectives() -> int:
    """With multigpu run's settings, NCCL's flight recorder keeps each collective (what a timeout would dump)."""
    import pickle

    engine = mg.Engine(strategy="ddp")
    total = torch.ones(4, device=engine.device)
    torch.distributed.all_reduce(total)
    torch.cuda.synchronize()
    trace = pickle.loads(torch._C._distributed_c10d._dump_nccl_trace())
    return len(trace["entries"])


def test_the_nccl_flight_recorder_is_on_under_multigpu_run() -> None:
    assert run_in_processes("tests.gpu.test_gpu_paths:nccl_records_collectives", 1, timeout=120)[0] >= 1


def deepspeed_export_memory() -> dict:
    """DeepSpeed ZeRO-3: assembling the whole model for export holds one whole tensor at a time on the GPU."""
    engine = mg.Engine(strategy="deepspeed", zero_stage=3)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = engine.setup(model, optimizer)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    state = engine.full_state_dict(model)
    checkpoint_share = engine.model_state_dict(model)
    return {
        "growth": torch.cuda.max_memory_allocated() - before,
        "devices": {str(t.device) for t in [*state.values(), *checkpoint_share.values()]},
        "tensors": len(state),
    }


@needs_deepspeed
def test_deepspeed_export_gathers_one_tensor_at_a_time() -> None:
    (result,) = run_in_processes("tests.gpu.test_gpu_paths:deepspeed_export_memory", 1, timeout=300)
    one_weight = 1024 * 1024 * 4
    assert result["tensors"] == 16 and result["devices"] == {"cpu"}
    assert result["growth"] <= 3 * one_weight, result  # the gathered weight and its fp32 copy, not the model (32 MB)


@pytest.mark.parametrize("method", ["lora", pytest.param("qlora", marks=needs_bitsandbytes)])
def test_finetune_bf16_on_the_gpu(tmp_path: Path, method: str) -> None:
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"Line {i}: to be, or not to be." for i in range(300)))
    args = ["finetune", "--model", "tiny", "--data", str(text), "--method", method, "--precision", "bf16-mixed"]
    args += ["--seq-len", "32", "--max-steps", "4", "--save-dir", str(tmp_path / "run"), "--log-every", "0"]
    result = multigpu(*args, timeout=300)
    assert result.returncode == 0, result.stdout
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()


@two_gpus
def test_dp_replicas_compute_in_bf16() -> None:
    from multigpu.strategies.dp import AutocastDataParallel

    seen = set()

    class Probe(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = super().forward(x)
            seen.add(out.dtype)
            return out

    model = AutocastDataParallel(Probe(8, 8).cuda())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(torch.randn(16, 8, device="cuda"))
    assert seen == {torch.bfloat16}


@two_gpus
def test_dp_batch_shares_give_gpu_0_fewer_rows_and_the_same_output() -> None:
    """dp with batch_shares 1,3: GPU 0 (which gathers the outputs) computes 4 of 16 rows; the gathered output is the
    even split's."""
    from multigpu.strategies.dp import AutocastDataParallel

    rows: dict[int, int] = {}

    class Probe(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            rows[x.device.index] = x.shape[0]
            return super().forward(x)

    torch.manual_seed(0)
    inner, x = Probe(8, 8).cuda(), torch.randn(16, 8, device="cuda")
    shares = (1.0, 3.0) + (1.0,) * (torch.cuda.device_count() - 2)
    uneven = AutocastDataParallel(inner, shares)(x)
    assert rows[0] < rows[1] and sum(rows.values()) == 16
    assert torch.allclose(uneven, AutocastDataParallel(inner)(x), atol=1e-6)


@two_gpus
def test_two_gpus_train_like_one(tmp_path: Path) -> None:
    from tests.reference import train_reference
    from tests.strategies.test_equivalence import MATRIX, assert_matches

    cases = [c for c in MATRIX if c.precision in ("32", "bf16-mixed")][:4]
    results = run_in_processes("tests.strategies.test_equivalence:train_cases", 2, timeout=300, cases=cases)
    for index, case in enumerate(cases):
        assert_matches(case, results[0][index], train_reference(case, world_size=2))


def sync_batchnorm_step(processes: int) -> dict:
    """One ddp step with sync_batchnorm, every rank on data of its own: BatchNorm must see the global batch.
    `processes`: the group's size (not `nproc`, which run_in_processes takes itself)."""
    engine = mg.Engine(strategy="ddp", sync_batchnorm=True)
    model = nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = engine.setup(model, optimizer)
    before = model.module[1].weight.detach().clone()
    batches = [torch.randn(8, 4, generator=torch.Generator().manual_seed(rank)) + rank for rank in range(processes)]
    x = batches[engine.rank].to(engine.device)
    engine.backward(nn.functional.cross_entropy(model(x), torch.zeros(8, dtype=torch.long, device=engine.device)))
    engine.step(optimizer)
    return {
        "layers": [type(m).__name__ for m in model.modules() if "BatchNorm" in type(m).__name__],
        "trained": not torch.equal(model.module[1].weight.detach(), before),
        # Momentum 0.1 from zeros: a tenth of the mean over every rank's batch, not over this rank's alone.
        "running_mean": model.module[0].running_mean.cpu(),
        "expected": 0.1 * torch.cat(batches).mean(dim=0),
    }


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=two_gpus)])
def test_sync_batchnorm_converts_and_normalises_over_every_rank(nproc: int) -> None:
    results = run_in_processes("tests.gpu.test_gpu_paths:sync_batchnorm_step", nproc, timeout=300, processes=nproc)
    for result in results:
        assert result["layers"] == ["SyncBatchNorm"] and result["trained"], result
        assert torch.allclose(result["running_mean"], result["expected"], atol=1e-5), result


def zero3_built_on_meta() -> dict:
    """zero3 under init_module on the GPU, with and without cpu_offload: where parameters and buffers end up, the
    weights after setup, and one training step on them."""
    from tests.engine.test_init_module import SEED, Net

    out = {}
    for offload in (False, True):
        engine = mg.Engine(strategy="zero3", seed=SEED, cpu_offload=offload)
        with engine.init_module():
            model = Net(width=64, blocks=4)
        model, optimizer = engine.setup(model, torch.optim.AdamW(model.parameters()))
        out[offload] = {
            "params": {str(p.device) for p in model.parameters()},
            "buffers": {str(b.device) for b in model.buffers()},
            "weights": engine.full_state_dict(model),
        }
        tokens = torch.arange(8 * 6, device=engine.device).reshape(8, 6) % 32
        engine.backward(model(tokens).square().mean())
        engine.step(optimizer)  # the shards train where they live, the layers compute on the GPU
    return out


def test_zero3_under_init_module_builds_on_the_cpu_and_shards_on_the_gpu() -> None:
    """Rank 0 makes each unit on the CPU and scatters it over NCCL into shards on the GPU, or, with cpu_offload,
    into shards in host memory through a GPU buffer; buffers go to the GPU either way."""
    from tests.engine.test_init_module import SEED, Net

    (result,) = run_in_processes("tests.gpu.test_gpu_paths:zero3_built_on_meta", 1, timeout=300)
    torch.manual_seed(SEED)
    expected = Net(width=64, blocks=4).state_dict()
    for offload, run in result.items():
        assert run["params"] == ({"cpu"} if offload else {"cuda:0"}), run
        assert run["buffers"] == {"cuda:0"}, run
        assert all(torch.equal(run["weights"][name].cpu(), tensor) for name, tensor in expected.items())
