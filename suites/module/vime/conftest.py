"""Fixtures of the vime conformance suite (marker ``vime``; the fork's provider: ``vime_fork``).

``--rlk-vime-root`` names an upstream vime checkout (or a tree rebuilt from its files at a pinned
commit), ``--rlk-vime-fork-root`` a checkout of the RL-Align fork. Without them every test here skips
with the reason (the ``vime`` marker's check in pytest_rlk/markers.py; ``vime_fork`` below).

Stand-ins (only where a module cannot be imported here; each named in ``parser_stand_ins``):
``vllm.engine.arg_utils`` when vLLM is not importable (vime's vLLM parser then knows only vime's own
``--vllm-*`` extras; engine flags are reported as unverifiable, never as known), and
``vime.observability.wandb_utils`` when the vime root lacks it (the stored copies of vime at the pinned
commit do not hold that file; the parser only calls ``logging_utils.configure_logger``).

vime's ``torch.compile``-decorated helpers (``compute_policy_loss``, ``compute_approx_kl``,
``compute_cispo_loss``) run eagerly here: their modules are imported under ``TORCHDYNAMO_DISABLE=1``
(``conformance.eager_torch_compile``), and only while they are imported.
Nothing else of vime is stubbed. What the tests import and read (vime's modules and their import-time
closure, the files whose call sites they compile, the specs' model scripts, Megatron-LM's
``megatron.training`` at the commit vime's ``docker/Dockerfile`` pins, ``six``) is checked at collection
(``requirements.py``): a test whose pieces are missing skips with one reason naming each of them.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from suites.module.vime import conformance, requirements


def _root(config, option: str) -> Path | None:
    value = config.getoption(option)
    if value is None:
        return None
    path = Path(value).expanduser().resolve()
    if not path.is_dir():
        raise pytest.UsageError(f"--{option.replace('_', '-')}: {value!r} is not a directory")
    return path


def _tree_findings(vime_root: Path, fork_root: Path | None) -> dict[str, list[requirements.Missing]]:
    from pytest_rlk.e2e import spec as spec_mod

    specs = [spec_mod.load_spec(p) for p in spec_mod.matrix_spec_paths()]
    vime_specs = [s for s in specs if s.engine == "vime"]
    return requirements.check_tree(
        vime_root, fork_root=fork_root,
        model_scripts=[s.settings.model_args_script for s in vime_specs if s.settings.model_args_script],
        vime_commits=[s.settings.commit for s in vime_specs])


def pytest_collection_modifyitems(config, items):
    """Before any test runs: what the vime root, the fork root and this environment lack, per test (by
    the fixtures it uses: requirements.NEEDS), as one skip reason naming every missing piece."""
    fork_root = _root(config, "rlk_vime_fork_root")
    vime_root = _root(config, "rlk_vime_root")
    findings = None
    for item in items:
        if item.get_closest_marker("vime_fork") is not None and fork_root is None:
            item.add_marker(pytest.mark.skip(reason="needs the RL-Align vime fork (--rlk-vime-fork-root not given)"))
            continue
        if vime_root is None or item.get_closest_marker("vime") is None:
            continue
        if findings is None:
            findings = _tree_findings(vime_root, fork_root)
        fixtures = getattr(item, "fixturenames", ())
        reason = requirements.skip_reason([m for name in requirements.NEEDS if name in fixtures
                                           for m in findings[name]])
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def vime_root(request) -> Path:
    root = _root(request.config, "rlk_vime_root")
    assert root is not None, "the vime marker guarantees --rlk-vime-root"
    return root


@pytest.fixture(scope="session")
def vime_fork_root(request) -> Path:
    root = _root(request.config, "rlk_vime_fork_root")
    assert root is not None, "the vime_fork marker guarantees --rlk-vime-fork-root"
    return root


@pytest.fixture(scope="session")
def megatron_single_rank():
    conformance.init_single_rank_megatron()


@pytest.fixture
def vime_loss(vime_root, megatron_single_rank):
    """vime's own ``vime.backends.megatron_utils.loss`` from the upstream root."""
    return conformance.use_vime_root(vime_root, conformance.LOSS_MODULE)


@pytest.fixture
def reference_arm(monkeypatch):
    """Our adapter's own path (kernels on) on the fp32 reference backend, no strict mode (fallbacks must
    be visible, not raised). With the kernels off the adapter hands every call to vime's loss."""
    import kernels
    from kernels.integrations import vime as adapter

    monkeypatch.setenv("VIME_RL_KERNEL", "1")
    monkeypatch.setenv("VIME_RL_KERNEL_BACKEND", "reference")
    monkeypatch.delenv("VIME_RL_KERNEL_OPS", raising=False)
    monkeypatch.delenv("VIME_RL_KERNEL_STRICT", raising=False)
    monkeypatch.delenv(adapter.NATIVE_LOSS_ENV, raising=False)
    kernels.reset_fallback_counts()
    adapter.reset_init_decision()
    adapter.reset_native_fallbacks()
    yield
    kernels.reset_fallback_counts()
    adapter.reset_init_decision()
    adapter.reset_native_fallbacks()


@dataclass
class ParserStandIns:
    """The stand-ins ``parser_stand_ins`` installed, and what they cost the parser check."""

    preload: dict[str, types.ModuleType] = field(default_factory=dict)  # vime modules (use_vime_root preload)
    vllm_engine_flags_known: bool = True  # False: vLLM's own engine flags are not registered
    labels: list[str] = field(default_factory=list)


def _vllm_engine_args_stand_in() -> dict[str, types.ModuleType]:
    """STAND-IN: vLLM is not importable here. vime's ``add_vllm_arguments`` wraps
    ``AsyncEngineArgs.add_cli_args(parser)`` to register every vLLM engine flag as ``--vllm-*``; this
    ``add_cli_args`` registers none, so only vime's own ``--vllm-*`` extras are known."""
    vllm = types.ModuleType("vllm")
    engine = types.ModuleType("vllm.engine")
    arg_utils = types.ModuleType("vllm.engine.arg_utils")

    class AsyncEngineArgs:
        @staticmethod
        def add_cli_args(parser):
            return parser

    arg_utils.AsyncEngineArgs = AsyncEngineArgs
    vllm.engine, engine.arg_utils = engine, arg_utils
    return {"vllm": vllm, "vllm.engine": engine, "vllm.engine.arg_utils": arg_utils}


@pytest.fixture(scope="session")
def parser_stand_ins(vime_root):
    """Install (for the session) only the stand-ins vime's argument parser needs in this environment."""
    stand_ins = ParserStandIns()
    with pytest.MonkeyPatch.context() as mp:
        if "vllm" in requirements.stand_ins_needed(vime_root):
            for name, module in _vllm_engine_args_stand_in().items():
                mp.setitem(sys.modules, name, module)
            stand_ins.vllm_engine_flags_known = False
            stand_ins.labels.append("vllm.engine.arg_utils.AsyncEngineArgs (vLLM not importable)")
        if requirements.WANDB_UTILS_STAND_IN in requirements.stand_ins_needed(vime_root):
            # STAND-IN: vime.observability.wandb_utils, imported at module level by logging_utils;
            # the argument parser calls only logging_utils.configure_logger.
            stand_ins.preload["vime.observability.wandb_utils"] = types.ModuleType("vime.observability.wandb_utils")
            stand_ins.labels.append("vime.observability.wandb_utils (not in this vime root)")
        yield stand_ins
