"""The TRL engine: one arm of an A/B spec as a real TRL ``GRPOTrainer`` run, in a subprocess.

    python -m pytest_rlk.e2e.engines.trl_engine --spec SPEC.json --arm baseline|kernels --out DIR

Both arms build the same tiny real model (``tiny_models``; same seed, so identical weights,
checked by a weight digest in ``run_info.json``), train on the same synthetic task (``task``)
with identical seeds and settings. The kernel arm differs only by the spec's ``kernel_switch``
environment (``VIME_RL_KERNEL=1`` ...): with it, ``kernels.integrations.trl`` routes TRL's
per-token log-probs through ``kernels.logp``.

Per step, a ``TrainerCallback`` writes one JSON line to ``DIR/metrics.jsonl`` in the suite's
canonical names (``pytest_rlk.e2e.metrics``): raw_reward, kl_loss (TRL's ``kl``), loss,
grad_norm, entropy, step / rollout (generation) / ref log-prob / actor-train / loss / optimizer
times, tokens/s, peak memory (``peak_vram_mib`` from torch.cuda on GPU; ``peak_rss_mib`` on CPU),
cumulative fallback count, and ``train_rollout_logprob_abs_diff``: the mean over samples of the
masked token mean of |log-prob the loss used - log-prob of the plain forward|, on the loss's own
rows at the weights the rollout was sampled with (one optimizer step per rollout). The loss's
log-probs come from GRPOTrainer's own path (TRL's fused LM head, or ours in the kernel arm); the
plain forward's logits are what transformers' generation samples from (the no-vLLM lane has no
other rollout engine). ``DIR/run_info.json`` records versions, the backend id, fallback counts
and reasons, patched-call counts and settings.

The parent side (``arm_commands``, ``plan_text``, ``run_arms``, ``read_arm_series``, ``run_ab``,
``gate_ab``, ``write_ab_report``, ``run_and_report``, ``load_ab_run``) builds the two commands from
the spec, checks they differ only by the kernel switch, runs them as subprocesses in their own
process groups (ending only those on timeout), reads the series back, gates them with
``pytest_rlk.e2e.gates`` and writes the suite's report.
See docs/e2e-trl.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pytest_rlk.e2e import metrics as m
from pytest_rlk.e2e.spec import ABSpec, ArmCommand, ArmRole, check_arms_differ_only_by_switch, load_spec

METRICS_FILE = "metrics.jsonl"
RUN_INFO_FILE = "run_info.json"
LOG_FILE = "arm.log"

TINY_PREFIX = "tiny:"
SYNTHETIC_TASK = "synthetic:repeat"


class TrlSettings(BaseModel):
    """The spec's ``trl`` section: TRL-engine settings shared by both arms."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_size: dict[str, int] = Field(
        default_factory=dict, description="TinyModelSize fields (tiny models only)."
    )
    extra_vocab: int = Field(default=0, ge=0, description="Filler words added to the tokenizer (a wider vocab).")
    num_prompts: int = Field(default=256, ge=1)
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: Literal["float32", "bfloat16"] = "float32"
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "grpo"
    logprob_diff: bool = Field(default=True, description="Record train_rollout_logprob_abs_diff each step.")
    env: dict[str, str] = Field(default_factory=dict, description="Environment for both arms.")


