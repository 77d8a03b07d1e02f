"""apply_databricks_widgets against a stand-in for Databricks' ``dbutils.widgets`` API.

``dbutils`` only exists inside Databricks; this minimal object has the two methods the helper
calls (``text`` creates a widget with a default, ``get`` returns the job's value or the default).
"""

import pytest

from dtlab.notebook import apply_databricks_widgets

pytestmark = pytest.mark.cluster  # code a cluster runs: make test-runtime repeats these on its stack


class Widgets:
    def __init__(self, job_values):
        self.job_values, self.created = job_values, {}

    def text(self, name, default):
        self.created[name] = default

    def get(self, name):
        return self.job_values.get(name, self.created[name])


class DbUtils:
    def __init__(self, job_values):
        self.widgets = Widgets(job_values)


def test_no_dbutils_is_a_no_op():
    ns = {"epochs": 3}
    assert apply_databricks_widgets(ns, ["epochs"]) == {} and ns == {"epochs": 3}


def test_job_parameters_arrive_with_the_defaults_types():
    ns = {"epochs": 3, "lr": 0.1, "backend": None, "nprocs": None, "name": "x", "plot": True,
          "dbutils": DbUtils({"epochs": "5", "lr": "1e-3", "backend": "gloo", "nprocs": "4", "plot": "false"})}
    changed = apply_databricks_widgets(ns, ["epochs", "lr", "backend", "nprocs", "name", "plot"])
    assert changed == {"epochs": 5, "lr": 1e-3, "backend": "gloo", "nprocs": 4, "plot": False}
    assert ns["name"] == "x" and ns["dbutils"].widgets.created["backend"] == ""


def test_a_bad_widget_value_names_the_parameter():
    ns = {"epochs": 3, "dbutils": DbUtils({"epochs": "three"})}
    with pytest.raises(ValueError, match="widget epochs='three' cannot be used as int"):
        apply_databricks_widgets(ns, ["epochs"])



class Conf:
    def __init__(self, version):
        self.version = version

    def get(self, key):
        assert key == "spark.databricks.clusterUsageTags.sparkVersion"
        return self.version


class Spark:
    """The one attribute of a Databricks SparkSession the check reads."""

    def __init__(self, version):
        self.conf = Conf(version)


def test_a_cluster_without_an_ml_runtime_is_refused_with_the_fix(capsys):
    from dtlab.notebook import RuntimeMismatch, check_databricks_runtime

    with pytest.raises(RuntimeMismatch,
                       match="not an ML runtime.*Fix: .*18.x-gpu-ml-scala2.13.*15.4.x-gpu-ml-scala2.12 for Horovod"):
        apply_databricks_widgets({"epochs": 3, "dbutils": DbUtils({}), "spark": Spark("15.4.x-scala2.12")},
                                 ["epochs"])
    assert check_databricks_runtime(Spark("15.4.x-cpu-ml-scala2.12")) == "15.4.x-cpu-ml-scala2.12"
    assert "CPU runtime" in capsys.readouterr().out
    assert check_databricks_runtime(Spark("15.4.x-gpu-ml-scala2.12")) == "15.4.x-gpu-ml-scala2.12"
    assert check_databricks_runtime(Spark("18.x-gpu-ml-scala2.13")) == "18.x-gpu-ml-scala2.13"
    assert check_databricks_runtime(Spark("18.2.x-gpu-ml-scala2.13")) == "18.2.x-gpu-ml-scala2.13"   # a point release
    assert "tested on" not in capsys.readouterr().out
    check_databricks_runtime(Spark("16.4.x-gpu-ml-scala2.12"))
    assert "tested on Databricks Runtime 18 and 15.4 LTS ML, not 16.4" in capsys.readouterr().out
    check_databricks_runtime(Spark("17.3.x-gpu-ml-scala2.13"))        # its libraries pinned, its lessons not run in CI
    assert "not 17.3" in capsys.readouterr().out


def test_a_widget_of_the_wrong_type_names_the_parameter_and_a_value_that_works():
    ns = {"epochs": 3, "lr": 0.1, "dbutils": DbUtils({"epochs": "two"})}
    with pytest.raises(ValueError, match=r'widget epochs=.two. cannot be used as int.*Fix: set the job parameter '
                                         r'epochs to a whole number, e.g. "3"'):
        apply_databricks_widgets(ns, ["epochs"])
    with pytest.raises(ValueError, match="expected a whole number"):
        apply_databricks_widgets({"epochs": 3, "dbutils": DbUtils({"epochs": "2.5"})}, ["epochs"])
