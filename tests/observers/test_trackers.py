"""Experiment trackers (--log-to): a real Engine trains a few steps in this process, then what W&B (offline) and
MLflow (a local file store) recorded is read back and compared with metrics.jsonl."""

from __future__ import annotations

import http.server
import json
import re
import socket
import struct
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import multigpu as mg
from multigpu.cli import build_parser
from multigpu.core.errors import UsageError
from multigpu.engine.config import EngineConfig
from multigpu.observers import trackers
from multigpu.recipes import common
from multigpu.recipes.common import recipe_engine, run_recipe
from multigpu.recipes.train import TrainConfig
from tests.dist import ROOT, run_command

SCRIPT_CONFIG = {"lr": 0.1, "epochs": 2, "data": {"name": "toy", "rows": 16}, "sample_prompt": None}


def train_a_little(log_dir: Path, **settings: Any) -> mg.Engine:
    """Four optimizer steps of a linear model, each logging a record (and the monitor's reports at steps 3, 4)."""
    engine = mg.Engine(strategy="single", log_dir=str(log_dir), log_every=1, **settings)
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    data = TensorDataset(torch.randn(16, 3), torch.randn(16, 1))
    for step, (x, y) in enumerate(engine.dataloader(data, batch_size=4, shuffle=False), start=1):
        loss = engine.forward_backward(model, x, y, nn.functional.mse_loss)
        engine.step(optimizer)
        engine.log(step, {"loss": loss.item(), "lr": 0.1, "phase": "train", "val_loss": None})
    engine.log_config(SCRIPT_CONFIG)
    return engine