@dataclass(frozen=True)
class TrlArmConfig:
    """Everything one arm needs, resolved from the spec."""

    spec: ABSpec
    settings: TrlSettings

    @classmethod
    def from_spec(cls, spec: ABSpec, *, where: str = "spec") -> TrlArmConfig:
        if spec.engine != "trl":
            raise ValueError(f"{where}: engine is {spec.engine!r}, the TRL engine needs engine 'trl'")
        try:
            settings = TrlSettings.model_validate(spec.trl or {})
        except ValidationError as exc:
            problems = "; ".join(f"trl.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise ValueError(f"{where}: invalid trl section: {problems}") from exc
        hp, par = spec.hyperparameters, spec.parallelism
        if spec.dataset.prompt_data != SYNTHETIC_TASK:
            raise ValueError(f"{where}: dataset.prompt_data must be {SYNTHETIC_TASK!r} (the only TRL-lane task)")
        if hp.global_batch_size != hp.rollout_batch_size * hp.n_samples_per_prompt:
            raise ValueError(
                f"{where}: hyperparameters.global_batch_size ({hp.global_batch_size}) must equal "
                "rollout_batch_size * n_samples_per_prompt (one optimizer step per rollout in the TRL lane)"
            )
        if hp.use_kl_loss and hp.kl_loss_type != "k3":
            raise ValueError(
                f"{where}: hyperparameters.kl_loss_type must be 'k3' (TRL's KL is the unclamped k3), "
                f"got {hp.kl_loss_type!r}"
            )
        if (par.tensor, par.pipeline, par.context, par.expert) != (1, 1, 1, 1):
            raise ValueError(f"{where}: parallelism must be all 1 in the TRL lane (single process)")
        if spec.model.hf_checkpoint.startswith(TINY_PREFIX):
            kind = spec.model.hf_checkpoint[len(TINY_PREFIX):]
            if (kind == "moe") != spec.model.moe:
                raise ValueError(f"{where}: model.moe = {spec.model.moe} but hf_checkpoint is {spec.model.hf_checkpoint!r}")
        if settings.device == "cpu" and spec.hardware.platform != "cpu":
            raise ValueError(f"{where}: trl.device 'cpu' with hardware.platform {spec.hardware.platform!r}")
        return cls(spec, settings)


# --------------------------------------------------------------------------------------------
# Parent side: commands, subprocesses, reading results.
# --------------------------------------------------------------------------------------------


def arm_commands(
    spec_path: Path, out_dir: Path, *, extra_env: dict[str, str] | None = None, max_rollouts: int | None = None
) -> dict[ArmRole, ArmCommand]:
    """The two arms' commands; raises ``ArmMismatchError`` if they differ beyond the switch.

    ``extra_env`` (both arms) carries extra settings, such as a test's choice of kernel backend
    (``VIME_RL_KERNEL_BACKEND``, which only the kernel arm uses). ``max_rollouts``
    (both arms) stops before the spec's ``num_rollout``: the first steps of a run are the same
    whatever its length (same seeds), so a shorter arm compares to the other arm's first steps.
    """
    spec = load_spec(spec_path)
    config = TrlArmConfig.from_spec(spec, where=str(spec_path))
    base_env = {**config.settings.env, **(extra_env or {})}
    commands: dict[ArmRole, ArmCommand] = {}
    for role in ("baseline", "kernels"):
        env = dict(base_env)
        if role == "kernels":
            env.update(spec.kernel_switch.env)
        lane_args = ["--arm", role, "--out", str(out_dir / role)]
        argv = [sys.executable, "-m", "pytest_rlk.e2e.engines.trl_engine", "--spec", str(spec_path)]
        if max_rollouts is not None:
            argv += ["--max-rollouts", str(max_rollouts)]
        argv += lane_args
        if role == "kernels":
            argv += list(spec.kernel_switch.args)
        commands[role] = ArmCommand(role, spec.arm_label(role), "live", argv, env, lane_args)
    check_arms_differ_only_by_switch(commands["baseline"], commands["kernels"], spec.kernel_switch)
    return commands


# Variables of the parent that must not leak into an arm: the kernel switches come from the spec.
_SCRUBBED_ENV_PREFIXES = ("VIME_RL_KERNEL",)


def _arm_environment(command: ArmCommand, repo_root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SCRUBBED_ENV_PREFIXES)}
    env.update(command.env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo_root), env.get("PYTHONPATH", "")]))
    return env


