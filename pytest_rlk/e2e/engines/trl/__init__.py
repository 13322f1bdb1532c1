"""The TRL engine (`engine`): settings (`settings`), the arm's training process (`child`, with
`trainer`), and its outputs (`series`). docs/e2e-trl.md."""

from pytest_rlk.e2e.engines.trl.engine import TrlEngine

ENGINE = TrlEngine()
