"""Cluster definitions, checked before you pay for them.

A Databricks cluster file with a typo fails only after a GPU cluster has started (and billed). This
module checks the course's files offline, in two layers:

1. **The strict models of ``databricks-bundles``** (``databricks.bundles.clusters.Cluster``,
   ``databricks.bundles.jobs.Job``): unknown keys and bad enum values raise. (``databricks-sdk``'s
   ``from_dict`` silently drops unknown keys: useless for this.) Their errors name a class, not a
   place; here each becomes ``file: key.path: problem. Fix: ...`` with a "did you mean".
2. **Rules the models cannot express**, about GPUs and the course's one-process-per-GPU layout:

   * a GPU node type (``GPU_NODE_TYPES``) needs a GPU ML runtime (``...-gpu-ml-...``), and a GPU
     runtime needs a GPU node type;
   * the single-node profile (``spark.databricks.cluster.profile: singleNode``) goes with
     ``num_workers: 0``, ``spark.master: local[...]`` and the tag ``ResourceClass: SingleNode``;
     ``num_workers: 0`` without the profile is a driver with no workers;
   * a multi-node GPU cluster sets ``spark.task.resource.gpu.amount`` to 1 (one GPU per Spark task,
     so one TorchDistributor process per GPU), uses a fixed ``num_workers`` (no autoscale), and
     any ``spark.executor.resource.gpu.amount`` equals the node's GPU count;
   * **process counts**: the optional tag ``custom_tags.dtlab_processes`` says how many training
     processes the notebooks start on the cluster. It must equal what the cluster offers: the
     node's GPUs on a single node (``local_mode=True``), ``num_workers x GPUs per node`` on a
     multi-node cluster (``local_mode=False``). In ``databricks.yml``, a notebook's ``nprocs``
     base parameter may not exceed the GPUs of its (driver) node;
   * spot clusters keep an on-demand driver (``first_on_demand >= 1``); all-purpose clusters set
     ``autotermination_minutes``; no literal credentials anywhere (only ``{{secrets/scope/key}}``);
   * in a bundle: ``${var.x}`` refers to a declared variable, tasks' ``depends_on`` and
     ``job_cluster_key`` exist, notebooks exist, and ``base_parameters`` are parameters of the notebook.

    from dtlab import clusters
    clusters.validate("clusters/g5-12xlarge-4-nodes.yml")    # [] when valid, else the problems
    clusters.offers("clusters/g5-12xlarge-4-nodes.yml")      # nodes, GPUs, memory, network

From the shell: ``dtlab clusters validate [PATH ...]`` (default: ``clusters/*.yml`` and ``databricks.yml``).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtlab import course

#: The databricks-bundles release the course validates with (as pinned in requirements.txt).
BUNDLES_PIN = "1.22.1"


class ClusterConfigError(ValueError):
    """A cluster or bundle file is invalid (``problems`` lists each, naming file, key and fix)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


@dataclass(frozen=True)
class NodeType:
    """One GPU instance type: GPUs and their memory, host CPUs and memory, bandwidths.

    ``network_gbps`` is the instance's network (gigabits/s; "up to" figures taken at their burst
    value). ``intra_node_gbs`` is a planning figure for GPU-to-GPU bandwidth inside the node
    (gigabytes/s per GPU, one direction): nominal NVLink where the GPUs have it; for PCIe-only
    nodes, what a collective can expect when traffic crosses the host (g5: ~10 GB/s, the figure
    notebook 08 uses). Measure your own with notebook 02 on the node.
    """

    gpus: int
    gpu: str
    gpu_memory_gb: float
    vcpus: int
    memory_gib: float
    network_gbps: float
    intra_node_gbs: float
    interconnect: str


