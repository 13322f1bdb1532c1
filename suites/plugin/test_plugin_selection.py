"""pytester runs: tier selection, the unknown-tier error, hardware skips, markers, options."""
from __future__ import annotations

import os

import pytest
from rlk_plugin_testing import latest_run, machine_conftest

TEST_BODY = "def test_{name}():\n    pass\n"


def _suite(pytester):
    pytester.makepyfile(**{
        "suites/op/test_o": TEST_BODY.format(name="o"),
        "suites/module/test_m": TEST_BODY.format(name="m"),
        "suites/e2e/test_e": TEST_BODY.format(name="e"),
        "suites/plugin/test_p": TEST_BODY.format(name="p"),
        "elsewhere/test_u": TEST_BODY.format(name="u"),
        "elsewhere/test_marked": "import pytest\n\n@pytest.mark.e2e\ndef test_marked():\n    pass\n",
    })


def test_default_tier_is_op_and_untiered_always_runs(rlk_pytester):
    _suite(rlk_pytester)
    result = rlk_pytester.runpytest()
    # suites/e2e, suites/module and suites/plugin are not even imported; the marked test elsewhere
    # is deselected
    result.assert_outcomes(passed=2, deselected=1)
    result.stdout.fnmatch_lines(["*= rlk =*", "tiers run: op (1 test); untiered: 1",
                                 "deselected (tier not selected): e2e 1",
                                 "not collected (tier not selected): e2e (suites/e2e/), module (suites/module/), "
                                 "plugin (suites/plugin/)"])
    run = latest_run(rlk_pytester)
    assert {t.nodeid: t.tier for t in run.tests} == {
        "suites/op/test_o.py::test_o": "op", "elsewhere/test_u.py::test_u": None}
    assert run.deselected == {"e2e": 1}


@pytest.mark.parametrize("tiers", ["e2e", "op,module"])
def test_a_tier_selection_runs_that_tier_only_not_the_plugin_tests(rlk_pytester, tiers):
    _suite(rlk_pytester)
    result = rlk_pytester.runpytest(f"--rlk-tier={tiers}")
    run = latest_run(rlk_pytester)
    assert not any(t.nodeid.startswith("suites/plugin/") for t in run.tests)
    result.stdout.fnmatch_lines(["not collected (tier not selected): *plugin (suites/plugin/)*"])


def test_the_plugin_tier_selects_the_plugin_tests(rlk_pytester):
    _suite(rlk_pytester)
    result = rlk_pytester.runpytest("--rlk-tier=plugin,op,module,e2e")
    result.assert_outcomes(passed=6)
    assert {t.nodeid: t.tier for t in latest_run(rlk_pytester).tests}["suites/plugin/test_p.py::test_p"] == "plugin"
    result.stdout.fnmatch_lines(["tiers run: plugin (1 test), op (1 test), module (1 test), e2e (2 tests); untiered: 1"])


def test_unselected_tier_directory_is_not_imported(rlk_pytester):
    rlk_pytester.makepyfile(**{
        "suites/op/test_o": TEST_BODY.format(name="o"),
        "suites/e2e/conftest": "raise RuntimeError('suites/e2e/conftest.py imported')\n",
        "suites/e2e/test_e": "raise RuntimeError('suites/e2e/test_e.py imported')\n",
    })
    result = rlk_pytester.runpytest()
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.OK


def test_path_given_inside_an_unselected_tier_is_collected_and_deselected(rlk_pytester):
    _suite(rlk_pytester)
    result = rlk_pytester.runpytest("--rlk-tier=op", "suites/e2e/test_e.py")
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED
    result.assert_outcomes(deselected=1)


def test_tier_list_selects_several(rlk_pytester):
    _suite(rlk_pytester)
    result = rlk_pytester.runpytest("--rlk-tier=module,e2e")
    result.assert_outcomes(passed=4)  # suites/op and suites/plugin are not collected
    result.stdout.fnmatch_lines(["not collected (tier not selected): op (suites/op/), plugin (suites/plugin/)"])
    assert latest_run(rlk_pytester).manifest.tiers == ["module", "e2e"]


