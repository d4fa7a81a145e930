"""The one harness: every section plugs in through the same protocol and one parser, ``--list`` lists them."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest

from benchmarks import harness
from benchmarks.section import Section, UsageError
from benchmarks.sections import SECTIONS

EXPECTED = {"default", "conv", "attention", "onnx", "targets", "dynamic", "training", "pipeline", "zoo",
            "onnx-forms", "optimize-time", "against", "guard-overhead", "memory-reorder", "first-calls", "auto-prepare", "breaks",
            "fusions", "precision", "int8", "parallel", "parallel-scale", "throughput", "interop"}


def test_every_benchmark_is_a_section_of_the_one_registry():
    assert set(SECTIONS) == EXPECTED
    for name, section in SECTIONS.items():
        assert isinstance(section, Section) and section.name == name and section.description


def test_list_names_every_section(capsys):
    assert harness.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_section_adds_its_options_to_the_one_parser(name):
    """No section's option clashes with the harness's (argparse raises on a duplicate), and --help works."""
    parser = harness.build_parser(SECTIONS[name], SECTIONS)
    assert isinstance(parser, argparse.ArgumentParser)
    with pytest.raises(SystemExit) as exit_, contextlib.redirect_stdout(io.StringIO()) as out:
        harness.main(["--suite", name, "--help"])
    assert exit_.value.code == 0 and f"--suite {name}:" in " ".join(out.getvalue().split())


def test_the_section_gets_the_parsed_options_and_the_command():
    seen = {}

    def add(parser):
        parser.add_argument("--calls", type=int, default=1)

    def run(args):
        seen.update(vars(args))
        return 3

    sections = {"default": Section("default", "d", add, run), "demo": Section("demo", "d", add, run)}
    assert harness.main(["--calls", "5", "--suite", "demo"], sections=sections) == 3
    assert seen["calls"] == 5 and seen["suite"] == "demo" and seen["argv"] == ["--calls", "5", "--suite", "demo"]
    assert seen["command"] == "python -m benchmarks --calls 5 --suite demo"
    assert harness.main([], sections=sections) == 3 and seen["suite"] == "default"


def test_usage_errors_exit_with_status_2(capsys):
    def refuse(args):
        raise UsageError("--calls must be >= 1")

    sections = {"default": Section("default", "d", lambda p: None, refuse)}
    with pytest.raises(SystemExit) as exit_:
        harness.main([], sections=sections)
    assert exit_.value.code == 2 and "--calls must be >= 1" in capsys.readouterr().err
    for argv in (["--suite", "nope"], ["--suite", "zoo", "--bogus"], ["--suite", "zoo", "--models", "nope"]):
        with pytest.raises(SystemExit) as exit_:
            harness.main(argv)
        assert exit_.value.code == 2, argv


def test_a_timed_section_lists_its_models(capsys):
    assert harness.main(["--suite", "conv", "--list-models"]) == 0
    out = capsys.readouterr().out
    assert "hf_resnet50 " in out and "hf_bert_base " in out and "fxforge-ort " in out


@pytest.mark.parametrize("module", ["log", "section", "harness", "sections", "zoo_env"])
def test_the_harness_modules_examples_run(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(f"benchmarks.{module}"))
    assert result.attempted > 0 and result.failed == 0
