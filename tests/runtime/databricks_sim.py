"""A Databricks job, simulated on this machine from the project's own files.

What the course meets on a Databricks Runtime 15.4 or 18 LTS ML (or 17.3) single-node job cluster, and how each is
reproduced here (the runtime's Python stack itself is the venv ``make test-runtime RUNTIME=...`` builds):

* **job parameters arrive as widgets**: a ``dbutils`` object whose ``widgets.get`` returns each task's
  ``base_parameters`` from ``databricks.yml`` — strings, as a job passes them;
* **the runtime is announced** by ``DATABRICKS_RUNTIME_VERSION`` and the cluster's Spark tag
  ``spark.databricks.clusterUsageTags.sparkVersion``;
* **a SparkSession exists before the notebook starts**, on the job cluster's one driver JVM, which every task of
  the job shares (each notebook its own session of the same SparkContext, as notebooks attached to one cluster
  have; notebook 05, whose Horovod job has a cluster of its own, attaches to the same driver here), in a folder
  of its own (``/databricks/driver`` on a cluster), made with the ``spark_conf`` of
  ``clusters/g5-12xlarge-single-node.yml`` (single-node profile, ``local[*, 4]`` with the node's 48 vCPUs
  as task slots: no GPU scheduling);
* **the notebook's interpreter lives in a folder without the runtime's console scripts**
  (``torchrun``, ``deepspeed``, ``horovodrun``, ``py-spy`` are not beside ``sys.executable`` nor on
  ``PATH``), as a notebook-scoped Python environment on Databricks;
* **dtlab is the tasks' library**: the wheel the bundle's artifact builds (its ``build`` command from
  ``databricks.yml``, run offline), installed as a cluster library is, apart from the source tree;
* **the working directory is the notebook's folder in the deployed bundle**, where the notebooks
  themselves cannot be read as files before Databricks Runtime 16.2 (15.4) and can from it (17.3), and what
  it writes lands in the "workspace";
* **the notebook's context is a job run's**: ``dbruntime``'s REPL context and ``dbutils``' command context
  carry ``apiUrl`` and ``apiToken`` and no ``browserHostName`` (absent in job runs); processes the notebook
  starts see no context, and no ``DATABRICKS_HOST`` / ``DATABRICKS_TOKEN`` in their environment;
* **MLflow's tracking URI is ``databricks``**, and MLflow's own Databricks store reaches the "workspace"
  through the context's ``apiUrl`` and token (in the notebook) or ``DATABRICKS_HOST`` and ``DATABRICKS_TOKEN``
  (in launched workers): the workspace is a real ``mlflow server`` on 127.0.0.1 that answers only requests
  carrying the token, and whose store, like the workspace's, refuses an experiment whose parent folder does
  not exist (``RESOURCE_DOES_NOT_EXIST``) or whose name is not a path; it says who runs the job (SCIM ``Me``:
  ``USER``, whose home folder exists). (Artifacts are written to a folder the
  server names, ``--no-serve-artifacts``: the workspace's own artifact service, with credentials per write,
  is the one path not reproduced; a registered model version is read back as the workspace serves it, through
  its list-artifacts and signed-download-URL endpoints.)
* **Unity Catalog, where a task is given a catalog, schema and volume** (the capstone): the local Spark's one
  catalog (``spark_catalog``) holds the schema; its ``information_schema`` lists grants to groups the job's user is
  in (``is_account_group_member``) and the owners, as a workspace's does; the volume is a folder
  (``DTLAB_VOLUMES_ROOT`` standing for ``/Volumes``); and the workspace serves Unity Catalog's model registry
  (``databricks-uc``): three-level names in schemas that exist, versions whose files go to "default storage"
  through presigned upload and download URLs (``/api/2.0/fs/...``), aliases. Not reproduced: Spark writing the
  table as Delta (a local Spark has no Delta Lake jars, so delta-rs writes it into the volume), and storage
  reached with cloud credentials instead of presigned URLs.

``Job`` builds all of it in a folder and starts the server (``Job.close`` stops it); ``Job.run(task)``
executes one task's notebook there with papermill, passing no parameters but the widgets.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
#: The runtime simulated: ``make test-runtime RUNTIME=...`` (DTLAB_TEST_RUNTIME), whose stack runs this.
RUNTIME_VERSION = os.environ.get("DTLAB_TEST_RUNTIME", "18")
SPARK_VERSION_TAG = {"15.4": "15.4.x-gpu-ml-scala2.12", "17.3": "17.3.x-gpu-ml-scala2.13",
                     "18": "18.x-gpu-ml-scala2.13"}[RUNTIME_VERSION]
#: DATABRICKS_RUNTIME_VERSION on the cluster: 18 LTS's clusters run a point release and say which (MLflow parses
#: "major.minor" from it: a bare "18" raises "Failed to parse databricks runtime version").
RUNTIME_VERSION_VARIABLE = {"18": "18.2"}.get(RUNTIME_VERSION, RUNTIME_VERSION)
#: From Databricks Runtime 16.2 a notebook in the workspace can be read as a file (its source).
NOTEBOOKS_ARE_FILES = tuple(map(int, RUNTIME_VERSION.split("."))) >= (16, 2)
#: Workspace folders a fresh workspace has (the parents MLflow accepts).
#: The user the job runs as (SCIM "Me" answers it), whose home folder exists like every user's.
USER = "learner@example.com"
EXISTING_FOLDERS = ("/", "/Shared", "/Users", "/Repos", "/Workspace", "/Workspace/Shared", "/Workspace/Users",
                    f"/Users/{USER}", f"/Workspace/Users/{USER}")

#: The Unity Catalog places of the simulated workspace: the local Spark's one catalog, a schema in it, and a volume in
#: that (its files under the job's folder, DTLAB_VOLUMES_ROOT); the job's user holds what the capstone needs through
#: groups, as a workspace grants it.
UNITY_CATALOG = {"catalog": "spark_catalog", "schema": "dtlab_course", "volume": "course"}
#: The grants the simulated catalog's information_schema lists (grantee, securable, privilege) and the groups the
#: job's user is in (is_account_group_member).
GRANTS = [("account users", "catalog", "USE CATALOG"), ("ml-team", "schema", "USE SCHEMA"),
          ("ml-team", "schema", "CREATE TABLE"), ("ml-team", "schema", "CREATE MODEL"),
          ("ml-team", "volume", "READ VOLUME"), ("ml-team", "volume", "WRITE VOLUME")]
GROUPS = ("account users", "ml-team")

_STARTUP = '''
# Run by the simulated Databricks kernel before the notebook: what a Databricks notebook finds defined.
import json as _json
import os as _os

class _Widgets:
    """dbutils.widgets: a job's base_parameters override the defaults a notebook declares."""

    def __init__(self, values):
        self._values, self._defaults = dict(values), {}

    def text(self, name, default_value, label=None):
        self._defaults[name] = default_value

    def get(self, name):
        if name in self._values:
            return self._values[name]
        if name in self._defaults:
            return self._defaults[name]
        raise ValueError(f"InputWidgetNotDefined: No input widget named {name} is defined")