def plan_text(spec_path: Path, out_dir: Path, *, repo_root: Path) -> str:
    """Both arms' exact subprocess commands (a dry run of ``run_ab``), as shell lines.

    Each arm runs in ``repo_root`` with the parent's environment minus any kernel-switch
    variables, plus the lines' variables and ``PYTHONPATH`` led by ``repo_root``.
    """
    import shlex

    spec = load_spec(spec_path)
    commands = arm_commands(spec_path, out_dir)
    lines = [
        f"# A/B plan: {spec.case} (engine trl, {spec.purpose}): {spec.description}",
        "# arms differ only by the kernel switch: env "
        + " ".join(f"{k}={v}" for k, v in spec.kernel_switch.env.items())
        + (" " + shlex.join(spec.kernel_switch.args) if spec.kernel_switch.args else "")
        + " (and each arm's --arm/--out)",
        f"# each arm: cwd {repo_root}, the caller's environment without "
        f"{', '.join(p + '*' for p in _SCRUBBED_ENV_PREFIXES)}, "
        f"timeout {spec.timeouts.job_s} s",
    ]
    for role, cmd in commands.items():
        env = {**cmd.full_env, "PYTHONPATH": str(repo_root)}
        assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
        lines += [f"# {role} arm {cmd.label!r}",
                  f"cd {shlex.quote(str(repo_root))} && env {assignments} {shlex.join(cmd.argv)}"]
    return "\n".join(lines)


def _out_dir(command: ArmCommand) -> Path:
    return Path(command.argv[command.argv.index("--out") + 1])


def run_arms(commands: list[ArmCommand], *, timeout_s: float, repo_root: Path) -> list[Path]:
    """Run arms concurrently (each in its own process group); returns their output dirs.

    On timeout only the process groups started here are killed. Raises naming the arm and its log.
    """
    running = []
    for command in commands:
        out = _out_dir(command)
        out.mkdir(parents=True, exist_ok=True)
        log = (out / LOG_FILE).open("w")
        proc = subprocess.Popen(
            command.argv, env=_arm_environment(command, repo_root), cwd=str(repo_root),
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        running.append((command, proc, log, out))
    deadline = time.monotonic() + timeout_s
    failures: list[str] = []
    for command, proc, log, out in running:
        timed_out = False
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # our own process group only
            rc = proc.wait()
            timed_out = True
            failures.append(f"{command.label} arm exceeded {timeout_s:.0f} s; log: {out / LOG_FILE}")
        finally:
            log.close()
        if rc != 0 and not timed_out:
            tail = (out / LOG_FILE).read_text()[-3000:]
            failures.append(f"{command.label} arm exited with {rc}; log: {out / LOG_FILE}\n{tail}")
    if failures:
        raise RuntimeError("\n".join(failures))
    return [out for _, _, _, out in running]


def read_arm_series(out_dir: Path) -> m.ArmSeries:
    """Per-step JSON lines -> metric name -> series; every line must carry the same names."""
    path = Path(out_dir) / METRICS_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path}: no metrics written (did the arm run?)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path}: no steps recorded")
    names = [k for k in rows[0] if k != "step"]
    series: m.ArmSeries = {name: [] for name in names}
    for i, row in enumerate(rows):
        if row.get("step") != i:
            raise ValueError(f"{path}: line {i + 1} has step {row.get('step')}, expected {i}")
        if set(row) - {"step"} != set(names):
            raise ValueError(f"{path}: line {i + 1} has metrics {sorted(row)}, expected {sorted(names)}")
        for name in names:
            series[name].append(float(row[name]))
    return series


def read_run_info(out_dir: Path) -> dict[str, Any]:
    return json.loads((Path(out_dir) / RUN_INFO_FILE).read_text())


@dataclass(frozen=True)
class TrlAbRun:
    """What an A/B run of the TRL engine produced (arm key -> command, series, run info)."""

    spec: ABSpec
    spec_path: Path
    commands: dict[str, ArmCommand]
    series: dict[str, m.ArmSeries]
    run_info: dict[str, dict[str, Any]]
    wall_s: float


PERTURBED = "kernels_perturbed"


