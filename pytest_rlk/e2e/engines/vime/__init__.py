"""The vime engine (`engine`): settings (`settings`), train.py commands (`commands`), stdout
metric parser (`log`). docs/e2e-vime.md."""

from pytest_rlk.e2e.engines.vime.engine import VimeEngine

ENGINE = VimeEngine()
