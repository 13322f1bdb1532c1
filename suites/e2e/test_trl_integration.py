"""TRL lane, fast in-process checks: the integration itself (patch/unpatch, parity with TRL's own
fused LM head, the path GRPO's model forward uses, the perturbed backend), `rlk e2e run`'s
refusals and its clear failure when an arm dies, the verifiable reward, and the engine's input
validation (a bad spec refused naming the field, ragged metric lines, a shared model directory).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_rlk.extras import require_extra

require_extra("trl")
require_extra("datasets")  # TRL's GRPOTrainer reads its prompts from a datasets.Dataset

import perturbed_logp_backend as perturbed_backend  # noqa: E402
import torch  # noqa: E402

from pytest_rlk.e2e.engines.task import TARGET_WORDS, make_prompts, repeat_reward  # noqa: E402
from pytest_rlk.e2e.engines.trl.series import METRICS_FILE, read_series  # noqa: E402
from pytest_rlk.e2e.spec import SpecError, load_spec  # noqa: E402
from suites.e2e.trl_ab_cases import (  # noqa: E402
    DENSE_CPU,
    REPLAY_CPU,
)



def _lm_head_case(seed: int = 0, n: int = 12, h: int = 16, v: int = 40):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen, requires_grad=True)
    weight = torch.randn(v, h, generator=gen, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=gen)
    return hidden, weight, targets


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_patched_lm_head_matches_trl_fused_head(monkeypatch, temperature):
    """Our drop-in gives TRL's log-probs, entropy and gradients (reference backend, in-process)."""
    from trl.kernels import ChunkedLogProbFunction

    from kernels.integrations.trl import RlkLmHeadLogProb

    monkeypatch.delenv("VIME_RL_KERNEL", raising=False)  # in-process: no interpreter, reference math
    outputs = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    results = []
    for fn in (ChunkedLogProbFunction.apply, RlkLmHeadLogProb.apply):
        hidden, weight, targets = _lm_head_case()
        out = fn(hidden, weight, None, targets, temperature, 32, None, 1.0, outputs)
        (out[0].sum() + 0.5 * out[1].sum()).backward()
        results.append((out, hidden.grad, weight.grad))
    (trl_out, trl_dh, trl_dw), (our_out, our_dh, our_dw) = results
    for name, a, b in zip(outputs, trl_out, our_out, strict=True):
        if a.dtype == torch.bool:
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=name)
    torch.testing.assert_close(our_dh, trl_dh, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(our_dw, trl_dw, atol=1e-5, rtol=1e-5)


def test_install_patches_the_name_trl_calls_and_restores_it():
    import trl.trainer.utils as trl_utils

    from kernels.integrations import trl as integration

    original = trl_utils._ChunkedLogProbFunction
    with integration.installed():
        assert trl_utils._ChunkedLogProbFunction is integration.RlkLmHeadLogProb
        assert integration.is_installed()
        with pytest.raises(RuntimeError, match="already installed"):
            integration.install()
    assert trl_utils._ChunkedLogProbFunction is original and not integration.is_installed()


def test_patched_path_is_what_grpo_model_forward_uses(monkeypatch, tmp_path):
    """A model given TRL's fused head calls our drop-in: call counter moves, log-probs match."""
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from kernels.integrations import trl as integration
    from pytest_rlk.e2e.engines.tiny_models import TinyModelSize, build_tiny_model_dir

    monkeypatch.delenv("VIME_RL_KERNEL", raising=False)
    model_dir = build_tiny_model_dir(tmp_path / "m", "dense", TinyModelSize(), seed=0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    ids = torch.randint(3, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :3] = -100
    native = model(input_ids=ids, labels=labels, fused_lm_head=True)
    with integration.installed():
        ours = model(input_ids=ids, labels=labels, fused_lm_head=True)
        assert integration.call_counts()["lm_head_logp"] == 1
    torch.testing.assert_close(ours.log_probs, native.log_probs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.entropy, native.entropy, atol=1e-5, rtol=1e-5)


def test_perturbed_backend_is_rlk_triton_plus_the_bias(monkeypatch):
    """The backend the perturbed arm selects by dotted path: rlk-triton's log-probs + LOGP_BIAS,
    dispatched like any backend (strict: no fallback), and nothing but logp."""
    import kernels
    from kernels.backends import get_backend

    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # read when kernels.ops is first imported
    hidden, weight, targets = _lm_head_case()
    logits = torch.nn.functional.linear(hidden, weight).detach()
    reason = get_backend("rlk-triton").supports("logp", device=logits.device)
    if reason is not None:
        pytest.skip(f"rlk-triton cannot run here: {reason}")
    monkeypatch.setenv("VIME_RL_KERNEL", "1")
    monkeypatch.setenv("VIME_RL_KERNEL_STRICT", "1")
    monkeypatch.setenv("VIME_RL_KERNEL_BACKEND", "rlk-triton")
    expected = kernels.logp(logits, targets)
    monkeypatch.setenv("VIME_RL_KERNEL_BACKEND", perturbed_backend.DOTTED_PATH)
    assert kernels.backend_id().startswith(perturbed_backend.BACKEND_ID + "/")
    perturbed = kernels.logp(logits, targets)
    torch.testing.assert_close(perturbed, expected + perturbed_backend.LOGP_BIAS, atol=1e-6, rtol=0)
    with pytest.raises(kernels.KernelFallbackError, match="does not implement ratio_kl"):
        kernels.ratio_kl(expected, expected, expected, torch.ones_like(expected))


def test_rlk_e2e_run_of_a_trl_spec_refuses_vime_only_options(capsys):
    from pytest_rlk.cli import main as rlk_main

    assert rlk_main(["e2e", "run", DENSE_CPU.stem, "--vime-root", "/v", "--mode", "local"]) == 2
    assert "engine 'trl' does not take --vime-root, --mode (options of engine vime)" in capsys.readouterr().err


def test_rlk_e2e_run_of_a_trl_spec_fails_clearly_when_an_arm_dies(tmp_path, capsys):
    """Both arms die building the model (a model size it does not know): exit 1, the arm and its
    log named, everything the arms left kept."""
    from pytest_rlk.cli import main as rlk_main

    spec_path = _spec_with(tmp_path, **{"trl.model_size": {"hidden_size_typo": 64}})
    out = tmp_path / "run"
    assert rlk_main(["e2e", "run", str(spec_path), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "rlk e2e run: FAILED: trl-qwen3-tiny-dense-cpu: A/B trl-qwen3-tiny-dense-cpu: 2 arm failure(s)" in err
    assert "arm 'trl' (live lane, local mode) failed: exit code 1" in err
    assert str(out / "live" / "baseline" / "arm.log") in err and "unknown field(s) ['hidden_size_typo']" in err
    # what the arms left is kept, the report says they failed, and the result says FAIL
    assert json.loads((out / "ab_result.json").read_text())["passed"] is False
    assert "### trl (live): failed" in (out / "report" / "report.md").read_text()


def test_rlk_e2e_run_refuses_a_checkpoint_that_is_not_there_before_starting(tmp_path, capsys):
    from pytest_rlk.cli import main as rlk_main

    spec_path = _spec_with(tmp_path, **{"model.hf_checkpoint": str(tmp_path / "no-model")})
    assert rlk_main(["e2e", "run", str(spec_path), "--out", str(tmp_path / "run")]) == 2
    assert f"model.hf_checkpoint {str(tmp_path / 'no-model')!r}: no config.json there" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_reward_is_verifiable():
    assert repeat_reward("c c w1 c", "c") == 0.75
    assert repeat_reward("", "a") == 0.0
    rows = make_prompts(50, seed=3)
    assert rows == make_prompts(50, seed=3)
    assert {r["target"] for r in rows} <= set(TARGET_WORDS)
    assert all(r["prompt"].split()[1] == r["target"] for r in rows)


def _spec_with(tmp_path: Path, **changes) -> Path:
    raw = json.loads(DENSE_CPU.read_text())
    for dotted, value in changes.items():
        node = raw
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hyperparameters.kl_loss_type": "low_var_kl"}, "kl_loss_type must be 'k3'"),
        ({"dataset.prompt_data": "gsm8k.jsonl"}, "dataset.prompt_data must be 'synthetic:repeat'"),
        ({"trl.dtype": "fp8"}, "trl.dtype: Input should be 'float32' or 'bfloat16'"),
        ({"lanes": ["replay", "live"], "trl.rollout": "vllm", "trl.model_size": {"head_dim": 64}},
         "the replay lane records and replays the transformers sampler's rollouts"),
        ({"bands": {"replay.loss": {"rel": 0.01}}}, "bands: 'replay.loss' is not '<lane>.<metric>'"),
        ({"bands": {"live.loss": {"rel": 0.01}}}, r"bands: 'live.loss' needs its source"),
        ({"trl.model_size": {"hidden": 3}}, None),
        ({"hyperparameters.global_batch_size": 8}, "global_batch_size"),
        ({"trl.rollout": "vllm"}, r"trl.rollout 'vllm' on cpu needs trl.model_size.head_dim in \[64\]"),
        ({"trl.rollout": "vllm", "trl.model_size": {"head_dim": 64}, "trl.vllm_max_model_length": 10},
         "vllm_max_model_length 10 is shorter"),
        ({"trl.rollout": "sglang"}, "trl.rollout: Input should be 'hf' or 'vllm'"),
    ],
)
def test_bad_trl_spec_is_refused_naming_the_field(tmp_path, change, message):
    path = _spec_with(tmp_path, **change)
    if message is None:  # model_size is checked when the model is built
        from pytest_rlk.e2e.engines.tiny_models import TinyModelSize

        with pytest.raises(ValueError, match="unknown field"):
            TinyModelSize.from_dict(change["trl.model_size"])
        return
    with pytest.raises(SpecError, match=message) as info:
        load_spec(path)
    assert str(path) in str(info.value)


def test_read_series_rejects_ragged_lines(tmp_path):
    (tmp_path / METRICS_FILE).write_text(
        json.dumps({"step": 0, "raw_reward": 0.1, "loss": 0.0}) + "\n" + json.dumps({"step": 1, "raw_reward": 0.2}) + "\n"
    )
    with pytest.raises(ValueError, match="line 2 has metrics"):
        read_series(tmp_path)


def test_a_shared_model_directory_refuses_an_arm_of_another_seed(tmp_path):
    """Arms share the model the first one built; one with another `seeds.seed` would silently
    train a model its seed did not make."""
    from pytest_rlk.e2e.engines.trl.child import WARM_START_RECORD, model_dir

    spec = load_spec(REPLAY_CPU)
    target = tmp_path / "model"
    target.mkdir()
    (target / WARM_START_RECORD).write_text(json.dumps({"steps": 0, "seed": spec.seeds.seed + 1}))
    with pytest.raises(ValueError, match=rf"built with seeds.seed = {spec.seeds.seed + 1}, this arm's is "
                                         rf"{spec.seeds.seed}.*vary seeds.rollout_seed"):
        model_dir(spec, spec.settings, target)
    (target / WARM_START_RECORD).write_text(json.dumps({"steps": 0, "seed": spec.seeds.seed}))
    assert model_dir(spec, spec.settings, target) == target
