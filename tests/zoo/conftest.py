"""The zoo runs in its own environment (``make zoo``, ``.venv-zoo`` with torchvision and timm); in the main
environment, which has neither, its tests are skipped. torchvision's op schemas are declared before anything
imports it (see :func:`benchmarks.zoo.define_torchvision_op_schemas`)."""

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from benchmarks.zoo import define_torchvision_op_schemas

define_torchvision_op_schemas()
