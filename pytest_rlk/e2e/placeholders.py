"""`${VAR}` placeholders in spec paths and planned commands.

A spec names machine-specific paths through variables (`${RLK_MODELS}/Qwen3-4B`,
`${RLK_DATA}/gsm8k/train.parquet`, `${MEGATRON_LM}`). `rlk e2e run` expands them and fails naming
the variable when one is unset; `rlk e2e plan` expands those that are set and lists the others.
`${RLK_RUN_DIR}` is never read from the environment: it stands for the run's `--out` directory in
a plan printed without one.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping

from pytest_rlk.e2e.spec import SpecError

RUN_DIR_PLACEHOLDER = "${RLK_RUN_DIR}"

# The variables the shipped specs use, each read here and nowhere else; any other `${VAR}` a spec
# names is read from the process environment by `environment_value`.
SPEC_VARIABLES: dict[str, Callable[[], str | None]] = {
    "RLK_MODELS": lambda: os.environ.get("RLK_MODELS"),
    "RLK_DATA": lambda: os.environ.get("RLK_DATA"),
    "MEGATRON_LM": lambda: os.environ.get("MEGATRON_LM"),
}

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def environment_value(name: str) -> str | None:
    """The value a spec's `${name}` expands to, or None when it is unset."""
    if name == RUN_DIR_PLACEHOLDER[2:-1]:
        return None  # the plan's stand-in for --out, whatever the environment says
    reader = SPEC_VARIABLES.get(name)
    return reader() if reader is not None else os.environ.get(name)


def placeholder_names(text: str) -> list[str]:
    return _VAR.findall(text)


def expand_placeholders(text: str, env: Mapping[str, str] | None = None, *, what: str,
                        keep_unset: bool = False) -> str:
    """Expand `${VAR}` from `env` (default: `environment_value`). An unset variable is an error
    naming it, or, with `keep_unset`, stays as written (plans)."""

    def _sub(match: re.Match[str]) -> str:
        name = match.group(1)
        value = environment_value(name) if env is None else env.get(name)
        if value is not None:
            return value
        if keep_unset:
            return match.group(0)
        raise SpecError(f"{what}: {text!r} uses ${{{name}}} but {name} is not set")

    return _VAR.sub(_sub, text)