class _Option:
    """A Scala Option, as the Java side of dbutils returns them."""

    def __init__(self, value=None):
        self._value = value

    def isDefined(self):
        return self._value is not None

    def get(self):
        if self._value is None:
            raise RuntimeError("java.util.NoSuchElementException: None.get")
        return self._value


class _Tags:
    def __init__(self, values):
        self._values = values

    def get(self, key):
        return _Option(self._values.get(key))


class _CommandContext:
    """dbutils.notebook().getContext() of a job run: apiUrl and apiToken, no browserHostName."""

    def __init__(self, repl):
        self._repl = repl

    def tags(self):
        return _Tags({"jobId": self._repl.jobId, "idInJob": self._repl.idInJob, "jobType": self._repl.jobType,
                      "clusterId": self._repl.clusterId})

    def __getattr__(self, name):        # apiUrl(), apiToken(), browserHostName(), notebookPath(), ...
        return lambda: _Option(getattr(self._repl, name, None))


class _Notebook:
    def __init__(self, repl):
        self._repl = repl

    def getContext(self):
        return _CommandContext(self._repl)


class _Logger:
    def logUsage(self, *args, **kwargs):
        pass


class _DriverConf:
    def workflowSslTrustAll(self):
        return False


class _EntryPoint:
    """dbutils.entry_point, the Py4J gateway's: what MLflow 2.13 reads the notebook's credentials through."""

    def __init__(self, repl):
        self._repl = repl

    def getDbutils(self):
        return self

    def notebook(self):
        return _Notebook(self._repl)

    def getNonUcApiToken(self):
        return self._repl.apiToken

    def getLogger(self):
        return _Logger()

    def getDriverConf(self):
        return _DriverConf()


class _DBUtils:
    def __init__(self, values, repl):
        self.widgets = _Widgets(values)
        self.entry_point = _EntryPoint(repl)   # MLflow 2.13 reads the notebook context through it


# The REPL context of this process only (dbruntime.databricks_repl_context.get_context()): the address and
# token leave the environment, so the processes the notebook starts have neither, as on Databricks.
import dbruntime.databricks_repl_context as _repl_context

_repl_context._CONTEXT = _repl_context.Context(apiUrl=_os.environ.pop("DTLAB_SIM_API_URL"),
                                               apiToken=_os.environ.pop("DTLAB_SIM_API_TOKEN"))
dbutils = _DBUtils(_json.loads(_os.environ.get("DTLAB_SIM_WIDGETS", "{}")), _repl_context._CONTEXT)

from pyspark import SparkConf as _SparkConf
from pyspark import SparkContext as _SparkContext
from pyspark.java_gateway import launch_gateway as _launch_gateway
from pyspark.sql import SparkSession as _SparkSession

# The job cluster's driver JVM (its SparkContext) runs already, started with the job (Job._start_driver) in its own
# folder, as /databricks/driver on a cluster; this notebook attaches to it through its Py4J gateway and gets a
# session of its own (its SQL settings, temporary views and functions), as every notebook on the cluster does.
# The gateway's address leaves the environment, as the workspace's token does.
_driver = _json.loads(_os.environ.pop("DTLAB_SIM_DRIVER"))
_os.environ["PYSPARK_GATEWAY_PORT"], _os.environ["PYSPARK_GATEWAY_SECRET"] = str(_driver["port"]), _driver["secret"]
try:
    _gateway = _launch_gateway()
