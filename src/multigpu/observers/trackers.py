"""Where the Engine's metrics go, on the main process: metrics.jsonl in `log_dir` always, and the experiment trackers
`log_to` names (TensorBoard, Weights & Biases, MLflow), each behind the same three calls.

Every tracker gets every record metrics.jsonl gets, under the same keys and at the same step; TensorBoard and MLflow
take its numbers (they store nothing else), W&B all of it. wandb and mlflow are optional (`multigpu[trackers]`) and
imported only when asked for.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import http
import http.client
import importlib.util
import json
import os
import re
import ssl
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from multigpu.core.errors import UsageError

TRACKERS = ("tensorboard", "wandb", "mlflow", "jsonl")  # jsonl: metrics.jsonl, written whenever log_dir is set
NEEDS_PACKAGE = {"wandb": "wandb", "mlflow": "mlflow-skinny"}  # tracker -> the pip package that provides it
DEFAULT_PROJECT = "multigpu"  # W&B project and MLflow experiment unless WANDB_PROJECT / MLFLOW_EXPERIMENT_* say
REACH_TIMEOUT_S = 5.0  # how long a tracker's server may take to answer before the run is refused


def parse_log_to(log_to: str, log_dir: str | None) -> tuple[str, ...]:
    """The trackers `log_to` names (comma-separated, repeats allowed), checked; wandb and mlflow need a log_dir."""
    names = [name.strip() for name in log_to.split(",") if name.strip()]
    unknown = [name for name in names if name not in TRACKERS]
    if unknown or not names:
        wrong = f"Unknown --log-to {', '.join(map(repr, unknown))}" if unknown else f"--log-to {log_to!r} names nothing"
        raise UsageError(
            f"{wrong}; name one or more of {', '.join(TRACKERS)}, comma-separated (jsonl alone: metrics.jsonl only)."
        )
    remote = [name for name in names if name in NEEDS_PACKAGE]
    if remote and log_dir is None:
        raise UsageError(
            f"--log-to {remote[0]} needs --log-dir (Engine(log_dir=...) in a script), the folder for metrics.jsonl "
            "and the tracker's local files; pass one."
        )
    return tuple(dict.fromkeys(names))


# -- can the trackers' servers be reached? -------------------------------------------------------------------------
def check_servers(log_to: Sequence[str]) -> None:
    """Refuses, within seconds, a tracker of `log_to` whose server does not answer (W&B's, unless offline; MLflow's
    when its tracking URI is http or https), naming the server: W&B and MLflow would retry for minutes first.

    Called where the trackers are about to be opened (the main process alone: the other workers never open them)
    and by the launcher's checks, before any worker starts.
    """
    for tracker in log_to:
        server = SERVERS[tracker]() if tracker in SERVERS else None
        if server is None:
            continue
        server = shown(server)  # asked without credentials: any answer, a refusal of them too, will do
        problem = unreachable(server)
        if problem is not None:
            raise UsageError(unreachable_server(tracker, server, problem))


def wandb_server() -> str | None:
    """The W&B server runs will talk to (WANDB_BASE_URL, `wandb login --host`, else W&B's default), or None when
    runs stay on disk (WANDB_MODE offline or disabled, or `wandb offline`): read as wandb.init reads it."""
    try:
        import wandb
    except ImportError:
        raise missing_package("wandb") from None
    settings = wandb.sdk.wandb_setup.singleton().settings  # loads the settings; starts no W&B process
    return None if settings.mode in ("offline", "dryrun", "disabled") else settings.base_url


def mlflow_server() -> str | None:
    """MLflow's tracking URI when it is a server (http or https; local stores need no network): the one a script
    set with mlflow.set_tracking_uri, else MLFLOW_TRACKING_URI."""
    mlflow = sys.modules.get("mlflow")  # imported only if the script did: importing it takes seconds
    uri = mlflow.get_tracking_uri() if mlflow is not None else os.environ.get("MLFLOW_TRACKING_URI", "")
    return uri if urllib.parse.urlsplit(uri).scheme in ("http", "https") else None


SERVERS: dict[str, Callable[[], str | None]] = {"wandb": wandb_server, "mlflow": mlflow_server}
WANDB_OFFLINE = "set WANDB_MODE=offline to keep the run on disk and `wandb sync` it later"


def unreachable_server(tracker: str, server: str, problem: str) -> str:
    """The sentence for a tracker whose server did not answer."""
    if tracker == "wandb":
        return (
            f"--log-to wandb cannot reach the W&B server {server} ({problem}); check the network and WANDB_BASE_URL, "
            f"or {WANDB_OFFLINE}."
        )
    return (
        f"--log-to mlflow cannot reach the tracking server {server} ({problem}); start the server, or {MLFLOW_STORES}."
    )


def shown(url: str) -> str:
    """`url` without the user name and password it may hold, for a message."""
    parts = urllib.parse.urlsplit(url)
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()


def unreachable(url: str) -> str | None:
    """Why nothing at `url` answers an HTTP request within REACH_TIMEOUT_S, in a few words, or None once anything
    answers, with any status. The environment's proxies apply, as they do for W&B and MLflow.

    The request runs in a thread of its own, so that the name lookup, which no socket timeout bounds, is bounded
    too: a thread still waiting past the time is left behind (a daemon: it cannot delay the exit).
    """
    timeout_s = REACH_TIMEOUT_S
    outcome: list[str | None] = []
    probe = threading.Thread(target=lambda: outcome.append(request_problem(url, timeout_s)), daemon=True)
    probe.start()
    probe.join(timeout_s)
    return outcome[0] if outcome else f"no answer within {timeout_s:g} s"


GATEWAY_FAILURES = (http.HTTPStatus.BAD_GATEWAY, http.HTTPStatus.GATEWAY_TIMEOUT)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # a redirect is an answer: the server is there


def request_problem(url: str, timeout_s: float) -> str | None:
    """What stopped a GET of `url` from being answered, or None when it was answered (any status)."""
    try:
        urllib.request.build_opener(_NoRedirect).open(url, timeout=timeout_s).close()
    except urllib.error.HTTPError as error:
        # Any status is the server's answer, but a gateway's 502 or 504: a proxy in between could not reach it.
        return f"HTTP {error.code} {error.reason}" if error.code in GATEWAY_FAILURES else None
    except urllib.error.URLError as error:
        if isinstance(error.reason, ssl.SSLError):
            return None  # the server answered; whether its certificate is trusted is the tracker client's matter
        return failure(error.reason, timeout_s)
    except (OSError, http.client.HTTPException, ValueError) as error:
        return failure(error, timeout_s)
    return None


def failure(error: BaseException | str, timeout_s: float) -> str:
    """`error` in a few words: the OS's, where it has them."""
    if isinstance(error, TimeoutError):
        return f"no answer within {timeout_s:g} s"
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return str(error) or type(error).__name__


class Tracker:
    """One destination of the run's metrics and configuration."""

    def write(self, step: int, record: Mapping[str, Any]) -> None:
        """One record the run logged at optimizer step `step`, as metrics.jsonl has it."""

    def log_config(self, config: Mapping[str, Any]) -> None:
        """The run's settings: nested mappings of plain values; a later call adds to (or updates) earlier ones."""

    def close(self) -> None:
        """The run is over: flush and finish."""


def numbers(record: Mapping[str, Any]) -> Iterator[tuple[str, float]]:
    """The record's numeric values (bools left out, as JSON writes them true/false); a list of numbers (one per
    rank, as batch_shares) as one value per item, `key/0`, `key/1`, ..."""
    for key, value in record.items():
        if isinstance(value, list):
            yield from numbers({f"{key}/{i}": item for i, item in enumerate(value)})
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield key, value


class JsonLines(Tracker):
    def __init__(self, directory: Path) -> None:
        self._file = (directory / "metrics.jsonl").open("a")

    def write(self, step: int, record: Mapping[str, Any]) -> None:
        self._file.write(json.dumps({"step": step, **record}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoard(Tracker):
    """Events under log_dir/tensorboard. The writer is made at the first record, since making one writes an events
    file: a run refused before its first step leaves none (an empty file would show as a run with no data)."""

    def __init__(self, directory: Path, run_name: str, say: Callable[[str], None]) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only where metrics are written

        self._open = functools.partial(SummaryWriter, str(directory / "tensorboard"))
        self._writer: Any = None

    def write(self, step: int, record: Mapping[str, Any]) -> None:
        self._writer = self._writer or self._open()
        for key, value in numbers(record):
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def missing_package(tracker: str) -> UsageError:
    return UsageError(
        f"--log-to {tracker} needs the {tracker} package; install it with pip install 'multigpu[trackers]' "
        f"(or pip install {NEEDS_PACKAGE[tracker]})."
    )


class WandB(Tracker):
    """A W&B run, named `run_name`, in WANDB_PROJECT (else "multigpu"); WANDB_MODE, WANDB_API_KEY, WANDB_DIR,
    WANDB_ENTITY and W&B's other variables apply as usual. Its local files go to log_dir/wandb unless WANDB_DIR."""

    def __init__(self, directory: Path, run_name: str, say: Callable[[str], None]) -> None:
        try:
            import wandb
        except ImportError:
            raise missing_package("wandb") from None
        try:
            # create_new: a run the script started itself stays open beside this one.
            self._run = wandb.init(
                project=os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
                name=run_name,
                dir=None if os.environ.get("WANDB_DIR") else str(directory),
                reinit="create_new",
            )
        except wandb.errors.Error as error:
            raise UsageError(wandb_refusal(error, wandb_server() or "")) from error

    def write(self, step: int, record: Mapping[str, Any]) -> None:
        self._run.log(dict(record), step=step)  # None is kept (as JSON null), as in metrics.jsonl

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._run.config.update(dict(config), allow_val_change=True)

    def close(self) -> None:
        # The exit code is W&B's own guess (it hooks sys.exit and the excepthook): a crashed run shows as failed.
        self._run.finish()


def wandb_refusal(error: Exception, server: str) -> str:
    """The sentence for a W&B run that could not start: a key to fix only where the key was the trouble."""
    import wandb

    said = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if isinstance(error, wandb.errors.AuthenticationError):
        return (
            f"--log-to wandb: the W&B server {shown(server)} refused the API key ({said}); log in again with "
            f"`wandb login --relogin` or set WANDB_API_KEY to a valid key, or {WANDB_OFFLINE}."
        )
    if isinstance(error, wandb.errors.CommError):  # no answer, after W&B's retries until its init_timeout
        return unreachable_server("wandb", shown(server), said)
    return (
        f"--log-to wandb could not start a W&B run ({said}); log in with `wandb login` or set WANDB_API_KEY, "
        f"or {WANDB_OFFLINE}."
    )


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"engine": {"seed": 0}} -> {"engine.seed": 0}."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


MLFLOW_STORES = (
    "set MLFLOW_TRACKING_URI to a tracking server (http://host:5000), to sqlite:///mlflow.db after pip install "
    "mlflow, or to a folder (file:./mlruns) together with MLFLOW_ALLOW_FILE_STORE=true"
)


def store_problem(uri: str, error: Exception) -> str:
    """What went wrong opening MLflow's store at `uri`, in a few words."""
    database = uri.split(":", 1)[0].split("+", 1)[0] in ("sqlite", "postgresql", "mysql", "mssql")
    if database and importlib.util.find_spec("sqlalchemy") is None:
        # MLflow itself says "Model registry functionality is unavailable", which points the wrong way.
        return "a database store needs sqlalchemy, which mlflow-skinny does not install"
    text = str(error).strip()
    if "MLFLOW_ALLOW_FILE_STORE" in text:  # MLflow's sentence about it is long and ends in the part that matters
        return "MLflow 3 opens a folder store only with MLFLOW_ALLOW_FILE_STORE=true"
    line = text.splitlines()[0] if text else type(error).__name__
    return line if len(line) <= 200 else line[:200] + "..."


class MLflow(Tracker):
    """An MLflow run, named `run_name`, in MLFLOW_EXPERIMENT_ID or MLFLOW_EXPERIMENT_NAME (else "multigpu"), in the
    tracking store MLflow resolves (MLFLOW_TRACKING_URI): the config as params, the numbers as metrics."""

    def __init__(self, directory: Path, run_name: str, say: Callable[[str], None]) -> None:
        try:
            import mlflow
            from mlflow.entities import Metric, Param
            from mlflow.environment_variables import MLFLOW_EXPERIMENT_ID, MLFLOW_EXPERIMENT_NAME
            from mlflow.tracking import MlflowClient
            from mlflow.tracking.context.registry import resolve_tags
            from mlflow.utils import validation
        except ImportError:
            raise missing_package("mlflow") from None
        self._metric, self._param, self._limits, self._say = Metric, Param, validation, say
        uri = mlflow.get_tracking_uri()
        try:  # the store is opened here, so that a store that cannot work stops the run before it trains
            self._client = client = MlflowClient()
            experiment_id = MLFLOW_EXPERIMENT_ID.get()
            if experiment_id is None:
                name = MLFLOW_EXPERIMENT_NAME.get() or DEFAULT_PROJECT
                found = client.get_experiment_by_name(name)
                experiment_id = found.experiment_id if found is not None else client.create_experiment(name)
            self._run_id = client.create_run(experiment_id, run_name=run_name, tags=resolve_tags()).info.run_id
        except Exception as error:  # MLflow raises many kinds (no sqlalchemy, file store refused, no server)
            raise UsageError(
                f"--log-to mlflow could not open the tracking store {uri} ({store_problem(uri, error)}); "
                f"{MLFLOW_STORES}."
            ) from error
        self._params: dict[str, str] = {}
        self._renamed: dict[str, str] = {}

    def write(self, step: int, record: Mapping[str, Any]) -> None:
        now = int(time.time() * 1000)
        metrics = [self._metric(self._key(key), float(value), now, step) for key, value in numbers(record)]
        if metrics:
            self._client.log_batch(self._run_id, metrics=metrics)

    def _key(self, key: str) -> str:
        """`key`, or a name MLflow takes, said once: it refuses characters other than letters, digits and _-./: ."""
        if key not in self._renamed:
            name = re.sub(r"[^\w\-./ :]", "_", key)
            if name != key:
                self._say(f"MLflow metric {key!r} is logged as {name!r} (MLflow refuses some of its characters)")
            self._renamed[key] = name
        return self._renamed[key]

    def log_config(self, config: Mapping[str, Any]) -> None:
        flat = {key: str(value) for key, value in flatten(config).items()}
        changed = [key for key, value in flat.items() if self._params.get(key, value) != value]
        if changed:
            key = changed[0]
            raise UsageError(
                f"MLflow params cannot change once logged, and {key!r} was {self._params[key]!r}, now {flat[key]!r}; "
                "log a changed setting under a new name."
            )
        new = {key: value for key, value in flat.items() if key not in self._params}
        self._params.update(new)
        limit = self._limits.MAX_PARAM_VAL_LENGTH
        long = [key for key, value in new.items() if len(value) > limit]
        params = [self._param(key, value[:limit]) for key, value in new.items()]
        if params:
            self._client.log_batch(self._run_id, params=params)  # the client splits it into MLflow's batch limits
        if long:  # nothing is lost: the whole values go to an artifact beside the params
            self._client.log_dict(self._run_id, {key: new[key] for key in long}, "long_params.json")
            self._say(
                f"MLflow params {', '.join(long)} are longer than MLflow's {limit} characters: cut there, and whole "
                "in the run's artifact long_params.json"
            )

    def close(self) -> None:
        self._client.set_terminated(self._run_id, "FINISHED")


OPEN: dict[str, Callable[[Path, str, Callable[[str], None]], Tracker]] = {
    "tensorboard": TensorBoard,
    "wandb": WandB,
    "mlflow": MLflow,
}


class MetricsLog:
    """metrics.jsonl in `directory` and the trackers `log_to` names, written alike; main process only.

    Closed by `close` (engine.close) or, failing that, at exit, before W&B's own exit handlers (registered earlier,
    so they run later) stop its service and before a multigpu worker ends the process.
    """

    def __init__(
        self,
        directory: Path,
        log_to: Sequence[str] = ("tensorboard",),
        run_name: str | None = None,
        say: Callable[[str], None] = print,
    ) -> None:
        check_servers(log_to)  # before any tracker opens: W&B and MLflow would retry for minutes
        directory.mkdir(parents=True, exist_ok=True)
        run_name = run_name or directory.resolve().name
        self._closing = contextlib.ExitStack()
        self._trackers: list[Tracker] = []
        opening = [lambda: JsonLines(directory)]
        opening += [lambda make=OPEN[name]: make(directory, run_name, say) for name in OPEN if name in log_to]
        try:
            for open_one in opening:
                tracker = open_one()
                self._trackers.append(tracker)
                self._closing.callback(tracker.close)
        except BaseException:
            self._closing.close()  # those already open: a W&B run left open would hold its service until exit
            raise
        self._closed = False
        atexit.register(self.close)

    def write(self, step: int, record: Mapping[str, Any]) -> None:
        self._check_open()
        for tracker in self._trackers:
            tracker.write(step, record)

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._check_open()
        for tracker in self._trackers:
            tracker.log_config(config)

    def _check_open(self) -> None:
        if self._closed:
            raise UsageError("The run's metrics log is closed (engine.close() was called); log before closing it.")

    def close(self) -> None:
        """Flushes and finishes every tracker (all of them, even if one fails); a second call does nothing."""
        if not self._closed:
            self._closed = True
            atexit.unregister(self.close)
            self._closing.close()
