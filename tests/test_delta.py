"""dtlab.delta: a DataFrame as a real Delta table and back (delta-rs where Spark has no Delta), and the Unity
Catalog names a job is given, checked before anything is written."""

import pyarrow as pa
import pytest

from dtlab import delta, shards
from dtlab import spark as dtspark

pytestmark = [pytest.mark.cluster, pytest.mark.slow]  # a Spark session each; the runtime stack repeats them


@pytest.fixture(scope="module")
def session():
    """One local Spark for the file (a session costs 8 s and 9 core-s to start); a test that adds databases to its
    catalog drops them again (``catalog_cleaned``)."""
    s = dtspark.session(cores=2)
    yield s
    dtspark.stop(s)


@pytest.fixture
def catalog_cleaned(session):
    """The databases a test creates in the shared session's catalog are dropped after it, so the next test meets
    the catalog a new local session has (no information_schema)."""
    before = {d.name for d in session.catalog.listDatabases()}
    yield
    for name in {d.name for d in session.catalog.listDatabases()} - before:
        session.sql(f"DROP DATABASE IF EXISTS `{name}` CASCADE")


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
    delta.check_catalog(session, "spark_catalog", "default", privileges=False)      # both exist: no error
    with pytest.raises(LookupError, match="cannot read the privileges.*SHOW GRANTS ON SCHEMA `spark_catalog`"):
        delta.check_catalog(session, "spark_catalog", "default")   # a local catalog has no information_schema


def grants(session, tmp_path, schema_grants, owner="someone-else", groups=("data-eng", "account users")):
    """A catalog's information_schema as Unity Catalog lays it out (its tables and columns), in a local Spark: the
    privileges of ``schema_grants`` (grantee -> privileges) on spark_catalog.my_schema, a volume in it (a local
    catalog refuses a hyphen in a schema name: quoting is held below)."""
    session.sql(f"CREATE DATABASE IF NOT EXISTS information_schema LOCATION '{tmp_path / 'is'}'")
    session.sql(f"CREATE DATABASE IF NOT EXISTS `my_schema` LOCATION '{tmp_path / 'ms'}'")
    me = session.sql("SELECT current_user()").collect()[0][0]
    session.udf.register("is_account_group_member", lambda g: g in groups, "boolean")
    tables = {
        "catalog_privileges": ("grantor string, grantee string, catalog_name string, privilege_type string",
                               [("admin", "account users", "spark_catalog", "USE CATALOG")]),
        "schema_privileges": ("grantor string, grantee string, catalog_name string, schema_name string, "
                              "privilege_type string, inherited_from string",
                              [("admin", g, "spark_catalog", "my_schema", p, "NONE")
                               for g, ps in schema_grants.items() for p in ps]),
        "volume_privileges": ("grantor string, grantee string, volume_catalog string, volume_schema string, "
                              "volume_name string, privilege_type string, inherited_from string",
                              [("admin", "data-eng", "spark_catalog", "my_schema", "v", p, "SCHEMA")
                               for p in ("READ VOLUME", "WRITE VOLUME")]),
        "catalogs": ("catalog_name string, catalog_owner string", [("spark_catalog", "admin")]),
        "schemata": ("catalog_name string, schema_name string, schema_owner string",
                     [("spark_catalog", "my_schema", owner)]),
        "volumes": ("volume_catalog string, volume_schema string, volume_name string, volume_owner string",
                    [("spark_catalog", "my_schema", "v", "admin")]),
    }
    for name, (columns, values) in tables.items():
        session.createDataFrame(values, columns).write.mode("overwrite").saveAsTable(f"information_schema.{name}")
    (tmp_path / "Volumes" / "spark_catalog" / "my_schema" / "v").mkdir(parents=True, exist_ok=True)
    return me


@pytest.mark.usefixtures("catalog_cleaned")
def test_privileges_are_checked_before_any_write_and_the_grant_is_named(session, tmp_path, monkeypatch):
    monkeypatch.setenv("DTLAB_VOLUMES_ROOT", str(tmp_path / "Volumes"))
    me = grants(session, tmp_path, {"data-eng": ["USE SCHEMA", "CREATE TABLE"]})
    with pytest.raises(PermissionError, match=rf"lack schema CREATE MODEL.*GRANT CREATE MODEL ON SCHEMA "
                                              rf"`spark_catalog`.`my_schema` TO `{me}`"):
        delta.check_catalog(session, "spark_catalog", "my_schema", "v")
    grants(session, tmp_path, {"data-eng": ["USE SCHEMA", "CREATE TABLE"], me: ["CREATE MODEL"]})
    delta.check_catalog(session, "spark_catalog", "my_schema", "v")      # a group's grants and one's own add up
    grants(session, tmp_path, {"data-eng": ["ALL PRIVILEGES"]}, groups=("account users",))
    with pytest.raises(PermissionError, match="lack schema USE SCHEMA, schema CREATE TABLE"):
        delta.check_catalog(session, "spark_catalog", "my_schema", "v")  # not in the group any more
    grants(session, tmp_path, {}, owner=me, groups=("data-eng", "account users"))
    delta.check_catalog(session, "spark_catalog", "my_schema", "v")      # the owner may do everything


def test_names_with_a_hyphen_are_quoted():
    assert delta.quote("my-cat", "s", "a`b") == "`my-cat`.`s`.`a``b`"


def test_a_raw_text_table_is_tokenized_and_packed_on_the_executors(session):
    from dtlab import text

    docs = text.corpus(25)
    tok = text.train_tokenizer(docs, 300)
    one = text.token_table(session.createDataFrame([(d,) for d in docs], "text string").coalesce(1), tok, 16)
    got = one.orderBy("id").toPandas()
    expected = text.token_rows(docs, tok, 16)            # the driver-side packing, as an independent reference
    assert got["id"].tolist() == list(range(expected.num_rows))
    assert [list(r) for r in got["tokens"]] == expected.column("tokens").to_pylist()
    three = text.token_table(session.createDataFrame([(d,) for d in docs], "text string").repartition(3), tok, 16)
    ids = sorted(r["id"] for r in three.collect())
    assert ids == list(range(len(ids))) and expected.num_rows - 3 < len(ids) <= expected.num_rows   # a tail each
    with pytest.raises(ValueError, match="no text column 'body'.*text_column="):
        text.token_table(session.createDataFrame([(d,) for d in docs], "text string"), tok, 16, text_column="body")
