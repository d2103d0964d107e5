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
