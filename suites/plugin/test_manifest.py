"""The suite commit in the run manifest: from git, or RLK_SUITE_COMMIT when a copied tree states it."""
from __future__ import annotations

import subprocess

from pytest_rlk.manifest import SUITE_COMMIT_ENV, suite_state


def test_copied_tree_takes_the_commit_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(SUITE_COMMIT_ENV, "0123abcd")
    assert suite_state(tmp_path) == ("0123abcd", None)  # dirty is unknown without git
    monkeypatch.delenv(SUITE_COMMIT_ENV)
    assert suite_state(tmp_path) == (None, None)


def test_git_gives_the_commit_unless_the_environment_states_one(tmp_path, monkeypatch):
    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t",
                               *args], check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "f.txt").write_text("x")
    git("add", "f.txt")
    git("commit", "-q", "-m", "one")
    assert suite_state(tmp_path) == (git("rev-parse", "HEAD"), False)
    (tmp_path / "f.txt").write_text("y")
    assert suite_state(tmp_path)[1] is True
    # a copied tree may carry a stale .git: the stated commit wins, dirty becomes unknown
    monkeypatch.setenv(SUITE_COMMIT_ENV, "0123abcd")
    assert suite_state(tmp_path) == ("0123abcd", None)
