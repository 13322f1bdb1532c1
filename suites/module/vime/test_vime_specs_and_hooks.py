"""The A/B specs and the init hook against the vime checkout they target.

* every vime spec names the vime commit it targets (``vime.commit``);
* every flag a spec plans for ``train.py`` (both arms, every lane, with the model script's
  ``MODEL_ARGS``) is known to that commit's own parser phases (``vime/utils/arguments.py`` with
  Megatron-LM's parser): vime drops an unknown flag without a word;
* both arms run the same loss path and the same log-prob forwards (vime's own decision in
  ``MegatronTrainRayActor.train_actor``, evaluated on the parsed arguments);
* ``--ci-test`` specs switch dropout off as vime's own CI scripts do (``kl_loss < 1e-8`` at step 0);
* the init hook runs through vime's own call site (the end of ``megatron_utils.initialize.init``).
"""

from __future__ import annotations

import ast
import functools
import logging
from argparse import Namespace

import pytest

from kernels.integrations import vime as adapter
from pytest_rlk.e2e import spec as spec_mod
from pytest_rlk.e2e.engines.vime import commands as vime_commands
from suites.module.vime import conformance as cf
from suites.module.vime import vime_files

pytestmark = pytest.mark.vime

VIME_SPECS = [p for p in spec_mod.matrix_spec_paths() if spec_mod.load_spec(p).engine == "vime"]
ROLES = ("baseline", "kernels")


def _spec(path):
    return spec_mod.load_spec(path)


def _train_argv(spec, lane, role: str, vime_root) -> list[str]:
    """The arm's ``train.py`` arguments as the e2e planner builds them, then the model script's
    ``MODEL_ARGS`` (the planner's ``bash -c 'source SCRIPT && exec "$@" "${MODEL_ARGS[@]}"'``)."""
    baseline, kernels_arm = vime_commands.arm_commands(spec, lane, vime_root=str(vime_root))
    argv = (baseline if role == "baseline" else kernels_arm).argv
    start = next(i for i, a in enumerate(argv) if a.endswith(("train.py", "train_async.py")))
    script = spec.settings.model_args_script
    return [*argv[start + 1:], *(vime_files.model_args(vime_root, script) if script else [])]


@pytest.fixture(scope="session")
def parse(vime_root, parser_stand_ins):
    """``parse(spec_path, lane, role)`` -> ParsedArgv through vime's parser (cached for the session)."""

    @functools.cache
    def run(path, lane, role):
        spec = _spec(path)
        try:
            return vime_files.parse_train_argv(vime_root, _train_argv(spec, lane, role, vime_root), parser_stand_ins.preload)
        except cf.VimeTreeError as exc:
            pytest.skip(f"vime's parser is not in this root: {exc}")

    return run


def _arms(path):
    spec = _spec(path)
    return [(lane, role) for lane in spec.lanes for role in ROLES]


@pytest.mark.parametrize("path", VIME_SPECS, ids=[p.stem for p in VIME_SPECS])
def test_spec_names_its_vime_commit(path):
    spec = _spec(path)
    assert spec.settings.commit, f"{spec.case}: vime.commit is not set (the spec must name the vime commit it targets)"


@pytest.mark.parametrize("path", VIME_SPECS, ids=[p.stem for p in VIME_SPECS])
def test_spec_flags_parse_with_vimes_parser(path, parse, parser_stand_ins):
    spec = _spec(path)
    unknown, unverifiable = {}, {}
    for lane, role in _arms(path):
        for flag in parse(path, lane, role).unknown:
            if flag.startswith("--vllm-") and not parser_stand_ins.vllm_engine_flags_known:
                unverifiable.setdefault(flag, []).append(f"{lane}/{role}")
            else:
                unknown.setdefault(flag, []).append(f"{lane}/{role}")
    assert not unknown, (
        f"{spec.case}: flags vime's parser does not know (train.py drops them silently): "
        + "; ".join(f"{flag} (arms {', '.join(arms)})" for flag, arms in unknown.items()))
    if unverifiable:
        pytest.skip(f"{spec.case}: vLLM engine flags not verifiable without vllm installed: {sorted(unverifiable)}")


def test_parser_check_reports_unknown_flags(vime_root, parser_stand_ins):
    """The check itself: a flag no phase knows is reported; flags of each phase are not."""
    argv = ["--rollout-batch-size", "8", "--not-a-vime-flag", "3", "--attention-dropout", "0.0",
            "--debug-train-only", "--vllm-enable-deterministic-inference", "--loss-type", "custom_loss"]
    parsed = vime_files.parse_train_argv(vime_root, argv, parser_stand_ins.preload)
    assert parsed.unknown == ["--not-a-vime-flag"]
    assert parsed.namespace.attention_dropout == 0.0 and parsed.namespace.loss_type == "custom_loss"