finally:
    del _os.environ["PYSPARK_GATEWAY_PORT"], _os.environ["PYSPARK_GATEWAY_SECRET"]
_jsc = _gateway.jvm.org.apache.spark.api.java.JavaSparkContext.fromSparkContext(
    _gateway.jvm.org.apache.spark.SparkContext.getOrCreate())
_sc = _SparkContext(gateway=_gateway, jsc=_jsc, conf=_SparkConf(_jconf=_jsc.sc().conf()))
spark = _SparkSession(_sc, jsparkSession=_gateway.jvm.org.apache.spark.sql.SparkSession.builder().getOrCreate()
                      .newSession())
spark.sparkContext.setLogLevel("ERROR")

# Unity Catalog, as far as a job meets it before it writes: the catalog's information_schema (grants, owners) and
# is_account_group_member, answered by this session for the places the job was given.
if _os.environ.get("DTLAB_SIM_UNITY_CATALOG"):
    _uc = _json.loads(_os.environ["DTLAB_SIM_UNITY_CATALOG"])
    _c, _s, _v = _uc["catalog"], _uc["schema"], _uc["volume"]
    spark.udf.register("is_account_group_member", lambda group: group in _uc["groups"], "boolean")
    import tempfile as _tempfile

    # each session's own folders: a later task's session must not meet an earlier one's files (Spark refuses a
    # managed table over a folder that exists)
    _where = _tempfile.mkdtemp(prefix="unity-catalog-", dir=_os.environ["DTLAB_SIM_DRIVER_DIR"])
    spark.sql(f"CREATE DATABASE IF NOT EXISTS {_s} LOCATION '{_where}/{_s}'")
    spark.sql(f"CREATE DATABASE IF NOT EXISTS information_schema LOCATION '{_where}/information_schema'")
    _grants = {kind: [(g, p) for g, k, p in _uc["grants"] if k == kind] for kind in ("catalog", "schema", "volume")}
    _tables = {
        "catalog_privileges": ("grantor string, grantee string, catalog_name string, privilege_type string",
                               [("admin", g, _c, p) for g, p in _grants["catalog"]]),
        "schema_privileges": ("grantor string, grantee string, catalog_name string, schema_name string, "
                              "privilege_type string, inherited_from string",
                              [("admin", g, _c, _s, p, "NONE") for g, p in _grants["schema"]]),
        "volume_privileges": ("grantor string, grantee string, volume_catalog string, volume_schema string, "
                              "volume_name string, privilege_type string, inherited_from string",
                              [("admin", g, _c, _s, _v, p, "NONE") for g, p in _grants["volume"]]),
        "catalogs": ("catalog_name string, catalog_owner string", [(_c, "admin")]),
        "schemata": ("catalog_name string, schema_name string, schema_owner string", [(_c, _s, "admin")]),
        "volumes": ("volume_catalog string, volume_schema string, volume_name string, volume_owner string",
                    [(_c, _s, _v, "admin")]),
    }
    for _name, (_columns, _rows) in _tables.items():
        spark.createDataFrame(_rows, _columns).write.mode("overwrite").saveAsTable(f"information_schema.{_name}")
'''

_DRIVER = '''
"""The job cluster's driver: one Spark JVM for every task of the job run (``Job._start_driver``); each task's
kernel attaches to it through the gateway whose port and secret this writes to the file named by its argument."""
import json
import os
import signal
import sys
import time

from pyspark.sql import SparkSession

builder = SparkSession.builder.appName("databricks-simulated")
for key, value in json.loads(os.environ["DTLAB_SIM_SPARK_CONF"]).items():
    builder = builder.config(key, value)
spark = builder.getOrCreate()
spark.sparkContext.setLogLevel("ERROR")
gateway = spark.sparkContext._gateway.gateway_parameters
with open(sys.argv[1] + ".tmp", "w") as f:
    json.dump({"port": gateway.port, "secret": gateway.auth_token}, f)
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
try:
    while True:
        time.sleep(3600)
finally:
    spark.stop()
'''

_STORE = '''
"""The workspace's MLflow store, for the simulated workspace's server: SQLite, refusing what the workspace refuses.

Registered as the tracking-store scheme ``dtlab-workspace``: ``dtlab-workspace:///path/to/db`` is that SQLite file.
"""
import os
import posixpath

from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE, RESOURCE_DOES_NOT_EXIST
from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

FOLDERS = set(os.environ.get("DTLAB_SIM_FOLDERS", "/").split(":"))


class WorkspaceStore(SqlAlchemyStore):
    def create_experiment(self, name, artifact_location=None, tags=None):
        if not name.startswith("/"):
            raise MlflowException(f"Experiment name must be an absolute path in the workspace, got {name!r}",
                                  error_code=INVALID_PARAMETER_VALUE)
        parent = posixpath.dirname(name.rstrip("/")) or "/"
        if parent not in FOLDERS:
            raise MlflowException(f"RESOURCE_DOES_NOT_EXIST: Parent directory {parent} does not exist.",
                                  error_code=RESOURCE_DOES_NOT_EXIST)
        return super().create_experiment(name, artifact_location, tags)


