"""`rlk diff RUN --a-tag ... --b-tag ...`: two backends of one run, through a real pytester run
that records the tags suites/op/test_backends.py records ({backend, backend_version, op, dtype, case})."""
from __future__ import annotations

import pytest
from rlk_plugin_testing import latest_run, latest_run_dir

from pytest_rlk import cli
from pytest_rlk.options import OptionError
from pytest_rlk.schema import Verdict
from pytest_rlk.tag_diff import diff_tag_selections, parse_selectors

BACKENDS = """
import pytest

# (backend, version, op, case, max error); rl_engine is 3x worse on logp/T8, and has no grpo_loss
ROWS = [
    ("rlk-triton", "0.1.0", "logp", "T8", 1e-6),
    ("rlk-triton", "0.1.0", "logp", "T64", 2e-6),
    ("rlk-triton", "0.1.0", "grpo_loss", "T8", 5e-7),
    ("rl_engine", "git-abc123", "logp", "T8", 3e-6),
    ("rl_engine", "git-abc123", "logp", "T64", 2.1e-6),
    ("rl_engine", "git-abc123", "ratio_kl", "T8", 4e-7),
]

@pytest.mark.parametrize("backend,version,op,case,err", ROWS)
def test_op(rlk_metrics, backend, version, op, case, err):
    rlk_metrics.set_case(f"backends.{op}.{case}.{backend}-{version}")
    tags = {"backend": backend, "backend_version": version, "op": op, "dtype": "bf16", "case": case}
    rlk_metrics.record("logp_max_abs_err", err, direction="lower_is_better", space="error",
                       tags=tags, gate=False)
"""


@pytest.fixture
def backends_run(rlk_pytester):
    rlk_pytester.makepyfile(**{"suites/op/test_backends_synthetic": BACKENDS})
    rlk_pytester.runpytest().assert_outcomes(passed=6)
    return rlk_pytester


def test_two_backends_pair_by_the_other_tags(backends_run):
    run = latest_run(backends_run)
    results = diff_tag_selections(run, {"backend": "rlk-triton"}, {"backend": "rl_engine"})
    by_case = {r.case: r.comparisons[0] for r in results}
    assert sorted(by_case) == [
        "case=T64,dtype=bf16,op=logp", "case=T8,dtype=bf16,op=grpo_loss",
        "case=T8,dtype=bf16,op=logp", "case=T8,dtype=bf16,op=ratio_kl"]
    t8 = by_case["case=T8,dtype=bf16,op=logp"]  # the error band (bands.py: rel 1.0) is exceeded
    assert (t8.baseline, t8.new, t8.verdict) == (1e-6, 3e-6, Verdict.REGRESSION)
    assert by_case["case=T64,dtype=bf16,op=logp"].verdict is Verdict.PASS
    assert by_case["case=T8,dtype=bf16,op=grpo_loss"].verdict is Verdict.MISSING_METRIC  # only in A
    assert by_case["case=T8,dtype=bf16,op=ratio_kl"].verdict is Verdict.NEW_METRIC  # only in B


def test_cli_exit_codes_and_table(backends_run, capsys):
    run_dir = str(latest_run_dir(backends_run))
    assert cli.main(["diff", run_dir, "--a-tag", "backend=rlk-triton", "--b-tag", "backend=rl_engine", "--wide"]) == 1
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("case=T8,dtype=bf16,op=logp/"))
    assert row.split() == ["case=T8,dtype=bf16,op=logp/logp_max_abs_err", "1e-06", "3e-06", "2e-06", "1e-06",
                           "regression"]
    # narrowed to the case both serve equally well: clean
    assert cli.main(["diff", run_dir, "--a-tag", "backend=rlk-triton", "--a-tag", "case=T64",
                     "--b-tag", "backend=rl_engine", "--b-tag", "case=T64"]) == 0
    assert "1 pass" in capsys.readouterr().out
    # B as the reference: rlk-triton's T8 is 3x better, within the error band (rel 1.0 of 3e-6)
    assert cli.main(["diff", run_dir, "--a-tag", "backend=rl_engine", "--b-tag", "backend=rlk-triton"]) == 1
    assert "1 missing_metric, 1 new_metric, 2 pass" in capsys.readouterr().out  # ratio_kl only in A now


def test_bad_selectors_are_usage_errors(backends_run, capsys):
    run_dir = str(latest_run_dir(backends_run))
    assert cli.main(["diff", run_dir, "--a-tag", "backend"]) == 2
    assert "--a-tag 'backend': expected KEY=VALUE" in capsys.readouterr().err
    assert cli.main(["diff", run_dir, "--a-tag", "backend=rl_engine"]) == 2
    assert "give both" in capsys.readouterr().err
    assert cli.main(["diff", run_dir, run_dir, "--a-tag", "backend=a", "--b-tag", "backend=b"]) == 2
    with pytest.raises(OptionError, match="given twice"):
        parse_selectors(["backend=a", "backend=b"], "--a-tag")
    # without the case tag, two logp metrics of one backend share name and tags: an error naming both
    run = latest_run(backends_run)
    for test in run.tests:
        for metric in test.metrics:
            del metric.tags["case"]
    with pytest.raises(OptionError, match=r"side A: metric 'logp_max_abs_err' .* both .*T8.*T64"):
        diff_tag_selections(run, {"backend": "rlk-triton"}, {"backend": "rl_engine"})


def test_table_columns_are_titled_with_the_tags(backends_run, capsys):
    run_dir = str(latest_run_dir(backends_run))
    cli.main(["diff", run_dir, "--a-tag", "backend=rlk-triton", "--b-tag", "backend=rl_engine", "--wide"])
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("metric"))
    assert header.split() == ["metric", "A:backend=rlk-triton", "B:backend=rl_engine", "delta", "band", "verdict"]


