"""The A/B specs and the init hook against the vime checkout they target.

* every vime spec names the vime commit it targets (``vime.commit``);
* every flag a spec plans for ``train.py`` is accepted by that commit's own parser
  (``vime/utils/arguments.py`` with Megatron-LM's ``megatron.training`` parser);
* both arms run the same loss path (``--loss-type``), so they run the same forwards;
* ``--ci-test`` specs switch dropout off as vime's own CI scripts do (``kl_loss < 1e-8`` at step 0);
* the init hook loads and runs through vime's own loader (``vime.utils.misc.load_function``).
"""

from __future__ import annotations

import importlib
import logging
import shlex
from argparse import Namespace

import pytest

from kernels.integrations import vime as adapter
from pytest_rlk.e2e import spec as spec_mod
from pytest_rlk.e2e import vime_engine
from suites.module.vime import conformance as cf

pytestmark = pytest.mark.vime

VIME_SPECS = [p for p in spec_mod.matrix_spec_paths() if spec_mod.load_spec(p).engine == "vime"]


def _spec(path):
    return spec_mod.load_spec(path)


def _train_args(spec, role: str) -> list[str]:
    lane = spec.lanes[0]
    baseline, kernels_arm = vime_engine.arm_commands(spec, lane)
    argv = (baseline if role == "baseline" else kernels_arm).argv
    start = next(i for i, a in enumerate(argv) if a.endswith(("train.py", "train_async.py")))
    return argv[start + 1:]


def _option(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


@pytest.mark.parametrize("path", VIME_SPECS, ids=[p.stem for p in VIME_SPECS])
def test_spec_names_its_vime_commit(path):
    spec = _spec(path)
    assert spec.vime.commit, f"{spec.case}: vime.commit is not set (the spec must name the vime commit it targets)"


@pytest.mark.parametrize("path", VIME_SPECS, ids=[p.stem for p in VIME_SPECS])
def test_arms_run_the_same_loss_path(path):
    spec = _spec(path)
    base, kern = _train_args(spec, "baseline"), _train_args(spec, "kernels")
    loss_types = (_option(base, "--loss-type") or "policy_loss", _option(kern, "--loss-type") or "policy_loss")
    assert loss_types[0] == loss_types[1], (
        f"{spec.case}: baseline --loss-type {loss_types[0]} vs kernel arm {loss_types[1]}: vime reuses the "
        f"training forward's log-probs under policy_loss only, so the arms run different forwards")


@pytest.mark.parametrize("path", VIME_SPECS, ids=[p.stem for p in VIME_SPECS])
def test_ci_test_specs_switch_dropout_off(path):
    spec = _spec(path)
    argv = _train_args(spec, "baseline")
    if "--ci-test" not in argv:
        pytest.skip(f"{spec.case} does not run vime's --ci-test checks")
    for flag in ("--attention-dropout", "--hidden-dropout"):
        value = _option(argv, flag)
        assert value is not None and float(value) == 0.0, (
            f"{spec.case}: --ci-test asserts kl_loss < 1e-8 at the first step; {flag} must be 0.0 (got {value})")


@pytest.mark.parametrize("path", VIME_SPECS, ids=[p.stem for p in VIME_SPECS])
def test_spec_flags_parse_with_vimes_parser(path, vime_root):
    spec = _spec(path)
    try:
        arguments = cf.use_vime_root(vime_root, cf.ARGUMENTS_MODULE)
    except cf.VimeTreeError as exc:
        pytest.skip(f"vime's parser is not in this root: {exc}")
    parser = arguments.get_vime_extra_args_provider()
    megatron_args = importlib.import_module("megatron.training.arguments")
    import argparse

    p = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    megatron_args.add_megatron_arguments(p) if hasattr(megatron_args, "add_megatron_arguments") else None
    parser(p)
    for role in ("baseline", "kernels"):
        argv = [a for a in _train_args(spec, role)]
        _, unknown = p.parse_known_args(argv)
        assert not unknown, f"{spec.case} ({role}): not flags of vime at this commit: {shlex.join(unknown)}"


def test_init_hook_through_vimes_loader(vime_root, reference_arm, caplog):
    misc = cf.use_vime_root(vime_root, "vime.utils.misc")
    hook = misc.load_function(cf.OUR_INIT_HOOK)
    assert hook is adapter.init_hook
    with caplog.at_level(logging.INFO, logger=adapter.log.name):
        decision = hook(Namespace(**vars(cf.vime_args())))
    assert decision.reasons == () and "rlk vime loss provider" in caplog.text
    adapter.reset_init_decision()
    strict_args = cf.vime_args(entropy_coef=0.01)
    import kernels

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VIME_RL_KERNEL_STRICT", "1")
        with pytest.raises(kernels.KernelFallbackError, match="entropy"):
            hook(strict_args)
