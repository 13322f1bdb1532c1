"""linear_logp probes on a GPU (not a test; docs/linear_logp.md's phase, budget and host-sync figures).

    python3 tools/probes/probe_linear_logp.py OUT_DIR [--sections phases,budgets,sync]
    python3 tools/probes/probe_linear_logp.py --compile-check      # no GPU: Triton's compiler for sm_90a

Shape: bf16 hidden [4096, 4096] x W [151936, 4096] (the benchmark's random case). Every section
times its variants in interleaved rounds (``pytest_rlk.timing.bench``, CUDA events, L2 flushed)
and reports the median: on these GPUs the products run at the power limit and the clock drifts
between calls. Writes OUT_DIR/probe_linear_logp.json and prints a table last.

``--compile-check`` compiles the Triton kernels of ``kernels/ops/linear_logp/kernels.py`` for sm_90a with
whatever Triton is first on the path (put the device machines' version there: a kernel the CPU
interpreter runs can still fail Triton's GPU compiler) and prints each one's shared memory; it
needs no GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys

import torch

T, H, V = 4096, 4096, 151936
FLOP = 2 * T * H * V
LOGITS_BYTES = T * V * 2
BUDGETS = {"256 MB (default)": None, "384 MB": 384 * 10**6, "512 MB": 512 * 10**6, "768 MB": 768 * 10**6,
           "1 GB": 10**9, "1.24 GB (logits)": LOGITS_BYTES, "1.27 GB (keep all)": int(LOGITS_BYTES * 1.02)}


def _interleaved(rows, fns, products=None, rounds=3):
    from pytest_rlk.timing import bench

    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(bench(fn, device="cuda", warmup_ms=50, rep_ms=200).median_ms)
    for name, values in times.items():
        ms = statistics.median(values)
        row = {"name": name, "ms": ms, "rounds": values, "tflops": (products or {}).get(name, 1.0) * FLOP / ms / 1e9}
        rows.append(row)
        print(json.dumps(row), flush=True)


def _with(module, attr, value, fn):
    def run():
        old = getattr(module, attr)
        setattr(module, attr, value)
        try:
            return fn()
        finally:
            setattr(module, attr, old)
    return run


def _with_env(name, value, fn):
    def run():
        old = os.environ.get(name)
        os.environ[name] = value
        try:
            return fn()
        finally:
            if old is None:
                os.environ.pop(name)
            else:
                os.environ[name] = old
    return run


def probe(out_dir: str, sections: set[str]) -> None:
    import kernels.ops.linear_logp as op
    from kernels.ops.linear_logp import launch as llp_launch
    from kernels.ops.linear_logp import passes as llp_passes
    from kernels.ops.linear_logp import plan as llp_plan

    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(V, H, device="cuda", generator=gen) * (2.0 / H**0.5)).to(torch.bfloat16).requires_grad_()
    ids = torch.randint(0, V, (T,), device="cuda", generator=gen)
    upstream = torch.randn(T, device="cuda", generator=gen)
    h, w = hidden.detach(), weight.detach()
    local_ids = llp_launch._local_ids(ids, 0)
    coef = (-upstream).contiguous()
    block_v = llp_plan._tile_config(torch.bfloat16).block_v
    n_tiles = -(-V // block_v)
    partials = (torch.empty(n_tiles, T, device="cuda"), torch.empty(n_tiles, T, device="cuda"), torch.zeros(T, device="cuda"))
    rows: list[dict] = []
    print(torch.cuda.get_device_name(), flush=True)

    def forward():
        with torch.no_grad():
            return op.linear_logp(hidden, weight, ids)

    def forward_backward(budget=None):
        torch.autograd.grad(op.linear_logp(hidden, weight, ids, workspace_bytes=budget), (hidden, weight), upstream)

    def tile_kernel(q=None):
        llp_launch._launch_tiles(h, w, None, local_ids, 1.0, col_start=0, n_cols=V, partials=partials, q=q)

    if "phases" in sections:
        q = torch.empty(T, V, device="cuda", dtype=torch.float16)
        _interleaved(rows, {"fwd tile kernel only": tile_kernel, "fwd tile kernel keeping all q": functools.partial(tile_kernel, q),
                            "fwd op (no grad)": forward, "cublas mm full vocab bf16 out": lambda: torch.mm(h, w.t())})
        del q
        # every column kept: dH and dW over the finished dlogits, then the q -> dlogits pass (in place:
        # finishing finished values again moves the same bytes; their values no longer matter)
        # (in the workspace's [T, V] buffer: the weight gradient's buffer opted out)
        logp = _with_env(op.KEEP_IN_WEIGHT_GRAD_ENV, "0", lambda: op.linear_logp(
            hidden, weight, ids, workspace_bytes=BUDGETS["1.27 GB (keep all)"]))()
        ctx = logp.grad_fn
        saved, lse, target_logit = ctx.saved_logits, ctx.saved_tensors[4], ctx.saved_tensors[6]

        def finish():
            return llp_passes._saved_dlogits(saved, 0, saved.cols, saved.buffer, lse, coef, target_logit, local_ids)

        dlogits = finish()
        dh, dw = torch.empty_like(h), torch.empty_like(w)
        _interleaved(rows, {"bwd keep-all: dH = dlogits @ W (K = V)": lambda: torch.mm(dlogits, w, out=dh),
                            "bwd keep-all: dW = dlogits^T @ H": lambda: torch.mm(dlogits.t(), h, out=dw)})
        _interleaved(rows, {"bwd keep-all: finish q -> dlogits (in place)": finish}, products={
                            "bwd keep-all: finish q -> dlogits (in place)": 0.0})
        del logp, ctx, saved, dlogits
        plan = llp_plan._plan(T, H, V, torch.bfloat16, op.DEFAULT_WORKSPACE_BYTES, explicit=False, save=True, tp=False)
        start, cols = llp_plan._even_chunks(plan.saved_cols, V, plan.buffer_cols, block_v)[0]
        chunk = torch.empty(T, plan.buffer_cols, device="cuda", dtype=torch.bfloat16)[:, :cols]
        dh32 = torch.zeros(T, H, device="cuda")
        lse = torch.full((T,), 13.0, device="cuda")

        def recompute():
            llp_launch._launch_tiles(h, w, None, local_ids, 1.0, col_start=start, n_cols=cols, dlogits=chunk, lse=lse, coef=coef)

        fns = {f"bwd default: recompute chunk of {cols} cols, TMA store": _with(llp_launch, "TMA_STORE_DLOGITS", True, recompute),
               f"bwd default: recompute chunk of {cols} cols, pointer stores": _with(llp_launch, "TMA_STORE_DLOGITS", False, recompute),
               "bwd default: dH32 += chunk @ W_chunk": lambda: llp_passes._accumulate_dh(dh32, chunk, w[start:start + cols], first=False),
               "bwd default: dW_chunk = chunk^T @ H": lambda: torch.mm(chunk.t(), h, out=dw[start:start + cols])}
        _interleaved(rows, fns, products=dict.fromkeys(fns, cols / V))
        del chunk, dh32, dh, dw
    if "budgets" in sections:
        fns = {f"fwd+bwd budget {k}": functools.partial(forward_backward, b) for k, b in BUDGETS.items()}
        products = {f"fwd+bwd budget {k}": 4 - op.kept_vocab_columns(T, H, V, torch.bfloat16, b) / V for k, b in BUDGETS.items()}
        _interleaved(rows, fns, products, rounds=2)
        from pytest_rlk.timing import peak_extra_memory

        for k, b in BUDGETS.items():
            extra = peak_extra_memory(functools.partial(forward_backward, b)) - (h.numel() + w.numel()) * 2
            row = {"name": f"workspace {k}", "mb": extra / 1e6,
                   "planned_mb": op.planned_workspace_bytes(T, H, V, torch.bfloat16, b) / 1e6,
                   "kept_cols": op.kept_vocab_columns(T, H, V, torch.bfloat16, b), "products": products[f"fwd+bwd budget {k}"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if "sync" in sections:  # the ids range check syncs the host before the forward's kernels
        check = "VIME_RL_KERNEL_CHECK_IDS"
        graph = torch.cuda.CUDAGraph()
        _with_env(check, "0", forward)()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            _with_env(check, "0", forward)()
        _interleaved(rows, {"fwd op, ids check on (default)": _with_env(check, "1", forward),
                            f"fwd op, {check}=0": _with_env(check, "0", forward),
                            "fwd op, CUDA-graph replay (no host)": graph.replay, "fwd tile kernel alone": tile_kernel,
                            "fwd+bwd default, ids check on": _with_env(check, "1", forward_backward),
                            f"fwd+bwd default, {check}=0": _with_env(check, "0", forward_backward)}, rounds=4)
    with open(os.path.join(out_dir, "probe_linear_logp.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\n{'probe':58} {'ms':>9} {'TFLOP/s':>8}  rounds")
    for r in rows:
        if "ms" in r:
            print(f"{r['name'][:58]:58} {r['ms']:9.3f} {r['tflops']:8.0f}  {' '.join(f'{x:.3f}' for x in r['rounds'])}")
        else:
            print(f"{r['name']:58} {r['mb']:8.1f} MB (plan {r['planned_mb']:.1f}), kept {r['kept_cols']} cols, "
                  f"{r['products']:.2f} products")


def compile_check() -> int:
    """Compile every Triton kernel of the op (the GPU configs) for sm_90a; 0 when all compile."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.ops.linear_logp import kernels as llp_kernels

    print("triton", triton.__version__)
    tile = {"BLOCK_T": 128, "BLOCK_V": 256, "BLOCK_K": 64, "NUM_PROGRAMS": 132, "FLATTEN": True,
            "INPUT_PRECISION": "tf32", "UPCAST": False}
    pointer = {"hidden_ptr": "*fp32", "weight_ptr": "*fp32", "bias_ptr": "*fp32", "local_ids_ptr": "*i32",
               "target_logit_ptr": "*fp32", "tile_max_ptr": "*fp32", "tile_sumexp_ptr": "*fp32", "q_ptr": "*fp32",
               "lse_ptr": "*fp32", "coef_ptr": "*fp32", "dlogits_ptr": "*fp32", "T": "i32", "H": "i32",
               "V_local": "i32", "col_start": "i32", "n_cols": "i32", "chunk_start": "i32", "chunk_cols": "i32",
               "stride_ht": "i32", "stride_wv": "i32", "stride_qt": "i32", "stride_qv": "i32", "stride_dt": "i32",
               "inv_temperature": "fp32"}
    pointer_consts = {"HAS_BIAS": True, "BLOCK_T": 64, "BLOCK_V": 128, "BLOCK_K": 32, "INPUT_PRECISION": "ieee",
                      "UPCAST": False, "EVEN_K": True}
    cases = []
    for dlogits, store_q, tma_store, bias, ws, q_t in [
            (False, False, False, False, False, False), (False, True, True, False, False, False),
            (False, True, False, True, False, False), (True, False, True, False, False, False),
            (True, False, False, True, False, False), (False, False, False, False, True, False),
            (False, True, True, False, False, True), (False, True, False, True, False, True)]:
        out = "bf16" if dlogits else "fp16"
        out_block = "[256,128]" if q_t else "[128,256]"
        types = {"h_desc": "tensordesc<bf16[128,64]>", "w_desc": "tensordesc<bf16[256,64]>",
                 "out_desc": f"tensordesc<{out}{out_block}>" if tma_store else "tensordesc<bf16[128,64]>",
                 "bias_ptr": "*bf16", "local_ids_ptr": "*i32", "lse_ptr": "*fp32", "coef_ptr": "*fp32",
                 "tile_max_ptr": "*fp32", "tile_sumexp_ptr": "*fp32", "target_logit_ptr": "*fp32", "out_ptr": f"*{out}",
                 "T": "i32", "H": "i32", "col_start": "i32", "n_cols": "i32", "stride_ot": "i32", "scale2": "fp32",
                 "group_t": "i32"}
        consts = {**tile, "DLOGITS": dlogits, "STORE_Q": store_q, "TMA_STORE": tma_store, "Q_TRANSPOSED": q_t,
                  "HAS_BIAS": bias, "WARP_SPECIALIZE": ws}
        cases.append((llp_kernels._tma_tiles_kernel, types, consts, 8, 3))
    cases += [
        (llp_kernels._fwd_tile_kernel, pointer, {**pointer_consts, "STORE_Q": True}, 8, 3),
        (llp_kernels._dlogits_kernel, pointer, pointer_consts, 8, 3),
        (llp_kernels._merge_partials_kernel, {"tile_max_ptr": "*fp32", "tile_sumexp_ptr": "*fp32", "row_max_ptr": "*fp32",
                                     "sumexp_ptr": "*fp32", "T": "i32", "n_tiles": "i32"}, {"BLOCK_T": 32, "BLOCK_N": 64}, 4, 3),
        (llp_kernels._target_column_kernel, {"dlogits_ptr": "*bf16", "local_ids_ptr": "*i32", "target_logit_ptr": "*fp32",
                                    "lse_ptr": "*fp32", "coef_ptr": "*fp32", "T": "i32", "col_start": "i32",
                                    "n_cols": "i32", "stride_dt": "i32"}, {"BLOCK_T": 32}, 4, 3),
        (llp_kernels._saved_dlogits_kernel, {"q_ptr": "*fp16", "d_ptr": "*bf16", "tile_max_ptr": "*fp32", "lse_ptr": "*fp32",
                                    "coef_ptr": "*fp32", "target_logit_ptr": "*fp32", "local_ids_ptr": "*i32",
                                    "T": "i32", "col_start": "i32", "n_cols": "i32", "stride_qt": "i32",
                                    "stride_qc": "i32", "stride_dt": "i32", "stride_dc": "i32"},
         {"TILE_V": 256, "BLOCK_T": 64, "BLOCK_C": 128}, 4, 3),
    ]
    failed = 0
    for fn, types, consts, num_warps, num_stages in cases:
        signature = {name: "constexpr" if name in consts else types[name] for name in fn.arg_names}
        flags = {k: v for k, v in consts.items() if isinstance(v, bool)}
        try:
            kernel = triton.compile(ASTSource(fn, signature, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                                    options={"num_warps": num_warps, "num_stages": num_stages})
            print(f"ok     {fn.__name__} {flags} shared memory {kernel.metadata.shared} B")
        except Exception as exc:  # noqa: BLE001 - any compiler error is reported, and the exit status says so
            failed += 1
            print(f"FAILED {fn.__name__} {flags}: {str(exc).splitlines()[-1][:300]}")
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?")
    parser.add_argument("--sections", default="phases,budgets,sync")
    parser.add_argument("--compile-check", action="store_true")
    args = parser.parse_args()
    if args.compile_check:
        return compile_check()
    if args.out_dir is None:
        parser.error("OUT_DIR is required (or --compile-check)")
    probe(args.out_dir, set(args.sections.split(",")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
