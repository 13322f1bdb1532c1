"""A/B spec: validation, the identical-arms check, and `rlk e2e plan` for every shipped spec."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest

from pytest_rlk.cli import main as rlk_main
from pytest_rlk.e2e.arms import ArmCommand, ArmMismatchError, check_arms_differ_only_by_switch
from pytest_rlk.e2e.engines.vime import commands as vime_commands
from pytest_rlk.e2e.placeholders import RUN_DIR_PLACEHOLDER, expand_placeholders
from pytest_rlk.e2e.runner import plan_text
from pytest_rlk.e2e.spec import ABSpec, SpecError, load_spec, matrix_spec_paths

SPEC_PATHS = matrix_spec_paths()
VIME_SPECS = [p for p in SPEC_PATHS if load_spec(p).engine == "vime"]
TRL_SPECS = [p for p in SPEC_PATHS if load_spec(p).engine == "trl"]
RUN_DIR = RUN_DIR_PLACEHOLDER  # the plan's stand-in for the run directory
MATRIX_CASES = {
    "qwen3-4b-a100-grpo-gsm8k", "qwen3-30b-a3b-h200-grpo-dapo", "qwen3-30b-a3b-r3-h200-grpo-dapo",
    "glm45-air-h200-grpo-dapo", "qwen3-0.6b-2gpu-smoke-gsm8k",
}


def _raw(case: str = "qwen3-30b-a3b-h200-grpo-dapo") -> dict:
    return json.loads((Path(SPEC_PATHS[0]).parent / f"{case}.json").read_text())


def test_the_mission_matrix_is_shipped():
    cases = {load_spec(p).case for p in VIME_SPECS}
    assert MATRIX_CASES <= cases
    r3 = load_spec(Path(SPEC_PATHS[0]).parent / "qwen3-30b-a3b-r3-h200-grpo-dapo.json")
    assert (r3.arms.baseline.label, r3.arms.kernels.label) == ("vime+R3", "vime+R3+kernels")
    assert r3.settings.routing_replay and not r3.gates.speed  # compatibility only
    smoke = load_spec(Path(SPEC_PATHS[0]).parent / "qwen3-0.6b-2gpu-smoke-gsm8k.json")
    assert smoke.hardware.gpus == 2 and smoke.settings.checkpoint_mode == "bridge"


@pytest.mark.parametrize("path", VIME_SPECS, ids=lambda p: p.stem)
def test_plan_arms_differ_only_by_the_kernel_switch(path, capsys):
    """`rlk e2e plan` prints, per lane, two job-submit lines identical except the switch."""
    assert rlk_main(["e2e", "plan", str(path)]) == 0
    out = capsys.readouterr().out
    spec = load_spec(path)
    submits = [shlex.split(line) for line in out.splitlines() if line.startswith("ray job submit")]
    assert len(submits) == 2 * len(spec.lanes)
    for base, kern in zip(submits[0::2], submits[1::2], strict=True):
        def parts(argv):
            opts = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv if a.startswith("--") and "=" in a}
            env = json.loads(opts["--runtime-env-json"])["env_vars"]
            return opts, env, shlex.split(argv[-1])  # argv[-1]: the bash -c command
        b_opts, b_env, b_cmd = parts(base)
        k_opts, k_env, k_cmd = parts(kern)
        assert b_opts["--address"] == k_opts["--address"]
        # env: the kernel arm adds exactly the switch; per-arm output dirs differ only by role
        assert {k: v for k, v in k_env.items() if k not in spec.kernel_switch.env} == {
            k: v.replace("/baseline/", "/kernels/") for k, v in b_env.items()}
        assert all(k_env[k] == v and k not in b_env for k, v in spec.kernel_switch.env.items())
        # command: the kernel arm appends exactly the switch args; replay swaps save -> load
        switch = list(spec.kernel_switch.args)
        assert k_cmd[len(k_cmd) - len(switch):] == switch
        k_rest = k_cmd[: len(k_cmd) - len(switch)]
        b_rest = [("--load-debug-rollout-data" if a == "--save-debug-rollout-data" else a) for a in b_cmd]
        assert k_rest == b_rest
        assert "--ci-test" not in b_cmd or "--use-fault-tolerance" not in b_cmd


def _trl_plan_arm(line: str) -> tuple[str, dict[str, str], list[str]]:
    """`cd DIR && env K=V ... ARGV` -> (DIR, env, argv)."""
    tokens = shlex.split(line)
    assert tokens[0] == "cd" and tokens[2:4] == ["&&", "env"], line
    rest = tokens[4:]
    n_env = next(i for i, t in enumerate(rest) if "=" not in t)
    return tokens[1], dict(t.split("=", 1) for t in rest[:n_env]), rest[n_env:]


def test_trl_arms_import_this_checkout_first_and_keep_the_callers_pythonpath(monkeypatch, capsys):
    """Packages the caller reaches through PYTHONPATH (pip --target, as on the GPU machines) stay
    importable in the arms: the checkout comes first, the caller's entries after it."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/opt/extra-site", "/opt/other"]))
    assert rlk_main(["e2e", "plan", TRL_SPECS[0].stem]) == 0
    arms = [_trl_plan_arm(line) for line in capsys.readouterr().out.splitlines() if line.startswith("cd ")]
    assert len(arms) == 2 * len(load_spec(TRL_SPECS[0]).lanes)
    for workdir, env, _ in arms:
        assert env["PYTHONPATH"] == os.pathsep.join([workdir, "/opt/extra-site", "/opt/other"])


