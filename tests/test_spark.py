import json
import subprocess

import pytest

from dtlab import spark

pytestmark = pytest.mark.cluster  # code a cluster runs: make test-runtime repeats these on its stack


def test_gpu_discovery_script_prints_spark_resource_json():
    script = spark.gpu_discovery_script(4)
    out = subprocess.run([str(script)], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == {"name": "gpu", "addresses": ["0", "1", "2", "3"]}


def test_config_files_go_to_a_private_folder_removed_at_exit():
    """A fixed /tmp name was shared (and overwritten) by every notebook and test at once."""
    import sys

    code = ("from dtlab import spark; p = spark.gpu_discovery_script(2); "
            "print(p.parent, p.parent.is_dir())")
    outs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
            for _ in range(2)]
    (first, existed), (second, _) = outs
    assert existed == "True" and first != second, outs
    from pathlib import Path

    assert not Path(first).exists() and not Path(second).exists(), "left behind after the process exited"


def test_gpu_problem_reads_the_cluster_files_as_databricks_would():
    """The single-node g5.12xlarge has GPU scheduling off: barrier-mode GPU training must not be tried there."""
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parent.parent / "clusters"
    single = yaml.safe_load((root / "g5-12xlarge-single-node.yml").read_text())["spark_conf"]
    multi = yaml.safe_load((root / "g5-12xlarge-4-nodes.yml").read_text())["spark_conf"]
    problem = spark.gpu_problem_of(single, set(), local_mode=False)
    assert problem and "single-node" in problem and "g5-12xlarge-4-nodes.yml" in problem
    assert spark.gpu_problem_of(multi, set(), local_mode=False) is None
    assert "no GPU" in spark.gpu_problem_of(single, set(), local_mode=True)
    driver = {**single, "spark.driver.resource.gpu.amount": "4"}
    assert spark.gpu_problem_of(driver, {"gpu"}, local_mode=True) is None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_fractional_or_larger_gpu_amount_is_refused_as_pyspark_35_would(monkeypatch):
    """PySpark's TorchDistributor reads spark.task.resource.gpu.amount with int(): "0.5" raises ValueError; with
    "2" it starts half as many Spark tasks as processes, and PySpark 3.5 gives each task one process and
    torchrun --nnodes=num_processes, so the world never assembles (SPARK-41916). Reproduced with PySpark itself."""
    import pyspark
    from pyspark.ml.torch.distributor import TorchDistributor
    from pyspark.sql import SparkSession

    found = {}
    for amount in ("0.5", "2"):
        session = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
                   .config("spark.task.resource.gpu.amount", amount)
                   .config("spark.executor.resource.gpu.amount", "4")
                   .config("spark.executor.resource.gpu.discoveryScript", str(spark.gpu_discovery_script(4)))
                   .getOrCreate())
        assert session.conf.get("spark.task.resource.gpu.amount") == amount   # a new context, not the last one
        try:
            found[amount] = TorchDistributor(num_processes=4, local_mode=False, use_gpu=True).num_tasks
        except ValueError as err:
            found[amount] = err
        finally:  # the next context reuses this Java process (about 8 s to start one); the last one stops it
            if amount == "2":
                spark.stop(session, force=True)
            else:
                session.stop()
        assert spark.gpu_problem_of({"spark.task.resource.gpu.amount": amount}, set(), local_mode=False)
    assert isinstance(found["0.5"], ValueError) and "int()" in spark.gpu_problem_of(
        {"spark.task.resource.gpu.amount": "0.5"}, set(), local_mode=False)
    assert found["2"] == 2                                       # two Spark tasks for four processes
    if pyspark.__version__.startswith("3.5"):
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", "29500")
        monkeypatch.setenv("RANK", "0")
        args, per_task = TorchDistributor._get_torchrun_args(local_mode=False, num_processes=4)
        assert "--nnodes=4" in args and per_task == 1           # 2 tasks x 1 process, waiting for 4 nodes
        assert "never assembles" in spark.gpu_problem_of({"spark.task.resource.gpu.amount": "2"}, set(), False)
    assert spark.gpu_problem_of({"spark.task.resource.gpu.amount": "1"}, set(), local_mode=False) is None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stop_stops_only_sessions_dtlab_started():
    """On Databricks the session is the cluster's: stopping it ends the notebook's Spark (and its Py4J gateway)."""
    from pyspark.sql import SparkSession

    theirs = (SparkSession.builder.master("local[1]").appName("the-clusters-own")
              .config("spark.ui.enabled", "false").getOrCreate())
    try:
        assert spark.session() is theirs
        assert spark.stop(theirs) is False
        assert theirs.range(3).count() == 3                    # still running
    finally:
        theirs.stop()                                          # PySpark's stop: its Java process stays, for ours
    ours = spark.session(cores=1)
    assert ours is not theirs
    assert spark.stop(ours) is True


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_barrier_stage_larger_than_the_task_slots_is_refused_with_the_fix():
    """Spark refuses it only after retrying its slot check for 10 minutes (BarrierJobSlotsNumberCheckFailed, 40
    tries 15 s apart), deep in a Java stack; horovod.spark.run waits 600 s for tasks that cannot start."""
    session = spark.session(cores=2)
    try:
        assert spark.task_slots(session) == 2
        spark.require_slots(session, 2)
        with pytest.raises(spark.NotEnoughSlots, match="Fix: nprocs <= 2"):
            spark.require_slots(session, 3)
    finally:
        spark.stop(session)


def test_deepspeed_torch_distributor_builds_a_torchrun_command_with_the_config_for_the_script(tmp_path):
    """PySpark's own command builder (3.5 and 4.x): ``torch.distributed.run`` launches the script, and
    ``--deepspeed --deepspeed_config <file>`` come after it, as the script's arguments (notebook 21 reads them)."""
    import sys

    from pyspark.ml.deepspeed.deepspeed_distributor import DeepspeedTorchDistributor

    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}
    command = DeepspeedTorchDistributor._create_torchrun_command(
        {"local_mode": True, "num_processes": 2, "deepspeed_config": config}, "train.py", 7)
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc_per_node=2" in command and "--standalone" in command
    script = command.index("train.py")
    assert command[script + 1:script + 4] == ["7", "--deepspeed", "--deepspeed_config"]
    assert json.loads(open(command[-1]).read()) == config
    (tmp_path / "ds.json").write_text("{}")
    by_path = DeepspeedTorchDistributor._create_torchrun_command(
        {"local_mode": True, "num_processes": 4, "deepspeed_config": str(tmp_path / "ds.json")}, "train.py")
    assert by_path[-2:] == ["--deepspeed_config", str(tmp_path / "ds.json")] and "--nproc_per_node=4" in by_path
    assert DeepspeedTorchDistributor._create_torchrun_command(
        {"local_mode": True, "num_processes": 1, "deepspeed_config": None}, "train.py")[-1] == "--deepspeed"