def test_unknown_tier_is_a_usage_error(rlk_pytester):
    _suite(rlk_pytester)
    result = rlk_pytester.runpytest("--rlk-tier=op,gpu")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--rlk-tier: unknown tier 'gpu'; valid tiers: op, module, e2e, plugin*"])


HARDWARE_TESTS = """
import pytest

@pytest.mark.h200
def test_h200():
    pass

@pytest.mark.h100
@pytest.mark.gpus(2)
def test_two_h100():
    pass

@pytest.mark.gpu_mem(80)
def test_big_memory():
    pass

@pytest.mark.qwen3_4b
def test_model():
    pass

@pytest.mark.cpu
@pytest.mark.tiny
def test_cpu_tiny():
    pass
"""


def test_hardware_markers_skip_with_reasons(rlk_pytester):
    rlk_pytester.makepyfile(**{"suites/e2e/test_hw": HARDWARE_TESTS})
    result = rlk_pytester.runpytest("--rlk-tier=e2e", "--rlk-platform=cpu",
                                    "--strict-markers", "-rs")
    result.assert_outcomes(passed=1, skipped=4)
    result.stdout.fnmatch_lines_random([
        "*needs an H200 (this machine: cpu, 0 GPUs)*",
        "*needs an H100 (this machine: cpu, 0 GPUs); needs 2 GPUs (found 0)*",
        "*needs 80 GB GPU memory (found 0)*",
        "*needs checkpoint qwen3_4b under --rlk-model-root (not given)*",
        "skipped: 4 (hardware/resources 4)",
    ])
    run = latest_run(rlk_pytester)
    assert sum(t.unserved for t in run.tests) == 4


def test_dash_m_h200_on_cpu_skips_and_exits_0(rlk_pytester):
    rlk_pytester.makepyfile(**{"suites/e2e/test_hw": HARDWARE_TESTS})
    result = rlk_pytester.runpytest("--rlk-tier=e2e", "-m", "h200", "--rlk-platform=cpu", "-rs")
    assert result.ret == pytest.ExitCode.OK
    # what an H200 node runs: all but the H100-only test; this CPU machine serves the cpu test
    result.assert_outcomes(passed=1, skipped=3, deselected=1)
    result.stdout.fnmatch_lines_random(["*needs an H200 (this machine: cpu, 0 GPUs)*",
                                        "*needs 80 GB GPU memory (found 0)*"])


PLATFORM_TESTS = """
import pytest

def test_anywhere():
    pass

@pytest.mark.cpu
def test_cpu():
    pass

@pytest.mark.gpu
def test_any_gpu():
    pass

@pytest.mark.gpus(2)
def test_two_gpus():
    pass

@pytest.mark.h100
def test_h100_only():
    pass

@pytest.mark.h200
def test_h200_only():
    pass

@pytest.mark.h100
@pytest.mark.h200
def test_hopper():
    pass

@pytest.mark.bench
@pytest.mark.bench_full
@pytest.mark.gpu
def test_variants():
    pass
"""


@pytest.mark.parametrize("expr, selected", [
    ("h100", {"anywhere", "cpu", "any_gpu", "two_gpus", "h100_only", "hopper"}),
    ("h200", {"anywhere", "cpu", "any_gpu", "two_gpus", "h200_only", "hopper"}),
    ("a100", {"anywhere", "cpu", "any_gpu", "two_gpus"}),
    ("cpu", {"anywhere", "cpu"}),
    ("gpu", {"anywhere", "cpu", "any_gpu", "two_gpus", "h100_only", "h200_only", "hopper"}),
    ("gpu and not cpu", {"any_gpu", "two_gpus", "h100_only", "h200_only", "hopper"}),
    # the labelled variants' job: never in a platform's selection, selected by its own marker
    ("bench_full", {"variants"}),
    ("bench_full and h200", {"variants"}),
    ("bench", set()),
])
def test_dash_m_selects_what_that_platform_runs(rlk_pytester, expr, selected):
    rlk_pytester.makepyfile(**{"suites/op/test_plat": PLATFORM_TESTS})
    result = rlk_pytester.runpytest("-m", expr, "--rlk-platform=cpu", "--strict-markers", "-rs")
    if not selected:
        assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED
        return
    run = latest_run(rlk_pytester)
    assert {t.nodeid.split("::test_")[1] for t in run.tests} == selected
    # on this CPU machine the GPU tests among them skip, naming the hardware
    ran = {t.nodeid.split("::test_")[1] for t in run.tests if t.outcome == "passed"}
    assert ran == selected & {"anywhere", "cpu"}
    assert all(t.unserved and "needs" in t.skip_reason for t in run.tests if t.outcome == "skipped")
    assert result.ret == pytest.ExitCode.OK


