"""Experiment tracking with MLflow, from rank 0 only.

Every rank of a job runs the same code; if each one logged, one experiment would show N runs
(or N copies of each metric) and the SQLite store would be written by N processes at once.
``start`` therefore returns a real run on rank 0 and a silent stand-in on the other ranks, so
the training code calls the same methods everywhere.

Where runs go (``default_uri``):

* ``MLFLOW_TRACKING_URI`` if it is set (MLflow 3's ``set_tracking_uri`` sets it too, so the
  last store used in this process stays the default);
* ``databricks`` on Databricks (experiments are workspace paths, ``/Users/<you>/dtlab-<name>``: your own
  folder, which every workspace has for every user, never ``/Shared``, which all users can change);
* otherwise a SQLite file ``mlflow.db`` in the current folder, artifacts beside it.

``local_server`` starts an MLflow tracking server bound to 127.0.0.1 for a UI or for
several machines' worth of logging. Only APIs present in both MLflow 2.13 (Databricks Runtime
15.4 LTS ML) and MLflow 3 are used; newer keywords are passed only where they exist.

>>> with start("ddp-digits", params={"lr": 0.1}) as run:       # doctest: +SKIP
...     run.log_metrics({"loss": 0.5}, step=1)
...     uri = run.log_model(model)
"""

from __future__ import annotations

import inspect
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from dtlab.processes import stop_group


class TrackingError(RuntimeError):
    """The tracking store cannot be used; the message names the cause and the fix."""


def on_databricks() -> bool:
    """True inside a Databricks runtime."""
    return "DATABRICKS_RUNTIME_VERSION" in os.environ