#: GPU node types the course knows (AWS). Add a row to use another one.
GPU_NODE_TYPES: dict[str, NodeType] = {
    "g4dn.xlarge": NodeType(1, "T4", 16, 4, 16, 25, 0.0, "single GPU"),
    "g4dn.12xlarge": NodeType(4, "T4", 16, 48, 192, 50, 8.0, "PCIe Gen3"),
    "g5.xlarge": NodeType(1, "A10G", 24, 4, 16, 10, 0.0, "single GPU"),
    "g5.12xlarge": NodeType(4, "A10G", 24, 48, 192, 40, 10.0, "PCIe Gen4, no NVLink"),
    "g5.24xlarge": NodeType(4, "A10G", 24, 96, 384, 50, 10.0, "PCIe Gen4, no NVLink"),
    "g5.48xlarge": NodeType(8, "A10G", 24, 192, 768, 100, 10.0, "PCIe Gen4, no NVLink"),
    "p3.2xlarge": NodeType(1, "V100", 16, 8, 61, 10, 0.0, "single GPU"),
    "p3.8xlarge": NodeType(4, "V100", 16, 32, 244, 10, 150.0, "NVLink 2"),
    "p3.16xlarge": NodeType(8, "V100", 16, 64, 488, 25, 150.0, "NVLink 2"),
    "p4d.24xlarge": NodeType(8, "A100", 40, 96, 1152, 400, 300.0, "NVSwitch"),
    "p5.48xlarge": NodeType(8, "H100", 80, 192, 2048, 3200, 450.0, "NVSwitch"),
}

#: Instance families with GPUs: a node type of these families missing from the table is refused.
_GPU_FAMILY = re.compile(r"^(g4ad|g4dn|g5g?|g6e?|gr6|p2|p3dn|p3|p4de?|p5e?n?)\.")
_VAR = re.compile(r"\$\{var\.([A-Za-z_][\w-]*)\}")
_SECRET_REF = re.compile(r"^\{\{secrets/[^/{}]+/[^/{}]+\}\}$")
_TOKEN_VALUE = re.compile(r"dapi[0-9a-f]{32}|ghp_[A-Za-z0-9]{36}|github_pat_\w{20,}|AKIA[0-9A-Z]{16}")
_SECRET_KEY = re.compile(r"token|password|secret|api_?key", re.I)
_BUNDLE_KEYS = ["bundle", "variables", "include", "workspace", "artifacts", "resources", "sync", "targets",
                "permissions", "run_as", "presets", "experimental", "python", "scripts", "git"]


def _models():
    """The strict model classes, or a clear error naming the install command."""
    try:
        from databricks.bundles.clusters import Cluster
        from databricks.bundles.jobs import Job
    except ImportError as exc:
        raise ClusterConfigError([f"cannot validate without the strict Databricks models ({exc}). "
                                  f"Fix: pip install databricks-bundles=={BUNDLES_PIN}"]) from exc
    return Cluster, Job


def _join(where: str, key: Any) -> str:
    return f"{where}[{key}]" if isinstance(key, int) else (f"{where}.{key}" if where else str(key))


