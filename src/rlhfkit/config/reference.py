"""The configuration reference, docs/configuration.md, written from the dataclasses of :mod:`rlhfkit.config`
(every key's type, default per trainer kind and help), so that the page cannot drift from the code:

    rlhfkit config reference > docs/configuration.md
    python -m rlhfkit.config.reference > docs/configuration.md      # the same, without the CLI

tests/config/test_reference.py fails when the committed page differs from :func:`reference_markdown`.
"""

from __future__ import annotations

from typing import Any

from rlhfkit.config.describe import (
    Key,
    kind_default,
    required_keys,
    section_keys,
    sections,
    top_level_keys,
    type_name,
)
from rlhfkit.config.run import KIND_DEFAULTS, KIND_FORCED, KIND_SECTIONS, KINDS

REGENERATE = "rlhfkit config reference > docs/configuration.md"


def reference_markdown() -> str:
    """The whole page, as Markdown."""
    out = [
        "# Configuration reference",
        "",
        f"<!-- Generated from src/rlhfkit/config/ by `{REGENERATE}`; do not edit by hand. -->",
        "",
        "One YAML file per run; every key below can also be set on the command line as `dotted.key=value` "
        "(parsed as YAML: `1e-5`, `true`, `null`, `[a, b]`), which wins over the file. An unknown key is an "
        "error that names the key and suggests the right one (also for TRL's names, e.g. `num_generations` "
        "-> `online.group_size`).",
        "",
        "- `rlhfkit train KIND --help` lists the keys KIND reads, with KIND's defaults.",
        "- `rlhfkit config init KIND > KIND.yaml` writes them as a commented YAML file to fill in.",
        "- `rlhfkit config show KIND --config KIND.yaml [dotted.key=value ...]` checks a configuration and "
        "prints it resolved, without loading a model (exit 2 and the run's own error when it is wrong).",
        "",
        "## Sections per trainer",
        "",
        "| kind | sections read (besides `output_dir`, `seed`) | required keys |",
        "|---|---|---|",
    ]
    for kind in KINDS:
        read = ", ".join(f"[`{s}`](#{s})" for s in KIND_SECTIONS[kind])
        out.append(f"| `{kind}` | {read} | {', '.join(_code_keys(required_keys(kind)))} |")
    out += [
        "",
        "Where a kind has a default of its own, the table of the key says so; `(fixed)` marks a value the "
        "command sets and refuses to change (`train grpo` always uses the grpo estimator). "
        "REINFORCE++ is `rlhfkit train ppo online.advantage_estimator=reinforce_pp` (no critic).",
        "",
        "## Top-level keys",
        "",
        *_table(top_level_keys()),
    ]
    for name, help in sections():
        used = [kind for kind in KINDS if name in KIND_SECTIONS[kind]]
        out += ["", f"## {name}", "", help, ""]
        if used:
            out.append(f"Read by: {', '.join(f'`{k}`' for k in used)}.")
        else:
            out.append(
                "Read by no `rlhfkit train` command: a refresh needs a labeller of new pairs, which "
                "`rlhfkit quickstart --refresh-steps K` (the built-in task's simulated annotators) and "
                "Python (`rlhfkit.trainers.online.OnlineHooks.refresh_reward_model`) provide; "
                "`rlhfkit train ppo|grpo|rloo` refuses `refresh.every` > 0."
            )
        out += ["", *_table(section_keys(name))]
    return "\n".join(out) + "\n"


def _table(keys: list[Key]) -> list[str]:
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    for key in keys:
        rows.append(f"| `{key.name}` | {_cell(type_name(key.type))} | {_defaults(key)} | {_cell(key.help)} |")
    return rows


def _defaults(key: Key) -> str:
    """The field's default, then each kind that has its own: ``1; grpo, rloo: 4``."""
    by_value: dict[str, list[str]] = {}
    for kind in KINDS:
        if key.name in KIND_DEFAULTS.get(kind, {}) or key.name in KIND_FORCED.get(kind, {}):
            fixed = " (fixed)" if key.name in KIND_FORCED.get(kind, {}) else ""
            by_value.setdefault(f"`{_value(kind_default(key, kind))}`{fixed}", []).append(kind)
    text = f"`{_value(key.default)}`"
    for value, kinds in by_value.items():
        text += f"; {', '.join(kinds)}: {value}"
    return _cell(text)


def _value(value: Any) -> str:
    import yaml

    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("\n...").strip()


def _code_keys(names: list[str]) -> list[str]:
    return [" or ".join(f"`{part}`" for part in name.split(" or ")) for name in names]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


if __name__ == "__main__":
    import sys

    sys.stdout.write(reference_markdown())
