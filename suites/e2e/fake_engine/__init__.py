"""A third engine, for the tests only: the smallest thing the A/B runner can drive.

It shows what a new engine is (docs/e2e-engines.md): a settings model, a scope statement, arm
commands, reading an arm back, progress from its output, report extras. Its arm (`arm.py`) trains
nothing: it prints one JSON line of canonical metrics per rollout, a deterministic function of
the seed, and with the kernel switch on it adds what its own environment asks for.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field

from pytest_rlk.e2e.arms import ArmCommand
from pytest_rlk.e2e.engine import ArmLayout, ArmReading, EngineOption, ReportExtras, RunContext, StepProgress
from pytest_rlk.e2e.launcher import ArmResult, LaunchConfig
from pytest_rlk.e2e.report import NO_MOE_CLAIM
from pytest_rlk.e2e.spec import ABSpec, ArmRole, EngineSettings, Lane

ARM_SCRIPT = Path(__file__).with_name("arm.py")
STEP_PREFIX = "fake-step "


class FakeSettings(EngineSettings):
    reward_slope: float = Field(default=0.02, gt=0, description="raw_reward gained per rollout")


@dataclass(frozen=True)
class FakeContext(RunContext):
    python: str = sys.executable


class FakeEngine:
    name = "fake"
    settings_model = FakeSettings
    scope = "Scope: a stand-in engine of the suite's own tests; nothing is trained. " + NO_MOE_CLAIM
    options = (EngineOption("--fake-python", "interpreter of the arms", default=sys.executable),)

    def prepare(self, spec: ABSpec, options: Mapping[str, Any], *, run_dir: str, for_run: bool) -> FakeContext:
        return FakeContext(run_dir=run_dir, launch=LaunchConfig(mode="local"), label="fake", concurrent_arms=True,
                           python=options["fake_python"])

    def arm_commands(self, spec: ABSpec, lane: Lane, ctx: FakeContext, layout: ArmLayout) -> tuple[ArmCommand, ArmCommand]:
        assert isinstance(spec.settings, FakeSettings)
        argv = [ctx.python, str(ARM_SCRIPT), "--rollouts", str(spec.hyperparameters.num_rollout),
                "--seed", str(spec.seeds.seed), "--slope", repr(spec.settings.reward_slope)]
        commands = []
        for role in ("baseline", "kernels"):
            env = dict(spec.kernel_switch.env) if role == "kernels" else {}
            switch_args = list(spec.kernel_switch.args) if role == "kernels" else []
            commands.append(ArmCommand(role, spec.arm_label(role), lane, argv + switch_args, env,
                                       arm_env=dict(getattr(spec.arms, role).env)))
        return commands[0], commands[1]

    def read_arm(self, spec: ABSpec, command: ArmCommand, result: ArmResult, arm_dir: Path) -> ArmReading:
        rows = [json.loads(line[len(STEP_PREFIX):]) for line in result.log_path.read_text().splitlines()
                if line.startswith(STEP_PREFIX)]
        series = {name: [float(row[name]) for row in rows] for name in (rows[0] if rows else {}) if name != "step"}
        return ArmReading(series=series, info={"rows": len(rows)})

    def progress(self, line: str) -> StepProgress | None:
        if not line.startswith(STEP_PREFIX):
            return None
        row = json.loads(line[len(STEP_PREFIX):])
        return StepProgress(row.pop("step"), row)

    def report_extras(self, spec: ABSpec, ctx: RunContext, readings: Mapping[ArmRole, ArmReading],
                      wall_s: float) -> ReportExtras:
        return ReportExtras(hardware="this machine", notes=[f"fake rows: {readings['kernels'].info.get('rows')}"])


ENGINE = FakeEngine()
