# Shared by the set-up scripts: quiet pip, uv for the requirements files, and the wheel cache outside the repo.
# shellcheck shell=bash

# pip, quiet, minus one harmless warning some machines' pip config prints for every package.
pip_q() { "$PY" -m pip --quiet --disable-pip-version-check "$@" 2>&1 \
            | sed '/is neither a file nor a directory/d'; }

# The requirements files are installed with uv (pinned here), not pip: the same versions, resolved and
# downloaded in parallel, and unpacked once into uv's cache (~/.cache/uv), from which each new venv is
# hard-linked instead of unzipped again. Measured side by side on this 2-core machine, requirements-dbr18.txt into
# a fresh venv with warm caches: pip 181 s (unpacking, then compileall on every core), uv 75 s (with its bytecode).
UV_VERSION=0.13.9

# Set-ups may run at the same time (scripts/setup_all.sh): what they share (uv's own venv, a source archive's
# wheel, apt) is made by one of them at a time, under a lock in dtlab's cache.
lock_path() {
  local folder
  folder="${DTLAB_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dtlab}/locks"
  mkdir -p "$folder"
  echo "$folder/$1.lock"
}
# locked NAME COMMAND...: run the program COMMAND holding the lock NAME (waiting for whoever holds it).
locked() { flock "$(lock_path "$1")" "${@:2}"; }

# uv_bin: the path of uv UV_VERSION, installed once (with pip, from PyPI) into a venv of its own in dtlab's cache.
# (Called as $(uv_bin): the lock's file descriptor closes with that subshell.)
uv_bin() {
  local tools fd
  tools="${DTLAB_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dtlab}/tools/uv-$UV_VERSION"
  if [ ! -x "$tools/bin/uv" ]; then
    exec {fd}>"$(lock_path "uv-$UV_VERSION")"
    flock "$fd"
    if [ ! -x "$tools/bin/uv" ]; then    # else another set-up made it while this one waited
      rm -rf "$tools"
      "$PY" -m venv "$tools"
      "$tools/bin/python" -m pip --quiet --disable-pip-version-check install "uv==$UV_VERSION" 2>&1 \
        | sed '/is neither a file nor a directory/d' >&2
    fi
  fi
  echo "$tools/bin/uv"
}

# uv does not read pip's configuration: the same places (find-links, index URLs, constraints, certificates,
# timeout), from `pip config list` (files and PIP_* variables alike), as uv's arguments and environment.
# Across indexes uv, like pip, takes the best version (its default takes the first index that has the package).
UV_ARGS=()
uv_args_from_pip() {
  local line key value item
  UV_ARGS=(--index-strategy unsafe-best-match)
  while IFS= read -r line; do
    key=${line%%=*}
    key=${key##*.}
    value=${line#*=}
    value=${value#\'}
    value=${value%\'}
    for item in $value; do
      case $key in
        find-links) UV_ARGS+=(--find-links "$item") ;;
        index-url) UV_ARGS+=(--index-url "$item") ;;
        extra-index-url) UV_ARGS+=(--extra-index-url "$item") ;;
        constraint) UV_ARGS+=(--constraint "$item") ;;
        cert) export SSL_CERT_FILE="$item" ;;
        default-timeout|timeout) export UV_HTTP_TIMEOUT="$item" ;;
      esac
    done
  done < <("$PY" -m pip config list 2>/dev/null)
}

# Packages PyPI has only as source archives (pyspark: 455 MB for 4.1.0) are built into a wheel once, by pip
# (which caches the build), and kept in dtlab's cache: uv would otherwise fetch and build the archive in every
# new venv (its cache revalidates the download and finds it "modified" here). sdist_wheels FILE: the folder.
sdist_wheels() {
  local file=$1 folder pin fd work
  folder="${DTLAB_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dtlab}/wheels/sdists"
  mkdir -p "$folder"
  while read -r pin; do
    if ! compgen -G "$folder/pyspark-${pin#pyspark==}-*.whl" >/dev/null; then
      exec {fd}>"$(lock_path "$pin")"
      flock "$fd"                # (called as $(sdist_wheels ...): released when that subshell ends)
      if ! compgen -G "$folder/pyspark-${pin#pyspark==}-*.whl" >/dev/null; then
        say "building $pin's wheel once (PyPI has only its source; cached in $folder)" >&2
        work=$(mktemp -d)        # built beside the cache, moved in whole: no other set-up sees half a wheel
        pip_q wheel --no-deps "$pin" -w "$work" >&2
        mv "$work"/*.whl "$folder"/
        rm -rf "$work"
      fi
    fi
  done < <(sed -n 's/^\(pyspark==[^ ;#]*\).*/\1/p' "$file")
  echo "$folder"
}

# install_requirements FILE [UV ARGS]: FILE's pinned packages into $PY's venv with uv, compiled to bytecode (as pip
# does by default: the lessons' first timings do not include compiling what they import).
install_requirements() {
  local file=$1 uv wheels
  shift
  uv=$(uv_bin)
  uv_args_from_pip
  wheels=$(sdist_wheels "$file")
  "$uv" pip install --quiet --python "$PY" --compile-bytecode "${UV_ARGS[@]}" --find-links "$wheels" "$@" -r "$file"
}

# Wheels built here depend on the Python and torch they were built against: cache them per pair,
# outside the repo, so fresh clones and new venvs on this machine reuse them.
# wheel_cache [VARIANT]: VARIANT (e.g. -nccl) keeps differently configured builds for the same pair apart.
wheel_cache() {
  local key
  key=$("$PY" -c "import sys, torch; print(f'py{sys.version_info[0]}{sys.version_info[1]}-torch{torch.__version__}')")
  echo "${DTLAB_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dtlab}/wheels/$key${1:-}"
}

# cached_wheel DIR NAME VERSION: the path of NAME's VERSION wheel in DIR, or nothing.
cached_wheel() {
  local f
  for f in "$1/$2-$3-"*.whl; do
    if [ -e "$f" ]; then echo "$f"; return 0; fi
  done
}

# install_cached_wheel NAME VERSION MINUTES BUILD [VARIANT]
# Install NAME's wheel from the cache; on a miss, first run the function BUILD with a scratch folder
# (it must leave the wheel in FOLDER/dist; its output goes to FOLDER/build.log) and cache the result.
# The cache folder also carries a hash of the calling build script: a changed recipe builds anew.
install_cached_wheel() {
  local name=$1 version=$2 minutes=$3 build=$4 variant=${5:-} cache wheel work t recipe
  recipe=$(sha256sum "${BASH_SOURCE[1]}" | cut -c1-8)
  cache=$(wheel_cache "$variant")/$name-recipe-$recipe
  mkdir -p "$cache"
  wheel=$(cached_wheel "$cache" "$name" "$version")
  if [ -z "$wheel" ]; then
    say "building $name $version (about $minutes minutes on 2 cores; cached in $cache)"
    t=$SECONDS
    work=$(mktemp -d)
    _dtlab_scratch=$work
    trap 'rm -rf "$_dtlab_scratch"' EXIT  # also when the build is interrupted: no scratch folder left behind
    if ! "$build" "$work" > "$work/build.log" 2>&1; then
      tail -n 40 "$work/build.log"
      say "build failed (log above)"
      return 1
    fi
    cp "$work"/dist/"$name"-*.whl "$cache/"
    rm -rf "$work"
    trap - EXIT
    wheel=$(cached_wheel "$cache" "$name" "$version")
    say "built in $((SECONDS - t)) s: $wheel"
  else
    say "using cached wheel $wheel"
  fi
  pip_q install --force-reinstall --no-deps "$wheel"
}
