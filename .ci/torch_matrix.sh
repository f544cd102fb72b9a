#!/usr/bin/env bash
# The torch-version matrix (issue 26 item 3): for each torch version, a fresh venv with that torch and
# `-e .[test]` under constraints.txt (less the pins that torch version cannot take), then the quick subset
# `pytest tests -m "not slow"`; one summary line per version with its result and wall time.
#
#   .ci/torch_matrix.sh                # the lower bound in pyproject.toml's torch requirement, and 2.11.0
#   .ci/torch_matrix.sh 2.7.1 2.11.0   # the versions named
#
# PyPI's Linux torch wheels are CUDA builds: torch plus its nvidia-* wheels is about 3 GB per version
# (2.5 GB to download). They run on a machine without a GPU (torch.cuda.is_available() is False), so the
# CPU paths the suite covers are exercised by the very binary users install. Wheels are downloaded once into
# $TORCH_MATRIX_DIR/wheels and reused; the venvs are made anew every run. Not in .ci/run: on the 2-core
# machine one version takes 15-20 minutes under load (install 3-6 min, tests 11-16 min; BENCHMARKS.md,
# "Torch versions"). The tree tested is this checkout, uncommitted changes included.
#
# Environment: TORCH_MATRIX_DIR (default /tmp/shardwise-torch-matrix), PYTHON (default python3),
# PYTEST_ARGS (extra pytest arguments, e.g. "-x" or "-k fsdp").
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
work=${TORCH_MATRIX_DIR:-/tmp/shardwise-torch-matrix}
py=${PYTHON:-python3}
mkdir -p "$work/wheels"

# The claimed lower bound, read from pyproject.toml's `"torch>=X"` (or `"torch>=X,<=Y"`) so the default follows the claim.
lower=$(sed -n 's/^ *"torch>=\([0-9.]*\)[,"].*/\1/p' pyproject.toml | head -1)
# torch 2.11: what the GPU machines we are lent carry. Run once when it is the lower bound too.
if [ $# -gt 0 ]; then
  versions=("$@")
elif [ "$lower" = 2.11 ] || [ "$lower" = 2.11.0 ]; then
  versions=("2.11.0")
else
  versions=("$lower" "2.11.0")
fi

# Pins in constraints.txt that a given torch cannot install with, dropped for that version only (pip then
# picks a version that satisfies torch). Found by running this script; recorded in BENCHMARKS.md.
relax_for() {
  case "$1" in
    # torch 2.6 requires sympy==1.13.1 exactly (constraints.txt pins 1.14.0). 2.10 and 2.11 need nothing
    # relaxed: deepspeed, bitsandbytes, transformers and peft at their pinned versions install with them.
    2.6|2.6.*) echo "sympy" ;;
    *) echo "" ;;
  esac
}

summary=()
for v in "${versions[@]}"; do
  venv="$work/venv-torch-$v"
  log="$work/torch-$v.log"
  cons="$work/constraints-torch-$v.txt"
  drop="torch $(relax_for "$v")"
  pattern="^($(echo $drop | tr ' ' '|'))=="
  grep -v -i -E "$pattern" constraints.txt > "$cons"
  echo "== torch $v: venv $venv, log $log, constraints.txt less: $drop"
  start=$(date +%s)
  rm -rf "$venv"
  {
    "$py" -m venv "$venv" &&
      "$venv/bin/python" -m pip download -q "torch==$v" -d "$work/wheels" &&
      "$venv/bin/python" -m pip install -q --find-links "$work/wheels" "torch==$v" -e ".[test]" -c "$cons"
  } > "$log" 2>&1
  if [ $? -ne 0 ]; then
    t=$(($(date +%s) - start))
    summary+=("torch $v: INSTALL FAILED after ${t}s (see $log)")
    tail -20 "$log"
    continue
  fi
  installed=$("$venv/bin/python" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())')
  echo "   installed: $installed (install $(($(date +%s) - start))s)"
  tstart=$(date +%s)
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pytest tests -q -m "not slow" -p no:cacheprovider ${PYTEST_ARGS:-} >> "$log" 2>&1
  rc=$?
  end=$(date +%s)
  result=$(grep -E " in [0-9.]+s( \(|$)" "$log" | tail -1)
  summary+=("torch $v ($installed): pytest exit $rc, $result; tests $((end - tstart))s, with install $((end - start))s")
  grep -E "^(FAILED|ERROR) " "$log" | head -30
done
echo
echo "== torch matrix summary ($(date -u +%Y-%m-%dT%H:%MZ), $(nproc) cores, commit $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?'))"
status=0
for line in "${summary[@]}"; do
  echo "$line"
  case "$line" in *"exit 0,"*) ;; *) status=1 ;; esac
done
exit $status
