"""The shipped vime specs' plans: both arms run the same loss path, the kernel switch is the environment.

vime's actor decides its log-prob forwards from ``--loss-type`` (an extra old-log-prob forward with
``custom_loss``, none with ``policy_loss`` when it can reuse the training forward): an arm pair that
differs in the loss path does different work. Both arms therefore install our loss hook and only
``VIME_RL_KERNEL=1`` separates them (with it off the adapter hands every call to vime's own loss).
The conformance suite (suites/module/vime/) checks the same plans through vime's own parser and actor.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from pytest_rlk.e2e.engines.vime import commands as vime_commands
from pytest_rlk.e2e.engines.vime.settings import LOSS_HOOK_ARGS
from pytest_rlk.e2e.spec import ABSpec, load_spec, matrix_spec_paths

VIME_SPECS = [p for p in matrix_spec_paths() if load_spec(p).engine == "vime"]


def _contains(argv: list[str], part: tuple[str, ...]) -> bool:
    return any(tuple(argv[i:i + len(part)]) == part for i in range(len(argv) - len(part) + 1))


@pytest.mark.parametrize("path", VIME_SPECS, ids=lambda p: p.stem)
def test_arms_differ_only_in_the_kernel_switch_env(path):
    spec = load_spec(path)
    assert spec.settings.commit, f"{spec.case}: vime.commit is not set"
    assert not spec.kernel_switch.args, f"{spec.case}: the kernel switch carries arguments {spec.kernel_switch.args}"
    for lane in spec.lanes:
        base, kern = vime_commands.arm_commands(spec, lane, vime_root="/v", run_dir="/r")
        base_argv = [a.replace("--save-debug-rollout-data", "--load-debug-rollout-data") for a in base.argv]
        assert base_argv == kern.argv, f"{spec.case} ({lane}): the arms' train.py arguments differ"
        assert _contains(base.argv, LOSS_HOOK_ARGS), f"{spec.case} ({lane}): the baseline lacks the loss hook"
        assert {k: v for k, v in kern.env.items() if k not in spec.kernel_switch.env} == base.env
        assert all(kern.env[k] == v and k not in base.env for k, v in spec.kernel_switch.env.items())


@pytest.mark.parametrize("flag", ["--loss-type", "--custom-loss-function-path", "--custom-megatron-init-path"])
def test_a_kernel_switch_that_changes_the_loss_path_is_rejected(flag):
    raw = json.loads(Path(VIME_SPECS[0]).read_text())
    raw["kernel_switch"]["args"] = [flag, "x"]
    with pytest.raises((ValidationError, ValueError), match="both vime arms install the loss hook"):
        ABSpec.model_validate(raw)


@pytest.mark.parametrize("where", ["vime.extra_args", "kernel_switch.args"])
@pytest.mark.parametrize("args", [["--linear-logp-provider", "kernels.integrations.linear_logp_provider.provide"],
                                  ["--linear-logp-provider=kernels.integrations.linear_logp_provider.provide"],
                                  ["--linear-logp-provider-mode", "strict"]], ids=["path", "path=", "mode"])
def test_the_forks_provider_with_our_custom_loss_is_refused(where, args):
    """Both arms run --loss-type custom_loss; the fork hands the provider its context only under policy_loss
    and sft_loss, so the provider would be consulted without it (an "unavailable" line per call handed to
    vime's loss, read as a kernel fallback). The plan refuses the combination, naming where it came from."""
    raw = json.loads(Path(VIME_SPECS[0]).read_text())
    section, key = where.split(".")
    raw[section][key] = [*raw[section].get(key, []), *args]
    with pytest.raises((ValidationError, ValueError), match=rf"{re.escape(where)} sets \['--linear-logp-provider"):
        ABSpec.model_validate(raw)
