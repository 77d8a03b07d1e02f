"""Cluster definitions, checked before you pay for them.

A Databricks cluster file with a typo fails only after a GPU cluster has started (and billed). This
package checks the course's files offline, in two layers, one concern per file:

* ``schema.py`` — **the strict models of databricks-bundles** (``Cluster``, ``Job``): unknown keys
  and bad enum values raise; each error becomes ``file: key.path: problem. Fix: ...`` with a
  "did you mean".
* ``rules.py`` — **rules the models cannot express**, about GPUs and the course's
  one-process-per-GPU layout: GPU node types need a GPU ML runtime; the single-node profile goes
  with ``num_workers: 0``, ``spark.master: local[...]`` and ``ResourceClass: SingleNode``;
  multi-node GPU clusters set ``spark.task.resource.gpu.amount: "1"`` and a fixed size; the tag
  ``custom_tags.dtlab_processes`` equals the GPUs the cluster offers; spot clusters keep an
  on-demand driver; all-purpose clusters stop themselves. Node facts come from ``dtlab.planner.hardware``.
* ``bundle.py`` — the bundle ``databricks.yml``: declared variables, tasks, job clusters,
  notebooks and their parameters (a notebook's ``nprocs`` may not exceed its node's GPUs); and no
  literal credentials in any file (only ``{{secrets/scope/key}}``).
* ``serverless.py`` — tasks with no cluster run on serverless compute: no libraries, an environment of the job
  (``environment_key``) for Python and wheel tasks, dtlab's wheel in it when they import dtlab.
* ``sharing.py`` — no init script, code source or bundle folder where every workspace user can write
  (``/Shared``, ``/Workspace/Shared``, DBFS): a Unity Catalog volume or your own folder instead.
* ``governance.py`` — what a platform team asks: job clusters under a policy, a production target run as a
  service principal with permissions, the CLI version the bundle's features need, code installed as root
  pinned (a wheel by name and sha256: ``pin_wheel``).
* ``files.py`` — ``load``, ``validate``, ``check`` one file; ``find_root``, ``default_paths``.
* ``offer.py`` — ``offers``: what a cluster file gives a job (nodes, GPUs, memory, bandwidths).
* ``problems.py`` — how a problem is worded, and ``ClusterConfigError``.

    from dtlab.tooling import clusters
    clusters.validate("clusters/g5-12xlarge-4-nodes.yml")    # [] when valid, else the problems
    clusters.offers("clusters/g5-12xlarge-4-nodes.yml")      # nodes, GPUs, memory, network

From the shell: ``dtlab clusters validate [PATH ...]`` (default: ``clusters/*.yml`` and ``databricks.yml``).
"""

from dtlab.tooling.clusters.bundle import bundle_notes
from dtlab.tooling.clusters.files import check, default_paths, find_root, load, validate
from dtlab.tooling.clusters.governance import pin_wheel
from dtlab.tooling.clusters.offer import Offer, offers
from dtlab.tooling.clusters.problems import ClusterConfigError
from dtlab.tooling.clusters.rules import GPU_NODE_TYPES, NodeType, cluster_problems, is_single_node, node_type
from dtlab.tooling.clusters.schema import BUNDLES_PIN, schema_problems
from dtlab.tooling.clusters.sharing import shared_path_problems

__all__ = ["BUNDLES_PIN", "GPU_NODE_TYPES", "ClusterConfigError", "NodeType", "Offer", "bundle_notes", "check",
           "cluster_problems", "default_paths", "find_root", "is_single_node", "load", "node_type", "offers",
           "pin_wheel", "schema_problems",
           "shared_path_problems", "validate"]