def build(store_uri=None, artifact_uri=None):
    return WorkspaceStore("sqlite:///" + store_uri.split(":///", 1)[1], artifact_uri)
'''

_SERVER_APP = '''
"""The simulated workspace's REST API: MLflow's own tracking server, answering only requests that carry the
workspace's token (``Authorization: Bearer <token>``), as Databricks does; plus the workspace registry's two artifact
endpoints, which MLflow's client uses to load ``models:/<name>/<version>`` from a Databricks workspace (and an
OSS server lacks): the files of a model version, and a signed download URL for each (as cloud storage's presigned
URLs, valid without the token, for this one file)."""
import hashlib
import hmac
import json
import os
import time
from pathlib import Path
from urllib.parse import quote, urlparse
from urllib.request import url2pathname

from flask import jsonify, request, send_file
from mlflow.server import app
from mlflow.server.handlers import _get_model_registry_store, _get_tracking_store

TOKEN = os.environ["DTLAB_SIM_API_TOKEN"]
SIGNED = "/dtlab-sim/signed/"


@app.before_request
def _require_the_token():
    if request.path == "/health" or request.path.startswith(SIGNED):
        return None
    if request.headers.get("Authorization") != f"Bearer {TOKEN}":
        return jsonify(error_code="UNAUTHENTICATED", message="Invalid access token."), 401
    return None


def _version_root():
    """The folder that holds the requested model version's files (its run's artifacts, at the model's path)."""
    version = _get_model_registry_store().get_model_version(request.args["name"], request.args["version"])
    source = version.source
    if source.startswith("runs:/"):
        run_id, _, inner = source[len("runs:/"):].partition("/")
        source = _get_tracking_store().get_run(run_id).info.artifact_uri.rstrip("/") + "/" + inner
    return Path(url2pathname(urlparse(source).path))


def _signature(path):
    return hmac.new(TOKEN.encode(), str(path).encode(), hashlib.sha256).hexdigest()


@app.route("/api/2.0/preview/scim/v2/Me", methods=["GET"])
def _me():
    return jsonify(userName=os.environ["DTLAB_SIM_USER"], active=True)


@app.route("/api/2.0/mlflow/model-versions/list-artifacts", methods=["GET"])
def _list_model_version_artifacts():
    root = _version_root()
    inner = request.args.get("path", "")
    target = root / inner
    if target.is_file():
        return jsonify(files=[{"path": inner, "is_dir": False, "file_size": target.stat().st_size}])
    files = [{"path": str(p.relative_to(root)), "is_dir": p.is_dir(),
              **({} if p.is_dir() else {"file_size": p.stat().st_size})} for p in sorted(target.iterdir())]
    return jsonify(files=files)


@app.route("/api/2.0/mlflow/model-versions/get-signed-download-uri", methods=["GET"])
def _signed_download_uri():
    path = (_version_root() / request.args.get("path", "")).resolve()
    return jsonify(signed_uri=_signed(path, "GET"), headers=[])


@app.route(SIGNED + "<signature>", methods=["GET", "PUT"])
def _signed_download(signature):
    path = request.args.get("file", "")
    if not hmac.compare_digest(signature, _signature(path + request.method)) or \
            (request.method == "GET" and not Path(path).is_file()):
        return jsonify(error_code="PERMISSION_DENIED", message="Invalid or expired signature."), 403
    if request.method == "PUT":                        # a presigned upload, as to the workspace's default storage
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(request.get_data())
        return ""
    return send_file(path)


def _signed(path, method):
    return f"{request.host_url.rstrip('/')}{SIGNED}{_signature(str(path) + method)}?file={quote(str(path))}"


# Unity Catalog's model registry, as MLflow's "databricks-uc" client meets it: registered models named
# catalog.schema.model in catalogs and schemas that exist, versions whose files go to the workspace's default
# storage through presigned URLs (/api/2.0/fs/...), aliases. Kept in a JSON file beside the files.
UC_ROOT = Path(os.environ.get("DTLAB_SIM_UC_ROOT", "/nonexistent"))
UC_SCHEMAS = set(os.environ.get("DTLAB_SIM_UC_SCHEMAS", "").split(","))


def _uc_state():
    path = UC_ROOT / "registry.json"
    return json.loads(path.read_text()) if path.is_file() else {"models": {}}


def _uc_save(state):
    (UC_ROOT / "registry.json").write_text(json.dumps(state))


def _uc_error(code, message, status=400):
    return jsonify(error_code=code, message=message), status


def _uc_body():
    return request.get_json(silent=True) or request.args.to_dict()


def _uc_find(name, version):
    """The stored model version ``version`` of ``name``, or None."""
    return _uc_state()["models"].get(name, {"versions": {}})["versions"].get(str(version))


def _uc_version(model, version):
    return {**model["versions"][str(version)],
            "aliases": [{"alias": a, "version": str(v)} for a, v in model["aliases"].items() if str(v) == str(version)]}


