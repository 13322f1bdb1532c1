"""``python -m pytest_rlk.drift``: the drift ladder command (see cli.py)."""

import sys

from pytest_rlk.drift.cli import main

# The TP=2 ranks are spawned processes that re-import this module: only the real main runs.
if __name__ == "__main__":
    sys.exit(main())
