#!/usr/bin/env bash
# The e2e nightly on one GPU (baselines recorded first where the platform has none); then the precision
# matrix's training side (PRECISION_DIR) and the plugin's tests (PLUGIN_LIMIT seconds), where asked
export RLK_SUITE_COMMIT=${RLK_SUITE_COMMIT:?}
nvidia-smi -L; date -u
# the wheels first: the platform probe below needs pydantic (gpu-nightly installs them again, a no-op)
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
plat=$(PYTHONPATH=/tmp/site:$PWD python3 -c 'from pytest_rlk import platform; print(platform.detect().tag)') \
  || { echo "e2e_nightly: the platform probe failed" >&2; exit 2; }
echo "platform=$plat"
if [ ! -d "baselines/e2e/$plat" ] || [ -n "${E2E_UPDATE:-}" ]; then
  s=$(date +%s)
  RLK_NIGHTLY_TAG=e2e-update timeout -s INT ${E2E_LIMIT:-280} .ci/gpu-nightly --rlk-tier=e2e -m "$plat" --rlk-update-baselines=all -q -rfE --durations=10
  echo "e2e_nightly e2e-update rc=$? wall=$(( $(date +%s) - s ))s"
fi
s=$(date +%s)
RLK_NIGHTLY_TAG=e2e-require timeout -s INT ${E2E_LIMIT:-280} .ci/gpu-nightly --rlk-tier=e2e -m "$plat" --rlk-require-baselines -q -rfE --durations=10
echo "e2e_nightly e2e-require rc=$? wall=$(( $(date +%s) - s ))s"; date -u
# PRECISION_DIR: the artifact folder of suites/module/drift/test_mismatch_rollouts.py::test_precision_matrix
# (its model and rollouts), carried: the precision matrix's training side on this GPU
if [ -n "${PRECISION_DIR:-}" ]; then
  A=$PRECISION_DIR
  PYTHONPATH=/tmp/site:$PWD timeout 120 python3 -m pytest_rlk.drift.precision $A/model --rollout bf16=$A/rollout-bf16.json \
      --rollout fp16=$A/rollout-fp16.json --device cuda --out "$OUT/precision" > "$OUT/precision.log" 2>&1
  echo "e2e_nightly precision rc=$?"; tail -30 "$OUT/precision.log"
fi
if [ -n "${PLUGIN_LIMIT:-}" ]; then
  s=$(date +%s)
  PYTHONPATH=/tmp/site:$PWD timeout -s INT "$PLUGIN_LIMIT" python3 -m pytest suites/plugin -q -p no:cacheprovider -rfE --durations=60 > "$OUT/plugin.log" 2>&1
  echo "e2e_nightly plugin rc=$? wall=$(( $(date +%s) - s ))s"; tail -75 "$OUT/plugin.log"
fi
date -u