@app.route("/api/2.0/mlflow/unity-catalog/registered-models/create", methods=["POST"])
def _uc_create_model():
    name = _uc_body()["name"]
    parts = name.split(".")
    if len(parts) != 3:
        return _uc_error("INVALID_PARAMETER_VALUE", f"Model name {name!r} must be <catalog>.<schema>.<model>.")
    if ".".join(parts[:2]) not in UC_SCHEMAS:
        return _uc_error("NOT_FOUND", f"Schema '{'.'.join(parts[:2])}' does not exist.", 404)
    state = _uc_state()
    if name in state["models"]:
        return _uc_error("RESOURCE_ALREADY_EXISTS", f"Registered model '{name}' already exists.")
    state["models"][name] = {"name": name, "versions": {}, "aliases": {}, "creation_timestamp": int(time.time() * 1e3)}
    _uc_save(state)
    return jsonify(registered_model={"name": name})


@app.route("/api/2.0/mlflow/unity-catalog/registered-models/get", methods=["GET"])
def _uc_get_model():
    model = _uc_state()["models"].get(_uc_body()["name"])
    if model is None:
        return _uc_error("RESOURCE_DOES_NOT_EXIST", "Registered model does not exist.", 404)
    return jsonify(registered_model={"name": model["name"], "aliases": [
        {"alias": a, "version": str(v)} for a, v in model["aliases"].items()]})


@app.route("/api/2.0/mlflow/unity-catalog/model-versions/create", methods=["POST"])
def _uc_create_version():
    body, state = _uc_body(), _uc_state()
    model = state["models"].get(body["name"])
    if model is None:
        return _uc_error("RESOURCE_DOES_NOT_EXIST", f"Registered model '{body['name']}' does not exist.", 404)
    version = str(len(model["versions"]) + 1)
    model["versions"][version] = {
        "name": body["name"], "version": version, "source": body.get("source", ""), "run_id": body.get("run_id", ""),
        "status": "PENDING_REGISTRATION", "creation_timestamp": int(time.time() * 1e3),
        "storage_location": "/Models/" + body["name"].replace(".", "/") + "/" + version}
    _uc_save(state)
    return jsonify(model_version=_uc_version(model, version))


@app.route("/api/2.0/mlflow/unity-catalog/model-versions/generate-temporary-credentials", methods=["POST"])
def _uc_credentials():
    return jsonify(credentials={"storage_mode": "DEFAULT_STORAGE"})


@app.route("/api/2.0/mlflow/unity-catalog/model-versions/finalize", methods=["POST"])
def _uc_finalize():
    body, state = _uc_body(), _uc_state()
    model = state["models"][body["name"]]
    model["versions"][str(body["version"])]["status"] = "READY"
    _uc_save(state)
    return jsonify(model_version=_uc_version(model, body["version"]))


@app.route("/api/2.0/mlflow/unity-catalog/model-versions/get", methods=["GET"])
def _uc_get_version():
    body = _uc_body()
    if _uc_find(body["name"], body["version"]) is None:
        return _uc_error("RESOURCE_DOES_NOT_EXIST", "Model version does not exist.", 404)
    return jsonify(model_version=_uc_version(_uc_state()["models"][body["name"]], body["version"]))


@app.route("/api/2.0/mlflow/unity-catalog/model-versions/get-download-uri", methods=["GET"])
def _uc_download_uri():
    """The version's storage location, as the workspace answers (a client without the storage's credentials then
    falls back to the models:/ URI, which goes through the presigned URLs)."""
    body = _uc_body()
    version = _uc_find(body["name"], body["version"])
    if version is None:
        return _uc_error("RESOURCE_DOES_NOT_EXIST", "Model version does not exist.", 404)
    return jsonify(artifact_uri=version["storage_location"])


@app.route("/api/2.0/mlflow/unity-catalog/registered-models/alias", methods=["POST", "GET"])
def _uc_alias():
    body, state = _uc_body(), _uc_state()
    model = state["models"].get(body["name"])
    if model is None:
        return _uc_error("RESOURCE_DOES_NOT_EXIST", "Registered model does not exist.", 404)
    if request.method == "POST":
        model["aliases"][body["alias"]] = str(body["version"])
        _uc_save(state)
        return jsonify({})
    if body["alias"] not in model["aliases"]:
        return _uc_error("RESOURCE_DOES_NOT_EXIST", f"Alias {body['alias']} does not exist.", 404)
    return jsonify(model_version=_uc_version(model, model["aliases"][body["alias"]]))


@app.route("/api/2.0/mlflow/unity-catalog/model-versions/emit-lineage", methods=["POST"])
def _uc_lineage():
    return jsonify({})


@app.route("/api/2.0/mlflow/unity-catalog/registered-models:is-databricks-sdk-models-artifact-repository-enabled",
           methods=["GET"])
def _uc_sdk_repository():
    return jsonify(is_databricks_sdk_models_artifact_repository_enabled=False)


def _storage(path):
    target = (UC_ROOT / path.lstrip("/")).resolve()
    if not str(target).startswith(str(UC_ROOT.resolve()) + os.sep) or not path.startswith("/Models/"):
        raise PermissionError(path)
    return target


@app.route("/api/2.0/fs/create-upload-url", methods=["POST"])
def _fs_upload_url():
    return jsonify(url=_signed(_storage(_uc_body()["path"]), "PUT"), headers=[])