def test_dash_m_h100_on_cpu_names_the_missing_hardware(rlk_pytester):
    rlk_pytester.makepyfile(**{"suites/op/test_plat": PLATFORM_TESTS})
    result = rlk_pytester.runpytest("--rlk-tier=op,module", "-m", "h100", "--rlk-platform=cpu", "-rs")
    result.assert_outcomes(passed=2, skipped=4, deselected=2)  # the H200 test and the bench_full one
    result.stdout.fnmatch_lines_random(["*test_plat.py:* needs a GPU (this machine: cpu, 0 GPUs)*",
                                        "*needs 2 GPUs (found 0)*",
                                        "*needs an H100 (this machine: cpu, 0 GPUs)*",
                                        "*needs an H100 or H200 (this machine: cpu, 0 GPUs)*"])


H100_MACHINE = machine_conftest(  # what detection reports on the lent H100
    tag="h100", detected_tag="h100", device_name="NVIDIA H100 80GB HBM3", device_count=1,
    memory_bytes=85_000_000_000, capability="9.0")


def test_cpu_override_on_a_gpu_machine_skips_exactly_like_cpu(rlk_pytester):
    """The two tests above pin --rlk-platform=cpu so they hold on the GPU machines too."""
    rlk_pytester.makeconftest(H100_MACHINE)
    rlk_pytester.makepyfile(**{"suites/e2e/test_hw": HARDWARE_TESTS})
    result = rlk_pytester.runpytest("--rlk-tier=e2e", "--rlk-platform=cpu", "-rs")
    result.assert_outcomes(passed=1, skipped=4)  # gpu_mem(80) is not served by a "cpu" platform
    result.stdout.fnmatch_lines_random(["*needs an H200 (this machine: cpu, 0 GPUs)*",
                                        "*needs 80 GB GPU memory (found 0)*"])
    platform = latest_run(rlk_pytester).manifest.platform
    assert (platform.tag, platform.detected_tag, platform.device_count) == ("cpu", "h100", 0)
    served = rlk_pytester.runpytest("--rlk-tier=e2e", "-rs")  # no override: the H100 serves more
    served.assert_outcomes(passed=2, skipped=3)


def test_dash_m_matching_nothing_still_exits_5(rlk_pytester):
    """Documented choice: the plugin does not mask "no tests collected"."""
    rlk_pytester.makepyfile(**{"suites/e2e/test_h100": "import pytest\n\n@pytest.mark.h100\ndef test_h100():\n    pass\n"})
    result = rlk_pytester.runpytest("--rlk-tier=e2e", "-m", "h200")
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED


CPU_MACHINE = machine_conftest(tag="cpu", detected_tag="cpu")  # a machine without a GPU


def test_platform_override_serves_the_marker(rlk_pytester):
    """The override names the platform; the GPU memory stays the machine's, so the machine is
    pinned here and the test holds on a GPU host too."""
    rlk_pytester.makeconftest(CPU_MACHINE)
    rlk_pytester.makepyfile(**{"suites/e2e/test_hw": HARDWARE_TESTS})
    result = rlk_pytester.runpytest("--rlk-tier=e2e", "-m", "h200", "--rlk-platform=h200")
    # the h200 test and the cpu one run; the GPU-memory and checkpoint ones still skip
    result.assert_outcomes(passed=2, skipped=2, deselected=1)
    assert latest_run(rlk_pytester).manifest.platform.tag == "h200"


