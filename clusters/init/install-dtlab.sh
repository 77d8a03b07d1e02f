#!/bin/bash
# Databricks cluster-scoped init script: installs dtlab on every node before Spark starts.
#
# Referenced by the cluster definitions in clusters/*.yml and by the job cluster in databricks.yml
# (init_scripts -> workspace -> destination). It reads, from the cluster's spark_env_vars:
#   DTLAB_SOURCE     where dtlab is: a workspace folder holding this repository (a Git folder, a
#                    `databricks sync` copy, or the files a bundle deploys), or a pip URL such as
#                    git+https://github.com/<you>/dtlab.git@main. Default: /Workspace/Shared/dtlab.
#   DTLAB_GIT_TOKEN  optional, for a private git+https URL only. Set it in spark_env_vars as a secret
#                    reference, "{{secrets/<scope>/<key>}}": Databricks fills it in on the node, and
#                    the token never appears in a file, a log line or the cluster's configuration page.
#
# --no-deps: the ML runtime already has torch and numpy (dtlab's only dependencies); letting pip
# "upgrade" torch here would replace the runtime's CUDA build. databricks-bundles (pure Python, no
# dependencies) is for notebook 11's offline validation of these cluster files.
# The log of this script is in the cluster's init-script logs (Compute > the cluster > Event log).
set -euo pipefail

DTLAB_SOURCE="${DTLAB_SOURCE:-/Workspace/Shared/dtlab}"
DATABRICKS_BUNDLES_VERSION="1.22.1"   # the pin in requirements.txt
PIP=/databricks/python/bin/pip

case "$DTLAB_SOURCE" in
  git+https://*)
    url="$DTLAB_SOURCE"
    if [[ -n "${DTLAB_GIT_TOKEN:-}" ]]; then
      url="git+https://x-access-token:${DTLAB_GIT_TOKEN}@${DTLAB_SOURCE#git+https://}"
    fi
    echo "dtlab: installing from ${DTLAB_SOURCE}"   # the URL without the token
    "$PIP" install --quiet --no-deps "$url"
    ;;
  *)
    src="$DTLAB_SOURCE"
    # Bundles and older CLIs write workspace paths with or without the /Workspace mount prefix.
    [[ "$src" == /Workspace/* ]] || src="/Workspace${src}"
    if [[ ! -f "$src/pyproject.toml" ]]; then
      echo "dtlab: no pyproject.toml in ${src}. Fix: put this repository there (a Git folder, or" \
           "databricks sync . ${src}), or set DTLAB_SOURCE in the cluster's spark_env_vars." >&2
      exit 1
    fi
    # Build from a local copy: pip writes build files next to the source, and the workspace
    # folder is shared by every node (and may be read-only to this script).
    build="$(mktemp -d)"
    cp -r "$src/pyproject.toml" "$src/README.md" "$src/dtlab" "$build/"
    echo "dtlab: installing from ${src}"
    "$PIP" install --quiet --no-deps "$build"
    ;;
esac

"$PIP" install --quiet "databricks-bundles==${DATABRICKS_BUNDLES_VERSION}"
echo "dtlab: installed"