def default_uri(directory: str | os.PathLike = ".") -> str:
    """The tracking URI to use when none is given (see the module docstring)."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    if on_databricks():
        return "databricks"
    return f"sqlite:///{Path(directory).resolve() / 'mlflow.db'}"


def experiment_path(name: str) -> str:
    """Databricks needs workspace paths for experiments; elsewhere the name is used as is.

    On Databricks a bare name becomes ``/Users/<you>/dtlab-<name>``, in the folder of the user (or service
    principal) the notebook or job runs as (``databricks_user``): the workspace refuses to create an
    experiment in a folder that does not exist (``RESOURCE_DOES_NOT_EXIST``), every identity has its own
    folder, and in a workspace shared with colleagues nobody else can change its runs (``/Shared``, which
    every user may write to, is not used). A name that already is a path (``/Users/you@example.com/my-exp``,
    ``/Shared/team/exp``) is used as given: its folder must exist.
    """
    return f"/Users/{databricks_user()}/dtlab-{name}" if on_databricks() and not name.startswith("/") else name


def databricks_user() -> str:
    """The workspace user name (or service principal's application id) this notebook or job runs as.

    ``DTLAB_DATABRICKS_USER`` when set (``worker_env`` passes it to launched workers); otherwise the
    workspace's answer to "who am I" (SCIM ``/api/2.0/preview/scim/v2/Me``) with ``databricks_credentials()``,
    remembered in ``DTLAB_DATABRICKS_USER`` for this process and the ones it starts.

    Raises:
        TrackingError: the workspace cannot be asked, naming the fix.
    """
    import json

    if os.environ.get("DTLAB_DATABRICKS_USER"):
        return os.environ["DTLAB_DATABRICKS_USER"]
    host, token = databricks_credentials()
    request = urllib.request.Request(f"{host}/api/2.0/preview/scim/v2/Me", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            name = json.loads(response.read())["userName"]
    except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
        raise TrackingError(f"cannot ask the workspace who runs this ({exc}), to put experiments in your folder. Fix: "
                            "name the experiment with its full path, e.g. /Users/<you>/<name>, or set "
                            "DTLAB_DATABRICKS_USER") from None
    os.environ["DTLAB_DATABRICKS_USER"] = name
    return name


def check_uri(uri: str, timeout: float = 3.0) -> str:
    """Fail fast, with the fix, when ``uri`` cannot work; return it unchanged when it can.

    A server that is down would otherwise surface as retries and a stack of HTTP errors minutes
    into training, possibly after rank 0 has already trained and cannot log.
    """
    parsed = urlparse(uri)
    local_fix = "or unset MLFLOW_TRACKING_URI to log to a SQLite file in this folder"
    if parsed.scheme == "sqlite":
        db = _sqlite_file(uri)
        if str(db) not in ("", ":memory:", ".") and not db.parent.is_dir():
            raise TrackingError(f"MLflow store {uri}: folder {db.parent} does not exist. "
                                f"Fix: create it (os.makedirs({str(db.parent)!r})) {local_fix}.")
    elif parsed.scheme in ("http", "https"):
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout) as response:
                response.read()
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            raise TrackingError(f"cannot reach the MLflow tracking server at {uri} ({reason}). Fix: start it "
                                "(dtlab.tracking.local_server() or `mlflow server --host 127.0.0.1 --port 5000`), "
                                f"correct the address, {local_fix}.") from None
    elif uri.startswith("databricks") and not on_databricks():
        if not (os.environ.get("DATABRICKS_HOST") or Path.home().joinpath(".databrickscfg").exists()):
            raise TrackingError(f"tracking URI {uri!r} needs Databricks credentials, and none are set here. "
                                "Fix: run on Databricks, set DATABRICKS_HOST and DATABRICKS_TOKEN (from a secret), "
                                f"{local_fix}.")
    return uri


def _sqlite_file(uri: str) -> Path:
    """The database file of a ``sqlite:///relative`` or ``sqlite:////absolute`` URI, as SQLAlchemy reads it.

    Three slashes and a name is a path relative to the working directory (``sqlite:///mlflow.db`` is
    ``./mlflow.db``, not ``/mlflow.db``); four slashes start an absolute path.
    """
    path = urlparse(uri).path  # "/mlflow.db" for three slashes, "//abs/mlflow.db" for four
    if path in ("", "/", "/:memory:"):
        return Path(":memory:") if path == "/:memory:" else Path("")
    return Path(path[1:]).absolute()


class Run:
    """One tracked run. On ranks other than 0 (``active`` is False) every method does nothing.

    Use it as a context manager, or call ``end()``: an exception inside the ``with`` block marks
    the run FAILED, so crashed runs are visible in the store rather than left "RUNNING".
    """

    def __init__(self, experiment: str, run_name: str | None = None, params: dict[str, Any] | None = None,
                 uri: str | None = None, system_metrics: bool = True, active: bool = True):
        self.active, self.run_id, self.uri, self.ended = active, None, None, False
        if not active:
            return
        import mlflow

        for chatty in ("mlflow.system_metrics", "mlflow.store.db.utils", "mlflow.tracking.fluent", "alembic"):
            logging.getLogger(chatty).setLevel(logging.WARNING)  # keep workers' output to what matters
        self.uri = check_uri(uri or default_uri())
        mlflow.set_tracking_uri(self.uri)
        name = experiment_path(experiment)
        experiment_id = _experiment_id(name, self.uri)
        kwargs: dict[str, Any] = {"experiment_id": experiment_id, "run_name": run_name}
        if system_metrics and "log_system_metrics" in inspect.signature(mlflow.start_run).parameters:
            if hasattr(mlflow, "set_system_metrics_sampling_interval"):
                mlflow.set_system_metrics_sampling_interval(1)
            kwargs["log_system_metrics"] = True  # CPU, memory, GPU use while the run is open
        self._run = mlflow.start_run(**kwargs)
        self.run_id = self._run.info.run_id
        if params:
            self.log_params(params)

    def log_params(self, params: dict[str, Any]) -> None:
        """Hyper-parameters (strings, numbers); logged once per run."""
        if self.active:
            import mlflow

            mlflow.log_params(params)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Numbers that change during training, e.g. ``{"loss": 0.41}`` at ``step``."""
        if self.active:
            import mlflow

            mlflow.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)

    def log_figure(self, figure: Any, name: str) -> None:
        """A matplotlib figure, stored as an image artifact (e.g. ``"loss.png"``)."""
        if self.active:
            import mlflow

            mlflow.log_figure(figure, name)

    def log_artifact(self, path: str | os.PathLike) -> None:
        """Any file (a config, a checkpoint, a report)."""
        if self.active:
            import mlflow

            mlflow.log_artifact(str(path))

    def log_model(self, model: Any, name: str = "model", input_example: Any = None,
                  output_example: Any = None) -> str | None:
        """Log a PyTorch model (pickle format, named explicitly) and return its URI for ``load_model``.

        MLflow 3 defaults to a torch.export format off Databricks and to pickle on it; saying
        ``pickle`` makes the model load back as the same ``nn.Module`` class everywhere (the
        class must be importable, as dtlab's models are).

        With ``input_example`` (a numpy array, what a caller would send) and ``output_example`` (what the model
        returns for it), the model gets a signature and an example: a model registered in Unity Catalog must
        have a signature (``register`` refuses one without). Given only the input, the output is the model's own
        on it.
        """
        if not self.active:
            return None
        import mlflow.pytorch

        params = inspect.signature(mlflow.pytorch.log_model).parameters
        kwargs: dict[str, Any] = {"pip_requirements": ["torch"]}
        if "serialization_format" in params:  # MLflow 3; 2.13 always pickles
            kwargs["serialization_format"] = "pickle"
        if "name" in params:  # MLflow 3 renamed artifact_path to name
            kwargs["name"] = name
        else:
            kwargs["artifact_path"] = name
        if input_example is not None:
            kwargs["signature"] = signature_of(model, input_example, output_example)
            kwargs["input_example"] = input_example
        info = mlflow.pytorch.log_model(model, **kwargs)
        return info.model_uri

    def end(self, status: str = "FINISHED") -> None:
        """Close the run (``FINISHED`` or ``FAILED``)."""
        if self.active and not self.ended:
            import mlflow

            mlflow.end_run(status=status)
            self.ended = True  # run_id stays, for queries after the run

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.end("FAILED" if exc_type else "FINISHED")


