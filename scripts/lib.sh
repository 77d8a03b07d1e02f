# Shared by the set-up scripts: quiet pip, and the wheel cache outside the repo.
# shellcheck shell=bash

# pip, quiet, minus one harmless warning some machines' pip config prints for every package.
pip_q() { "$PY" -m pip --quiet --disable-pip-version-check "$@" 2>&1 \
            | sed '/is neither a file nor a directory/d'; }

# install_requirements FILE [PIP ARGS]: pip installs FILE without compiling each module as it unpacks it (one file after
# another), then compiles them all on every core: the same .pyc files, 230 s -> 181 s for requirements.txt
# on 2 cores with an empty cache (benchmarks/setup_time.sh).
install_requirements() {
  local file=$1
  shift
  pip_q install --no-compile "$@" -r "$file"
  "$PY" -m compileall -q -j 0 "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    >/dev/null 2>&1 || true  # a few packages ship files for other Pythons that do not compile; pip skips them too
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
