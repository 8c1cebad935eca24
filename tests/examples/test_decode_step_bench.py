"""benchmarks/decode_step.py: one small cell of its grid runs end to end on the tiny model (the compiled decode is
left out: its first call compiles for tens of seconds) and gives a row per decode with a positive step time; a second call with the same ``--out``
measures nothing again."""

from __future__ import annotations

import sys

from tests.examples.loader import ROOT, load_example


def test_smoke_cell_gives_a_row_per_decode(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # as when run as a script from benchmarks/
    bench = load_example("decode_step", ROOT / "benchmarks")
    rows = bench.main(["--smoke", "--decodes", "dynamic,static", "--threads", "1", "--out", str(tmp_path)])
    assert [row["decode"] for row in rows] == ["dynamic", "static"]
    assert all(row["step_seconds"] > 0 and row["floor_seconds"] > 0 for row in rows)
    assert (tmp_path / "decode_step.json").is_file()

    def measured_again(*_args, **_kwargs):
        raise AssertionError("a cell already in --out was measured again")

    monkeypatch.setattr(bench, "timed", measured_again)  # the grid resumes: nothing left to measure
    again = bench.main(["--smoke", "--decodes", "dynamic,static", "--threads", "1", "--out", str(tmp_path)])
    assert again == rows
    sys.modules.pop("generation_profile", None)
