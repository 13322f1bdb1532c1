"""End to end: a third-party backend package plugs into the suite without touching it.

Every check runs a real child process (pytest or python) with the example package on PYTHONPATH,
so the registration paths are the ones a team would use: ``--rlk-backend pkg.module:factory``,
``VIME_RL_KERNEL_BACKEND`` (for the op tier and for ``kernels``' own dispatch), and an entry point
of the group ``pytest_rlk.backends`` (found through installed-package metadata).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_rlk.e2e.processes import pythonpath_first

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
FACTORY = "rlk_example_backend.backend:make_backend"
BROKEN_FACTORY = "rlk_example_backend.backend:make_broken_backend"
BACKENDS_TEST = "suites/op/test_backends.py"
# The child runs select the small cases only: the full-shape ones (GPU only) repeat what
# test_backends.py itself runs, and their number depends on the machine.
SMALL_ONLY = "not full"


def _env(extra_path: Path | None = None, **overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIME_RL_KERNEL")}
    env["PYTHONPATH"] = pythonpath_first(*(p for p in (extra_path, HERE, ROOT) if p is not None), environ=env)
    env.update(overrides)
    return env


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )


def _pytest(tmp_path: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return _run(
        ["-m", "pytest", BACKENDS_TEST, "-q", "-rs", "-p", "no:cacheprovider", "--rlk-artifacts", str(tmp_path / "runs"), *args],
        env,
    )


def _count(output: str, word: str) -> int:
    found = re.search(rf"(\d+) {word}", output)
    return int(found.group(1)) if found else 0


def _run_metrics(tmp_path: Path) -> list[dict]:
    """Every metric record of the child's run.json (wherever the schema nests them)."""
    run_file = tmp_path / "runs" / "latest" / "run.json"
    assert run_file.is_file(), f"no run.json at {run_file}"
    found: list[dict] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if "tags" in node and "value" in node:
                found.append(node)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads(run_file.read_text()))
    return found


def test_op_tier_validates_a_backend_given_by_dotted_path(tmp_path):
    proc = _pytest(tmp_path, "--rlk-backend", FACTORY, "-k", SMALL_ONLY, env=_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert _count(out, "passed") >= 15, out[-4000:]  # logp fp32/bf16, ratio_kl, linear_logp cases
    # what the backend declares it does not do is skipped with its reason, never run
    assert "example-torch/1.0.0: example-torch does not implement grpo_loss" in out
    assert "example-torch/1.0.0: dtype torch.float16 not supported by example-torch" in out
    assert "failed" not in out.splitlines()[-1]
    # max errors are recorded per backend and version
    metrics = _run_metrics(tmp_path)
    tagged = [m for m in metrics if m["tags"].get("backend") == "example-torch"]
    assert tagged and all(m["tags"].get("backend_version") == "1.0.0" for m in tagged)
    assert {m["tags"]["op"] for m in tagged} == {"logp", "ratio_kl", "linear_logp"}


def test_op_tier_takes_the_backend_from_the_environment(tmp_path):
    proc = _pytest(tmp_path, "-k", f"(test_ratio_kl or test_grpo_loss) and {SMALL_ONLY}", env=_env(VIME_RL_KERNEL_BACKEND=FACTORY))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert _count(out, "passed") == 5, out[-4000:]  # the five small ratio_kl cases
    assert "example-torch/1.0.0: example-torch does not implement grpo_loss" in out


def test_disagreement_report_says_where(tmp_path):
    proc = _pytest(
        tmp_path, "--rlk-backend", BROKEN_FACTORY, "-k", f"test_logp and fp32-t1.0-fwd and not V4099 and {SMALL_ONLY}", env=_env(),
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    assert _count(out, "failed") == 2, out[-4000:]  # fwd and fwdbwd
    assert (
        "example-broken/1.0.0 disagrees with the fp32 reference: op logp, output logp, shape (16,), dtype fp32, "
        "case fp32-t1.0-fwd: max abs err 1.0" in out
    ), out[-4000:]
    assert "at worst element index (2,)" in out


def test_kernels_dispatch_uses_the_env_registered_backend():
    script = """
import torch, kernels
from kernels.reference import LossConfig, selected_logprob
assert kernels.backend_id() == "example-torch/1.0.0", kernels.backend_id()
logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)).requires_grad_()
ids = torch.tensor([1, 2, 3, -100, 4, 49])
out = kernels.logp(logits, ids)
torch.testing.assert_close(out, selected_logprob(logits, ids), atol=1e-5, rtol=0)
assert kernels.fallback_counts() == {}, kernels.fallback_counts()
half = kernels.logp(logits.detach().half(), ids)          # fp16 is not declared: falls back, counted
assert kernels.fallback_counts() == {"logp": 1}, kernels.fallback_counts()
t = torch.ones(6)
kernels.grpo_loss(logits, ids.clamp(min=0), old_logp=out.detach(), ref_logp=None, advantages=t, loss_mask=t)
assert kernels.fallback_counts() == {"logp": 1, "grpo_loss": 1}, kernels.fallback_counts()
print("ok", kernels.fallback_reasons())
"""
    proc = _run(["-c", script], _env(VIME_RL_KERNEL="1", VIME_RL_KERNEL_BACKEND=FACTORY))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "example-torch does not implement grpo_loss" in proc.stdout


def test_entry_point_registration(tmp_path):
    """An installed distribution's entry point (here: its metadata on PYTHONPATH) is found by name."""
    dist_info = tmp_path / "rlk_example_backend-1.0.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: rlk-example-backend\nVersion: 1.0.0\n")
    (dist_info / "entry_points.txt").write_text(f"[pytest_rlk.backends]\nexample-torch = {FACTORY}\n")
    script = (
        "from kernels.backends import available_backends, get_backend\n"
        "assert 'example-torch' in available_backends(), available_backends()\n"
        "b = get_backend('example-torch')\n"
        "print(b.id, b.version, sorted(b.capabilities.ops))\n"
    )
    proc = _run(["-c", script], _env(extra_path=tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "example-torch 1.0.0 ['linear_logp', 'logp', 'ratio_kl']"


@pytest.mark.parametrize("factory", [FACTORY])
def test_example_backend_contract_in_process(factory):
    """The factory returns an object with the Backend interface (kernels.backends.base.Backend)."""
    sys.path.insert(0, str(HERE))
    try:
        from kernels.backends import load_dotted
        from kernels.backends.base import Backend

        backend = load_dotted(factory)()
        assert isinstance(backend, Backend)
        assert backend.supports("grpo_loss") == "example-torch does not implement grpo_loss"
        assert backend.supports("logp", dtype=__import__("torch").float16) is not None
    finally:
        sys.path.remove(str(HERE))