@pytest.mark.parametrize("path", VIME_SPECS, ids=[p.stem for p in VIME_SPECS])
def test_arms_run_the_same_loss_path(path, parse):
    spec = _spec(path)
    for lane in spec.lanes:
        loss_types = {role: parse(path, lane, role).namespace.loss_type for role in ROLES}
        assert loss_types["baseline"] == loss_types["kernels"], (
            f"{spec.case} ({lane}): baseline --loss-type {loss_types['baseline']} vs kernel arm "
            f"{loss_types['kernels']}: vime's loss_function dispatches the two to different code")


@pytest.mark.parametrize("path", VIME_SPECS, ids=[p.stem for p in VIME_SPECS])
def test_arms_run_the_same_forwards(path, parse, vime_root):
    """vime's actor reuses the training forward's log-probs as the old ones only under
    ``can_reuse_log_probs_in_loss``; otherwise it runs an extra log-prob forward inside the ``train``
    timer (perf/log_probs_time, rollout/log_probs and a nonzero train/ppo_kl follow from it)."""
    spec = _spec(path)
    for lane in spec.lanes:
        plans = {}
        for role in ROLES:
            args = Namespace(**vars(parse(path, lane, role).namespace))
            vime_files.apply_validate_derivations(vime_root, args)
            steps = args.rollout_batch_size * args.n_samples_per_prompt // args.global_batch_size
            plans[role] = vime_files.actor_forward_plan(vime_root, args, steps)
        base, kern = plans["baseline"], plans["kernels"]
        assert base.extra_log_prob_forward == kern.extra_log_prob_forward, (
            f"{spec.case} ({lane}): the baseline {'runs' if base.extra_log_prob_forward else 'skips'} the extra "
            f"log-prob forward and the kernel arm {'runs' if kern.extra_log_prob_forward else 'skips'} it "
            f"(vime {base.where}): the arms do different work inside the train timer")


@pytest.mark.parametrize("path", VIME_SPECS, ids=[p.stem for p in VIME_SPECS])
def test_ci_test_specs_switch_dropout_off(path, parse):
    spec = _spec(path)
    checked = False
    for lane, role in _arms(path):
        args = parse(path, lane, role).namespace
        if not args.ci_test:
            continue
        checked = True
        for name in ("attention_dropout", "hidden_dropout"):
            value = getattr(args, name)
            assert value == 0.0, (
                f"{spec.case} ({lane}/{role}): --ci-test asserts kl_loss < 1e-8 at the first step; "
                f"--{name.replace('_', '-')} parses to {value} (Megatron's default is 0.1), it must be 0.0")
    if not checked:
        pytest.skip(f"{spec.case} does not run vime's --ci-test checks")


def _init_hook_call_site(vime_root) -> vime_files.SourceStatement:
    """The ``if getattr(args, "custom_megatron_init_path", None): ...`` block at the end of vime's
    ``megatron_utils.initialize.init`` (the rest of init needs CUDA and a tokenizer)."""
    return vime_files.source_statement(
        vime_root, cf.INITIALIZE_FILE, "init",
        lambda n: isinstance(n, ast.If) and "custom_megatron_init_path" in ast.unparse(n.test))


@pytest.fixture
def init_call_site(vime_root) -> vime_files.SourceStatement:
    cf.use_vime_root(vime_root, "vime.utils.misc")  # the call site imports vime's load_function
    return _init_hook_call_site(vime_root)


def test_init_hook_through_vimes_call_site(init_call_site, reference_arm, caplog):
    call_site = init_call_site
    args = Namespace(**vars(cf.vime_args()), custom_megatron_init_path=cf.OUR_INIT_HOOK)
    with caplog.at_level(logging.INFO, logger=adapter.log.name):
        exec(call_site.code, {}, {"args": args})  # noqa: S102 - the checkout's own statement
    assert "rlk vime loss provider" in caplog.text, (
        f"vime's init call site ({call_site.where()}) did not run our hook {cf.OUR_INIT_HOOK}")
    adapter.reset_init_decision()
    strict_args = Namespace(**vars(cf.vime_args(entropy_coef=0.01)), custom_megatron_init_path=cf.OUR_INIT_HOOK)
    import kernels

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VIME_RL_KERNEL_STRICT", "1")
        with pytest.raises(kernels.KernelFallbackError, match="entropy"):
            exec(call_site.code, {}, {"args": strict_args})  # noqa: S102
