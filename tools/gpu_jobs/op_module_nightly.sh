#!/usr/bin/env bash
# The op and module nightly on one GPU, as a user runs it (the 8-minute goal: docs/nightly.md)
export RLK_SUITE_COMMIT=${RLK_SUITE_COMMIT:?}
nvidia-smi -L; date -u
start=$(date +%s)
timeout -s INT ${OPMOD_LIMIT:-575} .ci/gpu-nightly --rlk-tier=op,module -m h200 --rlk-require-baselines -q -rfE --durations=40
echo "op_module_nightly rc=$? wall=$(( $(date +%s) - start ))s"; date -u
