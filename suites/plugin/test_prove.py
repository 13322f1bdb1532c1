"""``rlk prove``: the registry's faults, the injected backend, and the proof itself through the real
entry point (real pytest subprocesses on the real op and module tests: the CPU part CI runs)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from rlk_plugin_testing import checkout_pythonpath

# the faults are kernel backends of torch tensors: without torch the file skips with that reason
torch = pytest.importorskip("torch", reason="rlk prove's faults are kernel backends of torch tensors",
                            exc_type=ModuleNotFoundError)

from pytest_rlk.prove import faults, registry  # noqa: E402
from pytest_rlk.prove.runner import TierResult, judge  # noqa: E402
from pytest_rlk.schema import MetricRecord, PlatformInfo, RunManifest, RunRecord, TestRecord  # noqa: E402

REPO = registry.__file__.rsplit("/pytest_rlk/", 1)[0]
CPU_FAMILIES = [f for f in registry.FAMILIES if f not in ("time", "memory")]


def rlk(*args: str, timeout: float = 120, cpu: bool = False) -> subprocess.CompletedProcess:
    """``rlk ARGS`` in a subprocess; ``cpu`` hides the host's GPUs from it, so the CPU tiers' cases
    run as CI runs them (interpreted kernels on CPU tensors) on a GPU host too. The GPU families are
    proven by ``rlk prove --tier op-gpu`` on the GPU nightly, not here."""
    env = {**os.environ, "PYTHONPATH": checkout_pythonpath(os.environ.get("PYTHONPATH"))}
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run([sys.executable, "-m", "pytest_rlk.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_every_gate_family_has_a_fault_and_every_fault_a_wrapper_and_cases():
    families = {f.family for f in registry.REGISTRY.values()}
    assert families == set(registry.FAMILIES)
    for fault in registry.REGISTRY.values():
        assert fault.name in faults.WRAPPERS and faults.WRAPPERS[fault.name][0] == fault.op
        assert all(fault.cases(tier) for tier in fault.tiers), fault.name
        assert list(fault.ladder) == sorted(fault.ladder)


def test_register_refuses_an_unknown_family_and_a_second_fault_of_one_name():
    with pytest.raises(ValueError, match="unknown family 'latency'"):
        registry.register(registry.Fault("x", "logp", "latency", "", 1.0))
    with pytest.raises(ValueError, match="logp_bias is registered already"):
        registry.register(registry.REGISTRY["logp_bias"])


def test_the_wrappers_do_what_they_say_and_size_0_is_harmless():
    logp = torch.tensor([-1.0, -2.0, -3.0, -4.0], requires_grad=True)
    biased = faults.WRAPPERS["logp_bias"][1](lambda call: logp * 1.0, 1e-3)(None)
    assert torch.allclose(biased - logp, torch.full((4,), 1e-3), atol=1e-6)
    for name, factor in (("logp_grad_scale_even", 1.5), ("logp_grad_sign_even", -1.0)):
        logp.grad = None
        size = 0.5 if name == "logp_grad_scale_even" else 1.0
        faults.WRAPPERS[name][1](lambda call: logp * 1.0, size)(None).sum().backward()
        assert logp.grad.tolist() == [factor, 1.0, factor, 1.0]
    logp.grad = None
    faults.WRAPPERS["logp_grad_sign_even"][1](lambda call: logp * 1.0, 0.0)(None).sum().backward()
    assert logp.grad.tolist() == [1.0] * 4
    loss, metrics = faults.WRAPPERS["grpo_metric_bias"][1](
        lambda call: (torch.tensor(1.0), {"ppo_kl": torch.tensor(0.0)}), 1e-3)(None)
    assert float(metrics["ppo_kl"]) == pytest.approx(1e-3) and float(loss) == 1.0


def test_the_faulty_backend_keeps_its_name_says_its_fault_and_declines_the_host_path():
    backend = faults.faulty_backend("grpo_loss_fallback", 1.0)
    assert backend.id == "rlk-triton" and backend.version.endswith("+fault.grpo_loss_fallback=1")
    assert "declines grpo_loss" in backend.supports("grpo_loss", device=torch.device("cpu"), dtype=torch.float32)
    import kernels.ops.logp  # noqa: F401  (the host-first entry exists once the op module is loaded)

    biased = faults.faulty_backend("logp_bias", 1e-3)
    assert biased.host_first("logp") is None and not biased.serves_own_routes("linear_logp")
    assert biased.serves_own_routes("ratio_kl")  # the ops without the fault keep every route of ours
    with pytest.raises(ValueError, match="unknown fault 'nope'"):
        faults.faulty_backend("nope", 1.0)


@pytest.mark.parametrize(("text", "message"), [
    ("logp_bias", "expected NAME=SIZE"), ("nope=1", "expected NAME=SIZE"), ("logp_bias=big", "size 'big'")])
def test_parse_fault_names_the_bad_text(text, message):
    with pytest.raises(ValueError, match=message):
        faults.parse_fault(text)


def test_the_dotted_path_factory_needs_rlk_fault(monkeypatch):
    monkeypatch.delenv(faults.FAULT_ENV, raising=False)
    with pytest.raises(ValueError, match="RLK_FAULT is not set"):
        faults.make_backend()
    monkeypatch.setenv(faults.FAULT_ENV, "ratio_kl_bias=0.01")
    assert faults.make_backend().version.endswith("ratio_kl_bias=0.01")


def _run(*tests: TestRecord) -> RunRecord:
    manifest = RunManifest(run_id="r", created_utc="", argv=[], tiers=["op"], software={},
                           platform=PlatformInfo(tag="cpu", detected_tag="cpu"))
    return RunRecord(manifest=manifest, status="complete", tests=list(tests))


def _test(nodeid: str, outcome: str, err: float, tol: float = 1e-5) -> TestRecord:
    return TestRecord(nodeid=nodeid, case=nodeid, tier="op", outcome=outcome,
                      failure="Failed: x" if outcome == "failed" else None,
                      metrics=[MetricRecord(name="e", value=err, direction="lower_is_better", space="error", gate=False,
                                            band={"abs_floor": tol})])


def test_judge_caught_margin_and_the_runs_that_prove_nothing():
    caught = judge(_run(_test("a", "failed", 1e-3), _test("b", "passed", 1e-6)), "op", ["a", "b"])
    assert caught == TierResult("op", True, pytest.approx(100.0), ["a"], "a: Failed: x")
    missed = judge(_run(_test("a", "passed", 5e-6)), "op", ["a"])
    assert not missed.caught and missed.margin == pytest.approx(0.5)
    with pytest.raises(Exception, match="not run .renamed or deselected"):
        judge(_run(), "op", ["a"])
    with pytest.raises(Exception, match="the clean run .no fault. fails"):
        judge(_run(_test("a", "failed", 1e-3)), "op", ["a"], clean=True)


def test_rlk_prove_catches_every_registered_fault_of_the_cpu_tiers():
    """The acceptance, and what CI runs on every submission: every gate family served on this
    machine catches its faults at their nominal sizes."""
    done = rlk("prove", "--tier", "op,module", timeout=900, cpu=True)
    assert done.returncode == 0, done.stdout + done.stderr
    for name, fault in registry.REGISTRY.items():
        if not fault.needs_gpu:
            assert any(name in line.split() and "CAUGHT" in line.split()
                       for line in done.stdout.splitlines()), (name, done.stdout)
    assert "NOT CAUGHT" not in done.stdout
    proven = next(line for line in done.stdout.splitlines() if line.startswith("families proven: "))
    for family in CPU_FAMILIES:
        assert family in proven.split(";")[0], (family, proven)


def test_rlk_prove_fails_when_a_registered_fault_is_made_harmless():
    done = rlk("prove", "--tier", "op", "--fault", "logp_bias", "--size", "0", timeout=600, cpu=True)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "NOT CAUGHT" in done.stdout and "rlk prove: FAILED: logp_bias=0 not caught by op" in done.stdout


def test_rlk_prove_refuses_an_unknown_tier_and_fault():
    assert "not a tier with cases" in rlk("prove", "--tier", "gpu").stderr
    assert "not registered" in rlk("prove", "--fault", "nope").stderr
