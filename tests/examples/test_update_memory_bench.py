"""benchmarks/update_memory.py: the probe behind docs/performance.md's "the update's temporaries" runs end to
end on a tiny Llama folder in each configuration it offers, and says which one it measured."""

from __future__ import annotations

import pytest

from tests.examples.loader import ROOT, load_example
from tests.helpers import tiny_llama


@pytest.mark.parametrize(
    "flags, label",
    [
        ((), "LoRA fused, entropy a value"),
        (("--peft-forward", "--entropy-grad"), "LoRA peft forward, entropy with grad"),
        (("--heap", "--trim-every", "1"), "malloc_trim every 1 layers"),
    ],
)
def test_the_update_memory_probe_runs_each_configuration(tmp_path, capsys, flags, label):
    tiny_llama().save_pretrained(tmp_path / "model")
    bench = load_example("update_memory", ROOT / "benchmarks")
    args = ["--model", str(tmp_path / "model"), "--threads", "1", "--passes", "2"]
    bench.main(args + ["--prompt", "5", "--response", "6", *flags])
    out = capsys.readouterr().out
    assert "2 forward + backward passes of 8 x 11 tokens, 1 threads" in out and label in out
    assert ("free in heap" in out) == ("--heap" in flags)
