"""``examples/profile_compare.py`` runs and shows the folded BatchNorms gone and the fused convs in."""

import re

from examples import profile_compare


def test_profile_compare_shows_where_the_time_went(capsys):
    profile_compare.main(["resnet_cnn"])
    out = capsys.readouterr().out
    assert out.startswith("== resnet_cnn: 31 -> ") and "ridge" in out
    rows = {line.split()[0]: line.split()[1:3] for line in out.splitlines() if re.match(r"^[a-z_.]+\s+\d+\s+\d+", line)}
    assert rows["batch_norm"] == ["9", "0"]  # every BatchNorm folded
    assert int(rows.get("fxforge.conv_pointwise", ["0", "0"])[1]) > 0 or rows["conv2d"] == ["9", "9"]  # fused, or autotune undid it
    assert "verdicts:" in out