def _experiment_id(name: str, uri: str) -> str:
    """The experiment's id, created with its artifacts next to a SQLite store (not in the cwd)."""
    import mlflow

    experiment = mlflow.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    location = None
    if uri.startswith("sqlite:///"):
        location = (_sqlite_file(uri).parent / "mlartifacts").resolve().as_uri()
    try:
        return mlflow.create_experiment(name, artifact_location=location)
    except Exception:  # another process created it in the meantime
        experiment = mlflow.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id


def start(experiment: str, run_name: str | None = None, params: dict[str, Any] | None = None,
          uri: str | None = None, system_metrics: bool = True, every_rank: bool = False) -> Run:
    """Open a run on rank 0 (a silent stand-in elsewhere); see ``Run``.

    ``every_rank=True`` logs from every rank: only for showing why not to.
    """
    from dtlab import distributed

    return Run(experiment, run_name, params, uri, system_metrics, active=every_rank or distributed.is_main())


def runs(experiment: str, uri: str | None = None) -> Any:
    """All runs of ``experiment`` as a pandas DataFrame (``mlflow.search_runs``), newest first."""
    import mlflow

    mlflow.set_tracking_uri(check_uri(uri or default_uri()))
    return mlflow.search_runs(experiment_names=[experiment_path(experiment)], order_by=["start_time DESC"])


def load_model(model_uri: str, uri: str | None = None) -> Any:
    """Load a model logged with ``Run.log_model`` (as the same ``nn.Module`` class)."""
    import mlflow.pytorch

    mlflow.set_tracking_uri(check_uri(uri or default_uri()))
    return mlflow.pytorch.load_model(model_uri)


def signature_of(model: Any, input_example: Any, output_example: Any = None) -> Any:
    """MLflow's ``ModelSignature`` for ``model`` called on ``input_example`` (numpy): the input's and the output's
    types and shapes (the batch dimension left open). ``output_example`` defaults to the model's own output."""
    import numpy as np
    import torch
    from mlflow.models import infer_signature

    if output_example is None:
        with torch.no_grad():
            output_example = model(torch.as_tensor(input_example))
    if torch.is_tensor(output_example):
        output_example = output_example.detach().cpu().numpy()
    return infer_signature(np.asarray(input_example), np.asarray(output_example))


