"""A Spark session for the course: the cluster's own on Databricks, a quiet local one elsewhere.

``session()`` returns the active session when there is one (on Databricks, ``spark`` already
exists and must be reused), and otherwise starts ``local[cores]`` with what a laptop needs:

* the workers run this very Python (``PYSPARK_PYTHON``), so they see the same packages;
* the JVM logs only errors (a log4j2 file at level ERROR) and binds to 127.0.0.1;
* the web UI is off;
* with ``gpus > 0``, the driver advertises that many GPUs through a discovery script, which
  ``TorchDistributor(local_mode=True, use_gpu=True)`` requires on a non-Databricks GPU machine.

Spark code in the course must also run on Databricks Runtime 15.4 LTS ML (Spark 3.5); nothing
here uses a newer API.

**Spark Connect.** Serverless compute and standard (shared) access mode clusters give a notebook a Spark
Connect session: a client of a Spark server elsewhere, with DataFrames and SQL but no ``sparkContext`` (no JVM
beside this Python), so nothing that reads Spark's configuration or schedules barrier tasks (TorchDistributor
with ``local_mode=False``, ``horovod.spark``) can run there. ``is_connect`` tells the two apart by the session's
class; ``classic_problem`` says why a cell steps aside. ``DTLAB_SPARK_REMOTE=local[2]`` makes ``session()``
start a local Spark Connect server and return its session, to see a lesson as serverless compute runs it.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

_LOG4J = """\
rootLogger.level = error
rootLogger.appenderRef.stdout.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n
"""


_FOLDER: list[Path] = []


def _folder() -> Path:
    """This process's own scratch folder for Spark's config files, removed when the process exits.

    (A fixed name under /tmp would be shared, and overwritten, by every notebook and test at once.)
    """
    if not _FOLDER:
        import atexit
        import shutil

        folder = Path(tempfile.mkdtemp(prefix="dtlab-spark-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        _FOLDER.append(folder)
    return _FOLDER[0]


def _write(name: str, text: str, executable: bool = False) -> Path:
    path = _folder() / name
    path.write_text(text)
    if executable:
        path.chmod(0o755)
    return path


def gpu_discovery_script(gpus: int) -> Path:
    """A script that prints Spark's resource JSON for GPUs ``0..gpus-1`` (used with ``gpus > 0``)."""
    payload = json.dumps({"name": "gpu", "addresses": [str(i) for i in range(gpus)]})
    return _write("discover_gpus.sh", f"#!/bin/sh\necho '{payload}'\n", executable=True)


def session(cores: int | None = None, gpus: int = 0, app_name: str = "dtlab-course"):
    """The active SparkSession, or a new quiet ``local[cores]`` one (``cores`` default: all cores).

    Args:
        cores: task slots; TorchDistributor's barrier mode (``local_mode=False``) needs one per process.
        gpus: GPUs the local driver advertises (0 on a CPU machine). Ignored when a session exists.
    """
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    remote = os.environ.get("DTLAB_SPARK_REMOTE")
    if remote:                         # a Spark Connect session, as serverless compute gives (module docstring)
        spark = SparkSession.builder.remote(remote).appName(app_name).getOrCreate()
        _OWNED.add(id(spark))
        return spark
    existed = SparkContext._active_spark_context is not None   # getOrCreate would return it: not ours to stop
    cores = cores or os.cpu_count() or 2
    log4j = _write("log4j2.properties", _LOG4J)
    builder = (SparkSession.builder.master(f"local[{cores}]").appName(app_name)
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", str(cores))
               .config("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile=file:{log4j}")
               .config("spark.executor.extraJavaOptions", f"-Dlog4j2.configurationFile=file:{log4j}"))
    if gpus:
        builder = (builder.config("spark.driver.resource.gpu.amount", str(gpus))
                   .config("spark.driver.resource.gpu.discoveryScript", str(gpu_discovery_script(gpus))))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    if not existed:
        _OWNED.add(id(spark.sparkContext))
    return spark