def run_ab(
    spec_path: Path, out_dir: Path, *, repo_root: Path, perturbed_env: dict[str, str] | None = None,
    perturb_rollouts: int | None = None,
) -> TrlAbRun:
    """Run both arms and, with ``perturbed_env``, a third: the kernel arm with these extra variables
    (a test selects a perturbed kernel backend this way), of ``perturb_rollouts`` steps when given
    (it only has to show that the gate fails)."""
    spec = load_spec(spec_path)
    commands: dict[str, ArmCommand] = dict(arm_commands(spec_path, out_dir))
    if perturbed_env is not None:
        perturbed = arm_commands(
            spec_path, out_dir / "perturbed", extra_env=perturbed_env, max_rollouts=perturb_rollouts
        )["kernels"]
        label = f"{perturbed.label} (test-only: {' '.join(f'{k}={v}' for k, v in perturbed_env.items())})"
        commands[PERTURBED] = dataclasses.replace(perturbed, label=label)
    start = time.perf_counter()
    if TrlArmConfig.from_spec(spec).settings.device == "cpu":
        # Concurrent on CPU (one thread each, set in the spec): results do not depend on it and
        # speed is not gated there. On a GPU the arms run one after the other so timings are clean.
        dirs = run_arms(list(commands.values()), timeout_s=spec.timeouts.job_s, repo_root=repo_root)
    else:
        dirs = [run_arms([c], timeout_s=spec.timeouts.job_s, repo_root=repo_root)[0] for c in commands.values()]
    wall = time.perf_counter() - start
    keys = list(commands)
    return TrlAbRun(
        spec, Path(spec_path), commands,
        {k: read_arm_series(d) for k, d in zip(keys, dirs, strict=True)},
        {k: read_run_info(d) for k, d in zip(keys, dirs, strict=True)},
        wall,
    )


def gate_ab(run: TrlAbRun, kernels_key: str = "kernels"):
    """The live-lane verdict of baseline vs ``kernels_key`` through ``pytest_rlk.e2e.gates``.

    An arm run with ``--max-rollouts N`` (planned shorter) is compared to the baseline's first N
    steps; any other length difference is left to the gate's rollout-count check.
    """
    from pytest_rlk.e2e.gates import gate_lane

    spec = run.spec
    baseline = run.series["baseline"]
    planned = run.run_info[kernels_key].get("max_rollouts")
    if planned is not None:
        baseline = {name: values[:planned] for name, values in baseline.items()}
    return gate_lane(
        baseline, run.series[kernels_key], case=spec.case, platform=spec.hardware.platform,
        lane="live", skip_warmup=spec.window.skip_warmup_rollouts, gates=spec.gates,
        baseline_label=run.commands["baseline"].label, kernels_label=run.commands[kernels_key].label,
    )


def _commit(repo_root: Path) -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo_root, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def write_ab_report(run: TrlAbRun, verdict, out_dir: Path, *, repo_root: Path, kernels_key: str = "kernels"):
    """The suite's A/B report (plots + reproducibility notes) for baseline vs ``kernels_key``."""
    import shlex

    from pytest_rlk.e2e.gates import pair_verdict
    from pytest_rlk.e2e.report import ArmRun, ReportInputs, write_report

    spec = run.spec
    kernel_info = run.run_info[kernels_key]
    arms = [
        ArmRun(role=run.commands[key].role, label=run.commands[key].label, lane="live", series=run.series[key],
               command=" ".join(f"{k}={shlex.quote(v)}" for k, v in run.commands[key].env.items())
               + " " + shlex.join(run.commands[key].argv),
               log_path=str(_out_dir(run.commands[key]) / LOG_FILE))
        for key in ("baseline", kernels_key)
    ]
    versions = kernel_info["versions"]
    notes = [
        f"Kernel arm: backend {kernel_info['backend_id']}, patched {kernel_info['patched']} "
        f"({kernel_info['patched_calls'].get('lm_head_logp', 0)} calls, "
        f"{kernel_info['patched_calls'].get('tokens', 0)} tokens); fallback counts "
        f"{kernel_info['fallback_counts'] or 'none'}.",
        "train_rollout_logprob_abs_diff: mean over samples of the masked token mean of |log-prob used by "
        "the loss - log-prob of the plain HF forward (what generation samples from)| at the rollout's "
        "weights; log-prob space.",
        f"Initial weights digest: baseline {run.run_info['baseline']['initial_weights_digest']}, "
        f"kernel arm {kernel_info['initial_weights_digest']}.",
        f"Wall time of all arms of this run: {run.wall_s:.0f} s.",
    ]
    if kernel_info["device"] == "cpu":
        notes.append(
            "CPU lane: the kernel arm runs our Triton kernels through the Triton interpreter "
            "(TRITON_INTERPRET=1) with VIME_RL_KERNEL_STRICT=1, so a fallback would have failed the run; "
            "speed and memory are reported, not gated, on CPU."
        )
    inputs = ReportInputs(
        case=spec.case, engine="trl", platform=spec.hardware.platform, hardware=kernel_info["hardware"],
        skip_warmup=spec.window.skip_warmup_rollouts, arms=arms, verdict=pair_verdict([verdict]),
        setup_commands=[
            "pip install -e '.[trl]'",
            "pytest suites/e2e/test_trl_ab.py --rlk-tier e2e   # runs both arms of " + str(run.spec_path),
        ],
        commits={"pytest-rlk": _commit(repo_root), **{k: v for k, v in versions.items()}},
        settings={
            "seeds": spec.seeds.model_dump(), "hyperparameters": spec.hyperparameters.model_dump(),
            "model": spec.model.model_dump(), "dataset": spec.dataset.model_dump(), "trl": spec.trl,
            "window": spec.window.model_dump(),
        },
        kernel_switch=" ".join(f"{k}={v}" for k, v in spec.kernel_switch.env.items()),
        notes=notes,
    )
    return write_report(out_dir, inputs)


