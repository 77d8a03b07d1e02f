"""Ray Train and Ray Data for the course: a quiet local Ray, the course's data as a Ray Dataset,
a trainer's request checked before the long wait, checkpoints read back, stray Ray processes found.

The lesson's Ray lines (``TorchTrainer``, ``ScalingConfig``, ``ray.train.report``,
``get_dataset_shard``...) stay in notebook 18; this module holds only the plumbing around them.

* ``NEEDS_RAY`` / ``require()`` — the lesson is written and tested against Ray 2.60, whose Train
  API is "Train V2" (the default there: a controller actor, no extra CPU for a trainer actor,
  collective timeouts). ``require()`` raises one ``RayProblem`` naming the fix when Ray is missing
  or older. Databricks Runtime 15.4 LTS ML preinstalls an older Ray, and Ray 2.60 cannot be
  installed over that runtime's pandas 1.5 / pyarrow 14 / packaging 23 (it needs pandas >= 2.2.3,
  pyarrow >= 17, packaging >= 24.2): use a newer ML runtime for this lesson.
* ``start(num_cpus)`` — ``ray.init`` on this machine with the dashboard off, workers' logs kept out
  of the notebook, token authentication off (a local, single-user cluster), and a *collective
  timeout*: a ``ray.train.report`` that some workers never reach raises instead of hanging.
* ``write_parquet(dataset, folder)`` — a course ``TensorDataset`` as a Parquet file with an ``id``
  column (so shards can be checked for overlap and coverage) and raw, unscaled features (so the
  lesson has a preprocessing step to do with ``map_batches``).
* ``check_request(...)`` — the bad inputs that would otherwise fail after a long wait (more
  workers than CPUs or GPUs, ``use_gpu`` without a GPU, an unwritable storage path, a training
  function that cannot be pickled), each as one ``RayProblem`` with the fix.
* ``load_state(checkpoint)`` — the ``state.pt`` the lesson's function saves in each checkpoint.
* ``ray_processes()`` / ``wait_until_stopped()`` — Ray's daemons (raylet, GCS...) still running:
  a lesson or test that starts Ray must leave none behind.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from dtlab.processes import wait_until_gone

#: The Ray version the lesson is written and tested against (Train V2).
NEEDS_RAY = "2.60"
#: How a learner gets it (the project's set-up installs the same pin).
INSTALL = 'pip install "ray[train,data,client]==2.60.0"'
#: Names of Ray's long-running processes.
DAEMONS = ("raylet", "gcs_server", "dashboard", "log_monitor", "monitor.py", "ray_client_server",
           "runtime_env_agent", "default_worker.py")


class RayProblem(RuntimeError):
    """A Ray set-up that cannot work, found before any wait; the message names the fix."""


def version() -> str | None:
    """The installed Ray's version, or None."""
    try:
        import ray
    except ImportError:
        return None
    return ray.__version__


def _tuple(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split(".")[:2] if p.isdigit())


def require() -> str:
    """Ray's version if it is at least ``NEEDS_RAY``; else a ``RayProblem`` saying what to do."""
    found = version()
    if found is None:
        raise RayProblem(f"Ray is not installed in this Python ({sys.executable}). Fix: `make setup` installs it; "
                         f"elsewhere `{INSTALL}` (on Databricks use an ML runtime newer than 15.4 LTS: Ray 2.60 "
                         "needs pandas >= 2.2.3 and pyarrow >= 17)")
    if _tuple(found) < _tuple(NEEDS_RAY):
        raise RayProblem(f"Ray {found} is older than the {NEEDS_RAY} this lesson is written for (Ray Train V2). "
                         f"Fix: `{INSTALL}`; on Databricks Runtime 15.4 LTS ML, whose preinstalled Ray is older and "
                         "whose pandas/pyarrow Ray 2.60 cannot use, run this lesson on a newer ML runtime")
    return found


