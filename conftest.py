"""Root conftest.

The repository root is on ``sys.path`` (pytest's rootdir conftest insertion), so ``kernels`` and
``pytest_rlk`` import from this checkout even without ``pip install -e .``. The plugin is loaded
here too; when it is also installed through its ``pytest11`` entry point (named after the module),
pytest sees it is already registered and does not load it twice.

Compiled graphs: Inductor's on-disk cache (``TORCHINDUCTOR_CACHE_DIR``, else
``/tmp/torchinductor_$USER``) keys a graph by its code and inputs, not by what a custom operator's
fake implementation returns, so a graph compiled against another checkout's operators (another
residual layout) would be reused here and fail on a size assertion. A run that names no cache
directory gets its own, removed at the end; xdist workers inherit it.
"""

import os
import shutil
import tempfile

pytest_plugins = ["pytest_rlk.plugin", "pytester"]

_INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"
_own_cache: str | None = None


def pytest_configure(config):
    global _own_cache
    if not os.environ.get(_INDUCTOR_CACHE):
        _own_cache = os.environ[_INDUCTOR_CACHE] = tempfile.mkdtemp(prefix="rlk-inductor-")


def pytest_unconfigure(config):
    global _own_cache
    if _own_cache is not None:
        shutil.rmtree(_own_cache, ignore_errors=True)
        os.environ.pop(_INDUCTOR_CACHE, None)
        _own_cache = None
