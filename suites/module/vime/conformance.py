"""vime conformance helpers: import vime's REAL modules from a checkout and run its own call sites on CPU.

Plain functions (no pytest): the conftest turns them into fixtures.

* ``use_vime_root(root)``: put a checkout on ``sys.path`` and import ``vime.backends.megatron_utils.loss``
  (the module whose ``loss_function`` dispatches ``--loss-type policy_loss`` / ``custom_loss``).
* ``init_single_rank_megatron()``: one gloo rank on loopback plus Megatron's model-parallel state
  (TP = CP = DP = 1), which ``loss_function`` queries through ``megatron.core.mpu``.
* ``vime_args(**overrides)``: the attributes vime's loss path reads, with the defaults of vime's parser.
* ``packed_batch(...)``: vime's packed micro-batch (``RolloutBatch``) with ``rollout_mask_sums``.
* ``run_loss_function(loss_module, args, batch, logits)``: vime's ``loss_function`` with a fresh
  leaf for the logits; returns the scaled loss, dlogits and the logged ``{key: value}``.

Its parser, model scripts and single functions of files that cannot be imported here: vime_files.py.

Shapes: logits fp32 ``[1, T, V]`` (T = sum of total lengths); per-sample tensors ``[R_i]``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import socket
import sys
from argparse import Namespace
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch

LOSS_MODULE = "vime.backends.megatron_utils.loss"
PROVIDER_MODULE = "vime.backends.megatron_utils.linear_logp_provider"
PPO_UTILS_MODULE = "vime.utils.ppo_utils"
ARGUMENTS_MODULE = "vime.utils.arguments"
MEGATRON_ARGUMENTS_MODULE = "vime.backends.megatron_utils.arguments"
VLLM_ARGUMENTS_MODULE = "vime.backends.vllm_utils.arguments"
ACTOR_FILE = "vime/backends/megatron_utils/actor.py"
INITIALIZE_FILE = "vime/backends/megatron_utils/initialize.py"
TRAIN_METRIC_UTILS_FILE = "vime/observability/train_metric_utils.py"
OUR_CUSTOM_LOSS = "kernels.integrations.vime.policy_loss"
OUR_INIT_HOOK = "kernels.integrations.vime.init_hook"
OUR_PROVIDER = "kernels.integrations.linear_logp_provider.provide"


class VimeTreeError(RuntimeError):
    """A vime root that does not hold the modules the conformance suite imports."""


def _drop_vime_modules() -> None:
    for name in [n for n in sys.modules if n == "vime" or n.startswith("vime.")]:
        del sys.modules[name]


@contextlib.contextmanager
def eager_torch_compile():
    """Import vime's modules with ``TORCHDYNAMO_DISABLE=1`` (unless the caller set it): vime's
    ``torch.compile``-decorated helpers (``compute_policy_loss``, ``compute_approx_kl``,
    ``compute_cispo_loss``) are decorated at import, and so stay eager; inductor would compile a
    C++ kernel per dynamic shape, minutes on a 2-core CPU, for the same math. Scoped to the import:
    torch reads the variable when ``torch.compile`` is called, so the rest of a pytest session
    keeps compiling."""
    previous = os.environ.get("TORCHDYNAMO_DISABLE")
    os.environ["TORCHDYNAMO_DISABLE"] = previous if previous is not None else "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TORCHDYNAMO_DISABLE", None)
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = previous


def use_vime_root(root: Path, module: str = LOSS_MODULE, preload: Mapping[str, ModuleType] | None = None):
    """Import ``module`` from the vime checkout at ``root`` (first on ``sys.path``; earlier vime imports dropped).

    ``preload`` puts modules into ``sys.modules`` after the drop and before the import: the stand-ins
    the caller names for modules that cannot be imported here (the conftest labels each one)."""
    root = Path(root).resolve()
    if not (root / "vime").is_dir():
        raise VimeTreeError(f"{root} is not a vime checkout: it has no vime/ package directory")
    source = root / (module.replace(".", "/") + ".py")
    if not source.is_file():
        raise VimeTreeError(f"{root} has no {source.relative_to(root)} (needed for {module})")
    while str(root) in sys.path:
        sys.path.remove(str(root))
    sys.path.insert(0, str(root))
    _drop_vime_modules()
    sys.modules.update(preload or {})
    with eager_torch_compile():
        imported = importlib.import_module(module)
    if not str(Path(imported.__file__).resolve()).startswith(str(root)):
        raise VimeTreeError(f"{module} was imported from {imported.__file__}, not from {root}")
    return imported


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_single_rank_megatron() -> None:
    """One-process gloo group on 127.0.0.1 and Megatron's parallel state with every size 1."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_loopback_port()}",
                                world_size=1, rank=0)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


