"""Resolved arm commands and the check that the two arms differ only by the kernel switch.

Engines turn a spec into one `ArmCommand` per arm and lane; `check_arms_differ_only_by_switch`
asserts on the resolved commands that nothing else differs, so a builder bug cannot slip a
second difference in. It is engine-agnostic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pytest_rlk.e2e.spec import ARM_ROLES, ArmRole, KernelSwitch, Lane


class ArmMismatchError(AssertionError):
    """The two arms' resolved commands differ by more than the kernel switch (and the lane's
    declared per-arm arguments and environment)."""


@dataclass(frozen=True)
class ArmCommand:
    """One arm's job, fully resolved: what is executed and with which environment.

    `lane_args` are the lane's declared per-arm arguments (record vs replay paths, output
    directories), contiguous in `argv`; `output_env` holds per-arm output locations (e.g.
    `TENSORBOARD_DIR`), same keys in both arms; `arm_env` is the spec's declared environment of
    this arm only (`arms.<role>.env`). The identical-arms check removes these (and the kernel
    switch) and requires the rest to be equal. The process environment is
    `env | arm_env | output_env` over the caller's environment without kernel switches.
    """

    role: ArmRole
    label: str
    lane: Lane
    argv: list[str]
    env: dict[str, str]
    lane_args: list[str] = field(default_factory=list)
    output_env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    arm_env: dict[str, str] = field(default_factory=dict)

    @property
    def full_env(self) -> dict[str, str]:
        return {**self.env, **self.arm_env, **self.output_env}


def _remove_run(argv: list[str], run: list[str], *, what: str) -> list[str]:
    if not run:
        return list(argv)
    for i in range(len(argv) - len(run) + 1):
        if argv[i : i + len(run)] == run:
            return argv[:i] + argv[i + len(run) :]
    raise ArmMismatchError(f"{what} {run} not found in the command {argv}")


def _group_options(argv: list[str]) -> list[tuple[str, ...]]:
    """Split argv into option groups (`--flag v1 v2`), so a mismatch names the flag."""
    groups: list[list[str]] = []
    for token in argv:
        if token.startswith("--") or not groups:
            groups.append([token])
        else:
            groups[-1].append(token)
    return [tuple(g) for g in groups]


def _env_problems(baseline: ArmCommand, kernels: ArmCommand, switch: KernelSwitch) -> list[str]:
    problems: list[str] = []
    for key, value in switch.env.items():
        if key in baseline.env or key in baseline.arm_env:
            problems.append(f"baseline env sets the kernel switch {key}={baseline.env.get(key, baseline.arm_env.get(key))}")
        if kernels.env.get(key) != value:
            problems.append(f"kernel arm env lacks {key}={value}")
    for cmd in (baseline, kernels):
        shadowed = sorted(set(cmd.arm_env) & (set(cmd.env) | set(cmd.output_env)))
        if shadowed:
            problems.append(f"{cmd.role} arm env {shadowed} overrides variables the engine sets")
    base_env = {k: v for k, v in baseline.env.items() if k not in switch.env}
    kern_env = {k: v for k, v in kernels.env.items() if k not in switch.env}
    for key in sorted(set(base_env) | set(kern_env)):
        if base_env.get(key) != kern_env.get(key):
            problems.append(f"env {key}: {base_env.get(key)!r} vs {kern_env.get(key)!r}")
    if set(baseline.output_env) != set(kernels.output_env):
        problems.append(f"output env keys: {sorted(baseline.output_env)} vs {sorted(kernels.output_env)}")
    return problems


def check_arms_differ_only_by_switch(
    baseline: ArmCommand, kernels: ArmCommand, switch: KernelSwitch
) -> None:
    """Raise ArmMismatchError naming every difference other than the kernel switch.

    The baseline must not carry any part of the switch; the kernel arm must carry all of it.
    """
    if (baseline.role, kernels.role) != ARM_ROLES:
        raise ArmMismatchError(f"expected roles {ARM_ROLES}, got {(baseline.role, kernels.role)}")
    if baseline.lane != kernels.lane:
        raise ArmMismatchError(f"arms are on different lanes: {baseline.lane} vs {kernels.lane}")
    problems = _env_problems(baseline, kernels, switch)
    for flag in switch.args:
        if flag.startswith("--") and flag in baseline.argv:
            problems.append(f"baseline command carries the kernel switch argument {flag}")
    base_argv = _remove_run(baseline.argv, baseline.lane_args, what="baseline lane args")
    kern_argv = _remove_run(kernels.argv, kernels.lane_args, what="kernel arm lane args")
    kern_argv = _remove_run(kern_argv, list(switch.args), what="kernel switch args")
    base_groups, kern_groups = _group_options(base_argv), _group_options(kern_argv)
    if base_groups != kern_groups:
        only_base = [" ".join(g) for g in base_groups if g not in kern_groups]
        only_kern = [" ".join(g) for g in kern_groups if g not in base_groups]
        if only_base or only_kern:
            problems.append(f"arguments only in baseline: {only_base}; only in kernel arm: {only_kern}")
        else:
            problems.append("the same arguments in a different order")
    if baseline.workdir != kernels.workdir:
        problems.append(f"workdir: {baseline.workdir!r} vs {kernels.workdir!r}")
    if problems:
        raise ArmMismatchError(
            f"arms {baseline.label!r} and {kernels.label!r} ({baseline.lane} lane) differ beyond "
            "the kernel switch: " + "; ".join(problems)
        )
