"""Whole-file writes: the destination is the old file or the new one, never a part of either."""

import pytest

from rlhfkit.engine.atomic import atomic_write, atomic_write_text


class _Killed(Exception):
    """Stands for a crash in the middle of a write."""


def test_a_write_killed_midway_leaves_the_old_file_whole(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text("old\n", encoding="utf-8")

    def half_then_crash(tmp):
        tmp.write_text("ne", encoding="utf-8")  # part of the new content is on disk...
        raise _Killed  # ...when the process dies

    with pytest.raises(_Killed):
        atomic_write(path, half_then_crash)
    assert path.read_text(encoding="utf-8") == "old\n"
    # the next write of the same file replaces the stale temporary file and leaves none behind
    atomic_write_text(path, "new ✓\n")
    assert path.read_bytes() == "new ✓\n".encode()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
