# Sourced by the scripts/gpu_*.sh runners: unbuffered output, $OUT created (default ./gpu_out),
# comparison wheels from .whl/ installed into /tmp/site when present, and src/ on PYTHONPATH.
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
# want STAGE: whether a runner's " $stages " (set after sourcing this, space-padded) names STAGE.
want() { [[ $stages == *" $1 "* ]]; }
# The device brings back at most 8 files from $OUT: on exit, every file under it (but earlier
# archives) goes into one $OUT/results-<runner>.tgz (read them with `tar xzf`). A runner killed by
# the call's own time limit packs nothing: keep each stage under its `timeout`.
pack_out() {
  local archive="results-$(basename "${0:-shell}" .sh).tgz"
  (cd "$OUT" && find . -type f ! -name '*.tgz' ! -name '*.part' | tar czf "$archive.part" -T - \
     && find . -type f ! -name '*.tgz' ! -name '*.part' -delete && mv "$archive.part" "$archive")
}
trap pack_out EXIT
