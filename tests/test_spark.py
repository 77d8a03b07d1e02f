import json
import subprocess

from dtlab import spark


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
