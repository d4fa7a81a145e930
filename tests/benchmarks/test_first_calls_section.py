"""The first-calls section: its block per target, the first calls' total per row, the U-Net's extra sizes."""

from __future__ import annotations

import argparse

from benchmarks import first_calls


def size(shape, first, plans):
    return {"shape": [shape], "first_s": first, "steady_s": 0.002, "eager_s": 0.003, "plans_built": plans,
            "matches": True}


def test_the_block_names_the_target_and_totals_the_first_calls():
    runs = {"this": [{"model": "unet-sizes", "example": [[1, 3, 64, 64]], "optimize_s": 14.0, "load": 1.0,
                      "sizes": [size([2, 3, 64, 48], 20.0, 2), size([1, 3, 96, 96], 8.0, 2), size([3, 3, 32, 64], 0.01, 2)]}]}
    block = first_calls.markdown(runs, "python -m benchmarks --suite first-calls --target inductor", "inductor")
    assert block.startswith("## First calls on new sizes (issue 48, item 2), target=inductor")
    assert "`target='inductor'`" in block and "(first calls 28.01 s in all)" in block
    assert "target=" not in first_calls.markdown(runs, "cmd").splitlines()[0]


def test_the_target_option_and_the_unet_with_more_sizes():
    parser = argparse.ArgumentParser()
    first_calls.add_arguments(parser)
    assert parser.parse_args([]).target == "native"
    assert parser.parse_args(["--target", "inductor"]).target == "inductor"
    _, _, fresh = first_calls._case("unet-sizes")
    _, _, own = first_calls._case("unet")
    assert len(fresh) == len(own) + len(first_calls.MORE_IMAGE_SIZES)
    assert [tuple(f[0].shape) for f in fresh[len(own):]] == first_calls.MORE_IMAGE_SIZES
