"""STAND-IN for vime's train.py, used ONLY because vime cannot run here (not on PyPI, needs GPUs).

It does no training. It accepts vime's command line, then prints metric lines in vime's real
stdout format (vime-facts.md, "Metrics"): a `[date time] file.py:LINE - ` prefix behind a Ray
actor prefix, `rollout N:`, `step N:`, two `perf N:` lines per rollout (rollout manager and
trainer), `eval N:`, values as `np.float64(x)`. Numbers are a deterministic function of
`--seed` and the rollout index, so two arms with the same settings print the same baseline
numbers; the kernel arm (env VIME_RL_KERNEL=1) prints `train/entropy_loss` 0 and a fallback
count, as the fork does. It writes nothing but stdout (plus the debug-rollout files it is asked to
save, so the replay lane has something to load, and a given TensorBoard file, see below).

Stand-in switches (environment, so an A/B test can put them in the kernel switch):
- RLK_STANDIN_DIE_AT_ROLLOUT=K   exit 17 after printing rollout K's lines (a run that dies midway)
- RLK_STANDIN_MALFORMED=1        also print malformed metric lines
- RLK_STANDIN_SLEEP_S=S          sleep S seconds per rollout (timeouts)
- RLK_STANDIN_REWARD_DROP=D      subtract D from raw_reward in the kernel arm
- RLK_STANDIN_ABSDIFF_RISE=D     add D to train_rollout_logprob_abs_diff in the kernel arm
- RLK_STANDIN_FALLBACKS=N        the kernel arm reports N fallbacks (and logs a fallback line)
- RLK_STANDIN_SPAWN_CHILD=1      leave a sleeping child process behind (teardown tests)
- RLK_STANDIN_TB_EVENTS=FILE     copy FILE (a TensorBoard event file) into $TENSORBOARD_DIR
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path


def _prefix(actor: str, line: int) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    return f"({actor} pid={os.getpid()}) [{stamp}] train.py:{line} - "


def _fmt(values: dict[str, float]) -> str:
    return "{" + ", ".join(f"'{k}': np.float64({v!r})" for k, v in values.items()) + "}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-rollout", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--save-debug-rollout-data")
    parser.add_argument("--load-debug-rollout-data")
    args, _vime_args = parser.parse_known_args(argv)

    kernels_on = os.environ.get("VIME_RL_KERNEL") == "1"
    die_at = int(os.environ.get("RLK_STANDIN_DIE_AT_ROLLOUT", "-1"))
    malformed = os.environ.get("RLK_STANDIN_MALFORMED") == "1"
    sleep_s = float(os.environ.get("RLK_STANDIN_SLEEP_S", "0"))
    reward_drop = float(os.environ.get("RLK_STANDIN_REWARD_DROP", "0")) if kernels_on else 0.0
    absdiff_rise = float(os.environ.get("RLK_STANDIN_ABSDIFF_RISE", "0")) if kernels_on else 0.0
    fallbacks = int(os.environ.get("RLK_STANDIN_FALLBACKS", "0")) if kernels_on else 0
    if os.environ.get("RLK_STANDIN_SPAWN_CHILD") == "1":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(f"stand-in child pid {child.pid}", flush=True)

    if os.environ.get("RLK_STANDIN_TB_EVENTS"):
        tb_dir = Path(os.environ["TENSORBOARD_DIR"])
        tb_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(os.environ["RLK_STANDIN_TB_EVENTS"], tb_dir / "events.out.tfevents.standin")
    print(f"stand-in vime train.py (NOT vime): kernels {'on' if kernels_on else 'off'}", flush=True)
    if kernels_on:
        print(_prefix("MegatronTrainRayActor", 40) + "linear_logp provider active: stand-in", flush=True)
    rng = random.Random(args.seed)
    for rollout in range(args.num_rollout):
        base_step = 10.0 + rng.random()
        reward = 0.2 + 0.05 * rollout + 0.01 * rng.random() - reward_drop
        abs_diff = 0.015 + 0.002 * rng.random() + absdiff_rise
        loss = 0.01 * math.sin(rollout + args.seed)
        if args.save_debug_rollout_data:
            target = Path(args.save_debug_rollout_data.format(rollout_id=rollout))
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(f"stand-in rollout {rollout}\n")
        if args.load_debug_rollout_data:
            source = Path(args.load_debug_rollout_data.format(rollout_id=rollout))
            if not source.exists():
                print(f"stand-in: missing recorded rollout {source}", file=sys.stderr, flush=True)
                return 3
        print(_prefix("RolloutManager", 120) + f"rollout {rollout}: " + _fmt({
            "rollout/raw_reward": reward, "rollout/response_lengths": 300.0 + rollout,
            "rollout/log_probs": -0.40 - 0.01 * rollout, "rollout/rollout_log_probs": -0.41 - 0.01 * rollout,
            "rollout/kl": 0.001 * rollout}), flush=True)
        print(_prefix("MegatronTrainRayActor", 210) + f"step {rollout}: " + _fmt({
            "train/loss": loss, "train/pg_loss": loss, "train/pg_clipfrac": 0.01,
            "train/ppo_kl": 0.0, "train/kl_loss": 0.0005 * rollout,
            "train/entropy_loss": 0.0 if kernels_on else 0.15,
            "train/train_rollout_logprob_abs_diff": abs_diff, "train/grad_norm": 1.0 + 0.1 * rollout,
            **({"train/rl_kernel_fallback_count": float(fallbacks)} if kernels_on else {})}), flush=True)
        if fallbacks:
            print(_prefix("MegatronTrainRayActor", 77) + "WARNING kernels: logp falls back to reference: "
                  "stand-in fallback", flush=True)
        step_time = base_step * (0.93 if kernels_on else 1.0)
        print(_prefix("RolloutManager", 130) + f"perf {rollout}: " + _fmt({
            "perf/rollout_time": 0.5 * base_step, **({"perf/update_weights_time": 0.4} if rollout else {})}),
            flush=True)
        print(_prefix("MegatronTrainRayActor", 230) + f"perf {rollout}: " + _fmt({
            "perf/log_probs_time": 0.1 * step_time, "perf/ref_log_probs_time": 0.1 * step_time,
            "perf/actor_train_time": 0.3 * step_time, "perf/train_time": 0.4 * step_time,
            "perf/step_time": step_time, "perf/tokens_per_gpu_per_sec": 1000.0 / step_time,
            "perf/actor_train_tok_per_s": 4000.0 / step_time}), flush=True)
        if malformed:
            print(_prefix("MegatronTrainRayActor", 231) + f"step {rollout}: {{'train/loss': np.float64(0.1", flush=True)
            print(_prefix("RolloutManager", 131) + f"perf {rollout}: {{'perf/step_time': 'fast'}}", flush=True)
        if rollout == die_at:
            print("stand-in: dying midway as asked (RLK_STANDIN_DIE_AT_ROLLOUT)", file=sys.stderr, flush=True)
            return 17
        if sleep_s:
            time.sleep(sleep_s)
    print(_prefix("RolloutManager", 300) + f"eval {args.num_rollout}: " + _fmt({"eval/gsm8k": 0.5}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
