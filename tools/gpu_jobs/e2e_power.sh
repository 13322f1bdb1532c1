#!/usr/bin/env bash
# The e2e power study on one GPU, in parts: E_LANES, E_AA, E_FAULTS ("NAME=SIZES NAME=SIZES ...")
export RLK_SUITE_COMMIT=${RLK_SUITE_COMMIT:?}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L; date -u
args=()
for f in ${E_FAULTS:-}; do args+=(--fault "$f"); done
s=$(date +%s)
timeout -s INT ${E_LIMIT:-560} python3 tools/e2e_power.py trl-qwen3-small-gpu --out "$OUT/power" --aa "${E_AA:-5}" --lanes "${E_LANES:-replay,live}" "${args[@]}"
echo "e2e_power rc=$? wall=$(( $(date +%s) - s ))s"; date -u
python3 tools/e2e_power.py trl-qwen3-small-gpu --regate "$OUT/power" > "$OUT/power-regate.md" 2>&1; tail -40 "$OUT/power-regate.md"