# The attributes vime's loss path reads (loss_function, policy_loss_function, get_log_probs_and_entropy,
# vanilla_tis_function / icepop_function, get_pg_loss_type), with the defaults vime's own parser gives
# them (vime/utils/arguments.py, Megatron's --calculate-per-token-loss).
LOSS_ARG_DEFAULTS: dict[str, object] = {
    "loss_type": "policy_loss",
    "custom_loss_function_path": None,
    "custom_tis_function_path": None,
    "custom_pg_loss_reducer_function_path": None,
    "calculate_per_token_loss": False,
    "recompute_loss_function": False,
    "allgather_cp": False,
    "rollout_temperature": 1.0,
    "rollout_top_p": 1.0,
    "log_probs_chunk_size": -1,
    "advantage_estimator": "grpo",
    "pg_loss_type": None,
    "use_score_centering": False,
    "eps_clip": 0.2,
    "eps_clip_high": 0.28,
    "eps_clip_c": None,
    "entropy_coef": 0.0,
    "use_kl_loss": True,
    "kl_loss_coef": 0.01,
    "kl_loss_type": "low_var_kl",
    "use_unbiased_kl": False,
    "use_rollout_logprobs": False,
    "get_mismatch_metrics": False,
    "use_tis": False,
    "tis_clip": 2.0,
    "tis_clip_low": 0.0,
    "use_opsm": False,
    "opsm_delta": 1e-4,
    "tensor_model_parallel_size": 1,
    "context_parallel_size": 1,
    "qkv_format": "thd",
}


def vime_args(**overrides: object) -> Namespace:
    unknown = sorted(set(overrides) - set(LOSS_ARG_DEFAULTS))
    if unknown:
        raise KeyError(f"not an attribute of vime's loss path: {unknown}")
    return Namespace(**{**LOSS_ARG_DEFAULTS, **overrides})


@dataclass
class Case:
    batch: dict
    logits: torch.Tensor  # [1, T, V] fp32


def packed_batch(*, seed: int = 0, vocab: int = 48, prompt_lengths: Sequence[int] = (5, 3, 4, 6),
                 response_lengths: Sequence[int] = (7, 9, 4, 6), rollout_ids: Sequence[int] | None = None,
                 logit_scale: float = 2.0, drift: float = 0.3) -> Case:
    """A micro-batch the way vime's actor hands it to ``loss_function`` (cp = 1).

    ``rollout_ids`` groups samples that come from one rollout execution: vime's per-sample denominator
    ``rollout_mask_sums[i]`` is then the sum of the loss-mask totals of every sample of that rollout.
    ``drift`` separates the old / rollout / ref log-probs from the current policy so ratios clip.
    """
    g = torch.Generator().manual_seed(seed)
    totals = [p + r for p, r in zip(prompt_lengths, response_lengths)]
    tokens = [torch.randint(0, vocab, (t,), generator=g) for t in totals]
    logits = (torch.randn(1, sum(totals), vocab, generator=g) * logit_scale).float()
    with torch.no_grad():
        rows = []
        end = 0
        for tok, total, resp in zip(tokens, totals, response_lengths):
            end += total
            lp = torch.log_softmax(logits[0, end - resp - 1:end - 1], dim=-1)
            rows.append(lp.gather(-1, tok[-resp:, None]).squeeze(-1))

    def near(x: torch.Tensor) -> torch.Tensor:
        return x + drift * torch.randn(x.shape, generator=g)

    masks = []
    for resp in response_lengths:
        m = torch.ones(resp)
        if resp > 3:
            m[torch.randint(0, resp, (1,), generator=g)] = 0.0
        masks.append(m)
    ids = list(rollout_ids) if rollout_ids is not None else list(range(len(totals)))
    per_rollout = {}
    for rid, m in zip(ids, masks):
        per_rollout[rid] = per_rollout.get(rid, 0.0) + float(m.sum())
    rewards = torch.randn(len(totals), generator=g)
    batch = {
        "unconcat_tokens": tokens,
        "tokens": torch.cat(tokens),
        "total_lengths": totals,
        "response_lengths": list(response_lengths),
        "loss_masks": masks,
        "log_probs": [near(r) for r in rows],
        "ref_log_probs": [near(r) for r in rows],
        "rollout_log_probs": [near(r) for r in rows],
        "advantages": [torch.full((resp,), float(a)) for resp, a in zip(response_lengths, rewards)],
        "rollout_mask_sums": [torch.tensor(per_rollout[rid]) for rid in ids],
    }
    return Case(batch=batch, logits=logits)


@dataclass
class LossRun:
    loss: torch.Tensor  # the scaled loss loss_function returns (what Megatron backpropagates)
    grad: torch.Tensor  # d loss / d logits, [1, T, V]
    metrics: dict[str, float]  # the keys/values loss_function logs (vime prefixes them with train/)
    normalizer: torch.Tensor
    log: dict = field(default_factory=dict)  # loss_function's {"keys": [...], "values": tensor} as returned


def run_loss_function(loss_module, args: Namespace, case: Case, *, num_microbatches: int = 1,
                      step_global_batch_size: int | None = None) -> LossRun:
    """vime's ``loss_function(args, batch, num_microbatches, step_global_batch_size, logits)``."""
    leaf = case.logits.clone().requires_grad_(True)
    gbs = step_global_batch_size or len(case.batch["total_lengths"])
    loss, normalizer, log = loss_module.loss_function(args, case.batch, num_microbatches, gbs, leaf)
    loss.backward()
    values = log["values"].detach()
    metrics = {key: float(v) for key, v in zip(log["keys"], values[1:].tolist())}
    return LossRun(loss=loss.detach(), grad=leaf.grad.detach(), metrics=metrics, normalizer=normalizer,
                   log={"keys": list(log["keys"]), "values": values.clone()})


def our_custom_loss_args(args: Namespace) -> Namespace:
    """The same settings with our adapter installed through vime's custom-loss hook."""
    return Namespace(**{**vars(args), "loss_type": "custom_loss", "custom_loss_function_path": OUR_CUSTOM_LOSS})


def environment_without(*names: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in names}
