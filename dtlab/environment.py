"""What this machine has, and how the course will run on it.

The course runs the same code on a laptop CPU, a one-GPU workstation and a GPU cluster.
Everything that differs between them is decided here, once:

* 2 or more CUDA GPUs: backend ``nccl``, device ``cuda``, one process per GPU;
* one GPU:  a *multi-process* lesson runs ``DEFAULT_CPU_PROCESSES`` CPU processes with ``gloo``
  (NCCL cannot put two ranks on one GPU, and one process teaches nothing about distribution);
  *single-device* work (``plan(nprocs=1)``: the baseline, precision, matmul speed) uses the GPU;
* no GPU: backend ``gloo``, device ``cpu``, ``DEFAULT_CPU_PROCESSES`` processes.

Asking for more processes than GPUs without forcing a device gives CPU processes too (with the
reason in ``Plan.reason``).

Either can be forced (``plan(backend="gloo")`` on a GPU box, for instance), and a forced choice
that cannot work (``nccl`` with no GPU, more GPU processes than GPUs) is refused with an error
that says how to fix it.

>>> from dtlab.environment import plan
>>> plan()                     # doctest: +SKIP
Plan(backend='gloo', device='cpu', nprocs=2, reason='no CUDA GPU: gloo with 2 CPU processes')
"""

from __future__ import annotations

import importlib
import os
import platform
import shutil
import subprocess
from dataclasses import asdict, dataclass

import torch

#: Processes used on a CPU-only machine when nothing is forced: the smallest world that is
#: still distributed. More than the number of cores only oversubscribes them.
DEFAULT_CPU_PROCESSES = 2

#: Hard ceiling on CPU processes, as a multiple of the core count. Beyond a few processes per
#: core, gloo collectives mostly measure the scheduler.
MAX_CPU_PROCESSES_PER_CORE = 4


@dataclass(frozen=True)
class Plan:
    """How a distributed lesson will run here: backend, device type and process count."""

    backend: str
    device: str
    nprocs: int
    reason: str

    def as_dict(self) -> dict:
        return asdict(self)


