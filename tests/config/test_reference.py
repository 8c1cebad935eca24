"""docs/configuration.md is the page :mod:`rlhfkit.config.reference` writes from the dataclasses."""

from pathlib import Path

from rlhfkit import cli
from rlhfkit.config.describe import keys
from rlhfkit.config.reference import REGENERATE, reference_markdown

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_committed_reference_is_fresh():
    assert PAGE.read_text(encoding="utf-8") == reference_markdown(), (
        f"docs/configuration.md is stale: the configuration dataclasses changed; regenerate it with `{REGENERATE}`"
    )


def test_the_reference_documents_every_key_with_its_defaults_per_kind(capsys):
    page = reference_markdown()
    for key in keys():
        assert f"| `{key.name}` |" in page, key.name
    assert "| `online.group_size` | int | `1`; grpo, rloo: `4` |" in page
    assert "`gae`; grpo: `grpo` (fixed); rloo: `rloo` (fixed)" in page
    assert cli.main(["config", "reference"]) == 0
    assert capsys.readouterr().out == page