@dataclass(frozen=True)
class TrlAbResult:
    """``run_and_report``'s outcome: the run, its pair verdict and the report's paths."""

    run: TrlAbRun
    verdict: Any  # gates.PairVerdict
    report: Any  # report.ReportPaths

    @property
    def passed(self) -> bool:
        return self.verdict.passed


def load_ab_run(spec_path: Path, out_dir: Path) -> TrlAbRun:
    """A finished ``run_and_report`` (``rlk e2e run``) read back from ``out_dir``: the commands as
    planned, each arm's series and run info, the wall time from ``ab_result.json``."""
    result_path = Path(out_dir) / "ab_result.json"
    if not result_path.exists():
        raise FileNotFoundError(f"{result_path}: no A/B result (was {out_dir} written by `rlk e2e run`?)")
    commands: dict[str, ArmCommand] = dict(arm_commands(spec_path, Path(out_dir)))
    return TrlAbRun(
        load_spec(spec_path), Path(spec_path), commands,
        {key: read_arm_series(_out_dir(cmd)) for key, cmd in commands.items()},
        {key: read_run_info(_out_dir(cmd)) for key, cmd in commands.items()},
        json.loads(result_path.read_text())["wall_s"],
    )


def run_and_report(spec_path: Path, out_dir: Path, *, repo_root: Path) -> TrlAbResult:
    """``rlk e2e run`` for a TRL spec: both arms, the live-lane gate, the report in ``out_dir/report``
    and ``out_dir/ab_result.json``. An arm that fails raises ``RuntimeError`` naming it and its log."""
    from pytest_rlk.e2e.gates import pair_verdict

    run = run_ab(spec_path, out_dir, repo_root=repo_root)
    lane = gate_ab(run)
    report = write_ab_report(run, lane, out_dir / "report", repo_root=repo_root)
    verdict = pair_verdict([lane])
    (out_dir / "ab_result.json").write_text(json.dumps({
        "case": run.spec.case, "platform": run.spec.hardware.platform, "passed": verdict.passed,
        "lanes": {lane.lane: {"verdict": lane.verdict, "failures": lane.failures()}},
        "report": str(report.markdown), "wall_s": run.wall_s,
    }, indent=1))
    return TrlAbResult(run, verdict, report)


# --------------------------------------------------------------------------------------------
# Child side: the training run.
# --------------------------------------------------------------------------------------------


def _weights_digest(model) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def _peak_memory_mib(device: str) -> tuple[str, float]:
    import torch

    if device == "cuda":
        return m.PEAK_VRAM, torch.cuda.max_memory_allocated() / 2**20
    import resource

    return m.PEAK_RSS, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _hardware(device: str) -> str:
    import platform

    import torch

    if device == "cuda":
        return f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}, CUDA {torch.version.cuda}"
    return f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"


