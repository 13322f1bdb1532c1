"""Rollout side of the drift check: a real vLLM engine samples responses with log-probs.

Run as a script in its own process (vLLM spawns worker processes, so the engine starts only under
``if __name__ == "__main__":``)::

    python suites/module/vllm_rollout.py --model DIR --request request.json --out rollout.json

``request.json``: ``{"prompts": [[ids...], ...], "n": int, "max_tokens": int, "seed": int,
"temperature": float}`` and optionally ``dtype`` (default bfloat16, what rollouts use),
``gpu_memory_utilization``, ``max_model_len``, ``max_num_seqs``. ``rollout.json``: ``{"samples": [{"prompt_ids", "response_ids",
"response_logprobs"}...], "vllm_version", "load_s", "generate_s"}``. The log-prob of each sampled
token is vLLM's ``processed_logprobs`` (after temperature), the quantity vime stores as
``rollout_log_probs``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def run_rollout(model_dir: str, request: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    import vllm

    t0 = time.perf_counter()
    llm = LLM(
        model=model_dir, dtype=str(request.get("dtype", "bfloat16")), seed=int(request["seed"]),
        gpu_memory_utilization=float(request.get("gpu_memory_utilization", 0.3)),
        max_model_len=int(request.get("max_model_len", 256)), enforce_eager=True,
        logprobs_mode="processed_logprobs", trust_remote_code=False,
        max_num_seqs=int(request.get("max_num_seqs", 16)),
    )
    load_s = time.perf_counter() - t0
    params = SamplingParams(
        n=int(request["n"]), temperature=float(request["temperature"]),
        max_tokens=int(request["max_tokens"]), logprobs=0, seed=int(request["seed"]),
        ignore_eos=True, detokenize=False,  # the model's vocab is padded beyond the tokenizer's
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
            samples.append({"prompt_ids": list(prompt), "response_ids": ids,
                            "response_logprobs": lps})
    return {"samples": samples, "vllm_version": vllm.__version__, "load_s": load_s,
            "generate_s": generate_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--request", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    result = run_rollout(args.model, json.loads(args.request.read_text()))
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(args.out)


if __name__ == "__main__":
    main()