@pytest.mark.parametrize("b_tag, message", [
    ("backend=rl_engne", "--b-tag backend=rl_engne matches no metric of this run; values of 'backend' in it: "
                         "rl_engine, rlk-triton"),
    ("bakend=rl_engine", "--b-tag bakend=rl_engine matches no metric of this run; its tags: backend, "
                         "backend_version, case, dtype, op"),
])
def test_a_tag_matching_nothing_is_an_error_naming_it(backends_run, capsys, b_tag, message):
    run_dir = str(latest_run_dir(backends_run))
    assert cli.main(["diff", run_dir, "--a-tag", "backend=rlk-triton", "--b-tag", b_tag]) == 2
    assert message in capsys.readouterr().err


def test_tags_matching_separately_but_not_together_are_an_error(backends_run, capsys):
    run_dir = str(latest_run_dir(backends_run))
    assert cli.main(["diff", run_dir, "--a-tag", "backend=rlk-triton",
                     "--b-tag", "backend=rl_engine", "--b-tag", "op=grpo_loss"]) == 2
    assert "--b-tag backend=rl_engine,op=grpo_loss: each tag matches metrics, but no metric has all of them" \
        in capsys.readouterr().err


def test_an_error_within_the_tolerance_is_no_regression_from_zero(rlk_pytester, capsys):
    """The band of an A/B of errors is the op's tolerance (recorded with the metric): 0 -> 1.9e-6
    stays within it, where the default error band (rel 1.0 of 0) would call it a regression."""
    rlk_pytester.makepyfile(**{"suites/op/test_tol": """
import pytest

@pytest.mark.parametrize("backend, err", [("rlk-triton", 0.0), ("liger", 1.9e-6)])
def test_op(rlk_metrics, backend, err):
    rlk_metrics.record("logp_max_abs_err", err, direction="lower_is_better", space="error",
                       tags={"backend": backend, "op": "logp"}, gate=False,
                       band={"abs_floor": 1e-4, "source": "kernels.tolerances logp bf16: atol 0.0001"})
"""})
    rlk_pytester.runpytest().assert_outcomes(passed=2)
    run_dir = str(latest_run_dir(rlk_pytester))
    capsys.readouterr()
    assert cli.main(["diff", run_dir, "--a-tag", "backend=rlk-triton", "--b-tag", "backend=liger"]) == 0
    out = capsys.readouterr().out
    assert "1 pass" in out
    assert "band source: kernels.tolerances logp bf16: atol 0.0001" in out


UNSUPPORTING = """
import pytest

# liger declares the fwdbwd cases unsupported (forward-only), as suites/op/test_backends.py skips them
@pytest.mark.parametrize("backend", ["rlk-triton", "liger"])
@pytest.mark.parametrize("case", ["T8-fwd", "T8-fwdbwd", "T64-fwdbwd"])
def test_logp(rlk_metrics, backend, case):
    if backend == "liger" and case.endswith("fwdbwd"):
        pytest.skip("liger/0.8.5: Liger's fused_selective_log_softmax is forward-only (torch.no_grad)")
    tags = {"backend": backend, "backend_version": "1", "op": "logp", "case": case}
    names = ("logp_max_abs_err",) if backend == "liger" else ("logp_max_abs_err", "dlogits_max_abs_err")
    for name in names:  # liger returns no gradient: its test records none and passes
        rlk_metrics.record(name, 1e-6, direction="lower_is_better", space="error", tags=tags, gate=False)
"""


def test_metrics_a_backend_does_not_support_are_unsupported_named_once_and_pass(rlk_pytester, capsys):
    rlk_pytester.makepyfile(**{"suites/op/test_unsupporting": UNSUPPORTING})
    rlk_pytester.runpytest().assert_outcomes(passed=4, skipped=2)
    run = latest_run(rlk_pytester)
    results = {r.case: r for r in diff_tag_selections(run, {"backend": "rlk-triton"}, {"backend": "liger"})}
    assert {c.verdict for c in results["case=T8-fwdbwd,op=logp"].comparisons} == {Verdict.UNSUPPORTED}
    assert {c.name: c.verdict for c in results["case=T8-fwd,op=logp"].comparisons} == {
        "logp_max_abs_err": Verdict.PASS, "dlogits_max_abs_err": Verdict.UNSUPPORTED}
    run_dir = str(latest_run_dir(rlk_pytester))
    capsys.readouterr()
    assert cli.main(["diff", run_dir, "--a-tag", "backend=rlk-triton", "--b-tag", "backend=liger"]) == 0
    out = capsys.readouterr().out
    assert "fwdbwd" not in out.split("unsupported by", 1)[0]  # not in the table
    assert out.count("forward-only") == 1
    assert "unsupported by B (backend=liger): 5 metrics of 3 groups (not a failure); why, by groups:\n" \
           "  2 x liger/0.8.5: Liger's fused_selective_log_softmax is forward-only (torch.no_grad)\n" \
           "  1 x returns no dlogits_max_abs_err (its tests pass without it)" in out
    assert "1 pass, 5 unsupported" in out


def test_counterpart_nodeid_swaps_the_whole_parameter_part():
    from pytest_rlk.tag_diff import counterpart_nodeid

    assert counterpart_nodeid("t.py::test_logp[rlk-triton-bf16]", "rlk-triton", "liger") == "t.py::test_logp[liger-bf16]"
    assert counterpart_nodeid("t.py::test_logp[bf16-rlk-triton]", "rlk-triton", "liger") == "t.py::test_logp[bf16-liger]"
    assert counterpart_nodeid("t.py::test_logp[xrlk-triton]", "rlk-triton", "liger") is None
    assert counterpart_nodeid("t.py::test_logp", "rlk-triton", "liger") is None