def test_vime_marker_needs_vime_root(rlk_pytester, tmp_path):
    rlk_pytester.makepyfile(**{"suites/op/test_v": "import pytest\n\n@pytest.mark.vime\ndef test_v():\n    pass\n"})
    rlk_pytester.runpytest().assert_outcomes(skipped=1)
    rlk_pytester.runpytest(f"--rlk-vime-root={tmp_path}").assert_outcomes(passed=1)
    assert latest_run(rlk_pytester).manifest.vime_root == str(tmp_path)
    bad = rlk_pytester.runpytest(f"--rlk-vime-root={tmp_path / 'nope'}")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad.stderr.fnmatch_lines(["*--rlk-vime-root:*nope*is not a directory*"])


MY_BACKENDS = """
from kernels.backends.reference import make_backend as make_reference


def make():
    return make_reference()


def make_nothing():
    return 42


def make_broken():
    raise RuntimeError("no device for this backend")
"""


@pytest.fixture(scope="module")
def with_kernels():
    """The backend check imports torch: import it here, before any pytester run of this module
    starts (a module-scoped fixture is set up first). Each in-process pytester run drops the
    modules imported during it, and torch does not survive being imported twice."""
    pytest.importorskip("torch", reason="the backend checks load kernels.backends (torch)")
    import kernels.backends.reference  # noqa: F401  (what my_pkg.backends imports)


def test_backend_option_is_exported_for_the_session(rlk_pytester, with_kernels):
    rlk_pytester.makepyfile(**{"my_pkg/__init__": "", "my_pkg/backends": MY_BACKENDS, "suites/op/test_b": (
        "import os\n\ndef test_b():\n    assert os.environ['VIME_RL_KERNEL_BACKEND'] == 'my_pkg.backends:make'\n")})
    rlk_pytester.syspathinsert()
    rlk_pytester.runpytest("--rlk-backend=my_pkg.backends:make").assert_outcomes(passed=1)
    assert "VIME_RL_KERNEL_BACKEND" not in os.environ  # restored after the session
    assert latest_run(rlk_pytester).manifest.kernel_backend_option == "my_pkg.backends:make"


@pytest.mark.parametrize("tier", ["op", "module", "e2e"])
@pytest.mark.parametrize("backend, why", [
    ("nosuch_pkg.backend:make", "cannot import backend module 'nosuch_pkg.backend' (No module named 'nosuch_pkg')"),
    ("my_pkg.backends:nosuch", "backend module 'my_pkg.backends' has no attribute 'nosuch'"),
    ("my_pkg.backends:make_nothing", "backend 'my_pkg.backends:make_nothing' lacks 'id'"),
    ("my_pkg.backends:make_broken", "its factory raised RuntimeError: no device for this backend"),
    ("nosuch_backend", "unknown backend 'nosuch_backend'"),
])
def test_a_backend_that_cannot_load_is_a_usage_error_at_startup(rlk_pytester, with_kernels, tier, backend, why):
    rlk_pytester.makepyfile(**{"my_pkg/__init__": "", "my_pkg/backends": MY_BACKENDS,
                               f"suites/{tier}/test_b": "def test_b():\n    pass\n"})
    rlk_pytester.syspathinsert()
    result = rlk_pytester.runpytest(f"--rlk-tier={tier}", "--rlk-backend", backend)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: --rlk-backend {backend!r}: {why}*"])
    assert "Traceback" not in result.stderr.str()
    assert not (rlk_pytester.path / ".rlk").exists()  # nothing ran, no run was started


def test_bad_marker_argument_fails_the_test(rlk_pytester):
    rlk_pytester.makepyfile(**{"suites/op/test_bad": (
        "import pytest\n\n@pytest.mark.gpus('two')\ndef test_bad():\n    pass\n")})
    result = rlk_pytester.runpytest()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*marker gpus takes one non-negative number*"])


def test_hooks_override_platform_and_extend_summary(rlk_pytester):
    rlk_pytester.makeconftest('''
pytest_plugins = ["pytest_rlk.plugin"]
from pytest_rlk.schema import PlatformInfo

def pytest_rlk_platform(config):
    return PlatformInfo(tag="h200", detected_tag="h200", device_name="NVIDIA H200", device_count=8,
                        memory_bytes=150_000_000_000, capability="9.0")

def pytest_rlk_summary(config, run):
    return [f"custom line: {len(run.tests)} tests"]
''')
    rlk_pytester.makepyfile(**{"suites/e2e/test_hw": HARDWARE_TESTS})
    result = rlk_pytester.runpytest("--rlk-tier=e2e", "-rs")
    result.assert_outcomes(passed=3, skipped=2)  # h200, gpu_mem(80) and cpu served; h100, checkpoint not
    result.stdout.fnmatch_lines(["custom line: 5 tests"])
    assert latest_run(rlk_pytester).manifest.platform.device_count == 8


