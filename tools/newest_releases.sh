#!/usr/bin/env bash
# The newest releases check: a fresh venv with `-e .[test]` installed WITHOUT constraints.txt, so pip picks
# the newest release of every dependency that pyproject.toml allows, then a fast subset of the suite:
# the Hugging Face / PEFT / DeepSpeed integration (the recipe, LoRA, ZeRO, the model matrix) and the unit
# tests. Run it before each stop; a failure here is what a user who runs `pip install shardwise[...]` today
# meets. pyproject.toml caps a release only while a named bug in it is open, the reason beside the cap.
#
#   tools/newest_releases.sh                       # everything newest
#   NEWEST_KEEP="torch" tools/newest_releases.sh   # keep these packages at the versions this python has
#
# NEWEST_KEEP: space-separated package names installed at the version the invoking python has (e.g. torch,
# whose PyPI Linux wheel is a 3 GB CUDA build; the CPU build on a development machine checks the same CPU
# paths). The machine's pip configuration is honoured except its constraint file (PIP_CONSTRAINT is
# emptied): any cap it sets would hide the newest releases. Environment: NEWEST_DIR (default
# /tmp/shardwise-newest), PYTHON (default python3), PYTEST_ARGS (extra pytest arguments, e.g. "-x").
# Prints the versions pip picked (newest-versions.txt beside the log) and pytest's summary; exits with
# pytest's status.
set -uo pipefail
cd "$(dirname "$0")/.."
work=${NEWEST_DIR:-/tmp/shardwise-newest}
py=${PYTHON:-python3}
venv="$work/venv"
log="$work/pytest.log"
mkdir -p "$work"
rm -rf "$venv"
"$py" -m venv "$venv" || exit 1

keep=()
for pkg in ${NEWEST_KEEP:-}; do
  version=$("$py" -c "import importlib.metadata as m; print(m.version('$pkg'))") || exit 1
  keep+=("$pkg==$version")
done
echo "== installing -e .[test] (newest releases${keep:+; kept: ${keep[*]}}) into $venv"
PIP_CONSTRAINT="" "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
PIP_CONSTRAINT="" "$venv/bin/python" -m pip install -q "${keep[@]}" -e ".[test]" || exit 1
"$venv/bin/python" -m pip freeze --exclude-editable | sort > "$work/newest-versions.txt"
grep -i -E "^(torch|transformers|peft|deepspeed|accelerate|safetensors|bitsandbytes|trl|datasets|tokenizers)==" \
  "$work/newest-versions.txt"

subset=(
  tests/recipes/test_finetune_e2e.py
  tests/recipes/test_finetune_deepspeed.py
  tests/recipes/test_lora.py
  tests/recipes/test_qlora.py
  tests/recipes/test_convert_recipe.py
  tests/recipes/test_sequence_parallel_hf.py
  tests/recipes/test_model_matrix.py
  tests/unit
)
echo "== pytest ${subset[*]} (log: $log)"
start=$(date +%s)
"$venv/bin/python" -m pytest "${subset[@]}" -q -p no:cacheprovider ${PYTEST_ARGS:-} >"$log" 2>&1
status=$?
grep -E "^(FAILED|ERROR)" "$log" | cut -c1-240
tail -1 "$log"
echo "== exit $status in $(($(date +%s) - start)) s"
exit $status
