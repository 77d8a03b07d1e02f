"""A Spark Connect session (what serverless compute gives a notebook) gets the lessons' messages, not a traceback.

A real local Spark Connect server (``DTLAB_SPARK_REMOTE=local[2]``: PySpark starts it and connects over gRPC), as a
notebook on serverless compute sees one: DataFrames work, ``sparkContext`` does not.
"""

import pytest

pytest.importorskip("google.rpc", reason="PySpark's connect extra (grpcio-status) is installed by make setup")
pytestmark = pytest.mark.slow


@pytest.mark.notebook
def test_notebook_04_runs_on_a_spark_connect_session_as_serverless_compute_gives_it(tmp_path):
    """The lesson's cells run on a Spark Connect session; what cannot run there (counting task slots) says so."""
    from pathlib import Path

    import nbformat
    from variants import check_result

    from dtlab.tooling import runner as course

    notebook = Path(__file__).resolve().parent.parent / "notebooks" / "04_torchdistributor.ipynb"
    result = course.run_one(notebook, tmp_path, ci=True, stream=False, env={"DTLAB_SPARK_REMOTE": "local[2]"})
    check_result(result, notebook)
    printed = "".join(out.get("text", "") for cell in nbformat.read(result.output, as_version=4).cells
                      for out in cell.get("outputs", []) if out.get("output_type") == "stream")
    assert "a Spark Connect session, started" in printed
    assert "Spark Connect does not say how many tasks its server runs at once" in printed
    assert "all 6 claims hold" in printed
# (first in the file: the fixture below keeps a local Spark Connect server on its port until the module ends)


@pytest.fixture(scope="module")
def connect():
    import os

    from dtlab import spark as dtspark

    os.environ["DTLAB_SPARK_REMOTE"] = "local[2]"
    try:
        spark = dtspark.session()
    finally:
        del os.environ["DTLAB_SPARK_REMOTE"]
    yield spark
    dtspark.stop(spark)


def test_the_session_is_spark_connect_and_has_dataframes_but_no_spark_context(connect):
    from dtlab import spark as dtspark

    assert dtspark.is_connect(connect)
    assert connect.range(7).count() == 7
    with pytest.raises(Exception, match="sparkContext"):
        _ = connect.sparkContext                               # what a classic-only lesson cell would meet


def test_classic_only_calls_say_why_and_name_the_fix(connect, capsys):
    from dtlab import spark as dtspark

    why = dtspark.classic_problem(connect, "TorchDistributor")
    assert why.startswith("skipped: TorchDistributor needs a classic Spark session") and "Fix: run this lesson on " \
        "a dedicated cluster" in why
    assert dtspark.gpu_problem(connect, local_mode=True) == why       # the lessons' GPU check steps aside too
    with pytest.raises(dtspark.SparkConnectUnsupported, match="counting task slots needs a classic Spark session.*Fix"):
        dtspark.task_slots(connect)
    dtspark.require_slots(connect, 2)                                  # cannot count: a note, not a traceback
    assert "Spark Connect does not say how many tasks" in capsys.readouterr().out
    # the capstone on Databricks refuses a Connect session before it writes anything, with the fix
    with pytest.raises(dtspark.SparkConnectUnsupported, match=r"the capstone \(TorchDistributor.*Fix: run this"):
        dtspark.require_classic(connect, "the capstone (TorchDistributor and DeepspeedTorchDistributor)")


def test_a_classic_session_is_not_connect():
    from dtlab import spark as dtspark

    class Classic:            # the check reads only the session's class, as pyspark.sql.SparkSession's module
        pass

    Classic.__module__ = "pyspark.sql.session"
    assert not dtspark.is_connect(Classic()) and dtspark.classic_problem(Classic(), "x") is None
    assert dtspark.require_classic(Classic(), "x") is None

