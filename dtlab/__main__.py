"""``python -m dtlab ...`` is the ``dtlab`` command (``dtlab.tooling.cli``), for interpreters with no console
scripts beside them (a Databricks cluster's Python)."""

if __name__ == "__main__":
    import sys

    from dtlab.tooling.cli import main

    sys.exit(main())
