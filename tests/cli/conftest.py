"""Fixtures of the command-line tests: a model file written outside the repository, an empty output folder."""

import pytest
from cli_helpers import USER_MODEL


@pytest.fixture
def user_model(tmp_path):
    """``user_model.py`` in a folder of its own, outside the repository (line 9: ``return self.drop(...)``)."""
    folder = tmp_path / "models"
    folder.mkdir()
    path = folder / "user_model.py"
    path.write_text(USER_MODEL)
    return path


@pytest.fixture
def out(tmp_path):
    """An empty folder for outputs (and the working directory of the command)."""
    folder = tmp_path / "out"
    folder.mkdir()
    return folder
