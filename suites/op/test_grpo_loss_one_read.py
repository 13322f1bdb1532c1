"""Host side of the one-read GRPO loss kernel: how rows are cut, when the kernel applies, and that
the Python side and the CUDA source agree (flags, argument list). The kernel's values are checked
against the reference on a GPU in test_grpo_loss.py (``one_read`` tests); here nothing needs one.
"""

from __future__ import annotations

import re

import pytest
import torch

from kernels import LossConfig
from kernels.ops.cuda import build
from kernels.ops.cuda import grpo_loss_one_read as one_read

SOURCE_TEXT = one_read.SOURCE.read_text()


@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("vocab", [8, 1032, 32000, 50257, 128256, 151936, 256000])
def test_cut_covers_the_row_in_aligned_slices_within_shared_memory(vocab, itemsize):
    cluster, slice_cols = one_read.cut(vocab, itemsize)
    assert cluster in one_read.CLUSTER_SIZES
    assert (slice_cols * itemsize) % 16 == 0, "slices must start on 16-byte boundaries"
    assert cluster * slice_cols >= vocab, "the cluster must cover the row"
    assert (cluster - 1) * slice_cols < vocab, "no CTA of the cluster may be left without columns"
    assert slice_cols * itemsize <= one_read.MAX_SLICE_BYTES
    smaller = [c for c in one_read.CLUSTER_SIZES if c < cluster]
    if smaller and slice_cols * itemsize <= one_read.SLICE_BYTES:
        # the smallest cluster that fits the preferred slice size was taken
        assert -(-vocab // smaller[-1]) * itemsize > one_read.SLICE_BYTES


def test_cut_of_the_benchmark_rows():
    # the shapes the benchmarks and docs quote: two CTAs of 75968 bytes per multiprocessor
    assert one_read.cut(151936, 2) == (4, 37984)
    assert one_read.cut(151936, 4) == (8, 18992)
    assert one_read.cut(32000, 2) == (1, 32000)


def test_cut_refuses_rows_beyond_eight_slices():
    limit_cols = max(one_read.CLUSTER_SIZES) * one_read.MAX_SLICE_BYTES // 4
    assert one_read.cut(limit_cols, 4) is not None
    assert one_read.cut(limit_cols + 4, 4) is None


def test_plan_names_why_it_does_not_apply(monkeypatch):
    logits = torch.zeros(4, 64)
    assert "not CUDA" in one_read.plan(logits)
    monkeypatch.setenv("RLK_GRPO_ONE_READ", "0")
    assert one_read.plan(logits) == "RLK_GRPO_ONE_READ=0"


def _source_defines() -> dict[str, int]:
    return {name: int(value) for name, value in re.findall(r"#define (FLAG_\w+|KL_TYPE_SHIFT) (\d+)", SOURCE_TEXT)}


def test_flag_bits_match_the_cuda_source():
    defines = _source_defines()
    assert defines == {
        "FLAG_SCALE": one_read.FLAG_SCALE, "FLAG_HAS_REF": one_read.FLAG_HAS_REF,
        "FLAG_UNBIASED": one_read.FLAG_UNBIASED, "FLAG_DUAL_CLIP": one_read.FLAG_DUAL_CLIP,
        "FLAG_TIS": one_read.FLAG_TIS, "FLAG_STATS_ONLY": one_read.FLAG_STATS_ONLY,
        "FLAG_WRITE_ALWAYS": one_read.FLAG_WRITE_ALWAYS, "KL_TYPE_SHIFT": one_read.KL_TYPE_SHIFT,
    }
    config = LossConfig(eps_clip_c=2.0, use_tis=True, use_unbiased_kl=True, kl_type="low_var_kl")
    flags = one_read.flags_for(config, scale=True, has_ref=True, kl_code=3)
    assert flags == (3 << 8) | 1 | 2 | 4 | 8 | 16
    assert not flags & one_read.FLAG_STATS_ONLY  # only a stats-only launch sets it
    assert one_read.flags_for(LossConfig(), scale=False, has_ref=False, kl_code=0) == 0


def test_the_last_gradient_encoding_is_the_same_in_every_source():
    """Word 3 of the error word holds bits(g) XOR bits(1.0f): the write kernel stores it, the Python
    path and the C++ host path decode it (kernels/device_errors.py states the encoding)."""
    from kernels import device_errors

    host_source = (one_read.SOURCE.parent.parent / "host" / "grpo_loss_one_read.cpp").read_text()
    assert int(re.search(r"#define FP32_ONE_BITS (0x[0-9a-f]+)u", SOURCE_TEXT).group(1), 16) == 0x3F800000
    assert int(re.search(r"kOneBits = (0x[0-9a-f]+)u;", host_source).group(1), 16) == 0x3F800000
    assert re.search(r"kLastGrad = (\d+);", host_source).group(1) == str(device_errors.LAST_GRAD)
    assert device_errors.FP32_ONE_BITS == 0x3F800000 and device_errors.encode_grad(1.0) == 0


@pytest.mark.parametrize(("macro", "signature"), [("RLK_DEFINE(NAME, T, C)", one_read.SIGNATURE),
                                                  ("RLK_DEFINE_WRITE(NAME, T)", one_read.WRITE_SIGNATURE)])
def test_argument_list_matches_the_cuda_source(macro, signature):
    """The driver passes arguments by position: the Python signatures must follow the kernels'
    (the cluster kernel, the write-from-statistics kernel)."""
    body = SOURCE_TEXT[SOURCE_TEXT.index(f"#define {macro}"):]
    params = body[body.index("NAME(") + len("NAME("):body.index(") {")]
    declared = [" ".join(p.replace("\\", " ").split()) for p in params.split(",")]
    kinds = []
    for decl in declared:
        if "*" in decl:
            kinds.append("ptr")
        elif decl.startswith("int64_t"):
            kinds.append("i64")
        elif decl.startswith("int "):
            kinds.append("i32")
        elif decl.startswith("float "):
            kinds.append("f32")
        else:
            raise AssertionError(f"unexpected kernel parameter {decl!r}")
    assert tuple(kinds) == signature


def test_fatbin_cache_key_covers_source_and_defines(tmp_path, monkeypatch):
    monkeypatch.setenv("RLK_CUDA_CACHE", str(tmp_path))
    source = tmp_path / "k.cu"
    source.write_text('extern "C" __global__ void k() {}\n')
    plain = build.fatbin_path(source)
    assert plain.parent == tmp_path
    assert build.fatbin_path(source, ("RLK_THREADS=512",)) != plain
    source.write_text('extern "C" __global__ void k() { }\n')
    assert build.fatbin_path(source) != plain


def test_missing_nvcc_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("RLK_CUDA_CACHE", str(tmp_path))
    monkeypatch.setenv("RLK_NVCC", str(tmp_path / "no-such-nvcc"))
    with pytest.raises(build.CudaBuildError, match="nvcc not found"):
        build.compile_fatbin(one_read.SOURCE)


# slow: the quick start (tox -e suite, -m "not slow") leaves it out; tox -e tests runs it
@pytest.mark.slow
@pytest.mark.skipif(build.find_nvcc() is None, reason="nvcc not installed on this machine (CUDA toolkit)")
@pytest.mark.parametrize("defines", [(), ("RLK_BULK_LOAD=0",)], ids=["default", "per-thread-cp-async"])
def test_the_cuda_source_compiles(tmp_path, monkeypatch, defines):
    """nvcc accepts the kernel for sm_90 (no GPU needed): a typo fails here, not on the GPU machine;
    also the per-thread copy path the probe (tools/probes/probe_grpo_one_read_config.py) compares with."""
    monkeypatch.setenv("RLK_CUDA_CACHE", str(tmp_path))
    fatbin = build.compile_fatbin(one_read.SOURCE, defines)
    assert fatbin.is_file() and fatbin.stat().st_size > 0
    assert build.compile_fatbin(one_read.SOURCE, defines) == fatbin  # cached: not rebuilt
