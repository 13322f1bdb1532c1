"""The rlk summary's skips by cause (matching pytest's own skip total) and the kernel backends a
run exercised (from the tests' records)."""
from __future__ import annotations

import pytest
from rlk_plugin_testing import latest_run

from pytest_rlk.schema import TestRecord
from pytest_rlk.skips import (
    CAPABILITY,
    HARDWARE,
    MISSING_PACKAGE,
    OTHER,
    exit_status,
    skip_cause,
    skip_lines,
    skips_by_cause,
)

SKIPPING = """
import pytest

@pytest.mark.gpu
def test_marker_gpu():
    pass

@pytest.mark.parametrize("i", [1, 2])
def test_own_cuda_skip(i):
    pytest.skip("a device mismatch needs a CUDA device")

def test_liger_case():
    pytest.skip("liger/0.8.5: Liger's fused_selective_log_softmax is forward-only (torch.no_grad)")

def test_peer_missing():
    pytest.skip("backend 'rl_engine' not available: rl_engine not importable (No module named 'rl_engine')")

def test_other():
    pytest.skip("the fixture data is regenerated weekly")

def test_runs():
    pass
"""
MODULE_SKIP = """
import pytest

pytest.importorskip("a_package_nobody_installed", reason="needs a_package_nobody_installed: install pytest-rlk[cpu]")

def test_never_collected():
    pass
"""


def test_every_skip_is_counted_by_cause_and_matches_pytest(rlk_pytester):
    rlk_pytester.makepyfile(**{"suites/op/test_skips": SKIPPING, "suites/op/test_needs_extra": MODULE_SKIP})
    result = rlk_pytester.runpytest("--rlk-platform=cpu", "-rs")
    result.assert_outcomes(passed=1, skipped=7)  # pytest counts the module skipped at collection
    result.stdout.fnmatch_lines([
        "skipped: 7 (hardware/resources 3, missing package 2, backend capability 1, other 1)",
        "  hardware/resources: 2 x a device mismatch needs a CUDA device",
        "  hardware/resources: 1 x needs a GPU (this machine: cpu, 0 GPUs)",
        "  missing package: 1 x *rl_engine not importable*",
        "  missing package: 1 x needs a_package_nobody_installed: install pytest-rlk[[]cpu[]]",
        "  backend capability: 1 x liger/0.8.5: *forward-only*",
        "  other: 1 x the fixture data is regenerated weekly",
    ])
    run = latest_run(rlk_pytester)
    assert sum(t.outcome == "skipped" for t in run.tests) == 7
    module = next(t for t in run.tests if t.nodeid == "suites/op/test_needs_extra.py")
    assert module.skip_reason == "needs a_package_nobody_installed: install pytest-rlk[cpu]"


@pytest.mark.parametrize("reason, unserved, cause", [
    ("needs 2 GPUs (found 0)", True, HARDWARE),
    ("full shape: needs a CUDA GPU (the CPU interpreter would take hours)", False, HARDWARE),
    ("needs transformers: install pytest-rlk[cpu] (pip install -e '.[cpu]')", False, MISSING_PACKAGE),
    ("could not import 'vllm': No module named 'vllm'", False, MISSING_PACKAGE),
    ("rlk-triton/0.1.0: rlk-triton does not implement linear_grpo_loss", False, CAPABILITY),
    ("kl_type low_var_kl not supported by liger", False, CAPABILITY),
    ("CPU-only variant; the nccl variants run on CUDA hosts", False, HARDWARE),
    ("flaky upstream", False, OTHER),
])
def test_skip_cause_rules(reason, unserved, cause):
    record = TestRecord(nodeid="t", case="t", outcome="skipped", skip_reason=reason, unserved=unserved)
    assert skip_cause(record) == cause


BACKENDS = {
    "kernels/__init__": ('"""Stand-in for the project kernels: only the identity and counters."""\n'
                         "import os\n__rlk_kernels__ = True\n\n"
                         "def fallback_counts():\n    return {}\n\n"
                         "def backend_id():\n"
                         "    return 'standin-fast/1' if os.environ.get('VIME_RL_KERNEL') == '1' else 'reference/0.1.0'\n"),
    "suites/op/test_backends_used": """
import kernels

def test_kernels_on(monkeypatch):
    monkeypatch.setenv("VIME_RL_KERNEL", "1")

def test_kernels_on_too(monkeypatch):
    monkeypatch.setenv("VIME_RL_KERNEL", "1")

def test_kernels_off():
    pass

def test_third_party(rlk_metrics):
    rlk_metrics.record_backend("liger/0.8.5")
""",
}


def test_run_names_the_backends_its_tests_exercised(rlk_pytester):
    rlk_pytester.makepyfile(**BACKENDS)
    result = rlk_pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["kernel backends exercised: standin-fast/1 (2 tests), liger/0.8.5 (1 test)"])
    run = latest_run(rlk_pytester)
    assert {t.nodeid.split("::")[1]: t.backends for t in run.tests} == {
        "test_kernels_on": ["standin-fast/1"], "test_kernels_on_too": ["standin-fast/1"],
        "test_kernels_off": [], "test_third_party": ["liger/0.8.5"]}
    assert run.manifest.kernel_backend_ids == ["standin-fast/1", "liger/0.8.5"]


def _skipped(reason: str) -> TestRecord:
    return TestRecord(nodeid=reason, case=reason, outcome="skipped", skip_reason=reason)


def test_wordings_of_one_reason_count_as_one():
    tests = [_skipped("a device mismatch needs a CUDA device"), _skipped("device mismatch needs a CUDA device"),
             _skipped("A device mismatch needs a CUDA device."), _skipped("needs a GPU (this machine: cpu, 0 GPUs)")]
    assert skips_by_cause(tests) == {HARDWARE: {"a device mismatch needs a CUDA device": 3,
                                                "needs a GPU (this machine: cpu, 0 GPUs)": 1}}


def test_every_reason_is_printed():
    tests = [_skipped(f"needs {n} GPUs (found 0)") for n in range(2, 12)]
    lines = skip_lines(tests)
    assert lines[0] == "skipped: 10 (hardware/resources 10)"
    assert sorted(lines[1:]) == sorted(f"  hardware/resources: 1 x needs {n} GPUs (found 0)" for n in range(2, 12))
    assert not any("more under" in line for line in lines)


def test_exit_5_turns_0_only_where_the_selection_was_skipped_at_collection_with_its_reason():
    assert exit_status(5, collection_skips=1, deselected=0) == 0  # a tier that needs torch, without it
    assert exit_status(5, collection_skips=0, deselected=0) == 5  # a selection that matched nothing
    assert exit_status(5, collection_skips=1, deselected=2) == 5  # it deselected what was there
    assert exit_status(1, collection_skips=1, deselected=0) == 1  # a failure stays a failure
    assert exit_status(0, collection_skips=3, deselected=0) == 0