def start(num_cpus: int | None = None, collective_timeout_s: float = 60.0, **init_kwargs: Any) -> dict[str, float]:
    """Start a local Ray (``ray.init``) for a lesson and return its resources (``{"CPU": 2.0, ...}``).

    ``num_cpus`` caps the CPUs Ray hands out (default: all). ``collective_timeout_s`` turns a
    ``ray.train.report`` that not every worker reaches into an error after that many seconds.
    """
    require()
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")     # one user, one machine (and Ray on local Spark)
    env = {"RAY_TRAIN_COLLECTIVE_TIMEOUT_S": str(collective_timeout_s),
           "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",      # notice finished or dead workers sooner
           "RAY_AUTH_MODE": os.environ["RAY_AUTH_MODE"], "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if ray.is_initialized():
        ray.shutdown()
    init_kwargs.setdefault("include_dashboard", False)
    init_kwargs.setdefault("log_to_driver", False)
    ray.init(num_cpus=num_cpus, runtime_env={"env_vars": env}, **init_kwargs)
    quiet_data()
    return dict(ray.cluster_resources())


def quiet_data() -> None:
    """No Ray Data progress bars (they redraw hundreds of lines into a notebook's output)."""
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False


def stop() -> None:
    """``ray.shutdown()`` and wait until Ray's daemons have exited."""
    import ray

    ray.shutdown()
    wait_until_stopped()


def write_parquet(dataset: Any, folder: str | os.PathLike, scale: float = 16.0) -> Path:
    """Write a ``(features, labels)`` ``TensorDataset`` to ``folder/data.parquet``; return the folder.

    Columns: ``id`` (row number), ``label``, ``features`` (a list of floats per row, flattened and
    multiplied by ``scale``: the digits' raw 0-16 pixel values, for the lesson to scale back).
    """
    import pandas as pd

    x, y = dataset.tensors
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    flat = (x.reshape(len(x), -1) * scale).numpy()
    frame = pd.DataFrame({"id": range(len(y)), "label": y.numpy(), "features": list(flat)})
    frame.to_parquet(folder / "data.parquet", index=False)
    return folder


def check_request(num_workers: int, use_gpu: bool, cpus_per_worker: float, storage_path: str | os.PathLike,
                  train_fn: Any = None, resources: dict[str, float] | None = None) -> None:
    """Refuse, with the fix, a trainer that cannot start or run here, before ``fit()`` waits for it.

    Ray itself would wait (for resources that never come) or fail late (pickling, storage).
    """
    import ray

    resources = resources if resources is not None else dict(ray.cluster_resources())
    if num_workers < 1:
        raise RayProblem(f"num_workers={num_workers}: a trainer needs at least 1 worker. Fix: num_workers=2")
    cpus, gpus = resources.get("CPU", 0.0), resources.get("GPU", 0.0)
    if use_gpu and gpus < 1:
        raise RayProblem("use_gpu=True, but this Ray cluster has no GPU. Fix: use_gpu=False (the course's plan "
                         "says so: environment.plan().device == 'cuda'), or start Ray on a machine with GPUs")
    if use_gpu and num_workers > gpus:
        raise RayProblem(f"num_workers={num_workers} with use_gpu=True, but Ray has {gpus:g} GPU(s): the trainer would "
                         f"wait forever. Fix: num_workers={int(gpus)} (one per GPU), or add nodes")
    if num_workers * cpus_per_worker > cpus + 1e-9:
        raise RayProblem(f"{num_workers} workers x {cpus_per_worker:g} CPU = {num_workers * cpus_per_worker:g} CPUs, "
                         f"but Ray has {cpus:g}: the trainer would wait forever. Fix: num_workers <= "
                         f"{int(cpus // cpus_per_worker) if cpus_per_worker else num_workers}, or "
                         f"resources_per_worker={{'CPU': {cpus / num_workers:.2g}}}")
    path = Path(storage_path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as err:
        raise RayProblem(f"storage_path {str(path)!r} is not writable ({err.strerror}): checkpoints and results go "
                         "there. Fix: a writable folder every node can reach (a shared volume on a cluster, e.g. "
                         "/Volumes/... on Databricks)") from None
    if train_fn is not None:
        from ray import cloudpickle

        try:
            cloudpickle.dumps(train_fn)
        except Exception as err:
            raise RayProblem(f"the training function cannot be pickled ({type(err).__name__}: {err}); Ray ships it "
                             "to every worker. Fix: create locks, open files, sessions and clients *inside* the "
                             "function, and pass only plain values (numbers, strings, paths) in its config") from None


def load_state(checkpoint: Any) -> dict[str, Any]:
    """The ``state.pt`` dictionary saved in a ``ray.train.Checkpoint`` (model, optimizer, position)."""
    import torch

    with checkpoint.as_directory() as folder:
        return torch.load(Path(folder) / "state.pt", map_location="cpu", weights_only=True)


def ray_processes() -> list[str]:
    """Ray daemons still running on this machine, as ``"name (pid)"`` (zombies excluded)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "name", "cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            text = " ".join(proc.info["cmdline"] or []) or (proc.info["name"] or "")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        name = next((d for d in DAEMONS if d in text and "ray" in text), None)
        if name and proc.info["pid"] != os.getpid():
            found.append(f"{name} ({proc.info['pid']})")
    return found


def wait_until_stopped(timeout: float = 20.0) -> list[str]:
    """Wait up to ``timeout`` s for Ray's daemons to exit; return those still running (empty: all gone)."""
    return wait_until_gone(ray_processes, timeout)
