"""MLflow tracking against a real SQLite store (and a real local server): rank 0 logs, others do not."""

import os
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from dtlab import distributed, launch, models, tracking  # noqa: E402

pytestmark = pytest.mark.cluster  # code a cluster runs: make test-runtime repeats these on its stack


def _log_from_every_rank(uri, every_rank):
    distributed.setup()
    with tracking.start("ranks", run_name=f"every_rank={every_rank}", params={"world": distributed.world_size()},
                        uri=uri, system_metrics=False, every_rank=every_rank) as run:
        for step in range(3):
            run.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
        return run.active


@pytest.mark.slow
def test_only_rank_0_logs_unless_told_otherwise(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert launch.run(_log_from_every_rank, uri, False, nprocs=2) == [True, False]
    assert len(tracking.runs("ranks", uri)) == 1
    launch.run(_log_from_every_rank, uri, True, nprocs=2)
    table = tracking.runs("ranks", uri)
    assert sorted(table["tags.mlflow.runName"]) == ["every_rank=False", "every_rank=True", "every_rank=True"]
    assert set(table["metrics.loss"]) == {1.0 / 3}


@pytest.mark.slow
def test_params_metrics_figures_and_the_model_round_trip(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default store is ./mlflow.db
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # MLflow 3's set_tracking_uri also sets it
    torch.manual_seed(0)
    model = models.MLP(8, 16, 3, depth=1)
    fig, ax = plt.subplots()
    ax.plot([3, 2, 1])
    with tracking.start("round-trip", params={"lr": 0.1, "hidden": 16}) as run:
        run.log_metrics({"loss": 0.5, "acc": 0.8}, step=7)
        run.log_figure(fig, "loss.png")
        model_uri = run.log_model(model)
    plt.close(fig)
    assert (tmp_path / "mlflow.db").exists() and list(tmp_path.glob("mlartifacts/*/*"))
    row = tracking.runs("round-trip").iloc[0]
    assert row["params.lr"] == "0.1" and row["metrics.acc"] == 0.8 and row["status"] == "FINISHED"
    loaded = tracking.load_model(model_uri)
    x = torch.randn(4, 8)
    assert type(loaded) is models.MLP and torch.equal(loaded(x), model(x))


@pytest.mark.slow
def test_a_run_that_raises_is_marked_failed(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.raises(ZeroDivisionError):
        with tracking.start("crash", uri=uri, system_metrics=False):
            raise ZeroDivisionError("a step failed")
    assert tracking.runs("crash", uri).iloc[0]["status"] == "FAILED"


def test_an_unreachable_server_is_a_clear_error_within_seconds():
    port = distributed.free_port()
    start = time.monotonic()
    with pytest.raises(tracking.TrackingError, match=rf"cannot reach the MLflow tracking server at "
                                                     rf"http://127.0.0.1:{port}.*Fix: start it"):
        tracking.start("x", uri=f"http://127.0.0.1:{port}")
    # The check uses a 3 s timeout; MLflow's own retries would take minutes. 30 s leaves room for a
    # loaded machine and still tells the two apart.
    assert time.monotonic() - start < 30


def test_a_store_in_a_missing_folder_and_databricks_without_credentials_are_refused(tmp_path, monkeypatch):
    with pytest.raises(tracking.TrackingError, match="does not exist. Fix: create it"):
        tracking.check_uri(f"sqlite:///{tmp_path / 'nope' / 'mlflow.db'}")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("DATABRICKS_HOST", raising=False)
    monkeypatch.delenv("DATABRICKS_RUNTIME_VERSION", raising=False)
    with pytest.raises(tracking.TrackingError, match="needs Databricks credentials"):
        tracking.check_uri("databricks")


def test_where_runs_go(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("DATABRICKS_RUNTIME_VERSION", raising=False)
    assert tracking.default_uri(tmp_path) == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert tracking.experiment_path("ddp") == "ddp"
    monkeypatch.setenv("DATABRICKS_RUNTIME_VERSION", "15.4")
    monkeypatch.setenv("DTLAB_DATABRICKS_USER", "me@example.com")
    # the user's own folder, which exists for every user (never /Shared, which every user can change)
    assert tracking.default_uri(tmp_path) == "databricks"
    assert tracking.experiment_path("ddp") == "/Users/me@example.com/dtlab-ddp"
    assert tracking.experiment_path("/Shared/team/ddp") == "/Shared/team/ddp"      # a path: as given
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking:5000")
    assert tracking.default_uri() == "http://tracking:5000"
    assert tracking.worker_env()["MLFLOW_TRACKING_URI"] == "http://tracking:5000"


def test_a_relative_sqlite_uri_is_relative_to_the_working_directory(tmp_path, monkeypatch):
    """SQLAlchemy reads sqlite:///mlflow.db as ./mlflow.db; it used to be checked as /mlflow.db and its
    artifacts went to file:///mlartifacts."""
    monkeypatch.chdir(tmp_path)
    assert tracking.check_uri("sqlite:///mlflow.db") == "sqlite:///mlflow.db"
    with pytest.raises(tracking.TrackingError, match="does not exist"):
        tracking.check_uri("sqlite:///missing-folder/mlflow.db")
    with tracking.start("relative", uri="sqlite:///mlflow.db", system_metrics=False) as run:
        run.log_metrics({"loss": 1.0}, step=0)
        run.log_artifact(__file__)
    assert (tmp_path / "mlflow.db").is_file() and list((tmp_path / "mlartifacts").rglob("test_tracking.py"))
    assert not Path("/mlflow.db").exists() and not Path("/mlartifacts").exists()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_local_server_listens_on_localhost_stores_runs_and_leaves_no_process_behind(tmp_path):
    import psutil

    with tracking.local_server(tmp_path) as uri:
        port = int(uri.rsplit(":", 1)[1])
        assert uri.startswith("http://127.0.0.1:") and tracking.port_is_open(port)
        with tracking.start("served", uri=uri, system_metrics=False, params={"a": 1}) as run:
            run.log_metrics({"loss": 0.25}, step=1)
        assert tracking.runs("served", uri).iloc[0]["metrics.loss"] == 0.25
        server = [p for p in psutil.Process().children() if "mlflow" in " ".join(p.cmdline())]
        assert len(server) == 1, server
        family = [server[0], *server[0].children(recursive=True)]
        assert len(family) > 1, "mlflow server runs worker processes (that is what used to be left behind)"
    assert not tracking.port_is_open(port)
    assert os.path.exists(tmp_path / "mlflow.db")
    gone, alive = psutil.wait_procs(family, timeout=15)
    assert not alive, f"still running after the server stopped: {[p.cmdline() for p in alive]}"


class _Option:
    """What the Java side of dbutils returns: a Scala Option."""

    def __init__(self, value=None):
        self.value = value

    def isDefined(self):
        return self.value is not None

    def get(self):
        return self.value


def _job_run_context(monkeypatch, **fields):
    """Databricks' REPL context module as a job run has it (no browserHostName), for this test only."""
    import sys
    import types

    module = types.ModuleType("dbruntime.databricks_repl_context")
    module.get_context = lambda: types.SimpleNamespace(**fields) if fields else None
    package = types.ModuleType("dbruntime")
    package.databricks_repl_context = module
    monkeypatch.setitem(sys.modules, "dbruntime", package)
    monkeypatch.setitem(sys.modules, "dbruntime.databricks_repl_context", module)


def test_workers_get_the_job_runs_api_url_and_token_never_a_host_of_none(monkeypatch):
    """Job runs have no browserHostName: the host came out as https://None and the error was swallowed."""
    monkeypatch.setenv("DATABRICKS_RUNTIME_VERSION", "15.4")
    for name in ("DATABRICKS_HOST", "DATABRICKS_TOKEN", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DTLAB_DATABRICKS_USER", "me@example.com")
    _job_run_context(monkeypatch, browserHostName=None, workspaceUrl=None, apiUrl="https://dbc-1.cloud.databricks.com",
                     apiToken="dapi-context")
    assert tracking.worker_env() == {"MLFLOW_TRACKING_URI": "databricks",
                                     "DATABRICKS_HOST": "https://dbc-1.cloud.databricks.com",
                                     "DATABRICKS_TOKEN": "dapi-context", "DTLAB_DATABRICKS_USER": "me@example.com"}
    # Options, as the Java context returns them, and a host without a scheme
    _job_run_context(monkeypatch, apiUrl=lambda: _Option("dbc-2.cloud.databricks.com/"),
                     apiToken=lambda: _Option("dapi-2"))
    assert tracking.databricks_credentials() == ("https://dbc-2.cloud.databricks.com", "dapi-2")
    # the job's own variables (a secret scope's token) come first
    monkeypatch.setenv("DATABRICKS_HOST", "https://from-env.cloud.databricks.com")
    monkeypatch.setenv("DATABRICKS_TOKEN", "dapi-env")
    assert tracking.databricks_credentials() == ("https://from-env.cloud.databricks.com", "dapi-env")


@pytest.mark.parametrize("context", [{}, {"apiUrl": None, "apiToken": "t", "browserHostName": None},
                                     {"apiUrl": "None", "apiToken": "t"},
                                     {"apiUrl": lambda: _Option(None), "apiToken": lambda: _Option("t")}])
def test_without_a_host_or_token_worker_env_names_the_fix(monkeypatch, context):
    monkeypatch.setenv("DATABRICKS_RUNTIME_VERSION", "15.4")
    for name in ("DATABRICKS_HOST", "DATABRICKS_TOKEN", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    _job_run_context(monkeypatch, **context)
    with pytest.raises(tracking.TrackingError, match="a workspace host") as err:
        tracking.worker_env()
    assert "Fix" in str(err.value) and "{{secrets/" in str(err.value)
    # a store that is not Databricks' needs no credentials
    assert tracking.worker_env("sqlite:///x.db") == {"MLFLOW_TRACKING_URI": "sqlite:///x.db"}


def test_the_user_is_asked_of_the_workspace_with_the_token_and_remembered(monkeypatch):
    """SCIM "Me" on a real HTTP server here: the notebook's host and token, the answer kept for launched workers."""
    import http.server
    import json
    import threading

    seen = []

    class Workspace(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append((self.path, self.headers.get("Authorization")))
            ok = self.headers.get("Authorization") == "Bearer dapi-x"
            self.send_response(200 if ok else 401)
            self.end_headers()
            self.wfile.write(json.dumps({"userName": "ada@example.com"} if ok else {"error_code": "X"}).encode())

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Workspace)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("DATABRICKS_RUNTIME_VERSION", "17.3")
        monkeypatch.delenv("DTLAB_DATABRICKS_USER", raising=False)
        monkeypatch.setenv("DATABRICKS_HOST", f"http://127.0.0.1:{server.server_port}")
        monkeypatch.setenv("DATABRICKS_TOKEN", "dapi-x")
        assert tracking.experiment_path("ddp") == "/Users/ada@example.com/dtlab-ddp"
        assert seen == [("/api/2.0/preview/scim/v2/Me", "Bearer dapi-x")]
        assert tracking.experiment_path("zero") == "/Users/ada@example.com/dtlab-zero" and len(seen) == 1
        monkeypatch.delenv("DTLAB_DATABRICKS_USER")
        monkeypatch.setenv("DATABRICKS_TOKEN", "dapi-wrong")
        with pytest.raises(tracking.TrackingError, match="Fix: name the experiment with its full path"):
            tracking.experiment_path("ddp")
    finally:
        server.shutdown()


@pytest.mark.slow
def test_register_refuses_a_model_without_a_signature_and_an_alias_loads_the_registered_one(tmp_path):
    import subprocess
    import sys

    code = f"""
import torch, mlflow
from dtlab import models, tracking
uri = tracking.default_uri({str(tmp_path)!r})
torch.manual_seed(0)
model = models.MLP(4, 8, 3)
x = torch.randn(2, 4).numpy()
with tracking.start("reg", uri=uri, system_metrics=False) as run:
    bare = run.log_model(model, "bare")
    signed = run.log_model(model, "signed", input_example=x)
try:
    tracking.register(bare, "m")
except tracking.TrackingError as err:
    print("refused:", err)
version = tracking.register(signed, "m", alias="champion")
back = mlflow.pytorch.load_model("models:/m@champion")
print("version", version, torch.equal(back(torch.as_tensor(x)), model(torch.as_tensor(x))))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "MLFLOW_TRACKING_URI": ""})
    assert "refused:" in out.stdout and "signature" in out.stdout and "input_example" in out.stdout, out.stderr[-2000:]
    assert "version 1 True" in out.stdout, out.stdout + out.stderr[-2000:]


def test_on_databricks_without_a_catalog_registration_is_refused_naming_the_parameters(monkeypatch):
    monkeypatch.delenv("DATABRICKS_RUNTIME_VERSION", raising=False)
    assert tracking.registry_for() is None                              # off Databricks: the store's own registry
    assert tracking.registry_for("main", "ml") == "databricks-uc"
    with pytest.raises(tracking.TrackingError, match="needs both"):
        tracking.registry_for("main", "")
    monkeypatch.setenv("DATABRICKS_RUNTIME_VERSION", "17.3")
    with pytest.raises(tracking.TrackingError, match="legacy Workspace Model Registry.*'catalog' and 'schema'"):
        tracking.registry_for()
    assert tracking.registry_for("main", "ml") == "databricks-uc"
