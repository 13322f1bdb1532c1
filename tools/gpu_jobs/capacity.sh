#!/usr/bin/env bash
# The capacity benchmark on one GPU: K_MODEL (default qwen3_0p6b), K_SETTINGS (recompute_on recompute_off);
# K_VIME=1 runs vime's own loss from a carried .vime/ tree (docs/e2e-vime.md: vime-2b83ea20-nearpin,
# megatron-lm-1dcf0daf, wheels/); K_LIMIT seconds for the whole run
export RLK_SUITE_COMMIT=${RLK_SUITE_COMMIT:?}
nvidia-smi -L; date -u
extra=()
if [ -n "${K_VIME:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .vime/wheels/*.whl 2>/dev/null || true
  export PYTHONPATH=$PWD/.vime/megatron-lm-1dcf0daf${PYTHONPATH:+:$PYTHONPATH}
  extra=(--rlk-vime-root "$PWD/.vime/vime-2b83ea20-nearpin")
fi
sel=""
for s in ${K_SETTINGS:-recompute_on recompute_off}; do sel="${sel:+$sel or }$s"; done
s0=$(date +%s)
RLK_NIGHTLY_TAG=capacity timeout -s INT ${K_LIMIT:-570} .ci/gpu-nightly suites/module/bench_capacity.py --rlk-tier=module -m bench_full \
   -k "${K_MODEL:-qwen3_0p6b} and ($sel)" -n 0 -s -q -rfE --rlk-update-baselines=all "${extra[@]}" 2>&1 | grep -v "^$" | tail -80
echo "capacity rc=${PIPESTATUS[0]} wall=$(( $(date +%s) - s0 ))s"; date -u
