"""The fake engine's arm (tests only): one JSON line of canonical metrics per rollout on stdout.

Deterministic in --seed, so two arms with the same settings print the same numbers. With
VIME_RL_KERNEL=1 it is the kernel arm: FAKE_REWARD_DROP (its own environment) lowers its reward.
"""

import argparse
import json
import os
import random

parser = argparse.ArgumentParser()
parser.add_argument("--rollouts", type=int, required=True)
parser.add_argument("--seed", type=int, required=True)
parser.add_argument("--slope", type=float, required=True)
args = parser.parse_args()
kernels = os.environ.get("VIME_RL_KERNEL") == "1"
drop = float(os.environ.get("FAKE_REWARD_DROP", "0")) if kernels else 0.0
rng = random.Random(args.seed)
for step in range(args.rollouts):
    row = {"step": step, "raw_reward": 0.1 + args.slope * step + 0.001 * rng.random() - drop,
           "train_rollout_logprob_abs_diff": 1e-7, "kl_loss": 0.001 * step, "fallback_count": 0.0,
           "step_time_s": 0.01}
    print("fake-step " + json.dumps(row), flush=True)
