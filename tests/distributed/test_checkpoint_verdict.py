"""A corrupt newest sharded checkpoint on two processes (gloo): ``--resume`` falls back to the previous
complete checkpoint on each, and a checksum failure at load stops both with one line, even where only one
process sees it (:mod:`tests.distributed.checkpoint_verdict_worker`)."""

from __future__ import annotations

import json

from tests.distributed.test_data_parallel import torchrun


def test_a_corrupt_shard_falls_back_on_every_process_and_a_checksum_verdict_is_shared(tmp_path):
    proc = torchrun("-m", "tests.distributed.checkpoint_verdict_worker", str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert [r["picked"] for r in ranks] == ["step-1", "step-1"]
    assert "step-2.sharded" in proc.stderr and "resuming from the previous complete checkpoint" in proc.stderr
    for key in ("corrupt", "one_sided"):
        lines = [r[key] for r in ranks]
        assert lines[0] is not None and lines[0] == lines[1], (key, lines)
        assert "corrupt: missing, or not the size or checksum" in lines[0] and "\n" not in lines[0]