def _masked_sample_mean(values, mask) -> float:
    """Mean over samples of each sample's masked token mean (samples without tokens skipped)."""
    tokens = mask.sum(-1)
    keep = tokens > 0
    per_sample = (values * mask).sum(-1)[keep] / tokens[keep]
    return float(per_sample.mean()) if per_sample.numel() else 0.0


def _build_trainer_class():
    import torch
    from trl import GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer with timing hooks and the train/rollout log-prob diff (engine-only subclass)."""

        def _init_rlk(self, settings: TrlSettings) -> None:
            self.rlk_settings = settings
            self.rlk_step: dict[str, float] = {}

        def _rlk_add(self, name: str, value: float) -> None:
            self.rlk_step[name] = self.rlk_step.get(name, 0.0) + value

        def _sync(self) -> None:
            if self.rlk_settings.device == "cuda":
                torch.cuda.synchronize()

        def _generate(self, prompts):
            self._sync()
            start = time.perf_counter()
            result = super()._generate(prompts)
            self._sync()
            self._rlk_add(m.ROLLOUT_TIME, time.perf_counter() - start)
            return result

        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
            self._sync()
            start = time.perf_counter()
            result = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
            self._sync()
            elapsed = time.perf_counter() - start
            if model is self.ref_model:
                self._rlk_add(m.REF_LOG_PROBS_TIME, elapsed)
            elif not torch.is_grad_enabled():
                self._rlk_add(m.LOG_PROBS_TIME, elapsed)
            elif self.rlk_settings.logprob_diff:
                # The loss's own log-probs, at the weights the rollout was sampled with (one
                # optimizer step per rollout), against the rollout path on the same rows.
                self._rlk_add(m.ABS_DIFF, self._train_rollout_abs_diff(
                    result[0], input_ids, attention_mask, logits_to_keep))
            return result

        def _compute_loss(self, model, inputs):
            self._sync()
            start = time.perf_counter()
            loss = super()._compute_loss(model, inputs)
            self._sync()
            self._rlk_add(m.LOSS_TIME, time.perf_counter() - start)
            return loss

        def _generate_and_score_completions(self, inputs):
            self._sync()
            start = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            self._sync()
            self._rlk_add("_prepare_s", time.perf_counter() - start)
            self._rlk_add("_tokens", float(out["prompt_mask"].sum() + out["completion_mask"].sum()))
            return out

        @torch.no_grad()
        def _train_rollout_abs_diff(self, train_logps, input_ids, attention_mask, logits_to_keep) -> float:
            # Rollout path: the plain forward's logits, which transformers' generation samples from.
            logits = self.model(
                input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep + 1
            ).logits
            logits = logits[:, :-1].float() / self.temperature
            completion_ids = input_ids[:, -logits_to_keep:]
            rollout_logps = torch.log_softmax(logits, dim=-1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
            mask = attention_mask[:, -logits_to_keep:].float()
            return _masked_sample_mean((train_logps.detach().float() - rollout_logps).abs(), mask)

    return TimedGRPOTrainer


def _build_callback(trainer_ref: list, settings: TrlSettings, metrics_path: Path, kernels_module):
    import torch
    from transformers import TrainerCallback

    class RlkMetricsCallback(TrainerCallback):
        """Writes one JSON line per optimizer step in the suite's canonical metric names."""

        def __init__(self) -> None:
            self.step_start = 0.0
            self.step_time = 0.0
            self.opt_start = 0.0
            self.opt_time = 0.0
            self.rows = 0
            metrics_path.write_text("")

        def _sync(self) -> None:
            if settings.device == "cuda":
                torch.cuda.synchronize()

        def on_step_begin(self, args, state, control, **kwargs):
            trainer_ref[0].rlk_step = {}
            if settings.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            self._sync()
            self.step_start = time.perf_counter()

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self._sync()
            self.opt_start = time.perf_counter()

        def on_optimizer_step(self, args, state, control, **kwargs):
            self._sync()
            self.opt_time = time.perf_counter() - self.opt_start

        def on_step_end(self, args, state, control, **kwargs):
            self._sync()
            self.step_time = time.perf_counter() - self.step_start

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = logs or {}
            if "reward" not in logs:  # the end-of-training summary line
                return
            step = trainer_ref[0].rlk_step
            prepare = step.get("_prepare_s", 0.0)
            memory_name, memory_value = _peak_memory_mib(settings.device)
            row: dict[str, float | int] = {
                "step": self.rows,
                m.RAW_REWARD: float(logs["reward"]),
                m.LOSS: float(logs["loss"]),
                m.GRAD_NORM: float(logs["grad_norm"]),
                m.ENTROPY: float(logs["entropy"]),
                m.RESPONSE_LENGTH: float(logs["completions/mean_length"]),
                m.STEP_TIME: self.step_time,
                m.ROLLOUT_TIME: step.get(m.ROLLOUT_TIME, 0.0),
                m.ACTOR_TRAIN_TIME: self.step_time - prepare,
                m.LOSS_TIME: step.get(m.LOSS_TIME, 0.0),
                m.OPTIMIZER_TIME: self.opt_time,
                m.TOKENS_PER_GPU_PER_S: step.get("_tokens", 0.0) / self.step_time,
                memory_name: memory_value,
                m.FALLBACK_COUNT: float(sum(kernels_module.fallback_counts().values())),
            }
            if "kl" in logs:
                row[m.KL_LOSS] = float(logs["kl"])
            if "clip_ratio/region_mean" in logs:
                row[m.PG_CLIPFRAC] = float(logs["clip_ratio/region_mean"])
            for name in (m.REF_LOG_PROBS_TIME, m.LOG_PROBS_TIME, m.ABS_DIFF):
                if name in step:
                    row[name] = step[name]
            with metrics_path.open("a") as f:
                f.write(json.dumps(row) + "\n")
            self.rows += 1

    return RlkMetricsCallback()