def test_every_marker_passes_strict_markers(rlk_pytester):
    from pytest_rlk.markers import MARKERS

    arguments = {"(n)": "(1)", "(gb)": "(1)", "(what)": "('a fault')"}
    decorators = ""
    for name in MARKERS:
        for placeholder, value in arguments.items():
            name = name.replace(placeholder, value)
        decorators += f"@pytest.mark.{name}\n"
    rlk_pytester.makepyfile(**{"suites/op/test_all": f"import pytest\n\n{decorators}def test_all():\n    pass\n"})
    result = rlk_pytester.runpytest("--strict-markers", "--rlk-platform=cpu", "-rs")
    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(skipped=1)  # collected (no unknown-marker error), skipped for hardware


def test_a_path_option_pytest_took_for_its_rootdir_is_a_usage_error(rlk_pytester, tmp_path_factory):
    """`--rlk-artifacts DIR` (two words) with DIR outside the project: pytest reads its
    configuration before plugin options are known, takes DIR for a test path and its rootdir,
    and never reads the project's configuration; the plugin says so and names the fix."""
    rlk_pytester.makepyprojecttoml('[tool.pytest.ini_options]\ntestpaths = ["suites"]\n')
    rlk_pytester.makepyfile(**{"suites/op/test_one": TEST_BODY.format(name="one")})
    outside = tmp_path_factory.mktemp("runs_elsewhere")
    # The project's conftest is not read here, so the plugin comes by name, as from its entry
    # point where the package is installed (a GPU host runs the checkout uninstalled).
    result = rlk_pytester.runpytest("-p", "pytest_rlk.plugin", "--rlk-artifacts", str(outside))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: --rlk-artifacts {outside}: pytest took * for a test path and its rootdir*"
                                 f"write --rlk-artifacts={outside}"])
    rlk_pytester.runpytest(f"--rlk-artifacts={outside}").assert_outcomes(passed=1)
    rlk_pytester.runpytest("--rlk-artifacts", str(rlk_pytester.path / "runs")).assert_outcomes(passed=1)  # not there yet


def _tier_skipped_at_collection(pytester):
    pytester.makepyfile(**{
        "suites/op/conftest": "import pytest\npytest.importorskip('rlk_no_such_module', reason='this tier needs it')\n",
        "suites/op/test_o": TEST_BODY.format(name="o"),
    })


def test_collect_only_names_what_a_tier_skipped_at_collection(rlk_pytester):
    """`pytest --co` makes no run: a tier whose conftest skips (torch missing) says why, not only
    `no tests collected`, and exits 0: the selection matched a tier, which was skipped with its reason."""
    _tier_skipped_at_collection(rlk_pytester)
    result = rlk_pytester.runpytest("--strict-markers", "--co")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["*= rlk =*", "skipped at collection: suites/op: this tier needs it"])


def test_a_tier_skipped_at_collection_exits_0(rlk_pytester):
    _tier_skipped_at_collection(rlk_pytester)
    result = rlk_pytester.runpytest()
    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(skipped=1)  # pytest counts the directory skipped at collection
    assert latest_run(rlk_pytester).exit_status == 0



def test_a_module_skipped_at_collection_beside_a_deselected_test_keeps_exit_5(rlk_pytester):
    rlk_pytester.makepyfile(**{
        "suites/op/test_o": "import pytest\npytest.importorskip('rlk_no_such_module')\n",
        "elsewhere/test_marked": "import pytest\n\n@pytest.mark.e2e\ndef test_marked():\n    pass\n",
    })
    result = rlk_pytester.runpytest()  # the op tier: the e2e-marked test is deselected
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED
    result.assert_outcomes(skipped=1, deselected=1)