def registry_name(name: str, catalog: str | None = None, schema: str | None = None) -> str:
    """The name to register ``name`` under: ``catalog.schema.name`` in Unity Catalog (both given), else ``name``."""
    if bool(catalog) != bool(schema):
        raise TrackingError(f"catalog={catalog!r}, schema={schema!r}: a Unity Catalog model needs both. Fix: give "
                            "both (catalog.schema.model), or neither to use the tracking server's registry")
    return f"{catalog}.{schema}.{name}" if catalog else name


def registry_for(catalog: str | None = None, schema: str | None = None) -> str | None:
    """The model registry to register in: Unity Catalog's (``"databricks-uc"``) with a catalog and schema; off
    Databricks without them, the tracking store's own (None).

    Raises:
        TrackingError: on Databricks without a catalog and schema. The legacy Workspace Model Registry, the only
        other one there, is disabled in accounts created since April 2024 and has no aliases, so it is not used;
        the message names the parameters.
    """
    if catalog or schema:
        registry_name("x", catalog, schema)                   # both or neither
        return "databricks-uc"
    if on_databricks():
        raise TrackingError("on Databricks a model is registered in Unity Catalog, and no catalog and schema are "
                            "given (the legacy Workspace Model Registry is disabled in accounts created since April "
                            "2024). Fix: set the parameters 'catalog' and 'schema' to a schema where you hold "
                            "CREATE MODEL")
    return None


def register(model_uri: str, name: str, alias: str | None = None, registry_uri: str | None = None) -> int:
    """Register the logged model at ``model_uri`` as a new version of ``name``; point ``alias`` at it where the
    registry takes aliases (``aliases_supported``); return the version.

    ``registry_uri`` ``"databricks-uc"`` registers in Unity Catalog (``name`` then is ``catalog.schema.model``:
    ``registry_name``); by default the tracking store's own registry. Load it back anywhere with
    ``load_model(f"models:/{name}@{alias}")``.

    Raises:
        TrackingError: the model has no signature (Unity Catalog refuses it; the fix: log it with an input
        example), or a Unity Catalog name that is not three-level.
    """
    import mlflow
    from mlflow import MlflowClient

    if registry_uri:
        mlflow.set_registry_uri(registry_uri)
    if (mlflow.get_registry_uri() or "").startswith("databricks-uc") and name.count(".") != 2:
        # MLflow 3 on Databricks registers in Unity Catalog by default
        raise TrackingError(f"{name!r} is not a Unity Catalog model name, and the registry is Unity Catalog's. Fix: "
                            "catalog.schema.model (dtlab.tracking.registry_name(name, catalog, schema))")
    info = mlflow.models.get_model_info(model_uri)
    if info.signature is None:
        raise TrackingError(f"{model_uri} was logged without a signature, and a model registered in Unity Catalog "
                            "must have one. Fix: log it with an example of its input, run.log_model(model, "
                            "input_example=x) (the signature is inferred from it), then register that")
    version = mlflow.register_model(model_uri, name)
    if alias and aliases_supported():
        MlflowClient().set_registered_model_alias(name, alias, version.version)
    return int(version.version)


def aliases_supported() -> bool:
    """Whether the registry in use takes aliases: Unity Catalog and MLflow's own registry do; Databricks' legacy
    Workspace Model Registry (registry URI ``databricks``) refuses them, so there load ``models:/<name>/<version>``."""
    import mlflow

    registry = mlflow.get_registry_uri() or ""
    return not (registry.startswith("databricks") and not registry.startswith("databricks-uc"))


