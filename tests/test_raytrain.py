"""Ray Train and Ray Data (notebook 18, ``dtlab.raytrain``): the checks that refuse a request before Ray waits.

What Ray itself computes is held by notebook 18's claims, which ``make test`` runs (with its solutions) on a real
local Ray: a Ray Train job in which a worker is killed mid-run ends with the weights of the run without a kill
(bitwise), of the same DDP loop under ``dtlab.launch.run`` (bitwise: 2 CPU workers do the same arithmetic) and of
one process on the full batch (within the derived bound); the Ray Data shards of 2 and 3 workers are disjoint and
cover every row but fewer than N. (Those two were also tests here; they repeated the notebook's runs, 3 minutes of
CI, and were removed.) Ray on a local Spark master is tested here: the notebook's CI run does not start it.
"""

import sys
import threading

import pytest
import torch

from dtlab import raytrain

ray = pytest.importorskip("ray", reason="Ray is installed by `make setup` (requirements.txt)")
from ray import cloudpickle  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import this test module


pytestmark = pytest.mark.slow  # every test here starts a cluster, a browser, a set-up or several launches


def test_write_parquet_keeps_ids_labels_and_raw_features(tmp_path):
    import pandas as pd

    from dtlab import data

    train = data.digits()[0]
    frame = pd.read_parquet(raytrain.write_parquet(train, tmp_path) / "data.parquet")
    x, y = train.tensors
    assert list(frame["id"]) == list(range(len(y)))
    assert torch.equal(torch.tensor(frame["label"].to_numpy()), y)
    assert torch.allclose(torch.tensor(list(frame["features"].iloc[5]), dtype=torch.float32) / 16, x[5].flatten())


RESOURCES = {"CPU": 2.0}


@pytest.mark.parametrize("kwargs, says", [
    ({"num_workers": 3, "use_gpu": False, "cpus_per_worker": 1.0}, "num_workers <= 2"),
    ({"num_workers": 2, "use_gpu": True, "cpus_per_worker": 0.5}, "use_gpu=False"),
    ({"num_workers": 0, "use_gpu": False, "cpus_per_worker": 1.0}, "num_workers=2"),
])
def test_check_request_refuses_what_would_wait_forever(tmp_path, kwargs, says):
    with pytest.raises(raytrain.RayProblem, match="Fix:") as err:
        raytrain.check_request(storage_path=tmp_path, resources=RESOURCES, **kwargs)
    assert says in str(err.value)


def test_check_request_refuses_more_gpu_workers_than_gpus(tmp_path):
    with pytest.raises(raytrain.RayProblem, match="num_workers=4 .one per GPU"):
        raytrain.check_request(8, True, 1.0, tmp_path, resources={"CPU": 48.0, "GPU": 4.0})


def test_check_request_refuses_an_unwritable_storage_path(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")             # no folder can be made under it, whoever runs the test
    with pytest.raises(raytrain.RayProblem, match="not writable.*Fix: a writable folder"):
        raytrain.check_request(2, False, 0.5, a_file / "results", resources=RESOURCES)


def test_check_request_refuses_a_training_function_that_cannot_be_pickled(tmp_path):
    lock = threading.Lock()

    def holds_a_lock(cfg):
        with lock:
            pass

    with pytest.raises(raytrain.RayProblem, match="cannot be pickled.*inside"):
        raytrain.check_request(2, False, 0.5, tmp_path, holds_a_lock, resources=RESOURCES)
    raytrain.check_request(2, False, 0.5, tmp_path, lambda cfg: None, resources=RESOURCES)  # a plain one passes


def test_require_names_the_version_and_the_fix(monkeypatch):
    assert raytrain.require() == ray.__version__
    monkeypatch.setattr(raytrain, "version", lambda: "2.10.0")
    with pytest.raises(raytrain.RayProblem, match=r"2\.10\.0 is older than the 2\.60.*Fix"):
        raytrain.require()
    monkeypatch.setattr(raytrain, "version", lambda: None)
    with pytest.raises(raytrain.RayProblem, match="not installed.*make setup"):
        raytrain.require()


@pytest.mark.timeout(300)
def test_ray_on_a_local_spark_master_refuses_sized_worker_nodes():
    """Notebook 18's advice: sizing Ray's worker nodes needs Spark's stage-level scheduling, which a local master
    (a Databricks single-node cluster's local[*, 4]) does not have; Ray itself refuses before starting anything."""
    from ray.util.spark import setup_ray_cluster

    from dtlab import spark as dtspark

    session = dtspark.session(cores=1)
    try:
        with pytest.raises(ValueError, match="stage scheduling"):
            setup_ray_cluster(max_worker_nodes=1, num_cpus_worker_node=1, num_gpus_worker_node=0)
    finally:
        dtspark.stop(session)
    assert not ray.is_initialized()