def jsonl_by_step(log_dir: Path) -> dict[int, dict[str, Any]]:
    """metrics.jsonl's records merged per step (the loop's record and the monitor's report share a step)."""
    rows: dict[int, dict[str, Any]] = defaultdict(dict)
    for line in (log_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        rows[record.pop("step")].update(record)
    return dict(rows)


# -- Weights & Biases --------------------------------------------------------------------------------------------
def wandb_records(path: Path) -> list[Any]:
    """The protobuf Records of a .wandb file: LevelDB's log format (32 KiB blocks of records, each a 7-byte header
    of masked CRC32C, length and type, then its payload) behind W&B's own 7-byte header."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:7] == b":W&B" + struct.pack("<HB", 0xBEE1, 0)
    block, position, pieces, records = 32 * 1024, 7, b"", []
    while position < len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position : position + 7])
        payload = data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind == 0 and length == 0:  # zeros: the writer preallocated, nothing was written here
            break
        assert kind in (1, 2, 3, 4), f"record type {kind} at byte {position}"
        pieces = payload if kind in (1, 2) else pieces + payload  # FULL, FIRST / MIDDLE, LAST
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            records.append(record)
    return records


def wandb_run(directory: Path, wait_s: float = 30) -> dict[str, Any]:
    """The one run W&B wrote under `directory`: its name, config, history rows by step, and whether it finished.
    W&B's service process writes the file behind the script (under load, seconds after `finish` returned, the file
    was still its preallocated zeros): read again until its exit record is there, or `wait_s` is spent."""
    [path] = directory.glob("wandb/offline-run-*/run-*.wandb")
    deadline = time.monotonic() + wait_s
    run = read_wandb_run(path)
    while not run["exited"] and time.monotonic() < deadline:
        time.sleep(0.2)
        run = read_wandb_run(path)
    return run


def read_wandb_run(path: Path) -> dict[str, Any]:
    run: dict[str, Any] = {"name": None, "config": {}, "history": defaultdict(dict), "exited": False}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        updates = []
        if kind == "run":
            run["name"] = record.run.display_name
            updates = record.run.config.update
        elif kind == "config":
            updates = record.config.update
        elif kind == "history":
            row = run["history"][record.history.step.num]
            for item in record.history.item:
                key = item.key or ".".join(item.nested_key)
                if not key.startswith("_"):  # W&B's own _step, _runtime, _timestamp
                    row[key] = json.loads(item.value_json)
        elif kind == "exit":
            run["exited"] = True
        run["config"].update({item.key: json.loads(item.value_json) for item in updates})
    return run


@pytest.fixture
def wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    # No importorskip: the suite installs the trackers extra, so a missing wandb must fail here, not pass unseen.
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # nothing of W&B's outside tmp_path
        monkeypatch.setenv(variable, str(tmp_path / "wandb-home"))
    for variable in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_NAME", "WANDB_RUN_ID"):
        monkeypatch.delenv(variable, raising=False)
    yield
    import wandb

    wandb.teardown()  # stops W&B's service process now rather than at the end of the session


def test_wandb_offline_run_holds_the_jsonl_metrics_the_config_and_the_name(tmp_path: Path, wandb_offline) -> None:
    log_dir = tmp_path / "run"
    train_a_little(log_dir, log_to="wandb", run_name="tiny-run").close()
    expected = jsonl_by_step(log_dir)
    assert "perf/step_time_s" in expected[4] and expected[4]["val_loss"] is None  # what is compared below
    run = wandb_run(log_dir)
    assert run["name"] == "tiny-run"
    assert run["exited"]  # finished: the run's last record is written
    assert dict(run["history"]) == expected  # every key, value and step, None and strings included
    assert {key: run["config"][key] for key in SCRIPT_CONFIG} == SCRIPT_CONFIG
    assert run["config"]["engine"]["log_to"] == "wandb" and run["config"]["engine"]["log_every"] == 1
    assert not (log_dir / "tensorboard").exists()


# -- MLflow ------------------------------------------------------------------------------------------------------
@pytest.fixture
def mlflow_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    uri = f"file:{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    for variable in ("MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(variable, raising=False)
    return uri


def mlflow_run(uri: str) -> Any:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("multigpu")
    [run] = client.search_runs([experiment.experiment_id])
    return client, run


def test_mlflow_run_holds_the_jsonl_numbers_as_metrics_and_the_config_as_params(
    tmp_path: Path, mlflow_store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    log_dir = tmp_path / "tiny"
    engine = train_a_little(log_dir, log_to="mlflow,tensorboard")
    engine.log(4, {"acc(top1)": 0.75})  # a name MLflow refuses: renamed, and said
    engine.log_config({"prompt": "x" * 7000})  # longer than MLflow keeps in a param
    changed = "MLflow params cannot change once logged, and 'lr' was '0.1', now '0.2'"
    with pytest.raises(UsageError, match=re.escape(changed)):
        engine.log_config({"lr": 0.2})
    engine.close()
    out = capsys.readouterr().out
    assert "MLflow metric 'acc(top1)' is logged as 'acc_top1_'" in out
    assert "MLflow params prompt are longer than MLflow's 6000 characters" in out

    client, run = mlflow_run(mlflow_store)
    assert run.info.run_name == "tiny"  # the log folder's name, without --run-name
    assert run.info.status == "FINISHED"
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for step, record in jsonl_by_step(log_dir).items():
        for key, value in record.items():
            # A list (one value per rank: batch_shares) is a metric per item, key/0, key/1, ...
            items = {f"{key}/{i}": item for i, item in enumerate(value)} if isinstance(value, list) else {key: value}
            for name, item in items.items():
                if isinstance(item, (int, float)) and key != "acc(top1)":
                    series[name].append((step, float(item)))
    assert "perf/step_time_s" in series and "memory/rank0_peak_mb" in series  # '/' is fine in MLflow's keys
    for key, expected in series.items():
        assert sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)) == expected, key
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "acc_top1_")] == [(4, 0.75)]
    assert set(run.data.metrics) == {*series, "acc_top1_"}  # strings and None are no metrics
    params = run.data.params
    assert params["lr"] == "0.1" and params["data.rows"] == "16" and params["sample_prompt"] == "None"
    assert params["engine.log_to"] == "mlflow,tensorboard" and params["engine.log_every"] == "1"
    assert params["prompt"] == "x" * 6000
    import mlflow

    assert mlflow.artifacts.load_dict(f"{run.info.artifact_uri}/long_params.json") == {"prompt": "x" * 7000}
    assert (log_dir / "tensorboard").is_dir()


def test_an_mlflow_store_that_cannot_open_is_refused_in_one_sentence(
    tmp_path: Path, mlflow_store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")  # MLflow 3 refuses its file store without it
    with pytest.raises(UsageError) as refused:
        mg.Engine(strategy="single", log_dir=str(tmp_path / "run"), log_to="mlflow")
    message = str(refused.value)
    assert message.startswith(f"--log-to mlflow could not open the tracking store {mlflow_store} (")
    assert "set MLFLOW_TRACKING_URI to a tracking server (http://host:5000)" in message
    assert "MLFLOW_ALLOW_FILE_STORE=true." in message and "\n" not in message


# -- servers that cannot be reached ----------------------------------------------------------------------------
# No test here needs the network: the servers are local ports that refuse, never answer, or answer.
@pytest.fixture
def refusing_url() -> str:
    """An http URL where nothing listens (a port bound and let go): a connection is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def silent_url() -> Iterator[str]:
    """An http URL whose server takes connections (the kernel does, for a listening socket) and never answers."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"


@pytest.fixture
def answering() -> Iterator[Callable[[int], str]]:
    """Starts local http servers that answer every request with a given status; returns their URLs."""
    servers = []

    def start(status: int) -> str:
        class Answers(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_error(status)

            def log_message(self, *args: Any) -> None:
                pass

        servers.append(http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answers))
        threading.Thread(target=servers[-1].serve_forever, args=(0.05,), daemon=True).start()
        return f"http://127.0.0.1:{servers[-1].server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_an_mlflow_server_that_refuses_connections_is_named_at_once(
    tmp_path: Path, mlflow_store: str, monkeypatch: pytest.MonkeyPatch, refusing_url: str
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", refusing_url)
    # MLflow alone would retry for minutes (260 s in the report): here one short try, should MLflow get to it.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    started = time.monotonic()
    with pytest.raises(UsageError) as refused:
        mg.Engine(strategy="single", log_dir=str(tmp_path / "run"), log_to="mlflow")
    assert str(refused.value).startswith(
        f"--log-to mlflow cannot reach the tracking server {refusing_url} (Connection refused); start the server, "
        "or set MLFLOW_TRACKING_URI to a tracking server (http://host:5000)"
    )
    assert time.monotonic() - started < trackers.REACH_TIMEOUT_S  # refused at once, not waited out


def test_a_wandb_server_that_refuses_connections_is_named_at_once_and_the_key_that_is_set_is_not_asked_for(
    tmp_path: Path, wandb_offline, monkeypatch: pytest.MonkeyPatch, refusing_url: str
) -> None:
    import wandb  # imported before the clock starts: it takes seconds on a busy machine

    monkeypatch.setenv("WANDB_MODE", "online")  # wandb_offline's isolation (W&B's files in tmp_path), but online
    monkeypatch.setenv("WANDB_BASE_URL", refusing_url)
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "3")  # W&B alone would retry for 90 s: here 3, should W&B get to it
    started = time.monotonic()
    with pytest.raises(UsageError) as refused:
        mg.Engine(strategy="single", log_dir=str(tmp_path / "run"), log_to="wandb")
    assert str(refused.value) == (
        f"--log-to wandb cannot reach the W&B server {refusing_url} (Connection refused); check the network and "
        "WANDB_BASE_URL, or set WANDB_MODE=offline to keep the run on disk and `wandb sync` it later."
    )
    assert time.monotonic() - started < trackers.REACH_TIMEOUT_S
    assert wandb.run is None


def test_a_server_that_never_answers_is_refused_after_the_timeout_before_any_worker_starts(
    tmp_path: Path, mlflow_store: str, monkeypatch: pytest.MonkeyPatch, silent_url: str
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://user:secret@{silent_url.removeprefix('http://')}/mlflow")
    monkeypatch.setattr(trackers, "REACH_TIMEOUT_S", 0.5)

    def launch(*args: Any, **kwargs: Any) -> int:
        raise AssertionError("workers were launched")

    monkeypatch.setattr(common, "launch", launch)
    config = TrainConfig(save_dir=str(tmp_path), log_to="mlflow", nproc=2)
    started = time.monotonic()
    with pytest.raises(UsageError) as refused:
        run_recipe(config, "multigpu.recipes.train", print, print)
    assert 0.5 <= time.monotonic() - started < 3
    # Named without the password its URI holds.
    assert str(refused.value).startswith(
        f"--log-to mlflow cannot reach the tracking server {silent_url}/mlflow (no answer within 0.5 s); "
    )


@pytest.mark.parametrize(
    ("failure", "advice"),
    [
        ("CommError", "cannot reach the W&B server {url} (Timed out while retrying); check the network"),
        ("AuthenticationError", "the W&B server {url} refused the API key (Timed out while retrying); log in again"),
        ("UsageError", "could not start a W&B run (Timed out while retrying); log in with `wandb login` or set"),
    ],
)
def test_a_server_that_answers_passes_and_a_wandb_run_that_cannot_start_gets_advice_that_fits(
    tmp_path: Path, wandb_offline, monkeypatch: pytest.MonkeyPatch, answering, failure: str, advice: str
) -> None:
    import wandb

    answering_url = answering(500)
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_BASE_URL", answering_url)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", answering_url)
    trackers.check_servers(["wandb", "mlflow", "tensorboard"])  # any answer counts, a 500 too

    def init(**settings: Any) -> None:
        raise getattr(wandb.errors, failure)("Timed out while retrying\nConsider increasing the init_timeout setting")

    monkeypatch.setattr(wandb, "init", init)
    with pytest.raises(UsageError) as refused:
        trackers.WandB(tmp_path, "run", print)
    assert advice.format(url=answering_url) in str(refused.value) and "\n" not in str(refused.value)


def test_a_proxy_that_could_not_reach_the_server_is_no_answer_from_it(
    mlflow_store: str, monkeypatch: pytest.MonkeyPatch, answering
) -> None:
    gateway = answering(502)  # what a proxy in between answers when the server is down
    monkeypatch.setenv("MLFLOW_TRACKING_URI", gateway)
    with pytest.raises(UsageError, match=re.escape(f"tracking server {gateway} (HTTP 502 Bad Gateway); start")):
        trackers.check_servers(["mlflow"])


# -- the process exit --------------------------------------------------------------------------------------------
def unclosed_run(log_dir: str) -> None:
    """A script's whole run, left for the process's exit to close."""
    train_a_little(Path(log_dir), log_to="wandb,mlflow")


def test_a_worker_that_never_closes_still_finishes_its_wandb_and_mlflow_runs(
    tmp_path: Path, wandb_offline, mlflow_store: str
) -> None:
    # Through multigpu's worker, which ends the process with os._exit once the exit handlers have run.
    script = tmp_path / "script.py"
    call = f"unclosed_run({str(tmp_path / 'run')!r})"
    script.write_text(f"from tests.observers.test_trackers import unclosed_run\n{call}\n")
    done = run_command(
        [sys.executable, "-m", "multigpu.launch.worker", str(script)], timeout=120, env={"PYTHONPATH": str(ROOT)}
    )
    assert done.returncode == 0, done.stdout
    run = wandb_run(tmp_path / "run")
    assert run["exited"] and dict(run["history"]) == jsonl_by_step(tmp_path / "run")
    _, mlflow = mlflow_run(mlflow_store)
    assert mlflow.info.status == "FINISHED" and mlflow.data.metrics["loss"] == run["history"][4]["loss"]


# -- choosing trackers -------------------------------------------------------------------------------------------
def test_unknown_trackers_and_trackers_without_a_log_dir_are_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"Unknown --log-to 'neptune'; name one or more of tensorboard, wandb, mlflow"):
        mg.Engine(strategy="single", log_dir=str(tmp_path), log_to="tensorboard,neptune")
    with pytest.raises(UsageError, match="--log-to ' , ' names nothing; name one or more of"):
        EngineConfig(log_dir=str(tmp_path), log_to=" , ")
    with pytest.raises(UsageError, match=r"--log-to mlflow needs --log-dir \(Engine\(log_dir=...\) in a script\)"):
        EngineConfig(log_to="jsonl,mlflow")
    assert EngineConfig(log_to="jsonl,jsonl, tensorboard").log_to  # repeats and spaces are fine
    with pytest.raises(UsageError, match="Unknown --log-to 'comet'"):  # refused before any process starts
        run_recipe(TrainConfig(save_dir=str(tmp_path), log_to="comet"), "multigpu.recipes.train", print, print)


@pytest.mark.parametrize(("tracker", "package"), [("wandb", "wandb"), ("mlflow", "mlflow-skinny")])
def test_a_missing_tracker_package_is_named_with_its_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tracker: str, package: str
) -> None:
    monkeypatch.setitem(sys.modules, tracker, None)  # `import wandb` now fails as if it were not installed
    with pytest.raises(UsageError) as refused:
        mg.Engine(strategy="single", log_dir=str(tmp_path), log_to=f"jsonl,{tracker}")
    assert str(refused.value) == (
        f"--log-to {tracker} needs the {tracker} package; install it with pip install 'multigpu[trackers]' "
        f"(or pip install {package})."
    )


def test_jsonl_alone_writes_metrics_jsonl_and_no_tensorboard(tmp_path: Path) -> None:
    train_a_little(tmp_path / "jsonl", log_to="jsonl").close()
    assert sorted(p.name for p in (tmp_path / "jsonl").iterdir()) == ["metrics.jsonl"]
    train_a_little(tmp_path / "default").close()
    assert (tmp_path / "default" / "tensorboard").is_dir()  # TensorBoard by default, as before


def test_a_run_that_ends_before_its_first_record_leaves_no_events_file(tmp_path: Path) -> None:
    """A refused resume ends before any step: an empty events file would show in TensorBoard as a run."""
    mg.Engine(strategy="single", log_dir=str(tmp_path)).close()
    assert not (tmp_path / "tensorboard").exists()


class ConfigNotes(mg.StepObserver):
    def __init__(self) -> None:
        self.configs: list[dict[str, Any]] = []
        self.closed = 0

    def on_config(self, config: Any) -> None:
        self.configs.append(dict(config))

    def on_close(self) -> None:
        self.closed += 1


def test_log_config_reaches_observers_and_is_harmless_without_a_log_dir(tmp_path: Path) -> None:
    notes = ConfigNotes()
    engine = mg.Engine(strategy="single", observers=[notes])
    engine.log_config({"lr": 0.1})
    engine.log(1, {"loss": 1.0})
    engine.close()
    assert notes.configs == [{"lr": 0.1}] and notes.closed == 1
    closed = train_a_little(tmp_path, log_to="jsonl")
    closed.close()
    closed.close()  # a second close does nothing
    with pytest.raises(UsageError, match=r"metrics log is closed \(engine.close\(\) was called\)"):
        closed.log(5, {"loss": 1.0})


def test_the_cli_and_the_recipes_map_log_to_and_run_name(tmp_path: Path) -> None:
    parser = build_parser()
    for verb in ("demo", "train", "finetune"):
        args = parser.parse_args([verb, "--log-to", "wandb,jsonl", "--run-name", "r1"])
        assert (args.log_to, args.run_name) == ("wandb,jsonl", "r1"), verb
    config = TrainConfig(save_dir=str(tmp_path / "save"), log_to="jsonl", run_name="r2", log_every=0)
    engine = recipe_engine(config)
    assert (engine.config.log_dir, engine.config.log_to, engine.config.run_name) == (config.save_dir, "jsonl", "r2")
    engine.close()
