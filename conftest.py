"""Root conftest.

The repository root is on ``sys.path`` (pytest's rootdir conftest insertion), so ``kernels`` and
``pytest_rlk`` import from this checkout even without ``pip install -e .``. The plugin is loaded
here too; when it is also installed through its ``pytest11`` entry point (named after the module),
pytest sees it is already registered and does not load it twice.
"""

pytest_plugins = ["pytest_rlk.plugin", "pytester"]