def _local_checkpoint(config: TrlArmConfig) -> Path | None:
    """The spec's local HF checkpoint directory (checked), or None for a ``tiny:`` model."""
    checkpoint = config.spec.model.hf_checkpoint
    if checkpoint.startswith(TINY_PREFIX):
        return None
    path = Path(checkpoint)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"model.hf_checkpoint {checkpoint!r}: no config.json there")
    return path


def _model_dir(config: TrlArmConfig, out: Path) -> Path:
    from pytest_rlk.e2e.engines.tiny_models import TinyModelSize, build_tiny_model_dir

    local = _local_checkpoint(config)
    if local is not None:
        return local
    kind = config.spec.model.hf_checkpoint[len(TINY_PREFIX):]
    size = TinyModelSize.from_dict(dict(config.settings.model_size))
    return build_tiny_model_dir(
        out / "model", kind, size, seed=config.spec.seeds.seed, extra_vocab=config.settings.extra_vocab
    )


def _check_arm_env(arm: ArmRole, spec: ABSpec) -> None:
    """The arm flag must agree with the environment the launcher set (the switch is the env)."""
    missing = {k: v for k, v in spec.kernel_switch.env.items() if os.environ.get(k) != v}
    if arm == "kernels" and missing:
        raise RuntimeError(f"--arm kernels but the kernel switch is not set in the environment: {missing}")
    present = sorted(k for k in spec.kernel_switch.env if k in os.environ)
    if arm == "baseline" and present:
        raise RuntimeError(f"--arm baseline but the kernel switch variables {present} are set")


