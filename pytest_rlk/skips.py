"""Why tests were skipped, by cause: what the rlk summary and the report count.

Every skipped record has exactly one cause, so the causes add up to pytest's own skip total
(a module skipped at collection, e.g. by ``pytest.importorskip``, counts once, as in pytest):

- ``hardware/resources``: the test's markers ask for what this machine lacks (``unserved``:
  a GPU, GPU memory, a checkpoint, a vime checkout), or its own skip names CUDA or a GPU;
- ``missing package``: an optional package (an extra of pytest-rlk, a peer library) is not
  installed: the reason says ``No module named``, ``not importable``, ``install ...``;
- ``backend capability``: a backend declares the case unsupported (reasons starting
  ``<backend>/<version>:``, or saying ``does not implement`` / ``not supported``);
- ``other``: any other reason.
"""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable

from pytest_rlk.schema import TestRecord

HARDWARE = "hardware/resources"
MISSING_PACKAGE = "missing package"
CAPABILITY = "backend capability"
OTHER = "other"
CAUSES = (HARDWARE, MISSING_PACKAGE, CAPABILITY, OTHER)

_MISSING_PACKAGE = re.compile(r"No module named|not importable|could not import|\binstall\b")
_HARDWARE = re.compile(r"\bCUDA\b|\bGPUs?\b|\bcuda\b")
_CAPABILITY = re.compile(r"^[\w.-]+/[\w.+-]+: |does not implement|not supported|unsupported")


NO_TESTS_COLLECTED, OK = 5, 0  # pytest.ExitCode's values


def exit_status(status: int, collection_skips: int, deselected: int) -> int:
    """pytest's exit status, except where nothing was collected because what the run selected was
    skipped at collection with its reason (a tier that needs torch, on a machine without it): that
    exits 0, as a GPU test skipped on a CPU does. A selection that matched nothing, or that
    deselected what was there, keeps exit 5."""
    if status == NO_TESTS_COLLECTED and collection_skips and not deselected:
        return OK
    return status


def skip_cause(test: TestRecord) -> str:
    if test.unserved:
        return HARDWARE
    reason = test.skip_reason or ""
    if _MISSING_PACKAGE.search(reason):
        return MISSING_PACKAGE
    if _HARDWARE.search(reason):
        return HARDWARE
    if _CAPABILITY.search(reason):
        return CAPABILITY
    return OTHER


_ARTICLE = re.compile(r"^(?:a|an|the)\s+", re.IGNORECASE)


def reason_key(reason: str) -> str:
    """What two wordings of one reason share: case, a leading article, runs of spaces and a
    closing full stop aside (``a device mismatch needs a CUDA device.`` and ``Device mismatch
    needs a CUDA device`` are one reason)."""
    text = " ".join(reason.split()).rstrip(".").strip()
    return _ARTICLE.sub("", text).casefold()


def skips_by_cause(tests: Iterable[TestRecord]) -> dict[str, Counter[str]]:
    """cause -> Counter of reasons, causes in :data:`CAUSES` order, only those that occurred.
    Wordings of one reason (:func:`reason_key`) count together, under the commonest wording (the
    first seen among equals)."""
    found: dict[str, dict[str, Counter[str]]] = {}  # cause -> key -> wordings
    for t in tests:
        if t.outcome == "skipped":
            reason = t.skip_reason or "(no reason given)"
            found.setdefault(skip_cause(t), {}).setdefault(reason_key(reason), Counter())[reason] += 1
    return {cause: Counter({wordings.most_common(1)[0][0]: sum(wordings.values())
                            for wordings in found[cause].values()})
            for cause in CAUSES if cause in found}


def skip_lines(tests: Iterable[TestRecord]) -> list[str]:
    """``skipped: N (cause n, ...)`` then every reason of each cause, commonest first, with counts."""
    causes = skips_by_cause(tests)
    if not causes:
        return []
    total = sum(sum(c.values()) for c in causes.values())
    lines = [f"skipped: {total} (" + ", ".join(f"{cause} {sum(c.values())}" for cause, c in causes.items()) + ")"]
    for cause, reasons in causes.items():
        common = sorted(reasons.items(), key=lambda item: (-item[1], item[0]))
        lines += [f"  {cause}: {n} x {reason}" for reason, n in common]
    return lines
