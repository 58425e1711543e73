"""hsdp: zero3 inside each replica, replicas averaged. 4 processes as 2 replicas x 2 shards compute what one
process computes, a checkpoint moves from hsdp to zero3 at another world size, a model built under init_module
starts every replica from the one-process build, and a layout that does not fit the processes is refused."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

import multigpu as mg
from tests.dist import refusal, run_in_processes
from tests.reference import Case, train_engine, train_reference

SAMPLES, GLOBAL_BATCH, STOP = 40, 4, 4
CASES = [Case("hsdp", "32", accum, samples=SAMPLES, batch_size=1, replicate=2) for accum in (1, 2)]


def hsdp_runs(folder: str) -> dict:
    """In each of 4 processes: the cases trained through, the mesh zero3's parameters were laid out on, a
    checkpoint saved after STOP steps, and a model built under init_module."""
    from torch.distributed.tensor import Replicate, Shard

    from tests.engine.test_init_module import SEED, Net

    out: dict = {"outcomes": [train_engine(case) for case in CASES]}
    engine = mg.Engine(strategy="hsdp", replicate=2, seed=SEED)
    with engine.init_module():
        model = Net(width=256, blocks=4)
    model, _ = engine.setup(model)
    weight = model.blocks[0][1].weight
    out["layout"] = (tuple(weight.device_mesh.mesh_dim_names), tuple(weight.device_mesh.shape), weight.placements)
    out["expected_layout"] = (("replicate", "shard"), (2, 2), (Replicate(), Shard(0)))
    out["local_rows"] = weight.to_local().shape[0]
    out["built"] = engine.full_state_dict(model)
    out["first"] = train_engine(CASES[0], save_to=str(Path(folder) / "step-4"), stop_after=STOP)
    return out


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    folder = tmp_path_factory.mktemp("hsdp")
    return folder, run_in_processes("tests.strategies.test_hsdp:hsdp_runs", 4, timeout=300, folder=str(folder))


def test_two_replicas_of_two_shards_train_like_one_process(four: tuple[Path, list[dict]]) -> None:
    """fp32: only the order of the sums over ranks differs, so 1e-5 as in the other strategies' equivalence."""
    _, ranks = four
    for case, got in zip(CASES, ranks[0]["outcomes"], strict=True):
        want = train_reference(
            Case(samples=SAMPLES, batch_size=GLOBAL_BATCH, grad_accum_steps=case.grad_accum_steps), 1
        )
        assert got.grad_norms == pytest.approx(want.grad_norms, rel=1e-5), case
        for name, param in want.params.items():
            assert (got.params[name] - param).abs().max().item() <= 1e-5, (case, name)
    first = ranks[0]
    assert first["layout"] == first["expected_layout"]
    assert [rank["local_rows"] for rank in ranks] == [128] * 4  # 256 rows over 2 shards, in each replica


def test_init_module_under_hsdp_fills_every_replica_with_the_one_process_build(four) -> None:
    from tests.engine.test_init_module import SEED, Net

    _, ranks = four
    torch.manual_seed(SEED)
    expected = Net(width=256, blocks=4).state_dict()
    assert all(torch.equal(ranks[0]["built"][name], tensor) for name, tensor in expected.items())


def test_a_checkpoint_saved_under_hsdp_resumes_under_zero3_on_two_processes(four) -> None:
    folder, ranks = four
    case = Case("zero3", samples=SAMPLES, batch_size=GLOBAL_BATCH // 2)
    second = run_in_processes(
        "tests.reference:train_engine", 2, timeout=120, case=case, resume_from=str(folder / "step-4")
    )
    counts: dict[int, Counter] = {}
    for outcome in [rank["first"] for rank in ranks] + second:
        for epoch, indices in outcome.seen:
            counts.setdefault(epoch, Counter()).update(indices)
    assert all(seen == Counter(range(SAMPLES)) for seen in counts.values()), counts
    want = train_reference(Case(samples=SAMPLES, batch_size=GLOBAL_BATCH), world_size=1)
    assert ranks[0]["first"].grad_norms + second[0].grad_norms == pytest.approx(want.grad_norms, rel=1e-5)
    for name, param in want.params.items():
        assert (second[0].params[name] - param).abs().max().item() <= 1e-5, name


@pytest.mark.parametrize(
    ("args", "sentence"),
    [
        (["--strategy", "hsdp", "--replicate", "3"], "hsdp cannot split 4 processes into 3 equal replicas"),
        (["--strategy", "zero3", "--replicate", "2"], "replicate is hsdp's number of replicas"),
    ],
)
def test_a_layout_that_does_not_fit_is_refused_before_anything_starts(args: list[str], sentence: str) -> None:
    printed = refusal("demo", "--nproc", "4", "--epochs", "1", *args)
    assert sentence in printed and printed.count("\n") == 1, printed