@app.route("/api/2.0/fs/create-download-url", methods=["POST"])
def _fs_download_url():
    return jsonify(url=_signed(_storage(_uc_body()["path"]), "GET"), headers=[])


@app.route("/api/2.0/fs/directories/<path:folder>", methods=["GET"])
def _fs_list(folder):
    target = _storage("/" + folder)
    if not target.is_dir():
        return _uc_error("NOT_FOUND", f"{folder} is not a directory.", 404)
    return jsonify(contents=[{"path": "/" + str(p.relative_to(UC_ROOT)), "is_directory": p.is_dir(),
                              **({} if p.is_dir() else {"file_size": p.stat().st_size})}
                             for p in sorted(target.iterdir())])
'''

_REPL_CONTEXT = '''
"""Databricks' ``dbruntime.databricks_repl_context``, simulated: the notebook's context in a job run.

``get_context()`` returns the context the notebook's start-up set, in the notebook's process only; None in
every other process (the workers a notebook launches).
"""
from dataclasses import dataclass

_CONTEXT = None


@dataclass
class Context:
    apiUrl: str
    apiToken: str
    browserHostName: object = None          # absent in job runs
    workspaceUrl: object = None             # None on job clusters (databricks-sdk-py #312)
    sslTrustAll: bool = False
    isInNotebook: bool = True
    isInJob: bool = True
    isInCluster: bool = True
    jobId: str = "1001"
    idInJob: str = "2002"
    jobType: str = "NORMAL"
    jobTaskType: str = "notebook"
    clusterId: str = "1201-000000-simulated"
    workspaceId: str = "1234567890"
    notebookId: str = "4242"
    notebookPath: str = "/Workspace/Users/learner@example.com/.bundle/dtlab-course/dev/files/notebooks/lesson"


def get_context():
    return _CONTEXT
