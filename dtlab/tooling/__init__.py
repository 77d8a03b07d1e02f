"""The course's own tooling: what runs, checks and publishes the course, not what a lesson teaches.

    dtlab.tooling.cli        the ``dtlab`` command (``dtlab env``, ``advise``, ``course``, ``site``, ``clusters``);
                             ``python -m dtlab`` is the same
    dtlab.tooling.runner     run the course notebooks headless with papermill (``dtlab course run``)
    dtlab.tooling.website    a course run as a static website, checked page by page in headless Chromium
    dtlab.tooling.jobs       the Databricks job's summary task: every lesson's status, read with the job's login
    dtlab.tooling.clusters   Databricks cluster files and the bundle validated offline, before you pay for them
"""

import importlib

#: The tools, loaded on first use.
TOOLS = ("cli", "runner", "website", "jobs", "clusters")


def __getattr__(name: str):
    if name in TOOLS:
        return importlib.import_module(f"dtlab.tooling.{name}")
    raise AttributeError(f"module 'dtlab.tooling' has no attribute {name!r}. Its tools: {', '.join(TOOLS)}")