@pytest.mark.parametrize("path", TRL_SPECS, ids=lambda p: p.stem)
def test_trl_plan_prints_both_arms_identical_except_the_kernel_switch(path, capsys):
    """`rlk e2e plan` of a TRL spec: the two subprocess command lines run_ab would start."""
    assert rlk_main(["e2e", "plan", path.stem]) == 0
    out = capsys.readouterr().out
    spec = load_spec(path)
    lanes: dict[str, list[str]] = {}
    for line in out.splitlines():
        if line.startswith("## lane "):
            lane = line.removeprefix("## lane ")
        elif line.startswith("cd "):
            lanes.setdefault(lane, []).append(line)
    assert sorted(lanes) == sorted(spec.lanes)
    recorded = f"{RUN_DIR}/replay/baseline/rollouts.jsonl"
    for lane, lines in lanes.items():
        (b_dir, b_env, b_argv), (k_dir, k_env, k_argv) = (_trl_plan_arm(line) for line in lines)
        assert b_dir == k_dir and b_env["PYTHONPATH"].split(os.pathsep)[0] == b_dir
        assert {k: v for k, v in k_env.items() if k not in spec.kernel_switch.env} == b_env
        assert all(k_env[k] == v and k not in b_env for k, v in spec.kernel_switch.env.items())
        assert b_argv[1:7] == ["-m", "pytest_rlk.e2e.engines.trl.child", "--spec", f"{RUN_DIR}/spec.json",
                               "--model-dir", f"{RUN_DIR}/model"]
        switch = list(spec.kernel_switch.args)
        k_rest = k_argv[: len(k_argv) - len(switch)]
        assert k_argv[len(k_rest):] == switch
        # argv ends with the lane's per-arm arguments: `--arm ROLE --out RUN/LANE/ROLE`, and in the
        # replay lane the baseline's recording or the other arms' replay of it; the rest is identical
        tail = {"baseline": ["--record-rollouts", recorded], "kernels": ["--replay-rollouts", recorded]} \
            if lane == "replay" else {"baseline": [], "kernels": []}
        n = 4 + len(tail["baseline"])
        assert b_argv[-n:] == ["--arm", "baseline", "--out", f"{RUN_DIR}/{lane}/baseline", *tail["baseline"]]
        assert k_rest[-n:] == ["--arm", "kernels", "--out", f"{RUN_DIR}/{lane}/kernels", *tail["kernels"]]
        assert k_rest[:-n] == b_argv[:-n]
    assert b_env.get("TRITON_INTERPRET") == ("1" if spec.hardware.platform == "cpu" else None)


def test_trl_plan_refuses_vime_root(capsys):
    assert rlk_main(["e2e", "plan", TRL_SPECS[0].stem, "--vime-root", "/v"]) == 2
    assert "engine 'trl' does not take --vime-root (options of engine vime)" in capsys.readouterr().err


