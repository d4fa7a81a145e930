"""``examples/profile_compare.py`` runs and shows the folded BatchNorms gone and the fused convs in."""

import re

from examples import profile_compare


def test_profile_compare_shows_where_the_time_went(capsys):
    profile_compare.main(["resnet_cnn"])
    out = capsys.readouterr().out
    assert out.startswith("== resnet_cnn: 31 -> ") and "ridge" in out
    rows = {line.split()[0]: line.split()[1:3] for line in out.splitlines() if re.match(r"^[a-z0-9_.]+\s+\d+\s+\d+", line)}
    assert rows["batch_norm"] == ["9", "0"]  # every BatchNorm folded
    # each of the 9 convolutions is still there after: fused (fxforge.conv_pointwise), or a plain or oneDNN
    # convolution where autotune, timing on a busy machine, undid the fusion
    assert sum(int(after) for op, (_, after) in rows.items() if "conv" in op) == 9, out
    assert "verdicts:" in out
