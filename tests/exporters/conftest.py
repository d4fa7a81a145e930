"""Make the repository root (``examples``) and the corpus folder (``models``) importable from these tests."""

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parents[1]
for _path in (str(_TESTS.parent), str(_TESTS / "corpus")):
    if _path not in sys.path:
        sys.path.insert(0, _path)