def run_training(spec_path: Path, arm: ArmRole, out: Path, max_rollouts: int | None = None) -> None:
    """The child: train one arm and write metrics.jsonl + run_info.json into ``out``."""
    spec = load_spec(spec_path)
    config = TrlArmConfig.from_spec(spec, where=str(spec_path))
    _check_arm_env(arm, spec)
    _local_checkpoint(config)  # a missing checkpoint fails before the heavy imports below
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed
    from trl import GRPOConfig

    import kernels
    from kernels.integrations import trl as trl_integration
    from pytest_rlk.e2e.engines.task import make_prompts, repeat_reward_func

    hp, settings = spec.hyperparameters, config.settings
    set_seed(spec.seeds.seed)
    model_dir = _model_dir(config, out)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dtype = getattr(torch, settings.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    initial_digest = _weights_digest(model)
    dataset = Dataset.from_list(make_prompts(settings.num_prompts, spec.seeds.rollout_seed))
    args = GRPOConfig(
        output_dir=str(out / "trainer"),
        use_cpu=settings.device == "cpu",
        bf16=settings.dtype == "bfloat16",
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
        seed=spec.seeds.seed,
        data_seed=spec.seeds.rollout_seed,
        max_steps=hp.num_rollout if max_rollouts is None else min(hp.num_rollout, max_rollouts),
        learning_rate=hp.lr,
        lr_scheduler_type="constant",
        per_device_train_batch_size=hp.global_batch_size,
        num_generations=hp.n_samples_per_prompt,
        max_completion_length=hp.rollout_max_response_len,
        temperature=hp.rollout_temperature,
        epsilon=hp.eps_clip,
        epsilon_high=hp.eps_clip_high,
        beta=hp.kl_loss_coef if hp.use_kl_loss else 0.0,
        loss_type=settings.loss_type,
        entropy_coef=hp.entropy_coef,
        disable_dropout=True,
    )

    patched = arm == "kernels" and trl_integration.logp_enabled_by_env()
    if arm == "kernels" and not patched:
        raise RuntimeError("--arm kernels but VIME_RL_KERNEL / VIME_RL_KERNEL_OPS do not enable 'logp'")
    kernels.reset_fallback_counts()
    trainer_cls = _build_trainer_class()
    trainer_ref: list = []
    callback = _build_callback(trainer_ref, settings, out / METRICS_FILE, kernels)
    if patched:
        trl_integration.install()
    try:
        trainer = trainer_cls(
            model=model,
            processing_class=tokenizer,
            reward_funcs=[repeat_reward_func],
            args=args,
            train_dataset=dataset,
            callbacks=[callback],
        )
        trainer._init_rlk(settings)
        trainer_ref.append(trainer)
        train_start = time.perf_counter()
        trainer.train()
        train_seconds = time.perf_counter() - train_start
    finally:
        calls = trl_integration.call_counts()
        trl_integration.uninstall()

    info = {
        "arm": arm,
        "label": spec.arm_label(arm),
        "case": spec.case,
        "spec": str(spec_path),
        "kernels_installed": patched,
        "patched": f"{trl_integration.PATCH_MODULE}.{trl_integration.PATCH_NAME}" if patched else None,
        "patched_calls": calls if patched else {},
        "backend_id": kernels.backend_id(),
        "fallback_counts": kernels.fallback_counts(),
        "fallback_reasons": kernels.fallback_reasons(),
        "max_rollouts": max_rollouts,
        "initial_weights_digest": initial_digest,
        "model_dir": str(model_dir),
        "settings": settings.model_dump(),
        "env": {k: os.environ[k] for k in sorted(os.environ) if k.startswith(("VIME_RL_", "TRITON_", "RLK_"))},
        "versions": {
            "python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
            "trl": trl.__version__, "kernels": kernels.__version__,
        },
        "device": settings.device,
        "hardware": _hardware(settings.device),
        "train_seconds": train_seconds,
        "wall_seconds": time.time() - started,
    }
    (out / RUN_INFO_FILE).write_text(json.dumps(info, indent=1, sort_keys=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pytest_rlk.e2e.engines.trl_engine", description=__doc__.split("\n")[0])
    parser.add_argument("--spec", required=True, type=Path, help="A/B spec (JSON) with engine 'trl'")
    parser.add_argument("--arm", required=True, choices=["baseline", "kernels"])
    parser.add_argument("--out", required=True, type=Path, help="output directory of this arm")
    parser.add_argument("--max-rollouts", type=int, default=None,
                        help="stop after this many rollouts (default: the spec's num_rollout)")
    ns = parser.parse_args(argv)
    if ns.max_rollouts is not None and ns.max_rollouts < 1:
        parser.error(f"--max-rollouts must be >= 1, got {ns.max_rollouts}")
    run_training(ns.spec, ns.arm, ns.out, ns.max_rollouts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