'''


@dataclass
class Task:
    """One task of the job: its key, notebook and the widget values it receives."""

    key: str
    notebook: Path
    widgets: dict[str, str]


def load_tasks(bundle: Path = ROOT / "databricks.yml") -> list[Task]:
    """The notebook tasks of the bundle's jobs, in order, with their ``base_parameters``."""
    doc = yaml.safe_load(bundle.read_text())
    every = [task for job in doc["resources"]["jobs"].values() for task in job["tasks"]]
    tasks = []
    for task in every:
        nb = task.get("notebook_task")
        if not nb:
            continue
        tasks.append(Task(task["task_key"], (bundle.parent / nb["notebook_path"]).resolve(),
                          {k: str(v) for k, v in (nb.get("base_parameters") or {}).items()}))
    return tasks


def single_node_spark_conf() -> dict[str, str]:
    """The Spark configuration of the single-node cluster file, as the cluster would have it: ``local[*, 4]``
    there means one task slot per vCPU of the node (48 on a g5.12xlarge), not per core of this machine."""
    from dtlab.planner import hardware

    spec = yaml.safe_load((ROOT / "clusters" / "g5-12xlarge-single-node.yml").read_text())
    conf = {k: str(v) for k, v in spec["spark_conf"].items()}
    conf["spark.master"] = conf["spark.master"].replace("*", str(hardware.node(spec["node_type_id"]).vcpus))
    conf.update({"spark.databricks.clusterUsageTags.sparkVersion": SPARK_VERSION_TAG,
                 "spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false"})
    return conf


def _answers(url: str) -> bool:
    """Whether an HTTP server answers ``url`` (any status). gunicorn's arbiter binds the port before its worker
    boots: until the worker runs, a connection opens but nothing answers (and the worker would start inside the
    first test, which would count it as a process that test left running)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


class Job:
    """The simulated cluster and workspace of one job run, in ``folder``."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.workspace = self.folder / "Workspace" / "bundle" / "files"
        self.python = self._notebook_environment()
        self.site, self.server_site = self._plugins()
        self._deploy()
        self.libraries = self._install_wheel()
        (self.folder / "tmp").mkdir(exist_ok=True)
        (self.folder / "driver").mkdir(exist_ok=True)
        (self.folder / "mlartifacts").mkdir(exist_ok=True)
        (self.folder / "uc-storage").mkdir(exist_ok=True)
        (self.folder / "Volumes" / UNITY_CATALOG["catalog"] / UNITY_CATALOG["schema"] /
         UNITY_CATALOG["volume"]).mkdir(parents=True, exist_ok=True)
        self.token = secrets.token_hex(16)           # the workspace's API token of this run
        self.api_url = self._start_workspace()
        self.driver = self._start_driver()

    def _deploy(self) -> None:
        """The bundle's files as `databricks bundle deploy` uploads them; notebooks are not files."""
        for name in ("dtlab", "clusters", "scripts"):
            shutil.copytree(ROOT / name, self.workspace / name, ignore=shutil.ignore_patterns("__pycache__"))
        for name in ("databricks.yml", "pyproject.toml", "README.md", "requirements.txt"):
            shutil.copy2(ROOT / name, self.workspace / name)
        for path in ROOT.glob("requirements-dbr*.txt"):
            shutil.copy2(path, self.workspace / path.name)
        (self.workspace / "notebooks").mkdir(parents=True)
        for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
            if NOTEBOOKS_ARE_FILES:
                shutil.copy2(nb, self.workspace / "notebooks" / nb.name)
            else:
                (self.workspace / "notebooks" / nb.name).mkdir()  # exists, but cannot be read as a file

    def _install_wheel(self) -> Path:
        """Build dtlab's wheel with the bundle's artifact command (offline: without build isolation, from the
        runtime's setuptools) in a copy of the sources, and install it as the cluster installs a library."""
        doc = yaml.safe_load((ROOT / "databricks.yml").read_text())
        build = doc["artifacts"]["dtlab"]["build"].replace("python3 -m pip wheel",
                                                            f"{sys.executable} -m pip wheel --no-build-isolation")
        source = self.folder / "bundle-source"
        source.mkdir()
        shutil.copytree(ROOT / "dtlab", source / "dtlab", ignore=shutil.ignore_patterns("__pycache__"))
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(ROOT / name, source / name)
        subprocess.run(["bash", "-c", build], cwd=source, check=True, capture_output=True, timeout=300)
        (wheel,) = (source / "dist").glob("dtlab-*.whl")
        libraries = self.folder / "cluster-libraries"
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target",
                        str(libraries), str(wheel)], check=True, capture_output=True, timeout=300)
        return libraries

    def _notebook_environment(self) -> Path:
        """A Python environment of its own (a folder with only `python`) that sees the runtime's packages."""
        env = self.folder / "python-env"
        (env / "bin").mkdir(parents=True)
        real_site = Path(sysconfig.get_paths()["purelib"])
        version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
        (env / "lib").mkdir()
        (env / "lib" / version).mkdir()
        (env / "lib" / version / "site-packages").symlink_to(real_site)
        base = Path(sys.base_prefix) / "bin" / version
        (env / "bin" / "python").symlink_to(base if base.exists() else Path(sys.executable).resolve())
        (env / "pyvenv.cfg").write_text(f"home = {Path(sys.base_prefix) / 'bin'}\ninclude-system-site-packages = "
                                        f"false\nversion = {sys.version_info[0]}.{sys.version_info[1]}\n")
        kernel = env / "share" / "jupyter" / "kernels" / "databricks"
        kernel.mkdir(parents=True)
        (kernel / "kernel.json").write_text(json.dumps({
            "argv": [str(env / "bin" / "python"), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Databricks (simulated)", "language": "python"}))
        startup = self.folder / "ipython" / "profile_default" / "startup"
        startup.mkdir(parents=True)
        (startup / "00-databricks.py").write_text(_STARTUP)
        return env / "bin" / "python"

    def _plugins(self) -> tuple[Path, Path]:
        """Two folders for PYTHONPATH: the kernel's (``dbruntime``'s REPL context) and the server's (the
        workspace store and the token check, registered as MLflow plugins)."""
        kernel, server = self.folder / "sim-site", self.folder / "server-site"
        (kernel / "dbruntime").mkdir(parents=True)
        (kernel / "dbruntime" / "__init__.py").write_text("")
        (kernel / "dbruntime" / "databricks_repl_context.py").write_text(_REPL_CONTEXT)
        (server / "dtlab_databricks_sim").mkdir(parents=True)
        (server / "dtlab_databricks_sim" / "__init__.py").write_text(_STORE)
        (server / "dtlab_databricks_sim" / "server.py").write_text(_SERVER_APP)
        info = server / "dtlab_databricks_sim-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dtlab-databricks-sim\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text("[mlflow.tracking_store]\ndtlab-workspace = dtlab_databricks_sim:build\n"
                                               "\n[mlflow.app]\ndatabricks-sim = dtlab_databricks_sim.server:app\n")
        return kernel, server

    def _start_workspace(self, timeout: float = 120.0) -> str:
        """Start the workspace's MLflow server (its own session, stopped by ``close``); return its URL."""
        from dtlab.distributed import free_port

        port = free_port()
        db = self.folder / "workspace-mlflow.db"
        cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
               "--backend-store-uri", f"dtlab-workspace:///{db}", "--registry-store-uri", f"sqlite:///{db}",
               "--no-serve-artifacts", "--default-artifact-root", (self.folder / "mlartifacts").as_uri(),
               "--app-name", "databricks-sim",
               # the simulated workspace is a Flask app: gunicorn serves it (MLflow 3.5+ would default to uvicorn, an
               # ASGI server, which cannot call a Flask app: every request answered 500)
               "--gunicorn-opts", "--graceful-timeout 5"]
        env = {**os.environ, "PYTHONPATH": str(self.server_site), "DTLAB_SIM_API_TOKEN": self.token,
               "DTLAB_SIM_FOLDERS": ":".join(EXISTING_FOLDERS), "DTLAB_SIM_USER": USER,
               "DTLAB_SIM_UC_ROOT": str(self.folder / "uc-storage"),
               "DTLAB_SIM_UC_SCHEMAS": f"{UNITY_CATALOG['catalog']}.{UNITY_CATALOG['schema']}",
               "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")}
        self._server_log = open(self.folder / "workspace-server.log", "w")
        self._server = subprocess.Popen(cmd, stdout=self._server_log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
        deadline = time.monotonic() + timeout
        while not _answers(f"http://127.0.0.1:{port}/health"):     # a worker serves: not just the socket bound
            if self._server.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("the workspace's mlflow server did not start; see "
                                   f"{self.folder / 'workspace-server.log'}")
            time.sleep(0.3)
        return f"http://127.0.0.1:{port}"

    def _start_driver(self, timeout: float = 120.0) -> dict:
        """Start the job cluster's driver JVM (its own session, stopped by ``close``) in the driver's folder, with the
        environment a task's kernel has but no task's parameters or credentials; return its gateway's address."""
        env = {**os.environ, **self.environment(None, {})}
        for name in ("DTLAB_SIM_API_URL", "DTLAB_SIM_API_TOKEN", "DTLAB_SIM_WIDGETS", "DTLAB_SIM_UNITY_CATALOG",
                     "DTLAB_SIM_DRIVER"):
            env.pop(name)
        address = self.folder / "driver-gateway.json"
        self._driver_log = open(self.folder / "driver.log", "w")
        self._driver = subprocess.Popen([str(self.python), "-c", _DRIVER, str(address)], cwd=self.folder / "driver",
                                        stdout=self._driver_log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
        deadline = time.monotonic() + timeout
        while not address.exists():
            if self._driver.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the job cluster's driver did not start; see {self.folder / 'driver.log'}")
            time.sleep(0.2)
        return json.loads(address.read_text())

    def close(self) -> None:
        """Stop the workspace's server, the driver and every process they started."""
        from dtlab.processes import stop_group

        if getattr(self, "_server", None) is not None:
            stop_group(self._server)
            self._server = None
            self._server_log.close()
        if getattr(self, "_driver", None) is not None:
            stop_group(self._driver)
            self._driver = None
            self._driver_log.close()

    def environment(self, task: Task | None, widgets: dict[str, str]) -> dict[str, str]:
        """The kernel's environment variables for ``task`` (PATH without the runtime's scripts)."""
        runtime_bin = str(Path(sys.executable).parent)
        path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                               if p and Path(p).resolve() != Path(runtime_bin).resolve())
        return {
            "DATABRICKS_RUNTIME_VERSION": RUNTIME_VERSION_VARIABLE,
            "DB_IS_DRIVER": "TRUE",
            "PATH": path or "/usr/bin:/bin",
            "PYTHONPATH": os.pathsep.join([str(self.site), str(self.libraries)]),
            "JUPYTER_PATH": str(self.python.parent.parent / "share" / "jupyter"),
            "IPYTHONDIR": str(self.folder / "ipython"),
            "TMPDIR": str(self.folder / "tmp"),
            "DTLAB_SCRATCH": "",                     # unset: notebooks choose their scratch as on Databricks
            "MLFLOW_TRACKING_URI": "",               # unset: dtlab.tracking picks "databricks"
            "DTLAB_SIM_WIDGETS": json.dumps(widgets),
            "DTLAB_VOLUMES_ROOT": str(self.folder / "Volumes"),          # /Volumes on a cluster
            # the simulated catalog answers (information_schema) where the task is given Unity Catalog places
            "DTLAB_SIM_UNITY_CATALOG": json.dumps({**UNITY_CATALOG, "grants": GRANTS, "groups": GROUPS})
            if widgets.get("catalog") else "",
            "DTLAB_SIM_SPARK_CONF": json.dumps(single_node_spark_conf()),
            "DTLAB_SIM_DRIVER_DIR": str(self.folder / "driver"),
            "DTLAB_SIM_DRIVER": json.dumps(getattr(self, "driver", {})),   # the gateway, removed by the start-up
            "DTLAB_SIM_API_URL": self.api_url,          # the notebook context's, removed from the environment
            "DTLAB_SIM_API_TOKEN": self.token,          # by the kernel's start-up (see _STARTUP)
            "DTLAB_DATABRICKS_USER": "",                 # unset: dtlab asks the workspace who runs the job
            "DATABRICKS_HOST": "",                       # unset: a job run's environment has neither
            "DATABRICKS_TOKEN": "",
            "SPARK_LOCAL_IP": "127.0.0.1",
            "PYSPARK_PYTHON": str(self.python),
            "PYSPARK_DRIVER_PYTHON": str(self.python),
        }

    def run(self, task: Task, widgets: dict[str, str] | None = None, timeout: int = 900, solutions: bool = False):
        """Execute ``task``'s notebook as the job would; returns ``dtlab.tooling.runner.Result``.

        ``widgets`` (strings) are added to the task's ``base_parameters`` (the tests pass each
        notebook's other parameters this way, as "Run now with different parameters" would);
        ``solutions=True`` keeps the exercise solutions' cells.
        """
        from dtlab.tooling import runner as course

        values = {**task.widgets, **(widgets or {})}
        out = self.folder / "runs"
        out.mkdir(exist_ok=True)
        return course.run_one(task.notebook, out, stream=False, cell_timeout=timeout, solutions=solutions,
                              cwd=self.workspace / "notebooks", kernel_name="databricks",
                              env=self.environment(task, values), inject_parameters=False)