def databricks_credentials() -> tuple[str, str]:
    """The workspace URL and an API token for processes this notebook starts, on Databricks.

    In order: ``DATABRICKS_HOST`` and ``DATABRICKS_TOKEN`` when both are set (a job's ``spark_env_vars``
    from a secret scope, or a service principal's); otherwise the notebook's context: its ``apiUrl`` and
    ``apiToken`` (present in interactive notebooks and in job runs alike; ``browserHostName``, which
    earlier code read, is absent in job runs and gave hosts of ``https://None``). The context's token is
    short-lived (about an hour), enough for a lesson's workers.

    Raises:
        TrackingError: no host or no token can be found, naming the fix (never a host of ``https://None``).
    """
    host, token = os.environ.get("DATABRICKS_HOST", ""), os.environ.get("DATABRICKS_TOKEN", "")
    if not (host and token):
        context = _notebook_context()
        host = host or _usable(getattr(context, "apiUrl", None)) or _usable(getattr(context, "workspaceUrl", None))
        token = token or _usable(getattr(context, "apiToken", None))
    if not host or not token:
        missing = " and ".join(n for n, v in (("a workspace host", host), ("an API token", token)) if not v)
        raise TrackingError(f"workers cannot log to Databricks: {missing} could not be found (no DATABRICKS_HOST / "
                            "DATABRICKS_TOKEN, and the notebook context has none). Fix: run this from a notebook or "
                            "notebook task, or give the job DATABRICKS_HOST and DATABRICKS_TOKEN from a secret scope "
                            "(spark_env_vars: {DATABRICKS_TOKEN: \"{{secrets/<scope>/<key>}}\"}).")
    if not host.startswith(("http://", "https://")):
        host = f"https://{host}"
    return host.rstrip("/"), token


def _usable(value: Any) -> str:
    """A context field as text: Databricks' fields may be strings, Scala Options (``.get()``) or None."""
    if callable(value):
        try:
            value = value()
        except Exception:
            return ""
    if hasattr(value, "isDefined"):
        value = value.get() if value.isDefined() else None
    text = "" if value is None else str(value)
    return "" if text.lower() in ("", "none", "null") else text


def _notebook_context() -> Any:
    """The notebook's context on Databricks (``dbruntime``'s REPL context), or None."""
    try:
        from dbruntime.databricks_repl_context import get_context  # Databricks Runtime 13 and later

        return get_context()
    except Exception:  # not on Databricks, or a Python task without a notebook
        return None


def worker_env(uri: str | None = None) -> dict[str, str]:
    """Environment variables that let launched workers log to the same store.

    Workers inherit ``os.environ``, not ``mlflow.set_tracking_uri``. On Databricks (tracking URI
    ``databricks``), workers also need the workspace host and a token: ``databricks_credentials``
    finds them (never written into code or files), or raises ``TrackingError`` naming the fix.
    """
    uri = uri or default_uri()
    env = {"MLFLOW_TRACKING_URI": uri}
    if uri.startswith("databricks"):
        env["DATABRICKS_HOST"], env["DATABRICKS_TOKEN"] = databricks_credentials()
        env["DTLAB_DATABRICKS_USER"] = databricks_user()
    return env


@contextmanager
def local_server(directory: str | os.PathLike = ".", port: int | None = None, timeout: float = 60.0):
    """Run ``mlflow server`` bound to 127.0.0.1 (not reachable from other machines) while the block runs.

    Yields the server's URI (``http://127.0.0.1:PORT``). The store is ``mlflow.db`` in
    ``directory``, artifacts are served from ``directory/mlartifacts``.
    """
    from dtlab.distributed import free_port

    directory = Path(directory).resolve()
    port = port or free_port()
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
           "--backend-store-uri", f"sqlite:///{directory / 'mlflow.db'}",
           "--artifacts-destination", str(directory / "mlartifacts"), "--workers", "1"]
    log = open(directory / "mlflow-server.log", "w")
    # Its own process group: `mlflow server` starts worker processes, and all of them must stop with it.
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                check_uri(uri, timeout=1.0)
                break
            except TrackingError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise TrackingError(f"mlflow server did not start (exit {server.poll()}); see "
                                        f"{directory / 'mlflow-server.log'}") from None
                time.sleep(0.5)
        yield uri
    finally:
        stop_group(server)
        log.close()


def port_is_open(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something listens on ``host:port`` (used to show the server bound to localhost only)."""
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0
