"""Runnable fxforge examples: example user models (``examples.models``), scripts and notebooks."""