def gpu_count() -> int:
    """Number of CUDA GPUs torch can see (0 on a CPU-only machine)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def plan(backend: str | None = None, nprocs: int | None = None, device: str | None = None) -> Plan:
    """Decide backend, device and process count for this machine.

    Args:
        backend: ``"nccl"`` or ``"gloo"`` to force one; ``None`` picks nccl with GPUs, gloo without.
        nprocs: processes to start; ``None`` means one per GPU with 2 or more GPUs, else
            ``DEFAULT_CPU_PROCESSES`` CPU processes. More than the GPUs (device not forced): CPU processes.
        device: ``"cuda"`` or ``"cpu"`` to force one; ``None`` follows the backend and the GPU count.

    Raises:
        ValueError: a forced choice this machine cannot run, with the fix in the message.
    """
    gpus = gpu_count()
    cores = os.cpu_count() or 1
    forced_cpu = (device or "").lower() == "cpu" or (backend or "").lower() == "gloo"
    if backend is not None:
        backend = backend.lower()
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"backend={backend!r} is not one the course uses. Fix: pass 'nccl' (GPUs), "
                             "'gloo' (CPU, or GPUs without NCCL) or None to choose automatically.")
    if device is not None:
        device = device.lower()
        if device not in ("cuda", "cpu"):
            raise ValueError(f"device={device!r} is not supported. Fix: pass 'cuda', 'cpu' or None.")

    if backend == "nccl" and gpus == 0:
        raise ValueError("backend='nccl' needs CUDA GPUs, but torch.cuda.is_available() is False on this "
                         "machine. Fix: use backend='gloo' (or leave backend unset to choose automatically).")
    if device == "cuda" and gpus == 0:
        raise ValueError("device='cuda' was forced, but no CUDA GPU is visible. Fix: use device='cpu' "
                         "or leave device unset.")
    if backend == "nccl" and device == "cpu":
        raise ValueError("nccl only moves CUDA tensors. Fix: use backend='gloo' for device='cpu'.")

    if nprocs is not None and (not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1):
        raise ValueError(f"nprocs={nprocs!r} must be a positive integer (or None for automatic), e.g. nprocs=2.")
    # Can the GPUs take the processes, one each? (NCCL refuses two ranks on one GPU.)
    wanted = nprocs if nprocs is not None else max(gpus, DEFAULT_CPU_PROCESSES)
    gpus_fit = gpus >= 1 and wanted <= gpus
    if device == "cuda" or backend == "nccl":
        if nprocs is not None and nprocs > gpus:
            raise ValueError(f"nprocs={nprocs} but this machine has {gpus} GPU(s); the course runs one process "
                             f"per GPU. Fix: pass nprocs<={gpus}, or device='cpu' to run CPU processes.")
        if nprocs is None and gpus < DEFAULT_CPU_PROCESSES and backend == "nccl":
            raise ValueError(f"backend='nccl' for a multi-process lesson needs 2 or more GPUs; this machine has "
                             f"{gpus}. Fix: leave backend unset (CPU processes with gloo), or pass nprocs=1.")
    if backend is None:
        backend = "nccl" if device != "cpu" and (device == "cuda" or gpus_fit) else "gloo"
    if device is None:
        device = "cuda" if backend == "nccl" else "cpu"
    if nprocs is None:
        nprocs = gpus if device == "cuda" else DEFAULT_CPU_PROCESSES

    limit = MAX_CPU_PROCESSES_PER_CORE * cores
    if device == "cpu" and nprocs > limit:
        raise ValueError(f"nprocs={nprocs} CPU processes on {cores} core(s) is more than this machine can "
                         f"usefully run (limit {limit}). Fix: pass nprocs<={cores} (one per core) for timing, "
                         f"or at most {limit} for a correctness check.")

    if device == "cuda":
        reason = f"{gpus} CUDA GPU(s): {backend} with one process per GPU ({nprocs})"
    elif gpus and forced_cpu:
        reason = f"CPU forced on a machine with {gpus} GPU(s): gloo with {nprocs} CPU processes"
    elif gpus:
        reason = (f"{nprocs} processes but {gpus} GPU(s): NCCL needs one GPU per process, so gloo with {nprocs} "
                  "CPU processes (single-device work still uses the GPU; pass nprocs<=GPUs to run on them)")
    else:
        reason = f"no CUDA GPU: gloo with {nprocs} CPU processes"
    return Plan(backend=backend, device=device, nprocs=nprocs, reason=reason)


def resume_world(plan: Plan, resume_on: int | None = None) -> int:
    """How many processes a run that resumes ``plan``'s checkpoint uses: ``resume_on`` when given (checked), else
    ``plan.nprocs + 1`` where the machine has them, else ``plan.nprocs - 1`` (on GPUs, all of them already in
    use), else ``plan.nprocs`` (one process: nothing fewer).

    Raises:
        ValueError: ``resume_on`` GPU processes on a machine with fewer GPUs (PySpark would quietly start fewer),
        naming the fix.
    """
    n = plan.nprocs
    if resume_on is not None:
        if not isinstance(resume_on, int) or isinstance(resume_on, bool) or resume_on < 1:
            raise ValueError(f"resume_on={resume_on!r}: a positive number of processes. Fix: e.g. resume_on={n}")
        if plan.device == "cuda" and resume_on > gpu_count():
            raise ValueError(f"resume_on={resume_on} processes, one per GPU, but this node has {gpu_count()} GPU(s). "
                             f"Fix: resume_on <= {gpu_count()} (e.g. {max(n - 1, 1)}: fewer ranks than the first run), "
                             "or leave it unset")
        return resume_on
    if plan.device != "cuda" or n + 1 <= gpu_count():
        return n + 1
    return n - 1 if n > 1 else n


def global_batch(per_rank: int, *worlds: int) -> int:
    """The smallest global batch of at least ``per_rank x worlds[0]`` samples that every world size in ``worlds``
    divides: each run then takes the same samples per step, and the optimisation is the same whatever N."""
    import math

    if per_rank < 1 or not worlds or min(worlds) < 1:
        raise ValueError(f"per_rank={per_rank}, worlds={worlds}: positive numbers. Fix: e.g. global_batch(6, 2, 3)")
    step = math.lcm(*worlds)
    return -(-per_rank * worlds[0] // step) * step


#: Library versions of the Databricks runtimes the course targets, as shipped (requirements-dbr<runtime>.txt
#: pins the same, with their sources; tests/test_environment.py checks they agree). ``dtlab env`` on a
#: cluster reports any installed version that differs: usually requirements.txt installed over the runtime.
#: (17.3's and 18's MLflow is mlflow-skinny: the ``mlflow`` distribution there is that one. 18 LTS has point releases,
#: 18.0 to 18.2, with the same libraries: ``DATABRICKS_RUNTIME_VERSION`` 18.2 matches "18".)
DATABRICKS_RUNTIME_STACKS: dict[str, dict[str, str]] = {
    "15.4": {"torch": "2.3.1", "pyspark": "3.5.0", "mlflow": "2.13.1", "numpy": "1.23.5", "pandas": "1.5.3",
             "pyarrow": "14.0.1", "ipywidgets": "7.7.2", "cloudpickle": "2.2.1", "matplotlib": "3.7.2",
             "scikit-learn": "1.3.0", "horovod": "0.28.1", "deepspeed": "0.14.4", "transformers": "4.41.2"},
    "17.3": {"torch": "2.7.0", "pyspark": "4.0.0", "mlflow": "3.0.1", "numpy": "2.1.3", "pandas": "2.2.3",
             "pyarrow": "19.0.1", "ipywidgets": "7.8.1", "cloudpickle": "3.0.0", "matplotlib": "3.10.0",
             "scikit-learn": "1.6.1", "deepspeed": "0.16.5", "transformers": "4.51.3"},
    "18": {"torch": "2.9.0", "pyspark": "4.1.0", "mlflow": "3.8.1", "numpy": "2.1.3", "pandas": "2.2.3",
           "pyarrow": "21.0.0", "ipywidgets": "7.8.1", "cloudpickle": "3.0.0", "matplotlib": "3.10.0",
           "scikit-learn": "1.6.1", "deepspeed": "0.18.1", "transformers": "4.57.1", "deltalake": "1.1.4"},
}


def runtime_mismatches(runtime: str | None = None) -> list[str]:
    """Installed versions that differ from the Databricks runtime's own (empty off Databricks, or when all match).

    ``runtime`` defaults to ``DATABRICKS_RUNTIME_VERSION`` (e.g. ``15.4``); local builds such as
    ``2.3.1+cu121`` match ``2.3.1``.
    """
    from importlib import metadata

    runtime = runtime or os.environ.get("DATABRICKS_RUNTIME_VERSION", "")
    stack = next((v for k, v in DATABRICKS_RUNTIME_STACKS.items() if runtime == k or runtime.startswith(k + ".")), None)
    if not stack:
        return []
    found = []
    for package, shipped in stack.items():
        try:
            installed = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
        if installed.split("+")[0] != shipped:
            found.append(f"{package} {installed} (the runtime ships {shipped})")
    return found


def _version(module: str) -> str | None:
    try:
        mod = importlib.import_module(module)
    except Exception:
        return None
    return getattr(mod, "__version__", "unknown")


def horovod_status() -> dict:
    """Whether Horovod is importable with PyTorch, and which controllers/operations it was built with.

    Returns a dict with ``installed`` (bool), ``version``, ``gloo``, ``mpi``, ``nccl`` and, when
    something is missing, ``problem`` and ``fix`` (the command that repairs it).
    """
    fix = ("run `make setup` (builds Horovod 0.28.1 with PyTorch + Gloo: scripts/build_horovod.sh); on "
           "Databricks use Runtime 15.4 LTS ML, the last with Horovod preinstalled, or move to "
           "TorchDistributor (notebook 04)")
    try:
        import horovod
    except ImportError:
        return {"installed": False, "problem": "horovod is not installed", "fix": fix}
    if getattr(horovod, "__file__", None) is None:     # a folder named horovod on sys.path, not the package
        where = ", ".join(getattr(horovod, "__path__", []))
        return {"installed": False, "problem": f"horovod is not installed (`import horovod` found the folder {where})",
                "fix": fix}
    try:
        import horovod.torch as hvd
    except Exception as exc:  # ImportError, or a torch ABI mismatch raised as OSError/RuntimeError
        return {"installed": False, "version": horovod.__version__,
                "problem": f"horovod is installed but not built for PyTorch ({type(exc).__name__}: {exc})",
                "fix": fix}
    built = {name: bool(getattr(hvd, f"{name}_built", lambda: False)())
             for name in ("gloo", "mpi", "nccl", "ddl", "ccl", "cuda", "rocm")}
    return {"installed": True, "version": horovod.__version__, **built}


def require_horovod() -> dict:
    """``horovod_status()`` when Horovod works with PyTorch; otherwise a RuntimeError naming the fix."""
    status = horovod_status()
    if not status["installed"]:
        raise RuntimeError(f"{status['problem']}. Fix: {status['fix']}.")
    return status


def console_script(name: str) -> str | None:
    """The path of an installed command-line tool (``py-spy``, ``torchrun``...), or None.

    Looks on ``PATH``, next to this Python, and in the ``bin`` folder of every installation whose
    packages this Python sees. On Databricks a notebook's interpreter lives in its own environment,
    away from the runtime's scripts (``/databricks/python3/bin``), so ``PATH`` and ``sys.executable``
    alone miss them; for Python tools prefer ``python -m`` (``-m torch.distributed.run``).
    """
    import site
    import sys
    from pathlib import Path

    found = shutil.which(name)
    if found:
        return found
    candidates = [Path(sys.executable).parent / name]
    for folder in [*site.getsitepackages(), site.getusersitepackages()]:
        real = Path(folder).resolve()
        if real.name == "site-packages" and len(real.parents) >= 3:
            candidates.append(real.parents[2] / "bin" / name)  # <prefix>/lib/pythonX.Y/site-packages
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return None


def java_version() -> str | None:
    """The first line of ``java -version`` (Spark needs Java 17), or None without Java."""
    java = shutil.which("java")
    if java is None:
        return None
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = (out.stderr or out.stdout).strip().splitlines()
    return lines[0] if lines else None


def report() -> dict:
    """Everything the course depends on, as a dict (see ``format_report`` for the printed form)."""
    gpus = [torch.cuda.get_device_name(i) for i in range(gpu_count())]
    dist = torch.distributed
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.version.cuda else None
    except Exception:  # a CUDA build without NCCL
        nccl = None
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_cores": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "nccl": nccl,
        "databricks_runtime": os.environ.get("DATABRICKS_RUNTIME_VERSION"),
        "runtime_mismatches": runtime_mismatches(),
        "gpus": gpus,
        "backends": {
            "gloo": dist.is_available() and dist.is_gloo_available(),
            "nccl": dist.is_available() and dist.is_nccl_available(),
            "mpi": dist.is_available() and dist.is_mpi_available(),
        },
        "bf16_on_gpu": bool(gpus) and torch.cuda.is_bf16_supported(),
        "packages": {name: _version(name) for name in
                     ("deepspeed", "pyspark", "mlflow", "papermill", "ipywidgets", "matplotlib")},
        "horovod": horovod_status(),
        "java": java_version(),
        "plan": plan().as_dict(),
    }


def format_report(info: dict | None = None) -> str:
    """The environment report as readable text (what ``dtlab env`` prints)."""
    info = report() if info is None else info
    lines = [
        f"python      {info['python']}  ({info['platform']}, {info['cpu_cores']} CPU cores)",
        f"torch       {info['torch']}  (CUDA {info['cuda'] or 'none'}, cuDNN {info.get('cudnn') or 'none'}, "
        f"NCCL {info.get('nccl') or 'none'})",
        f"GPUs        {', '.join(info['gpus']) if info['gpus'] else 'none'}",
        "backends    " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in info["backends"].items()),
    ]
    for name, version in info["packages"].items():
        lines.append(f"{name:<11} {version or 'not installed'}")
    hvd = info["horovod"]
    if hvd["installed"]:
        controllers = [k for k in ("gloo", "mpi") if hvd.get(k)]
        ops = [k for k in ("nccl", "ddl", "ccl", "cuda", "rocm") if hvd.get(k)]
        lines.append(f"horovod     {hvd['version']}  (PyTorch; controllers {', '.join(controllers) or 'none'}; "
                     f"GPU operations {', '.join(ops) or 'none'})")
    else:
        lines.append(f"horovod     MISSING: {hvd['problem']}. Fix: {hvd['fix']}")
    lines.append(f"java        {info['java'] or 'MISSING: Spark needs Java 17. Fix: apt-get install openjdk-17-jre'}")
    if info.get("databricks_runtime"):
        mismatched = info.get("runtime_mismatches") or []
        lines.append(f"databricks  runtime {info['databricks_runtime']}: " + (
            "MISMATCH: " + "; ".join(mismatched) + ". Was requirements.txt installed over the runtime? Fix: restart "
            "the cluster (a new node has the runtime's own libraries) and install only dtlab, with --no-deps, as "
            "clusters/init/install-dtlab.sh does" if mismatched else "libraries as the runtime ships them"))
    p = info["plan"]
    lines.append(f"course plan backend={p['backend']} device={p['device']} nprocs={p['nprocs']}  ({p['reason']})")
    return "\n".join(lines)
