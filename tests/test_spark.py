import json
import subprocess

from dtlab import spark


def test_gpu_discovery_script_prints_spark_resource_json():
    script = spark.gpu_discovery_script(4)
    out = subprocess.run([str(script)], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == {"name": "gpu", "addresses": ["0", "1", "2", "3"]}