def test_plan_refuses_a_vime_root_that_is_not_there(tmp_path, capsys):
    """As `rlk e2e run` does: a usage error at once, before any command is printed."""
    assert rlk_main(["e2e", "plan", VIME_SPECS[0].stem, "--vime-root", str(tmp_path / "no-such-dir")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and f"--vime-root {tmp_path / 'no-such-dir'}: not a directory" in captured.err
    (tmp_path / "empty").mkdir()
    assert rlk_main(["e2e", "plan", VIME_SPECS[0].stem, "--vime-root", str(tmp_path / "empty")]) == 2
    assert "train.py not found (is this a vime checkout?)" in capsys.readouterr().err


def test_plan_with_a_vime_root_and_out_prints_no_placeholder_for_them(tmp_path, capsys, monkeypatch):
    root = tmp_path / "vime"
    (root / "scripts" / "models").mkdir(parents=True)
    (root / "train.py").write_text("")
    for var in ("RLK_MODELS", "RLK_DATA", "MEGATRON_LM"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    for path in VIME_SPECS:
        assert rlk_main(["e2e", "plan", path.stem, "--vime-root", str(root), "--out", str(tmp_path / "run")]) == 0
        out = capsys.readouterr().out
        assert "${" not in out.replace("${MODEL_ARGS[@]}", ""), path.stem
        assert f"{root}/" in out and f"{tmp_path / 'run'}/live/kernels/tensorboard" in out


@pytest.mark.parametrize("path", SPEC_PATHS, ids=lambda p: p.stem)
def test_every_shipped_spec_plans(path, capsys):
    assert rlk_main(["e2e", "plan", path.stem]) == 0
    assert load_spec(path).kernel_switch.env["VIME_RL_KERNEL"] == "1"
    assert "arms differ only by the kernel switch" in capsys.readouterr().out


def test_identical_arms_check_passes_on_the_built_commands():
    spec = ABSpec.model_validate(_raw())
    for lane in spec.lanes:
        base, kern = vime_commands.arm_commands(spec, lane, vime_root="/v", run_dir="/r")
        check_arms_differ_only_by_switch(base, kern, spec.kernel_switch)


@pytest.mark.parametrize("change, message", [
    (lambda k: {"argv": [("7" if a == "1234" else a) for a in k.argv]}, "--seed"),
    (lambda k: {"env": {**k.env, "NCCL_ALGO": "Tree"}}, "NCCL_ALGO"),
    (lambda k: {"env": {key: v for key, v in k.env.items() if key != "VIME_RL_KERNEL"}}, "lacks VIME_RL_KERNEL=1"),
    (lambda k: {"argv": k.argv[:-1]}, "kernel switch args"),
    (lambda k: {"workdir": "/elsewhere"}, "workdir"),
])
def test_identical_arms_check_fails_on_a_difference(change, message):
    raw = _raw()
    raw["kernel_switch"]["args"] = ["--a-kernel-arm-flag"]  # vime specs switch by env only; the check covers args
    spec = ABSpec.model_validate(raw)
    base, kern = vime_commands.arm_commands(spec, "live", vime_root="/v", run_dir="/r")
    bad = ArmCommand(**{**kern.__dict__, **change(kern)})
    with pytest.raises(ArmMismatchError, match=message.replace("(", r"\(")):
        check_arms_differ_only_by_switch(base, bad, spec.kernel_switch)


def test_baseline_carrying_the_switch_fails():
    spec = ABSpec.model_validate(_raw())
    base, kern = vime_commands.arm_commands(spec, "live", vime_root="/v", run_dir="/r")
    bad_base = ArmCommand(**{**base.__dict__, "env": {**base.env, "VIME_RL_KERNEL": "1"}})
    with pytest.raises(ArmMismatchError, match="baseline env sets the kernel switch"):
        check_arms_differ_only_by_switch(bad_base, kern, spec.kernel_switch)


def test_a_declared_arm_env_is_the_one_other_allowed_difference():
    """`arms.<role>.env` (e.g. a kernel backend for the kernel arm of a test variant) reaches that
    arm only; the same variables set any other way are a mismatch, and it may not shadow the engine's."""
    raw = _raw()
    raw["arms"]["kernels"]["env"] = {"VIME_RL_KERNEL_BACKEND": "suites.e2e.backend:make"}
    spec = ABSpec.model_validate(raw)
    base, kern = vime_commands.arm_commands(spec, "live", vime_root="/v", run_dir="/r")
    assert kern.full_env["VIME_RL_KERNEL_BACKEND"] == "suites.e2e.backend:make"
    assert "VIME_RL_KERNEL_BACKEND" not in base.full_env
    check_arms_differ_only_by_switch(base, kern, spec.kernel_switch)
    undeclared = ArmCommand(**{**kern.__dict__, "env": {**kern.env, **kern.arm_env}, "arm_env": {}})
    with pytest.raises(ArmMismatchError, match="env VIME_RL_KERNEL_BACKEND: None vs 'suites.e2e.backend:make'"):
        check_arms_differ_only_by_switch(base, undeclared, spec.kernel_switch)
    shadowing = ArmCommand(**{**kern.__dict__, "arm_env": {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}})
    with pytest.raises(ArmMismatchError, match=r"kernels arm env \[.CUDA_DEVICE_MAX_CONNECTIONS.\] overrides variables the engine sets"):
        check_arms_differ_only_by_switch(base, shadowing, spec.kernel_switch)


def test_ci_test_with_fault_tolerance_is_refused(tmp_path):
    raw = _raw()
    raw["vime"]["ci_test"] = True
    raw["vime"]["extra_args"] = raw["vime"]["extra_args"] + ["--use-fault-tolerance"]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(SpecError, match=r"bad.json.*--ci-test together with --use-fault-tolerance"):
        load_spec(path)


@pytest.mark.parametrize("mutate, field", [
    (lambda r: r.pop("vime"), "the 'vime' section is missing"),
    (lambda r: r.update(trl={}), "trl: engine is 'vime': remove the 'trl' section"),
    (lambda r: r.update(engine="verl"), "engine: unknown engine 'verl' (known: trl, vime)"),
    (lambda r: r["vime"].update(checkpoint_mode="fp8"), "vime.checkpoint_mode: Input should be 'bridge' or"),
    (lambda r: r["arms"]["kernels"].update(env={"VIME_RL_KERNEL": "0"}), "arms.kernels.env sets kernel switch"),
    (lambda r: r["parallelism"].update(tensor=3), "does not divide"),
    (lambda r: r["hardware"].update(gpus=16), "hardware.gpus = 16"),
    (lambda r: r["window"].update(skip_warmup_rollouts=99), "leaves no rollout"),
    (lambda r: r["window"].update(replay_horizon={"steps": 0, "source": "m"}), "window.replay_horizon.steps"),
    (lambda r: r["window"].update(replay_horizon={"steps": 2}), "window.replay_horizon.source"),
    (lambda r: r["window"].update(replay_horizon={"steps": 999, "source": "m"}),
     "window.replay_horizon.steps = 999 needs the replay lane"),
    (lambda r: r["kernel_switch"]["env"].pop("VIME_RL_KERNEL"), "VIME_RL_KERNEL=1"),
    (lambda r: r["arms"]["kernels"].update(label="vime"), "both arms are labelled"),
    (lambda r: r["hyperparameters"].update(lr="fast"), "hyperparameters.lr"),
    (lambda r: r.update(colour="red"), "colour"),
])
def test_bad_specs_name_the_field(tmp_path, mutate, field):
    raw = _raw()
    mutate(raw)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(path) in str(info.value) and field in str(info.value)


def test_extra_args_must_not_repeat_generated_flags():
    raw = _raw()
    raw["vime"]["extra_args"] = ["--seed", "7"]
    with pytest.raises(SpecError, match=r"repeats flags the spec generates: \['--seed'\]"):
        vime_commands.arm_commands(ABSpec.model_validate(raw), "live")


def test_placeholders_expand_or_name_the_missing_variable():
    assert expand_placeholders("${A}/x", {"A": "/m"}, what="t") == "/m/x"
    with pytest.raises(SpecError, match=r"RLK_MODELS is not set"):
        expand_placeholders("${RLK_MODELS}/Qwen3-4B", {}, what="model")


def test_the_run_dir_placeholder_is_never_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("RLK_RUN_DIR", "/elsewhere")
    text = plan_text(load_spec(TRL_SPECS[0]))
    assert "/elsewhere" not in text and f"--out '{RUN_DIR}/live/baseline'" in text


def test_unknown_spec_name_lists_the_shipped_ones(capsys):
    assert rlk_main(["e2e", "plan", "no-such-case"]) == 2
    assert "qwen3-30b-a3b-h200-grpo-dapo" in capsys.readouterr().err