def _suggest(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(str(word), choices, n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}?" if close else f"valid: {', '.join(sorted(choices))}"


def _concrete(tpe: Any, value: Any) -> Any:
    """The type a model field holds for ``value``: strip Variable[...], Optional and Union wrappers."""
    if isinstance(value, str) and re.fullmatch(r"\$\{[^}]+\}", value):
        return None  # an interpolation the bundle resolves at deploy time
    while typing.get_origin(tpe) is typing.Union or type(tpe).__name__ == "UnionType":
        args = [a for a in typing.get_args(tpe)
                if a is not type(None) and getattr(typing.get_origin(a), "__name__", "") != "Variable"]
        if len(args) != 1:
            return None
        tpe = args[0]
    return tpe


def schema_problems(cls: Any, value: Any, where: str = "") -> list[str]:
    """Unknown keys, bad enum values and non-numbers under ``where``, walking a model's fields.

    The strict model raises on the first such error without saying where it is; this walk finds
    every one, with its key path and a suggestion. (Problems are ``"key.path: what. Fix: how"``.)
    """
    tpe = _concrete(cls, value)
    if tpe is None or value is None:
        return []
    problems = []
    if dataclasses.is_dataclass(tpe):
        if not isinstance(value, dict):
            return [f"{where}: expected a mapping of {tpe.__name__} fields, got {value!r}. "
                    "Fix: indent its keys under it"]
        hints = typing.get_type_hints(tpe)
        names = [f.name for f in dataclasses.fields(tpe)]
        for key, item in value.items():
            if key in names:
                problems += schema_problems(hints[key], item, _join(where, key))
            else:
                problems.append(f"{_join(where, key)}: unknown key {key!r} for {tpe.__name__}. "
                                f"Fix: {_suggest(key, names)}")
    elif typing.get_origin(tpe) is list:
        if not isinstance(value, list):
            return [f"{where}: expected a list, got {value!r}. Fix: write it as a YAML list (- item)"]
        for i, item in enumerate(value):
            problems += schema_problems(typing.get_args(tpe)[0], item, _join(where, i))
    elif typing.get_origin(tpe) is dict:
        if not isinstance(value, dict):
            return [f"{where}: expected a mapping, got {value!r}. Fix: write it as key: value lines"]
        for key, item in value.items():
            problems += schema_problems(typing.get_args(tpe)[1], item, _join(where, key))
    elif isinstance(tpe, type) and issubclass(tpe, enum.Enum):
        allowed = [m.value for m in tpe]
        if str(value) not in allowed:
            problems.append(f"{where}: {value!r} is not a valid {tpe.__name__}. Fix: {_suggest(value, allowed)}")
    elif tpe in (int, float) and not isinstance(value, bool):
        try:
            tpe(value)
        except (TypeError, ValueError):
            problems.append(f"{where}: {value!r} is not a number. Fix: write a {tpe.__name__}, e.g. 30")
    return problems


def _model_problems(cls: Any, value: Any, where: str) -> list[str]:
    """Validate ``value`` with the strict model; explain any error with ``schema_problems``."""
    try:
        cls.from_dict(value)
        return []
    except Exception as exc:  # the models raise ValueError/TypeError/KeyError with a bare message
        found = schema_problems(cls, value, where)
        return found or [f"{where or cls.__name__}: {exc}. Fix: compare with the {cls.__name__} model's fields"]


def _resolve(value: Any, variables: dict[str, Any], problems: list[str], where: str = "") -> Any:
    """Replace ``${var.name}`` with the variable's default (other ``${...}`` stay for the bundle)."""
    if isinstance(value, dict):
        return {k: _resolve(v, variables, problems, _join(where, k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, variables, problems, _join(where, i)) for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value
    for name in _VAR.findall(value):
        if name not in variables:
            problems.append(f"{where}: ${{var.{name}}} is not declared under variables. "
                            f"Fix: {_suggest(name, list(variables))}")
    whole = _VAR.fullmatch(value)
    if whole and whole.group(1) in variables:
        return variables[whole.group(1)]
    return _VAR.sub(lambda m: str(variables.get(m.group(1), m.group(0))), value)


def _secret_problems(value: Any, where: str = "") -> list[str]:
    """Literal credentials anywhere in a file (tokens belong in ``{{secrets/scope/key}}`` references)."""
    if isinstance(value, dict):
        out = []
        for k, v in value.items():
            if isinstance(v, (str, int)) and not isinstance(v, bool) and _SECRET_KEY.search(str(k)) \
                    and str(v).strip() and not _SECRET_REF.match(str(v)) and not str(v).startswith("${"):
                out.append(f"{_join(where, k)}: a literal credential. Fix: store it with `databricks secrets "
                           f"put-secret <scope> <key>` and write \"{{{{secrets/<scope>/<key>}}}}\" here")
            else:
                out += _secret_problems(v, _join(where, k))
        return out
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _secret_problems(v, _join(where, i))]
    if isinstance(value, str) and _TOKEN_VALUE.search(value):
        return [f"{where}: looks like a token. Fix: use a secret reference \"{{{{secrets/<scope>/<key>}}}}\""]
    return []


def node_type(spec: dict) -> NodeType | None:
    """The ``NodeType`` of a cluster spec's ``node_type_id`` (None for a CPU or unknown type)."""
    return GPU_NODE_TYPES.get(str(spec.get("node_type_id", "")))


def is_single_node(spec: dict) -> bool:
    """True for the single-node profile (or the newer ``is_single_node: true``)."""
    conf = spec.get("spark_conf") or {}
    return conf.get("spark.databricks.cluster.profile") == "singleNode" or spec.get("is_single_node") is True


def cluster_problems(spec: dict, where: str = "", all_purpose: bool = True) -> list[str]:
    """The course's own rules for one cluster spec (see the module docstring). Problems as strings.

    ``all_purpose=False`` for a job cluster (it ends with its run, so no autotermination needed).
    """
    at = lambda key: _join(where, key)  # the key path inside ``where``
    problems: list[str] = []
    node_id = str(spec.get("node_type_id", ""))
    runtime = str(spec.get("spark_version", ""))
    conf = spec.get("spark_conf") or {}
    tags = spec.get("custom_tags") or {}
    gpu = GPU_NODE_TYPES.get(node_id)
    unresolved = "${" in node_id + runtime  # an interpolation only the deployed bundle knows: no guessing
    if not unresolved and gpu is None and _GPU_FAMILY.match(node_id):
        problems.append(f"{at('node_type_id')}: {node_id!r} is a GPU instance type dtlab does not know. "
                        f"Fix: {_suggest(node_id, list(GPU_NODE_TYPES))} (or add it to dtlab.clusters.GPU_NODE_TYPES)")
    if gpu and not unresolved and "-gpu-ml-" not in runtime:
        problems.append(f"{at('spark_version')}: {runtime!r} has no CUDA libraries, but {node_id} is a GPU node. "
                        "Fix: a GPU ML runtime, e.g. spark_version: 15.4.x-gpu-ml-scala2.12")
    if not gpu and not unresolved and "-gpu-" in runtime and not _GPU_FAMILY.match(node_id):
        problems.append(f"{at('spark_version')}: the GPU runtime {runtime!r} on {node_id or 'no node type'!r}, "
                        "which has no GPU. Fix: a GPU node_type_id such as g5.12xlarge, or a CPU runtime "
                        "(e.g. 15.4.x-cpu-ml-scala2.12)")

    workers = spec.get("num_workers")
    if isinstance(workers, str) and workers.isdigit():
        workers = int(workers)
    if is_single_node(spec):
        if workers not in (0, None) or spec.get("autoscale"):
            problems.append(f"{at('num_workers')}: the single-node profile with {workers or 'autoscaled'} workers. "
                            "Fix: num_workers: 0 (or remove spark.databricks.cluster.profile: singleNode "
                            "for a multi-node cluster)")
        if not str(conf.get("spark.master", "")).startswith("local"):
            problems.append(f"{at('spark_conf')}.spark.master: a single node runs Spark in local mode. "
                            "Fix: spark.master: \"local[*, 4]\"")
        if tags.get("ResourceClass") != "SingleNode":
            problems.append(f"{at('custom_tags')}.ResourceClass: a single-node cluster is tagged SingleNode. "
                            "Fix: custom_tags: {ResourceClass: SingleNode}")
    elif spec.get("autoscale"):
        if gpu:
            problems.append(f"{at('autoscale')}: a GPU training cluster that grows and shrinks changes the number "
                            "of processes under a running job. Fix: a fixed num_workers instead of autoscale")
    elif workers in (0, None):
        problems.append(f"{at('num_workers')}: {workers} workers without the single-node profile is a driver with "
                        "nothing to run Spark tasks (TorchDistributor(local_mode=False) waits forever). Fix: "
                        "num_workers >= 1, or the single-node profile: spark_conf spark.databricks.cluster.profile: "
                        "singleNode, spark.master: \"local[*, 4]\", custom_tags ResourceClass: SingleNode")
    elif gpu:
        amount = conf.get("spark.task.resource.gpu.amount")
        if amount is None:
            problems.append(f"{at('spark_conf')}: a multi-node GPU cluster needs spark.task.resource.gpu.amount, "
                            "or Spark tasks get no GPU. Fix: spark.task.resource.gpu.amount: \"1\"")
        elif not re.fullmatch(r"\d+(\.\d+)?", str(amount)):
            problems.append(f"{at('spark_conf')}.spark.task.resource.gpu.amount: {amount!r} is not a number. "
                            "Fix: spark.task.resource.gpu.amount: \"1\"")
        elif float(amount) != 1:
            problems.append(f"{at('spark_conf')}.spark.task.resource.gpu.amount: {amount} gives "
                            f"{gpu.gpus / float(amount):g} tasks per {gpu.gpus}-GPU node; the notebooks run one "
                            "process per GPU. Fix: spark.task.resource.gpu.amount: \"1\"")
        per_executor = conf.get("spark.executor.resource.gpu.amount")
        if per_executor is not None and str(per_executor) not in (str(gpu.gpus), f"{gpu.gpus}.0"):
            problems.append(f"{at('spark_conf')}.spark.executor.resource.gpu.amount: {per_executor}, but a "
                            f"{node_id} has {gpu.gpus} GPUs. Fix: spark.executor.resource.gpu.amount: \"{gpu.gpus}\" "
                            "(or leave it out: Databricks sets it from the node)")

    declared = tags.get("dtlab_processes")
    if declared is not None and gpu and not problems:
        single = is_single_node(spec)
        offered = gpu.gpus if single else (workers or 0) * gpu.gpus
        how = (f"one per GPU of the single {node_id}" if single
               else f"{workers} workers x {gpu.gpus} GPUs per {node_id}, one process per GPU")
        if str(declared) != str(offered):
            problems.append(f"{at('custom_tags')}.dtlab_processes: {declared}, but this cluster runs {offered} "
                            f"processes ({how}). Fix: dtlab_processes: \"{offered}\", or change num_workers")

    aws = spec.get("aws_attributes") or {}
    on_demand = str(aws.get("first_on_demand") or 0)
    if str(aws.get("availability", "")).startswith("SPOT") and on_demand.isdigit() and int(on_demand) < 1:
        problems.append(f"{at('aws_attributes')}.first_on_demand: a spot driver can be reclaimed, ending the "
                        "cluster and every notebook's state. Fix: first_on_demand: 1 (an on-demand driver)")
    if all_purpose and not spec.get("autotermination_minutes"):
        problems.append(f"{at('autotermination_minutes')}: an all-purpose GPU cluster without it bills until "
                        "someone stops it. Fix: autotermination_minutes: 30")
    return problems


def load(path: str | Path) -> Any:
    """Read a YAML file (``yaml.safe_load``); a syntax error becomes a ClusterConfigError naming the line."""
    import yaml

    try:
        return yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as exc:
        raise ClusterConfigError([f"{path}: not valid YAML: {exc}. Fix: check the indentation there"]) from exc


def _job_problems(job: dict, where: str, base: Path) -> list[str]:
    """Tasks, job clusters and notebooks of one job of a bundle."""
    problems: list[str] = []
    clusters = {c.get("job_cluster_key"): c.get("new_cluster") or {} for c in job.get("job_clusters") or []}
    for i, spec in enumerate(clusters.values()):
        problems += cluster_problems(spec, f"{where}.job_clusters[{i}].new_cluster", all_purpose=False)
    tasks = job.get("tasks") or []
    keys = [t.get("task_key") for t in tasks]
    for i, task in enumerate(tasks):
        at = f"{where}.tasks[{i}]"
        if keys.count(task.get("task_key")) > 1:
            problems.append(f"{at}.task_key: {task.get('task_key')!r} is used twice. Fix: make task keys unique")
        for dep in task.get("depends_on") or []:
            if dep.get("task_key") not in keys:
                problems.append(f"{at}.depends_on: no task {dep.get('task_key')!r}. "
                                f"Fix: {_suggest(dep.get('task_key'), keys)}")
        cluster_key = task.get("job_cluster_key")
        if cluster_key is not None and cluster_key not in clusters:
            problems.append(f"{at}.job_cluster_key: no job cluster {cluster_key!r}. "
                            f"Fix: {_suggest(cluster_key, list(clusters))}")
        nb_task = task.get("notebook_task") or {}
        if not nb_task.get("notebook_path"):
            continue
        nb_path = (base / nb_task["notebook_path"]).resolve()
        if not nb_path.is_file():
            others = [p.name for p in sorted(nb_path.parent.glob("*.ipynb"))]
            close = difflib.get_close_matches(nb_path.name, others, n=1, cutoff=0.85)
            fix = f"did you mean {close[0]!r}?" if close else f"create it, or use one of {', '.join(others) or 'none'}"
            problems.append(f"{at}.notebook_task.notebook_path: {nb_task['notebook_path']} does not exist. Fix: {fix}")
            continue
        names = list(course.notebook_parameters(nb_path))
        params = nb_task.get("base_parameters") or {}
        for name in params:
            if name not in names:
                problems.append(f"{at}.notebook_task.base_parameters.{name}: {nb_path.name} has no parameter "
                                f"{name!r} (a widget nobody reads). Fix: {_suggest(name, names)}")
        gpu = node_type(clusters.get(cluster_key) or {})
        nprocs = str(params.get("nprocs", "None"))
        if gpu and nprocs.isdigit() and int(nprocs) > gpu.gpus:
            problems.append(f"{at}.notebook_task.base_parameters.nprocs: {nprocs} processes, but the notebook runs "
                            f"on one {gpu.gpus}-GPU node. Fix: nprocs: \"{gpu.gpus}\" (or \"None\": one per GPU)")
    return problems


def _bundle_problems(doc: dict, path: Path) -> list[str]:
    Cluster, Job = _models()
    problems = []
    for key in doc:
        if key not in _BUNDLE_KEYS:
            problems.append(f"{key}: unknown top-level key of a bundle. Fix: {_suggest(key, _BUNDLE_KEYS)}")
    if not (doc.get("bundle") or {}).get("name"):
        problems.append("bundle.name: a bundle needs a name. Fix: bundle: {name: dtlab-course}")
    variables = {name: (v or {}).get("default") if isinstance(v, dict) else v
                 for name, v in (doc.get("variables") or {}).items()}
    resolved = _resolve(doc, variables, problems)
    resources = resolved.get("resources") or {}
    for name, job in (resources.get("jobs") or {}).items():
        where = f"resources.jobs.{name}"
        found = _model_problems(Job, job, where)
        problems += found or _job_problems(job, where, path.parent)
    for name, spec in (resources.get("clusters") or {}).items():
        where = f"resources.clusters.{name}"
        problems += _model_problems(Cluster, spec, where) or cluster_problems(spec, where)
    return problems


def validate(path: str | Path) -> list[str]:
    """Check one file: a cluster definition or a bundle (``databricks.yml``). Returns the problems.

    Each problem reads ``file: key.path: what is wrong. Fix: what to write``; an empty list means
    valid. A file with a top-level ``bundle`` or ``resources`` key is read as a bundle.

    Raises:
        ClusterConfigError: when databricks-bundles is not installed (nothing can be validated).
        FileNotFoundError: when ``path`` does not exist.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    Cluster, _ = _models()
    try:
        doc = load(path)
    except ClusterConfigError as exc:
        return exc.problems
    if not isinstance(doc, dict):
        return [f"{path}: expected a YAML mapping (key: value lines), got {type(doc).__name__}. "
                "Fix: see clusters/g5-12xlarge-single-node.yml for the shape"]
    if "bundle" in doc or "resources" in doc:
        problems = _bundle_problems(doc, path)
    else:
        problems = _model_problems(Cluster, doc, "") or cluster_problems(doc)
    problems += _secret_problems(doc)
    return [f"{path}: {p}" for p in problems]


def check(path: str | Path) -> None:
    """``validate``, raising ``ClusterConfigError`` with every problem when there are any."""
    problems = validate(path)
    if problems:
        raise ClusterConfigError(problems)


def find_root(start: str | Path | None = None) -> Path:
    """The repository root: the first of ``start`` (default: cwd) and its parents with a ``clusters/``
    folder, else the folder above the installed ``dtlab`` package."""
    here = Path(start or Path.cwd()).resolve()
    for folder in [here, *here.parents]:
        if (folder / "clusters").is_dir() and (folder / "dtlab").is_dir():
            return folder
    return Path(__file__).resolve().parent.parent


def default_paths(root: str | Path | None = None) -> list[Path]:
    """Every YAML file in ``clusters/`` and the bundle ``databricks.yml`` of the repository."""
    root = Path(root) if root else find_root()
    paths = sorted([*root.glob("clusters/*.yml"), *root.glob("clusters/*.yaml")])
    return paths + ([root / "databricks.yml"] if (root / "databricks.yml").is_file() else [])


@dataclass(frozen=True)
class Offer:
    """What a cluster gives a training job: nodes, GPUs, memory and bandwidths (see ``offers``)."""

    name: str
    node_type: str
    nodes: int            # nodes whose GPUs train (the driver on a single node, the workers otherwise)
    gpus_per_node: int
    gpu: str
    gpu_memory_gb: float  # per GPU
    cpu_memory_gib: float  # per node
    network_gbps: float   # between nodes, per node
    intra_node_gbs: float  # between GPUs of one node (GB/s, planning figure; see NodeType)
    local_mode: bool      # TorchDistributor's local_mode for this cluster
    processes: int        # training processes: one per GPU

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def gpu_memory_gb_total(self) -> float:
        return self.gpus * self.gpu_memory_gb

    @property
    def inter_node_gbs(self) -> float:
        """The network in gigabytes/s (what an all-reduce across nodes can use at best)."""
        return self.network_gbps / 8


def offers(source: str | Path | dict) -> Offer:
    """What the GPU cluster in ``source`` (a cluster file or an already loaded spec) offers.

    Raises:
        ClusterConfigError: for a spec that is not a GPU cluster dtlab knows.
    """
    spec = load(source) if not isinstance(source, dict) else source
    gpu = node_type(spec)
    if gpu is None:
        raise ClusterConfigError([f"{source if not isinstance(source, dict) else 'spec'}: node_type_id "
                                  f"{spec.get('node_type_id')!r} is not a GPU node type dtlab knows. "
                                  f"Fix: one of {', '.join(GPU_NODE_TYPES)}"])
    single = is_single_node(spec)
    nodes = 1 if single else int(spec.get("num_workers") or 0)
    return Offer(name=str(spec.get("cluster_name", "")), node_type=str(spec["node_type_id"]), nodes=nodes,
                 gpus_per_node=gpu.gpus, gpu=gpu.gpu, gpu_memory_gb=gpu.gpu_memory_gb, cpu_memory_gib=gpu.memory_gib,
                 network_gbps=gpu.network_gbps, intra_node_gbs=gpu.intra_node_gbs, local_mode=single,
                 processes=nodes * gpu.gpus)
