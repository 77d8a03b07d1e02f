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
