"""``rlk drift MODEL... [--out DIR]``: the ladder on models a user names, with progress lines.

Also ``python -m pytest_rlk.drift`` (the same command without the ``rlk`` entry point; it needs
neither pytest nor pydantic, so it runs on a bare GPU image with torch and transformers).

Per model: sample the responses (with vLLM when installed, so rung A5 compares its rollout
log-probs; else with transformers' ``generate``, and A5 is skipped with the reason), run every
rung's comparisons, and write ``drift.json``, ``drift.md`` (the table and the attribution) and
``drift.png`` to the output directory. Exit status: 0 when every comparison keeps its contract,
1 when one breaks it, 2 on a usage error (the message names the bad input), 3 when the vLLM
rollout fails (the message carries its log's tail).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

DEFAULT_PROMPTS = (
    "The capital of France is",
    "Write a short poem about the sea.",
    "Explain in one paragraph why the sky is blue, as if to a ten year old child.",
    "def fibonacci(n):",
    "Translate to German: The weather is nice today and we are going for a walk in the park.",
    "List three prime numbers greater than one hundred and explain how you checked them.",
    "Once upon a time",
    "Summarize the rules of chess for someone who has never played a board game before.",
)


class DriftUsageError(ValueError):
    """A bad argument; the message names it."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("models", nargs="+", metavar="MODEL",
                        help="an HF model directory, or a name under --model-root (e.g. qwen3_4b or Qwen3-4B)")
    parser.add_argument("--model-root", "--rlk-model-root", dest="model_root", type=Path, default=None,
                        help="where model names are looked up (the plugin's --rlk-model-root layout)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default: .rlk/runs/drift-<UTC time>)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="where the training forward runs (auto: cuda when available)")
    parser.add_argument("--rungs", default=None, help="comma list of rungs to run (default: A0,A1,A2,A3,A4,A5)")
    parser.add_argument("--no-rollout", action="store_true",
                        help="do not start vLLM: sample with transformers, skip A5")
    parser.add_argument("--prompts", type=Path, default=None,
                        help="JSON list of prompts (strings, or lists of token ids); default: 8 built-in English prompts")
    parser.add_argument("--n", type=int, default=4, help="responses per prompt (default 4)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per response (EOS ignored; default 32)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eps-clip", type=float, default=0.2, help="clipfrac0's lower clip (default 0.2)")
    parser.add_argument("--eps-clip-high", type=float, default=0.28, help="clipfrac0's upper clip (default 0.28)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="vLLM's share of the GPU")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow a model's own code (transformers and vLLM); off unless given")
    parser.add_argument("--no-plot", action="store_true", help="no drift.png (machines without matplotlib)")
    parser.add_argument("--deterministic", action="store_true",
                        help="torch.use_deterministic_algorithms (and cuBLAS's workspace setting) for the training "
                             "forward: when A0 is not bitwise on a GPU, this tells scheduling noise from numerics")


def add_subcommands(subparsers) -> None:
    """The ``rlk`` entry point's hook (pytest_rlk.cli.EXTENSION_MODULES)."""
    parser = subparsers.add_parser("drift", help="run the train/rollout drift ladder (A0-A5) on models you name")
    add_arguments(parser)
    parser.set_defaults(func=cmd_drift)


def resolve_model(name: str, model_root: Path | None) -> Path:
    tried = [Path(name).expanduser()]
    if model_root is not None:
        from pytest_rlk.markers import CHECKPOINT_DIRS

        tried += [model_root / name] + [model_root / d for d in CHECKPOINT_DIRS.get(name, ())]
    for path in tried:
        if (path / "config.json").is_file():
            return path.resolve()
    raise DriftUsageError(f"model {name!r}: no HF model directory (with config.json) at "
                          + ", ".join(str(p) for p in tried)
                          + ("" if model_root else " (give --model-root to look names up)"))


def _prompts(path: Path | None, tokenizer) -> list[list[int]]:
    if path is None:
        raw: list = list(DEFAULT_PROMPTS)
    else:
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise DriftUsageError(f"--prompts {path}: not a readable JSON list ({exc})") from None
        if not isinstance(raw, list) or not raw:
            raise DriftUsageError(f"--prompts {path}: expected a non-empty JSON list")
    prompts = []
    for i, p in enumerate(raw):
        if isinstance(p, str):
            ids = tokenizer(p, add_special_tokens=False)["input_ids"] if tokenizer is not None else None
            if ids is None:
                raise DriftUsageError(f"prompt {i} is text but the model directory has no tokenizer; give token ids")
        elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            ids = p
        else:
            raise DriftUsageError(f"prompt {i}: {p!r} is neither a string nor a list of token ids")
        if not ids:
            raise DriftUsageError(f"prompt {i} ({p!r}) has no tokens")
        prompts.append(list(ids))
    return prompts


def run_model(model_dir: Path, args: argparse.Namespace, device, say) -> object:
    import torch

    from pytest_rlk.drift import batch as drift_batch
    from pytest_rlk.drift import rollout, rungs
    from pytest_rlk.drift.runner import run_ladder
    from pytest_rlk.drift.sides import load_config, load_model

    load_config(model_dir, args.trust_remote_code)  # refuses a model that needs its own code, unless asked
    tokenizer = None
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as exc:
        say(f"no tokenizer in {model_dir} ({exc}); prompts must be token ids")
    prompts = _prompts(args.prompts, tokenizer)
    try:
        sampling = drift_batch.Sampling(temperature=args.temperature, n=args.n, max_tokens=args.max_tokens,
                                        seed=args.seed)
    except ValueError as exc:
        raise DriftUsageError(str(exc)) from None
    specs = rungs.select(rungs.default_ladder(), args.rungs)
    wants_rollout = any(s.rung == "A5" for s in specs)
    why_not = "--no-rollout" if args.no_rollout else rollout.vllm_missing_reason()
    if wants_rollout and why_not is None:
        if args.trust_remote_code:
            raise DriftUsageError("--trust-remote-code is not passed to vLLM by this command; use --no-rollout")
        say(f"vLLM rollout of {len(prompts)} prompts x {sampling.n} (one subprocess; log in {args.out})")
        request = rollout.request_for(prompts, sampling, dtype="bfloat16",
                                      gpu_memory_utilization=args.gpu_memory_utilization,
                                      max_model_len=max(map(len, prompts)) + sampling.max_tokens + 8)
        t0 = time.perf_counter()
        (result,) = rollout.run_rollouts([{"model": str(model_dir), "out": str(args.out / f"rollout-{model_dir.name}.json"),
                                           "request": request}], args.out)
        say(f"vLLM {result['vllm_version']}: load {result['load_s']:.1f}s, generate {result['generate_s']:.1f}s, "
            f"wall {time.perf_counter() - t0:.1f}s")
        token_batch = drift_batch.batch_from_rollout(result, sampling)
    else:
        if wants_rollout:
            say(f"A5 skipped: {why_not}; sampling with transformers instead")
        model = load_model(model_dir, device, args.trust_remote_code)
        token_batch = drift_batch.sample_with_hf(model, prompts, sampling)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return run_ladder(model_dir, token_batch, specs, device=device, rollout_unavailable=why_not,
                      eps_clip=args.eps_clip, eps_clip_high=args.eps_clip_high,
                      trust_remote_code=args.trust_remote_code, progress=say)


def cmd_drift(args: argparse.Namespace) -> int:
    from pytest_rlk.drift.preconditions import PreconditionError
    from pytest_rlk.drift.rollout import RolloutError
    from pytest_rlk.drift.rungs import LadderError

    try:
        return _drift(args)
    except (DriftUsageError, LadderError, PreconditionError) as exc:
        print(f"rlk drift: error: {exc}", file=sys.stderr)
        return 2
    except RolloutError as exc:
        print(f"rlk drift: error: {exc}", file=sys.stderr)
        return 3


def _drift(args: argparse.Namespace) -> int:
    if args.device in ("auto", "cpu"):
        # our Triton kernels run on CPU tensors through Triton's interpreter, which must be on before
        # kernels.ops is imported; a CUDA run compiles them
        import torch

        if args.device == "cpu" or not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from pytest_rlk.drift.runner import write_outputs

    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DriftUsageError("--device cuda: no CUDA device here")
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    args.out = (args.out or Path(".rlk/runs") / f"drift-{stamp}").resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    def say(line: str) -> None:
        print(f"[rlk drift {time.perf_counter() - t_start:6.1f}s] {line}", flush=True)

    models = [resolve_model(m, args.model_root) for m in args.models]
    results = []
    for model_dir in models:
        say(f"model {model_dir} on {device}")
        results.append(run_model(model_dir, args, device, say))
    paths = write_outputs(results, args.out, plot=not args.no_plot)
    print(paths["table"].read_text())
    for path in paths.values():
        say(f"wrote {path}")
    broken = [f"{r.model} {c.spec.key}: {c.violation}" for r in results for c in r.violations]
    if broken:
        print("rlk drift: contract violations:\n  " + "\n  ".join(broken), file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pytest_rlk.drift", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return cmd_drift(parser.parse_args(argv))
