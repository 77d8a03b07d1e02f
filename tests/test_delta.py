"""dtlab.delta: a DataFrame as a real Delta table and back (delta-rs where Spark has no Delta), and the Unity
Catalog names a job is given, checked before anything is written."""

import pyarrow as pa
import pytest

from dtlab import delta, shards
from dtlab import spark as dtspark

pytestmark = [pytest.mark.cluster, pytest.mark.slow]  # a Spark session each; the runtime stack repeats them


@pytest.fixture
def session():
    s = dtspark.session(cores=2)
    yield s
    dtspark.stop(s)


def rows(n):
    return pa.table({"id": pa.array(range(n), pa.int64()),
                     "tokens": pa.array([[i % 7] * 5 for i in range(n)], pa.list_(pa.int32()))})


def test_a_dataframe_round_trips_through_a_delta_table_with_a_version_history(session, tmp_path):
    assert not delta.spark_has_delta(session)            # a local Spark: delta-rs writes
    where = delta.write_table(delta.dataframe(session, rows(30)), path=tmp_path / "t")
    assert where["writer"].startswith("delta-rs") and where["version"] == 0
    assert (tmp_path / "t" / "_delta_log").is_dir()
    again = delta.write_table(delta.dataframe(session, rows(12)), path=tmp_path / "t")
    assert again["version"] == 1                          # an overwrite is a new version, the old one kept
    back = delta.read_table(session, again).orderBy("id").collect()
    assert [r["id"] for r in back] == list(range(12)) and list(back[3]["tokens"]) == [3] * 5
    index = shards.write_shards_from_dataframe(delta.read_table(session, again), tmp_path / "s", seq_len=4,
                                               tokenizer="t", shards=3)
    assert index["num_samples"] == 12 and len(index["shards"]) == 3
    with pytest.raises(FileNotFoundError, match="no Delta table.*Fix"):
        delta.read_table(session, {**where, "table": str(tmp_path / "nothing")})


def test_missing_unity_catalog_places_name_the_parameter_and_the_fix(session):
    with pytest.raises(LookupError, match="no catalog given. Fix: set the notebook parameter"):
        delta.check_catalog(session, "", "s", "v")
    with pytest.raises(LookupError, match="catalog 'nope' does not exist.*parameter 'catalog'.*CREATE CATALOG"):
        delta.check_catalog(session, "nope", "s")
    with pytest.raises(LookupError, match="schema spark_catalog.nope does not exist.*parameter 'schema'"):
        delta.check_catalog(session, "spark_catalog", "nope")
    with pytest.raises(LookupError, match="volume spark_catalog.default.v does not exist.*CREATE VOLUME"):
        delta.check_catalog(session, "spark_catalog", "default", "v")
    delta.check_catalog(session, "spark_catalog", "default")       # both exist: no error
