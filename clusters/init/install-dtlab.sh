#!/bin/bash
# Databricks cluster-scoped init script: installs dtlab on every node before Spark starts.
#
# Referenced by the cluster definitions in clusters/*.yml and by the job cluster in databricks.yml
# (init_scripts -> workspace -> destination). It reads, from the cluster's spark_env_vars:
#   DTLAB_SOURCE     where dtlab is: the wheel you built (`python3 -m pip wheel --no-deps -w dist .`), by its
#                    exact file in a Unity Catalog volume, with DTLAB_WHEEL_SHA256 (checked before installing;
#                    `dtlab clusters pin-wheel` writes both); a workspace folder holding this repository (a Git
#                    folder or a `databricks sync` copy, in your own user folder); or a pip URL at a commit,
#                    git+https://github.com/<you>/dtlab.git@<commit sha>. Not a folder of wheels: "the newest
#                    one there" would let anyone who may write to that folder choose what runs here as root.
#   DTLAB_WHEEL_SHA256  the wheel's sha256 (sha256sum): a wheel whose bytes differ is refused.
#                    Never a folder every workspace user can write (/Shared, /Workspace/Shared, DBFS): this
#                    script runs as root; `dtlab clusters validate` refuses such paths.
#                    Unset (the bundle's job cluster): dtlab comes as the tasks' library, the wheel the
#                    bundle builds, and this script installs only the optional tools.
#                    Reading a workspace folder from an init script is supported from Databricks Runtime
#                    11.3 LTS for init scripts that are themselves workspace files (AWS and Azure docs,
#                    "Reference files from init scripts"); Databricks on GCP documents it as unsupported:
#                    there, use the pip URL, or install the wheel (`python3 -m pip wheel --no-deps -w dist .`,
#                    uploaded to a Unity Catalog volume) as a cluster library.
#   DTLAB_GIT_TOKEN  optional, for a private git+https URL only. Set it in spark_env_vars as a secret
#                    reference, "{{secrets/<scope>/<key>}}": Databricks fills it in on the node, and
#                    the token never appears in a file, a log line or the cluster's configuration page.
#
# What a cluster start must not depend on: PyPI. dtlab is installed with --no-deps (the ML runtime has
# torch and numpy, dtlab's only dependencies: letting pip "upgrade" torch would replace the runtime's
# CUDA build) and --no-build-isolation (build isolation downloads setuptools from PyPI; the runtime
# has it). Never install requirements.txt on a cluster: its pins (torch, PySpark, MLflow) would
# shadow the runtime's own.
# Optional tools are soft and driver-only: databricks-bundles (notebook 11's offline validation) and
# py-spy (notebook 10's stack dumps). When PyPI cannot be reached they are skipped with a line in this
# log, and the lessons that use them say so; the cluster still starts.
# The log of this script is in the cluster's init-script logs (Compute > the cluster > Event log).
set -euo pipefail

DTLAB_SOURCE="${DTLAB_SOURCE:-}"
DATABRICKS_BUNDLES_VERSION="1.22.1"   # the pins in requirements.txt
PY_SPY_VERSION="0.4.3"
PIP="${DTLAB_PIP:-/databricks/python/bin/pip}"   # DTLAB_PIP: for testing this script elsewhere

case "$DTLAB_SOURCE" in
  "")
    echo "dtlab: DTLAB_SOURCE unset: dtlab is installed as the tasks' library (the bundle's wheel)"
    ;;
  git+https://*)
    url="$DTLAB_SOURCE"
    if [[ -n "${DTLAB_GIT_TOKEN:-}" ]]; then
      url="git+https://x-access-token:${DTLAB_GIT_TOKEN}@${DTLAB_SOURCE#git+https://}"
    fi
    echo "dtlab: installing from ${DTLAB_SOURCE}"   # the URL without the token
    "$PIP" install --quiet --no-deps --no-build-isolation "$url"
    echo "dtlab: installed"
    ;;
  *)
    src="$DTLAB_SOURCE"
    # Bundles and older CLIs write workspace paths with or without the /Workspace mount prefix.
    [[ -e "$src" || "$src" == /Workspace/* || "$src" == /Volumes/* ]] || src="/Workspace${src}"
    if [[ "$src" == *.whl ]]; then
      # A wheel, pinned by its sha256: nothing to build, nothing downloaded, nothing installed that differs.
      if [[ ! -f "$src" ]]; then
        echo "dtlab: no wheel ${src}. Fix: copy it there (databricks fs cp dist/<the wheel> dbfs:${src%/*}/)" >&2
        exit 1
      fi
      want="${DTLAB_WHEEL_SHA256:-}"
      got="$(sha256sum "$src" | cut -d' ' -f1)"
      if [[ -z "$want" ]]; then
        echo "dtlab: DTLAB_WHEEL_SHA256 unset: ${src} is not installed unchecked. Fix: dtlab clusters pin-wheel" \
             "<the wheel> --volume ${src%/*} <the cluster file> (writes its sha256)" >&2
        exit 1
      fi
      if [[ "$got" != "$want" ]]; then
        echo "dtlab: ${src} has sha256 ${got}, not the pinned ${want}: it was replaced or rebuilt. Fix: pin the" \
             "wheel you built again (dtlab clusters pin-wheel) and copy that one there" >&2
        exit 1
      fi
      echo "dtlab: installing ${src} (sha256 ${got})"
      "$PIP" install --quiet --no-deps "$src"
      echo "dtlab: installed"
    elif [[ -f "$src/pyproject.toml" ]]; then
      # Build from a local copy: pip writes build files next to the source, and the workspace
      # folder is shared by every node (and may be read-only to this script).
      build="$(mktemp -d)"
      trap 'rm -rf "$build"' EXIT
      cp -r "$src/pyproject.toml" "$src/README.md" "$src/dtlab" "$build/"
      echo "dtlab: installing from ${src}"
      "$PIP" install --quiet --no-deps --no-build-isolation "$build"
      echo "dtlab: installed"
    else
      echo "dtlab: ${src} is not a dtlab wheel file nor a folder with this repository (pyproject.toml). Fix:" \
           "name the wheel file itself and its sha256 (dtlab clusters pin-wheel dist/dtlab-*.whl --volume" \
           "<volume folder> <the cluster file>), or put this repository there (a Git folder of your own)." >&2
      exit 1
    fi
    ;;
esac

# Optional, driver only, never fatal (DB_IS_DRIVER is TRUE on the driver node).
if [[ "${DB_IS_DRIVER:-}" == "TRUE" ]]; then
  if timeout 180 "$PIP" install --quiet "databricks-bundles==${DATABRICKS_BUNDLES_VERSION}" "py-spy==${PY_SPY_VERSION}"; then
    echo "dtlab: optional tools installed (databricks-bundles, py-spy)"
  else
    echo "dtlab: optional tools not installed (PyPI unreachable?): notebook 11's offline validation and" \
         "notebook 10's py-spy section will say so; the course runs without them"
  fi
fi
exit 0