def is_connect(spark) -> bool:
    """Whether ``spark`` is a Spark Connect session (serverless compute, a standard access mode cluster), which has
    no ``sparkContext``; False for a classic session (a dedicated cluster, a local Spark)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def classic_problem(spark, what: str) -> str | None:
    """Why ``what`` cannot run on ``spark`` because it is a Spark Connect session, or None (a classic session).

    ``what`` names the part of the lesson that steps aside, e.g. "TorchDistributor". The message says what to
    run the lesson on instead.
    """
    if not is_connect(spark):
        return None
    return (f"skipped: {what} needs a classic Spark session (its SparkContext, a JVM beside this Python); this is "
            "a Spark Connect session (serverless compute, or a standard access mode cluster), which has none. Fix: "
            "run this lesson on a dedicated cluster: Databricks Runtime 18 LTS ML, clusters/g5-12xlarge-single-"
            "node.yml, or the course's job (databricks bundle run dtlab_course)")


class SparkConnectUnsupported(RuntimeError):
    """A classic-Spark-only call on a Spark Connect session; the message names the fix (``classic_problem``)."""


def require_classic(spark, what: str) -> None:
    """Refuse ``what`` on a Spark Connect session, with ``classic_problem``'s message (what to run it on instead);
    nothing on a classic session.

    Raises:
        SparkConnectUnsupported: ``spark`` is a Spark Connect session.
    """
    problem = classic_problem(spark, what)
    if problem:
        raise SparkConnectUnsupported(problem.removeprefix("skipped: "))


#: The SparkContexts (and Spark Connect sessions) ``session`` started: the only ones ``stop`` stops.
_OWNED: set[int] = set()


class NotEnoughSlots(RuntimeError):
    """Spark cannot run as many tasks at once as a barrier stage needs; the message names the fix."""


def task_slots(spark) -> int:
    """How many Spark tasks can run at once: the default parallelism (a local master's cores, a cluster's
    executor cores) over ``spark.task.cpus``. A barrier stage (``TorchDistributor(local_mode=False)``,
    ``horovod.spark.run``) needs one slot per process, all at once."""
    require_classic(spark, "counting task slots")
    sc = spark.sparkContext
    return sc.defaultParallelism // max(1, int(sc.getConf().get("spark.task.cpus", "1")))


def require_slots(spark, processes: int) -> None:
    """Refuse, with the fix, a barrier stage of ``processes`` tasks that this Spark cannot start at once.

    Spark itself refuses one that can never fit only after retrying its check for 10 minutes
    (``BarrierJobSlotsNumberCheckFailed``: 40 tries, 15 s apart), deep in a Java stack, and ``horovod.spark.run``
    waits for its tasks until ``start_timeout`` (600 s).

    On a Spark Connect session the slots cannot be read (no SparkContext): it prints a note and checks nothing.

    Raises:
        NotEnoughSlots: ``processes`` is more than ``task_slots(spark)``.
    """
    if is_connect(spark):
        print(f"note: Spark Connect does not say how many tasks its server runs at once: {processes} barrier tasks "
              "are not checked against it here (Spark refuses a stage that can never fit after 10 minutes)")
        return
    slots = task_slots(spark)
    if processes > slots:
        raise NotEnoughSlots(f"{processes} processes need {processes} Spark tasks running at once (a barrier stage), "
                             f"and this Spark runs {slots} (master {spark.sparkContext.master}). Fix: nprocs <= "
                             f"{slots}, or more task slots (dtlab.spark.session(cores={processes}) on one machine, "
                             "more workers or cores on a cluster)")


def gpu_problem(spark, local_mode: bool) -> str | None:
    """Why ``TorchDistributor(local_mode=local_mode, use_gpu=True)`` cannot get GPUs here, or None if it can.

    * ``local_mode=False`` gives each Spark *task* a GPU, so the cluster must schedule GPUs to tasks
      (``spark.task.resource.gpu.amount``). Databricks turns GPU scheduling off on single-node
      clusters: there ``TorchDistributor`` raises "'spark.task.resource.gpu.amount' was unset".
    * ``local_mode=True`` gives each process one of the *driver's* GPUs, which the driver must
      advertise to Spark (a ``gpu`` resource, ``spark.driver.resource.gpu.amount``).

    The message says what happens instead in the lesson and how to fix the cluster. On a Spark Connect session
    (serverless compute) it is ``classic_problem``'s: TorchDistributor cannot run there at all.
    """
    connect = classic_problem(spark, "TorchDistributor")
    if connect:
        return connect
    conf = dict(spark.sparkContext.getConf().getAll())
    return gpu_problem_of(conf, set(spark.sparkContext.resources), local_mode)


def gpu_problem_of(conf: dict, driver_resources: set, local_mode: bool) -> str | None:
    """``gpu_problem`` for a Spark configuration given as a dict (e.g. a cluster file's ``spark_conf``)."""
    if not local_mode:
        amount = str(conf.get("spark.task.resource.gpu.amount", "0"))
        try:
            whole = int(amount)                          # as PySpark 3.5's TorchDistributor reads it
        except ValueError:
            return (f"spark.task.resource.gpu.amount is {amount!r}: PySpark 3.5's TorchDistributor reads it with "
                    "int() (_get_num_tasks), so a fraction raises ValueError before anything runs. Fix: \"1\" (one "
                    "GPU per Spark task, one training process per GPU)")
        if whole == 1:
            return None
        if whole > 1:
            return (f"spark.task.resource.gpu.amount is {whole}: PySpark 3.5's TorchDistributor then starts "
                    f"num_processes / {whole} Spark tasks, each one torchrun --nproc_per_node=1 with "
                    "--nnodes=num_processes, so the world never assembles (SPARK-41916). Fix: \"1\"")
        single = conf.get("spark.databricks.cluster.profile") == "singleNode" or \
            str(conf.get("spark.master", "")).startswith("local")
        return ("Spark gives its tasks no GPU here (spark.task.resource.gpu.amount is unset"
                + (": GPU scheduling is off on single-node clusters" if single else "")
                + "), so TorchDistributor(local_mode=False, use_gpu=True) would raise. Fix: a multi-node cluster "
                "with spark.task.resource.gpu.amount: \"1\" (clusters/g5-12xlarge-4-nodes.yml)")
    if "gpu" in driver_resources and str(conf.get("spark.driver.resource.gpu.amount", "0")) not in ("0", "0.0"):
        return None
    return ("the Spark driver advertises no GPU (no 'gpu' resource, spark.driver.resource.gpu.amount unset), "
            "so TorchDistributor(local_mode=True, use_gpu=True) would raise 'GPUs were unable to be found on the "
            "driver'. Fix: set spark.driver.resource.gpu.amount and a discovery script in the cluster's "
            "spark_conf (dtlab.spark.session(gpus=N) does it for a local Spark)")


def stop(spark, force: bool = False) -> bool:
    """Stop ``spark`` and the Java process behind it (``SparkSession.stop`` leaves the JVM running until
    Python exits) — if ``session`` started it. A session that existed before (the cluster's own on
    Databricks, which runs the notebook's Py4J gateway: stopping it ends the notebook's Spark) is left
    alone, with a note, unless ``force`` (a script's own session, never the cluster's). Returns whether it
    stopped anything."""
    from pyspark import SparkContext

    if is_connect(spark):                # no SparkContext; stopping a local remote session stops its local server
        if id(spark) not in _OWNED and not force:
            print("dtlab.spark.stop: this Spark Connect session was not started by dtlab.spark.session: left running")
            return False
        _OWNED.discard(id(spark))
        spark.stop()
        return True
    if id(spark.sparkContext) not in _OWNED and not force:
        print("dtlab.spark.stop: this Spark session was not started by dtlab.spark.session (on Databricks it is "
              "the cluster's): left running")
        return False
    _OWNED.discard(id(spark.sparkContext))
    gateway = SparkContext._gateway
    spark.stop()
    if gateway is None:
        return True
    proc = getattr(gateway, "proc", None)
    gateway.shutdown()
    if proc is not None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except Exception:
            proc.kill()
    SparkContext._gateway = None
    SparkContext._jvm = None
    return True
