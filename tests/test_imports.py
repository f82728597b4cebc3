"""The budget policies and the drafters import without the model stack (transformers, the model loaders)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["specexec.budget", "specexec.drafters"])
def test_policies_and_drafters_import_without_the_model_stack(module: str) -> None:
    # A fresh interpreter: this one has long imported everything.
    check = (
        f"import sys, {module}\n"
        "print(sorted(m for m in ('transformers', 'specexec.models') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
