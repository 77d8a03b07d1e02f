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
  them exist? A ``LookupError`` names the parameter and the SQL that creates it.
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


def volume_path(catalog: str, schema: str, volume: str, *parts: str) -> Path:
    """A path in a Unity Catalog volume: ``/Volumes/<catalog>/<schema>/<volume>/<parts...>``."""
    return Path("/Volumes", catalog, schema, volume, *parts)


def check_catalog(spark: Any, catalog: str, schema: str, volume: str | None = None) -> None:
    """Raise ``LookupError`` naming the parameter and the fix when ``catalog``, ``catalog.schema`` or the volume does
    not exist (or is not given). Run it before writing anything on Databricks."""
    for name, value in (("catalog", catalog), ("schema", schema), ("volume", volume)):
        if name == "volume" and volume is None:
            continue
        if not value:
            raise LookupError(f"no {name} given. Fix: set the notebook parameter (job parameter) {name!r} to a Unity "
                              f"Catalog {name} you may write to")
    catalogs = {r[0] for r in spark.sql("SHOW CATALOGS").collect()}
    if catalog not in catalogs:
        raise LookupError(f"catalog {catalog!r} does not exist or you cannot see it (parameter 'catalog'). "
                          f"Fix: another catalog, or CREATE CATALOG {catalog} (needs the CREATE CATALOG privilege)")
    schemas = {r[0] for r in spark.sql(f"SHOW SCHEMAS IN {catalog}").collect()}
    if schema not in schemas:
        raise LookupError(f"schema {catalog}.{schema} does not exist (parameter 'schema'). Fix: CREATE SCHEMA "
                          f"{catalog}.{schema}, or set 'schema' to one of {sorted(schemas)[:5]}")
    if volume and not volume_path(catalog, schema, volume).is_dir():
        raise LookupError(f"volume {catalog}.{schema}.{volume} does not exist (parameter 'volume'). Fix: CREATE VOLUME "
                          f"{catalog}.{schema}.{volume}")


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
