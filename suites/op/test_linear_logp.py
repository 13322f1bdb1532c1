"""linear_logp parity, vocab-parallel, bad inputs and the vime provider adapter.

Oracle: kernels.reference.linear_logp (fp32 upcast of hidden and weight before the matmul). On CPU the
Triton kernels run through the interpreter (suites/op/conftest.py sets TRITON_INTERPRET=1 when there
is no CUDA), so shapes stay small: T <= 64, H <= 64, V <= 1031.
"""

from __future__ import annotations

import importlib
import re
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import kernels
from kernels import tolerances
from kernels.integrations import linear_logp_provider as provider
from kernels.ops import INTERPRETED
from kernels.ops import linear_logp as op_module
from kernels.ops.linear_logp import linear_logp
from kernels.reference.linear_logp import linear_logp as reference_linear_logp

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ODD_VOCAB = 1031  # prime: every tile size leaves a partial last tile


def _inputs(dtype, T=24, H=40, V=ODD_VOCAB, bias=True, seed=0, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * (2.0 / H**0.5)  # logits of a few units, like a trained LM head
    b = torch.randn(V, generator=gen) * 0.5 if bias else None
    ids = torch.randint(0, V, (T,), generator=gen)
    ids[:4] = torch.tensor([0, V - 1, -100, V // 2])  # vocab edges and one ignored row
    to = {"device": device, "dtype": dtype}
    leaves = [hidden.to(**to).requires_grad_(), weight.to(**to).requires_grad_()]
    leaves.append(b.to(**to).requires_grad_() if bias else None)
    return leaves, ids.to(device)


def _grads(fn, leaves, ids, temperature, **kw):
    hidden, weight, bias = leaves
    logp = fn(hidden, weight, ids, bias, temperature, **kw)
    upstream = torch.linspace(-1.0, 2.0, logp.shape[0], device=logp.device)
    wrt = [t for t in leaves if t is not None]
    return logp, torch.autograd.grad(logp, wrt, upstream)


def assert_linear_logp_close(logp, grads, ref_logp, ref_grads, dtype, rlk_metrics=None):
    """logp vs the fp32 reference; grads vs the fp32 reference cast to the grads' dtype (issue 8)."""
    assert logp.dtype == torch.float32
    result = tolerances.assert_close(logp, ref_logp, "linear_logp", dtype, name="logp")
    for name, got, want in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert got.dtype == dtype, f"grad of {name} is {got.dtype}, expected {dtype}"
        tolerances.assert_close(got, want.to(dtype).float(), "linear_logp.grad", dtype, name=f"grad of {name}")
    if rlk_metrics is not None:
        rlk_metrics.record("logp_max_abs_err", result.max_abs_err, unit="", direction="lower_is_better",
                           space="logprob", tags={"dtype": tolerances.dtype_name(dtype)}, gate=False)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_parity_with_fp32_reference(dtype, temperature, rlk_metrics):
    leaves, ids = _inputs(dtype)
    logp, grads = _grads(linear_logp, leaves, ids, temperature)
    ref_logp, ref_grads = _grads(reference_linear_logp, leaves, ids, temperature)
    assert logp[2].item() == 0.0 and all(g is not None for g in grads)
    assert torch.all(grads[0][2] == 0), "the ignored row (-100) must get a zero hidden gradient"
    assert_linear_logp_close(logp, grads, ref_logp, ref_grads, dtype, rlk_metrics)


def test_backward_over_several_vocab_chunks_without_bias(monkeypatch):
    """A tiny workspace forces the backward through many vocab chunks (dH accumulates across them)."""
    leaves, ids = _inputs(torch.float32, T=40, H=32, V=257, bias=False, seed=1)
    monkeypatch.setattr(op_module, "BACKWARD_WORKSPACE_BYTES", 40 * 64 * 4)
    T, V = 40, 257
    cfg = op_module._tile_config(torch.float32)
    assert op_module._vocab_chunk_cols(T, V, 4, cfg.block_v) < V, "the test must exercise several chunks"
    logp, grads = _grads(linear_logp, leaves, ids, 1.0)
    ref_logp, ref_grads = _grads(reference_linear_logp, leaves, ids, 1.0)
    assert_linear_logp_close(logp, grads, ref_logp, ref_grads, torch.float32)


@pytest.mark.parametrize("matmul", ["torch", "triton"])
def test_backward_matmul_options(monkeypatch, matmul):
    """Both backward matmul options (cuBLAS, the default, and our Triton matmul) meet the tolerances
    over several vocab chunks."""
    monkeypatch.setenv(op_module.BWD_MATMUL_ENV, matmul)
    monkeypatch.setattr(op_module, "BACKWARD_WORKSPACE_BYTES", 24 * 100 * 2)
    leaves, ids = _inputs(torch.bfloat16, T=24, H=32, V=257, seed=2)
    logp, grads = _grads(linear_logp, leaves, ids, 0.7)
    ref_logp, ref_grads = _grads(reference_linear_logp, leaves, ids, 0.7)
    assert_linear_logp_close(logp, grads, ref_logp, ref_grads, torch.bfloat16)


@pytest.mark.skipif(not INTERPRETED, reason="on a Hopper GPU the TMA kernel is the bf16 default (covered above)")
@pytest.mark.parametrize("group_t", ["4096", "1"], ids=["token_tile_fastest", "grouped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tma_kernel_through_the_interpreter(monkeypatch, dtype, group_t):
    """The persistent TMA kernel (GPU default for bf16/fp16) forced on in the interpreter: partial
    tiles in T, V and K (H = 40), bias, an ignored row, several backward chunks, both tile orders."""
    monkeypatch.setattr(op_module, "TMA_IN_INTERPRETER", True)
    monkeypatch.setenv(op_module.GROUP_T_ENV, group_t)
    monkeypatch.setattr(op_module, "BACKWARD_WORKSPACE_BYTES", 40 * 128 * 4)
    launched = []
    kernel = op_module._tma_tiles_kernel

    class _Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return kernel[grid]

    monkeypatch.setattr(op_module, "_tma_tiles_kernel", _Spy())
    leaves, ids = _inputs(dtype, T=40, H=40, V=ODD_VOCAB, seed=3)
    logp, grads = _grads(linear_logp, leaves, ids, 0.7)
    ref_logp, ref_grads = _grads(reference_linear_logp, leaves, ids, 0.7)
    assert len(launched) > 2, "forward plus several backward chunks must run the TMA kernel"
    assert torch.all(grads[0][2] == 0)
    assert_linear_logp_close(logp, grads, ref_logp, ref_grads, dtype)


@pytest.mark.parametrize("path", ["default", "tma", "tma_store"])
def test_saved_first_chunk_matches_recompute(monkeypatch, path):
    """The forward keeps the first backward chunk (exp(z - tile max)); the backward turns it into
    dlogits instead of recomputing it. Same tolerances as the recompute path, through the default
    kernel, the TMA kernel and its TMA stores (interpreter); no_grad saves nothing; a second
    backward over the same graph (retain_graph) recomputes and agrees."""
    if path != "default" and not INTERPRETED:
        pytest.skip("the TMA paths are the GPU default for bf16 (covered by the parity tests there)")
    monkeypatch.setattr(op_module, "TMA_IN_INTERPRETER", path != "default")
    for knob in ("TMA_STORE_Q", "TMA_STORE_DLOGITS"):
        monkeypatch.setattr(op_module, knob, path == "tma_store")
    monkeypatch.setattr(op_module, "BACKWARD_WORKSPACE_BYTES", 40 * 128 * 2)  # several chunks
    finished = []
    finish = op_module._finish_saved_chunk
    monkeypatch.setattr(op_module, "_finish_saved_chunk", lambda *a: finished.append(1) or finish(*a))
    leaves, ids = _inputs(torch.bfloat16, T=40, H=40, V=ODD_VOCAB, seed=4)
    ref_logp, ref_grads = _grads(reference_linear_logp, leaves, ids, 0.7)
    got = {}
    for save in ("1", "0"):
        monkeypatch.setenv(op_module.SAVE_CHUNK_ENV, save)
        got[save] = _grads(linear_logp, leaves, ids, 0.7)
        assert_linear_logp_close(*got[save], ref_logp, ref_grads, torch.bfloat16)
    assert finished == [1], "only the saving run may take the saved-chunk path"
    assert torch.equal(got["1"][0], got["0"][0]), "saving must not change the forward's log-probs"
    monkeypatch.setenv(op_module.SAVE_CHUNK_ENV, "1")
    hidden, weight, bias = leaves
    logp = linear_logp(hidden, weight, ids, bias, 0.7)
    upstream = torch.linspace(-1.0, 2.0, logp.shape[0], device=logp.device)
    first = torch.autograd.grad(logp, (hidden, weight, bias), upstream, retain_graph=True)
    second = torch.autograd.grad(logp, (hidden, weight, bias), upstream)
    assert len(finished) == 2, "the second backward must recompute (the saved chunk was consumed)"
    for a, b in zip(first, second):
        tolerances.assert_close(a.float(), b.float(), "linear_logp.grad", torch.bfloat16, name="second backward")
    with torch.no_grad():
        linear_logp(hidden, weight, ids, bias, 0.7)
    assert len(finished) == 2


def test_bad_save_chunk_setting_is_an_error(monkeypatch):
    monkeypatch.setenv(op_module.SAVE_CHUNK_ENV, "sometimes")
    leaves, ids = _inputs(torch.float32, T=8, H=16, V=40)
    with pytest.raises(ValueError, match=op_module.SAVE_CHUNK_ENV):
        linear_logp(leaves[0], leaves[1], ids, leaves[2])


def test_backward_chunks_are_even_and_fill_whole_waves_at_the_issue_shape():
    """9 chunks of 16896 columns (66 vocab tiles of 256): no thin leftover chunk."""
    cols = op_module._vocab_chunk_cols(4096, 151936, 2, 256)
    assert cols == 16896 and -(-151936 // cols) == 9
    assert 4096 * cols * 2 <= op_module.BACKWARD_WORKSPACE_BYTES


def test_bad_backward_matmul_setting_is_an_error(monkeypatch):
    monkeypatch.setenv(op_module.BWD_MATMUL_ENV, "cublas-ish")
    leaves, ids = _inputs(torch.float32, T=8, H=16, V=40)
    logp = linear_logp(leaves[0], leaves[1], ids, leaves[2])
    with pytest.raises(ValueError, match="RLK_LINEAR_LOGP_BWD_MATMUL"):
        logp.sum().backward()


def test_bad_tile_setting_is_an_error(monkeypatch):
    monkeypatch.setenv(op_module.TILES_ENV, "128,100,64,8,3")
    with pytest.raises(ValueError, match="powers of two"):
        op_module._tile_config(torch.bfloat16, interpreted=False)


@pytest.mark.parametrize("value", ["0", "x"])
def test_bad_tma_setting_is_an_error(monkeypatch, value):
    monkeypatch.setenv(op_module.GROUP_T_ENV, value)
    with pytest.raises(ValueError, match=op_module.GROUP_T_ENV):
        op_module._tma_group_t()


def test_dispatch_serves_linear_logp_from_the_triton_backend(triton_strict):
    leaves, ids = _inputs(torch.float32, T=20, H=32, V=100)
    hidden, weight, bias = leaves
    backend, impl = kernels.dispatch.select("linear_logp", device=hidden.device, dtype=hidden.dtype,
                                            shape=tuple(hidden.shape), temperature=1.0, tp_world=1)
    assert backend.id == "rlk-triton" and impl is linear_logp.run
    got = kernels.linear_logp(hidden, weight, ids, bias)
    want = reference_linear_logp(hidden, weight, ids, bias)
    tolerances.assert_close(got, want, "linear_logp", torch.float32, name="kernels.linear_logp")


def test_never_materializes_full_logits_workspace_bound():
    """The issue's shape stays within 256 MB of workspace (computed from the allocation plan)."""
    budget = 256 * 10**6
    for dtype in (torch.bfloat16, torch.float32):
        need = op_module.workspace_bytes(4096, 4096, 151936, dtype)
        assert need <= budget, f"{dtype}: workspace {need / 1e6:.0f} MB > 256 MB"
        assert need < 4096 * 151936 * 2, "workspace must be far below one [T, V] bf16 logits buffer"


# --------------------------------------------------------------------------------------------
# Vocab-parallel: two gloo processes on CPU (or two GPUs when present)
# --------------------------------------------------------------------------------------------

TP_CASES = [(torch.float32, 0.7, True), (torch.bfloat16, 1.0, False)]
TP_SHAPE = {"T": 16, "H": 32}  # V stays ODD_VOCAB: unequal shards (516 + 515)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _to_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    return x


def _tp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    # CPU: gloo + the interpreter; GPU machine: one GPU per rank + NCCL.
    device = "cpu" if INTERPRETED else f"cuda:{rank}"
    if not INTERPRETED:
        torch.cuda.set_device(rank)
    dist.init_process_group("gloo" if INTERPRETED else "nccl", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    try:
        results = []
        for dtype, temperature, bias in TP_CASES:
            (hidden, weight, b), ids = _inputs(dtype, bias=bias, device=device, **TP_SHAPE)
            hidden, weight = hidden.detach(), weight.detach()
            b = None if b is None else b.detach()
            width = -(-ODD_VOCAB // world)
            start, stop = rank * width, min(ODD_VOCAB, (rank + 1) * width)
            # shard-edge targets: last id of shard 0 and first of shard 1
            ids[4:6] = torch.tensor([width - 1, width], device=device)
            shard = [hidden.clone().requires_grad_(), weight[start:stop].clone().requires_grad_()]
            shard.append(None if b is None else b[start:stop].clone().requires_grad_())
            kw = {"tp_group": dist.group.WORLD, "vocab_start": start, "global_vocab": ODD_VOCAB}
            ours = _grads(linear_logp, shard, ids, temperature, **kw)
            ref = _grads(reference_linear_logp, shard, ids, temperature, **kw)
            results.append(_to_cpu({"ours": ours, "ref": ref, "start": start, "stop": stop, "ids": ids}))
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not INTERPRETED and torch.cuda.device_count() < 2,
                    reason="vocab-parallel TP=2 needs the CPU interpreter (gloo) or 2 GPUs (NCCL)")
def test_vocab_parallel_tp2_matches_single_device_reference(tmp_path):
    world = 2
    mp.spawn(_tp_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    per_rank = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for case_index, (dtype, temperature, bias) in enumerate(TP_CASES):
        (hidden, weight, b), _ = _inputs(dtype, bias=bias, device="cpu", **TP_SHAPE)
        full = [hidden.detach().requires_grad_(), weight.detach().requires_grad_()]
        full.append(None if b is None else b.detach().requires_grad_())
        ids = per_rank[0][case_index]["ids"]
        want_logp, want_grads = _grads(reference_linear_logp, full, ids, temperature)
        for rank in range(world):
            case = per_rank[rank][case_index]
            lo, hi = case["start"], case["stop"]
            sliced = [want_grads[0], want_grads[1][lo:hi]] + ([want_grads[2][lo:hi]] if bias else [])
            for label in ("ours", "ref"):
                logp, grads = case[label]
                assert_linear_logp_close(logp, grads, want_logp, sliced, dtype)
        assert torch.equal(per_rank[0][case_index]["ours"][0], per_rank[1][case_index]["ours"][0]), \
            "every rank must return the same log-probs"


# --------------------------------------------------------------------------------------------
# Bad inputs: one test per error, each naming the input
# --------------------------------------------------------------------------------------------


def _good():
    (hidden, weight, bias), ids = _inputs(torch.float32, T=8, H=16, V=40)
    return {"hidden": hidden, "weight": weight, "target_ids": ids, "bias": bias}


BAD_INPUTS = {
    "hidden_not_2d": (lambda a: a.update(hidden=a["hidden"][None]), "hidden must be 2-D"),
    "hidden_int": (lambda a: a.update(hidden=a["hidden"].long()), "hidden dtype"),
    "weight_dtype_mismatch": (lambda a: a.update(weight=a["weight"].double()), "weight dtype"),
    "weight_wrong_H": (lambda a: a.update(weight=a["weight"][:, :8]), "weight must be [V_local, H=16]"),
    "weight_not_tensor": (lambda a: a.update(weight=[1.0]), "weight must be a torch.Tensor"),
    "empty_hidden": (lambda a: a.update(hidden=a["hidden"][:0], target_ids=a["target_ids"][:0]), "hidden is empty"),
    "bias_wrong_shape": (lambda a: a.update(bias=a["bias"][:-1]), "bias must have shape [40]"),
    "ids_out_of_range": (lambda a: a["target_ids"].__setitem__(0, 40), "target_ids has 1 id(s) outside [0, 40)"),
    "ids_wrong_length": (lambda a: a.update(target_ids=a["target_ids"][:-1]), "target_ids must have shape [8]"),
    "ids_float": (lambda a: a.update(target_ids=a["target_ids"].float()), "target_ids dtype"),
    "temperature_zero": (lambda a: a.update(temperature=0.0), "temperature must be a finite float > 0"),
    "vocab_start_without_tp": (lambda a: a.update(vocab_start=8), "without tp_group"),
    "negative_vocab_start": (lambda a: a.update(vocab_start=-1), "vocab_start must be an int >= 0"),
    "global_vocab_too_small": (lambda a: a.update(global_vocab=10), "global_vocab must be an int >= "),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_raises_naming_it(case):
    mutate, message = BAD_INPUTS[case]
    args = _good()
    mutate(args)
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        linear_logp(**args)


def test_tp_group_requires_global_vocab():
    args = _good()
    with pytest.raises(ValueError, match="global_vocab is required with tp_group"):
        linear_logp(**args, tp_group=object())


# --------------------------------------------------------------------------------------------
# The vime provider adapter (vime itself cannot run here: the request is our contract mirror)
# --------------------------------------------------------------------------------------------


def _request(mode="auto", **overrides):
    (hidden, weight, bias), ids = _inputs(torch.float32, T=24, H=32, V=100)
    request = provider.LinearLogpRequest(
        target_ids=ids,
        context=provider.LinearLogpContext(
            hidden_states=hidden,
            projection=provider.Projection(weight=weight, bias=bias),
            vocab_partition=provider.VocabPartition(local_start=0, local_size=100, real_vocab_size=100,
                                                    padded_vocab_size=100),
        ),
        temperature=0.7,
        mode=mode,
    )
    for path, value in overrides.items():
        target = request
        *parents, leaf = path.split(".")
        for name in parents:
            target = getattr(target, name)
        setattr(target, leaf, value)
    return request


UNSERVABLE = {
    "entropy": ({"with_entropy": True}, "entropy requested"),
    "entropy_grad": ({"with_entropy_grad": True}, "entropy requested"),
    "layout_zigzag": ({"token_layout": provider.TokenLayout(world_size=2, rank=0, layout="zigzag")}, "token layout 'zigzag'"),
    "weight_missing": ({"context.projection.weight": None}, "LM-head weight unavailable"),
    "temperature_zero": ({"temperature": 0.0}, "temperature <= 0"),
    "empty_ids": ({"target_ids": torch.empty(0, dtype=torch.long)}, "target ids are empty"),
    "sharded_without_tp": ({"context.vocab_partition.padded_vocab_size": 200}, "no TP group"),
    "ids_past_real_vocab": ({"context.vocab_partition.real_vocab_size": 50}, "past the real vocab size 50"),
}


@pytest.mark.parametrize("case", sorted(UNSERVABLE))
def test_provider_auto_returns_unavailable_with_reason(case):
    overrides, reason = UNSERVABLE[case]
    result = provider.provide(_request("auto", **overrides))
    assert isinstance(result, provider.LinearLogpUnavailable) and result.available is False
    assert reason in result.reason


@pytest.mark.parametrize("case", sorted(UNSERVABLE))
def test_provider_strict_raises_with_reason(case):
    overrides, reason = UNSERVABLE[case]
    with pytest.raises(provider.LinearLogpProviderUnavailable, match=re.escape(reason)):
        provider.provide(_request("strict", **overrides))


@pytest.mark.parametrize("mode", ["auto", "strict"])
def test_provider_result_contract(triton_strict, mode):
    """A served request runs the public op through dispatch: here the kernels (strict, no fallback)."""
    request = _request(mode)
    result = provider.provide(request)
    ctx = request.context
    assert isinstance(result, provider.LinearLogpResult) and result.available is True
    assert result.log_probs.shape == (24, 1) and result.log_probs.dtype == torch.float32
    assert result.log_probs.device == ctx.hidden_states.device
    assert result.log_probs.requires_grad and result.log_probs.grad_fn is not None
    assert result.backend_id == provider.BACKEND_ID == kernels.backend_id()
    assert result.contract_id == provider.CONTRACT_ID
    assert result.entropy is None and result.provenance["op"] == "linear_logp"
    want = reference_linear_logp(ctx.hidden_states, ctx.projection.weight, request.target_ids,
                                 ctx.projection.bias, 0.7)
    tolerances.assert_close(result.log_probs[:, 0], want, "linear_logp", torch.float32, name="provider log_probs")
    (grad_w,) = torch.autograd.grad(result.log_probs.sum(), [ctx.projection.weight])
    assert grad_w.abs().sum() > 0, "log-probs must be connected to the LM-head weight"


def test_provider_applies_keep_mask_and_accepts_duck_typed_requests():
    """The fork's own request objects are read by attribute: a SimpleNamespace stands in for one."""
    typed = _request()
    keep = torch.ones(24, dtype=torch.bool, device=DEVICE)
    keep[::3] = False
    duck = SimpleNamespace(
        target_ids=typed.target_ids, tp_group=None, temperature=0.7, chunk_size=4096, keep_mask=keep,
        with_entropy=False, with_entropy_grad=False, metadata={"mode": "strict", "store_prefix": "ref_"},
        token_layout=SimpleNamespace(world_size=1, rank=0, layout="single"),
        context=SimpleNamespace(
            hidden_states=typed.context.hidden_states,
            projection=SimpleNamespace(weight=typed.context.projection.weight, bias=typed.context.projection.bias),
            vocab_partition=SimpleNamespace(local_start=0, local_size=100, real_vocab_size=100, padded_vocab_size=100),
        ),
    )
    masked = provider.provide(duck).log_probs[:, 0]
    full = provider.provide(typed).log_probs[:, 0]
    assert torch.all(masked[~keep] == 0)
    assert torch.equal(masked[keep], full[keep])
    assert provider.provide(duck).provenance["request_metadata"]["store_prefix"] == "ref_"


def test_provider_dotted_path_resolves_like_the_fork():
    """The fork splits ``pkg.module.callable`` at the last dot and imports the module."""
    module_name, _, attr = provider.DOTTED_PATH.rpartition(".")
    assert getattr(importlib.import_module(module_name), attr) is provider.provide


def test_provider_rejects_unknown_mode():
    with pytest.raises(ValueError, match="mode must be one of"):
        provider.provide(_request("sometimes"))
