"""A Delta table, on Databricks and off it, and the Unity Catalog names a job is given.

On Databricks, Spark writes Delta itself: ``df.write.saveAsTable("catalog.schema.table")`` makes a Unity
Catalog table. A local Spark has no Delta (its jars come from Maven, which the course's machines cannot
reach), so off Databricks the same DataFrame is written by **delta-rs** (the ``deltalake`` package: Delta's
transaction log and Parquet files, written from Rust, no JVM) into a folder; readers of either see a Delta
table with a version history.

* ``spark_has_delta(spark)`` — whether this Spark session can write Delta itself.
* ``write_table(df, name=..., path=...)`` / ``read_table(spark, where)`` — the DataFrame as a Delta table and
  back; ``where`` says which table and which writer.
* ``check_catalog(spark, catalog, schema, volume)`` — before anything is written on Databricks: does each of
  them exist (a ``LookupError`` names the parameter and the SQL that creates it), and may you write there
  (a ``PermissionError`` names the missing privileges and the ``GRANT`` an owner runs)?
* ``quote(*parts)`` — a Unity Catalog name in backticks, ```my-catalog`.`sales```: a hyphen or a space needs them.
* ``volume_path(catalog, schema, volume, *parts)`` — ``/Volumes/<catalog>/<schema>/<volume>/...``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

SCHEMA = "id long, tokens array<int>"


def spark_has_delta(spark: Any) -> bool:
    """True when ``spark`` can write Delta tables itself (Databricks, or a session with Delta Lake's jars)."""
    try:
        spark._jvm.java.lang.Class.forName("org.apache.spark.sql.delta.DeltaLog")   # noqa: SLF001
        return True
    except Exception:   # no JVM class (local Spark without Delta) or no JVM at all (Spark Connect)
        return os.path.isdir("/Volumes") and "DATABRICKS_RUNTIME_VERSION" in os.environ


#: The privileges a job needs to write a table and register a model in a schema, and to write files in a volume.
WRITE_PRIVILEGES = {"catalog": ("USE CATALOG",), "schema": ("USE SCHEMA", "CREATE TABLE", "CREATE MODEL"),
                    "volume": ("READ VOLUME", "WRITE VOLUME")}


def volume_path(catalog: str, schema: str, volume: str, *parts: str) -> Path:
    """A path in a Unity Catalog volume: ``/Volumes/<catalog>/<schema>/<volume>/<parts...>``."""
    return Path(os.environ.get("DTLAB_VOLUMES_ROOT") or "/Volumes", catalog, schema, volume, *parts)


def quote(*parts: str) -> str:
    """``catalog``, ``schema``, ... as one Unity Catalog name, each part in backticks (a backtick inside doubled):
    ``quote("my-cat", "s")`` is ```my-cat`.`s```."""
    return ".".join("`" + p.replace("`", "``") + "`" for p in parts)


def _literal(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def missing_privileges(spark: Any, catalog: str, schema: str, volume: str | None = None,
                       needed: dict[str, tuple[str, ...]] = WRITE_PRIVILEGES) -> dict[str, list[str]]:
    """The privileges of ``needed`` the user running this lacks, per securable (``{"schema": ["CREATE MODEL"]}``);
    empty when none is missing.

    Read from the catalog's ``information_schema`` (``catalog_privileges``, ``schema_privileges`` and
    ``volume_privileges`` list each grant with what it inherits from above; ``schemata`` and ``volumes`` name the
    owners): a grant counts when it is to you (``current_user()``) or to a group you are in
    (``is_account_group_member``); ``ALL PRIVILEGES`` and owning the object count for everything.

    Raises:
        LookupError: the ``information_schema`` cannot be read (not Unity Catalog), naming the check to run instead.
    """
    where = {"catalog": f"catalog_name = {_literal(catalog)}",
             "schema": f"catalog_name = {_literal(catalog)} AND schema_name = {_literal(schema)}",
             "volume": f"volume_catalog = {_literal(catalog)} AND volume_schema = {_literal(schema)} AND "
                       f"volume_name = {_literal(volume or '')}"}
    owners = {"catalog": ("catalogs", "catalog_owner"), "schema": ("schemata", "schema_owner"),
              "volume": ("volumes", "volume_owner")}
    mine = "(grantee = current_user() OR is_account_group_member(grantee))"
    missing = {}
    for securable, privileges in needed.items():
        if securable == "volume" and not volume:
            continue
        info = f"{quote(catalog)}.information_schema"
        try:
            held = {r[0] for r in spark.sql(f"SELECT privilege_type FROM {info}.{securable}_privileges "
                                            f"WHERE {where[securable]} AND {mine}").collect()}
            table, column = owners[securable]
            owned = spark.sql(f"SELECT 1 FROM {info}.{table} WHERE {where[securable]} AND "
                              f"({column} = current_user() OR is_account_group_member({column}))").collect()
        except Exception as exc:                         # no information_schema: a catalog outside Unity Catalog
            raise LookupError(f"cannot read the privileges in {info} ({str(exc).splitlines()[0][:200]}). Fix: on "
                              f"Databricks with Unity Catalog this works; elsewhere check them yourself "
                              f"(SHOW GRANTS ON SCHEMA {quote(catalog, schema)})") from None
        if owned or "ALL PRIVILEGES" in held:
            continue
        lacking = [p for p in privileges if p not in held]
        if lacking:
            missing[securable] = lacking
    return missing


def check_catalog(spark: Any, catalog: str, schema: str, volume: str | None = None,
                  privileges: bool = True) -> None:
    """Raise ``LookupError`` naming the parameter and the fix when ``catalog``, ``catalog.schema`` or the volume does
    not exist (or is not given), and ``PermissionError`` naming the privileges you lack and the ``GRANT`` that gives
    them (``missing_privileges``; ``privileges=False`` skips that). Run it before writing anything on Databricks:
    a missing privilege found after the training would lose the run."""
    for name, value in (("catalog", catalog), ("schema", schema), ("volume", volume)):
        if name == "volume" and volume is None:
            continue
        if not value:
            raise LookupError(f"no {name} given. Fix: set the notebook parameter (job parameter) {name!r} to a Unity "
                              f"Catalog {name} you may write to")
    catalogs = {r[0] for r in spark.sql("SHOW CATALOGS").collect()}
    if catalog not in catalogs:
        raise LookupError(f"catalog {catalog!r} does not exist or you cannot see it (parameter 'catalog'). "
                          f"Fix: another catalog, or CREATE CATALOG {quote(catalog)} (needs the CREATE CATALOG "
                          "privilege)")
    schemas = {r[0] for r in spark.sql(f"SHOW SCHEMAS IN {quote(catalog)}").collect()}
    if schema not in schemas:
        raise LookupError(f"schema {catalog}.{schema} does not exist (parameter 'schema'). Fix: CREATE SCHEMA "
                          f"{quote(catalog, schema)}, or set 'schema' to one of {sorted(schemas)[:5]}")
    if volume and not volume_path(catalog, schema, volume).is_dir():
        raise LookupError(f"volume {catalog}.{schema}.{volume} does not exist (parameter 'volume'). Fix: CREATE VOLUME "
                          f"{quote(catalog, schema, volume)}")
    if not privileges:
        return
    missing = missing_privileges(spark, catalog, schema, volume)
    if missing:
        on = {"catalog": f"CATALOG {quote(catalog)}", "schema": f"SCHEMA {quote(catalog, schema)}",
              "volume": f"VOLUME {quote(catalog, schema, volume or '')}"}
        user = spark.sql("SELECT current_user()").collect()[0][0]
        grants = "; ".join(f"GRANT {', '.join(p)} ON {on[s]} TO {quote(user)}" for s, p in missing.items())
        raise PermissionError(f"you ({user}) lack {', '.join(f'{s} {p}' for s, ps in missing.items() for p in ps)}, "
                              f"which this job needs before it writes anything. Fix: ask the owner or an admin to "
                              f"run: {grants} (or choose a catalog, schema and volume you may write to)")


def write_table(df: Any, *, path: str | os.PathLike, name: str | None = None) -> dict[str, Any]:
    """Write ``df`` as a Delta table (overwriting); return where it went and what wrote it.

    With a session that writes Delta (``spark_has_delta``): a Unity Catalog table ``name`` (``catalog.schema.table``)
    if given, else the folder ``path``. Otherwise delta-rs writes the folder ``path`` (the rows pass through the
    driver: fine for a lesson's table, not for a large one — on Databricks Spark writes it from the executors).
    """
    if spark_has_delta(df.sparkSession):
        if name:
            df.write.format("delta").mode("overwrite").saveAsTable(name)
            return {"table": name, "writer": "Spark (Delta Lake)", "version": _spark_version(df.sparkSession, name)}
        df.write.format("delta").mode("overwrite").save(str(path))
        return {"table": str(path), "writer": "Spark (Delta Lake)", "version": None}
    import deltalake

    arrow = _to_arrow(df)
    deltalake.write_deltalake(str(path), arrow, mode="overwrite")
    return {"table": str(path), "writer": f"delta-rs (deltalake {deltalake.__version__})",
            "version": deltalake.DeltaTable(str(path)).version()}


def read_table(spark: Any, where: dict[str, Any]) -> Any:
    """The table ``write_table`` described in ``where``, as a Spark DataFrame."""
    if where["writer"].startswith("Spark"):
        table = where["table"]
        is_name = "/" not in table and "." in table           # catalog.schema.table, not a folder
        return spark.table(table) if is_name else spark.read.format("delta").load(table)
    import deltalake

    if not Path(where["table"], "_delta_log").is_dir():
        raise FileNotFoundError(f"no Delta table at {where['table']} (no _delta_log). Fix: write it first "
                                "(dtlab.delta.write_table), or pass the folder it was written to")
    return dataframe(spark, deltalake.DeltaTable(where["table"]).to_pyarrow_table())


def dataframe(spark: Any, table: Any) -> Any:
    """A pyarrow ``table`` with ``id`` and ``tokens`` as a Spark DataFrame (``SCHEMA``), through plain Python rows:
    Spark 3.5 refuses numpy integers in an array column."""
    return spark.createDataFrame(table.select(["id", "tokens"]).to_pylist(), schema=SCHEMA)


def _to_arrow(df: Any) -> Any:
    import pyarrow as pa

    if hasattr(df, "toArrow"):          # Spark >= 4.0
        return df.toArrow()
    return pa.Table.from_pandas(df.toPandas(), preserve_index=False)


def _spark_version(spark: Any, name: str) -> int | None:
    try:
        return int(spark.sql(f"DESCRIBE HISTORY {name} LIMIT 1").collect()[0]["version"])
    except Exception:
        return None
