"""The README and docs/ as a user reads them: the commands the README shows run as written (the cheap ones: the
help forms, `config init`, and every `rlhfkit train` recipe checked by `rlhfkit config show` with the files the
README shows written out), each option a command line shows exists, CI runs the README's test command, the
README stays short, every link resolves, and the pages that point into the code (algorithms.md,
coming-from-trl.md, experiments.md's summary) name what exists."""

from __future__ import annotations

import ast
import io
import json
import os
import re
import shlex
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_BYTES = 12_000
LINKED_PAGES = [
    README,
    ROOT / "CONTRIBUTING.md",
    ROOT / "CHANGELOG.md",
    ROOT / "examples" / "README.md",
    ROOT / "benchmarks" / "README.md",
    *sorted(DOCS.glob("*.md")),
]


def code_blocks(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)


def command_lines(body: str) -> list[str]:
    """The lines of a shell block with backslash continuations joined and trailing ``# comments`` cut."""
    joined = re.sub(r"\\\n\s*", "", body)
    lines = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        lines.append(re.sub(r"\s+#\s.*$", "", line))
    return lines


def rlhfkit(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``rlhfkit ARGS`` run in this process (:func:`rlhfkit.cli.main`, which never exits) from ``cwd``."""
    from rlhfkit.cli import main

    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(cwd)
    try:
        with redirect_stdout(out), redirect_stderr(err):
            code = main(list(args))
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(["rlhfkit", *args], code, out.getvalue(), err.getvalue())


def readme_commands() -> list[str]:
    return [line for lang, body in code_blocks(README.read_text()) for line in command_lines(body)]


def test_readme_is_short():
    size = len(README.read_bytes())
    assert size <= MAX_README_BYTES, f"README.md is {size} bytes, more than {MAX_README_BYTES}"


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    targets = re.findall(r"\]\(([^)\s]+)\)", page.read_text())
    missing = []
    for target in targets:
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.exists():
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


def test_the_architecture_count_the_readme_gives_is_the_suites():
    from tests.models.tiny_architectures import ARCHITECTURES

    count = int(re.search(r"tiny models of (\d+) architectures", README.read_text()).group(1))
    assert count == len(ARCHITECTURES), (
        f"README.md says {count} architectures, the suite has {len(ARCHITECTURES)}"
    )


def test_ci_runs_the_readme_test_command_verbatim():
    tests = [line for line in readme_commands() if "pytest" in line and "setup.sh" in line]
    assert len(tests) == 1, f"README.md should show one set-up + test command, found {tests}"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests[0] in [line.strip() for line in ci], f"{tests[0]!r} is not a line of .ci/run"
    assert tests[0].startswith("./setup.sh dev "), "the test set-up asks for Chromium explicitly"


def test_readme_shows_the_two_commands_in_a_virtual_environment():
    lines = readme_commands()
    assert "./setup.sh && rlhfkit quickstart" in lines
    assert any(line.startswith("python3 -m venv ") for line in lines)


def test_setup_refuses_an_unknown_form_before_installing_anything():
    result = subprocess.run(
        ["bash", str(ROOT / "setup.sh"), "bogus"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert "unknown argument 'bogus'" in result.stderr


def _help_for(words: list[str]) -> str:
    """The help of the command a README line shows (``train`` with its kind, ``config`` with its tool)."""
    path = words[1:3] if words[1] in ("train", "config") else words[1:2]
    if path[0] == "train" and (len(path) < 2 or path[1].startswith("{")):
        path = ["train", "ppo"]
    result = rlhfkit(*path, "--help")
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_every_option_a_readme_command_shows_exists():
    lines = [line for line in readme_commands() if line.startswith("rlhfkit ")]
    assert len(lines) >= 8, lines
    for line in lines:
        words = line.split()
        shown = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", line))
        usage = _help_for(words)
        missing = sorted(flag for flag in shown if flag not in usage)
        assert not missing, f"README: `{line}` shows options that `--help` does not list: {missing}"
        for choice in re.findall(r"\[?--[\w-]+ ([a-z0-9]+(?:\|[a-z0-9]+)+)", line):
            for value in choice.split("|"):
                assert value in usage, f"README: `{line}` shows the value {value!r} that `--help` does not"


def test_every_option_a_readme_script_line_shows_exists():
    lines = [line for line in readme_commands() if line.startswith("python benchmarks/")]
    assert lines, "README.md shows how to get the offline model"
    for line in lines:
        script, *args = shlex.split(line)[1:]
        usage = subprocess.run(
            [sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        assert usage.returncode == 0, usage.stderr
        missing = [flag for flag in args if flag.startswith("--") and flag not in usage.stdout]
        assert not missing, f"README: `{line}` shows options that `--help` does not list: {missing}"


def test_the_readme_help_and_config_init_lines_run_as_written(tmp_path):
    lines = readme_commands()
    assert "rlhfkit train grpo --help" in lines
    grpo_help = rlhfkit("train", "grpo", "--help")
    assert grpo_help.returncode == 0, grpo_help.stderr
    assert "online.group_size (int, default: 4)" in grpo_help.stdout
    assert not re.search(r"^\s+(dpo|reward)\.\w+ \(", grpo_help.stdout, re.M), (
        "grpo's help lists dpo/reward keys"
    )
    init_line = next(line for line in lines if line.startswith("rlhfkit config init"))
    command, _, target = init_line.partition(" > ")
    result = rlhfkit(*shlex.split(command)[1:], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    (tmp_path / target.strip()).write_text(result.stdout)
    yaml.safe_load(result.stdout)


def _write_the_files_the_readme_shows(folder: Path) -> None:
    """reward.py from its block, one row for each data file a recipe names, in the shapes the README gives, and
    the folders of the stages the README runs first."""
    text = README.read_text()
    reward = next(body for lang, body in code_blocks(text) if lang == "python" and "def correct" in body)
    ast.parse(reward)
    (folder / "reward.py").write_text(reward)
    namespace: dict = {}
    exec(compile(reward, "README.md reward.py", "exec"), namespace)
    said = [[{"role": "assistant", "content": "It is 4."}], [{"role": "assistant", "content": "Five."}]]
    assert namespace["correct"](prompts=[None, None], completions=said, answer=["4", "4"]) == [1.0, 0.0]
    prompt_row = re.search(r"prompts\.jsonl, one row a line: (\{.*\})", text).group(1)
    (folder / "prompts.jsonl").write_text(json.dumps(json.loads(prompt_row)) + "\n")
    pair = {"prompt": "Is the sky blue?", "chosen": "Yes.", "rejected": "No."}
    (folder / "prefs.jsonl").write_text(json.dumps(pair) + "\n")
    (folder / "demos.jsonl").write_text(json.dumps({"prompt": "Hi", "completion": "Hello!"}) + "\n")
    (folder / "examples").symlink_to(ROOT / "examples")
    # the model folders the README's earlier stages write (`-> runs/recipes/sft/final`), which the pre-flight of
    # a later stage looks for: their config only, nothing here loads them
    for stage in re.findall(r"# -> (runs/recipes/\w+/final)", text):
        (folder / stage).mkdir(parents=True)
        (folder / stage / "config.json").write_text("{}")


def test_every_train_command_of_the_readme_resolves_with_config_show(tmp_path):
    """`rlhfkit config show` in place of `rlhfkit train`, as the README suggests: the recipe exists and parses,
    every key the command sets exists for its kind and has a valid value, and the required paths are given."""
    _write_the_files_the_readme_shows(tmp_path)
    trains = [
        line
        for line in readme_commands()
        if line.startswith("rlhfkit train ")
        and "--config" in line
        and not re.search(r"\[--|\{sft|FILE|\.\.\.", line)
    ]
    assert {shlex.split(line)[2] for line in trains} >= {"grpo", "dpo", "sft", "reward", "ppo"}
    assert any("reward_functions" in line for line in trains), (
        "the GRPO command on the reader's own data is checked"
    )
    for line in trains:
        args = shlex.split(line)[2:]
        result = rlhfkit("config", "show", *args, cwd=tmp_path)
        assert result.returncode == 0, f"README: `{line}` does not resolve:\n{result.stderr}"
        resolved = yaml.safe_load(result.stdout)
        assert resolved["kind"] == args[0]
        for override in args[3:]:
            key, _, value = override.partition("=")
            node = resolved
            for part in key.split("."):
                node = node[part]
            assert node == yaml.safe_load(value), f"`{line}`: {key} resolved to {node!r}"


def test_algorithms_page_names_code_and_tests_that_exist():
    text = (DOCS / "algorithms.md").read_text()
    modules = set(re.findall(r"`((?:algos|trainers|rollout|models|data|config)/[\w/]+\.py|types\.py)`", text))
    assert len(modules) >= 10
    for module in modules:
        assert (ROOT / "src" / "rlhfkit" / module).is_file(), f"algorithms.md names src/rlhfkit/{module}"
    for section in re.split(r"\n## ", text):
        tests = re.findall(r"`(tests/[\w/]+\.py)`(?: \(([^)]*)\))?", section)
        for path, names in tests:
            source = (ROOT / path).read_text()
            for name in re.findall(r"`(test_\w+)`", names):
                assert f"def {name}(" in source, f"algorithms.md: {path} has no {name}"
        for function in re.findall(r"`(?:algos|trainers|rollout|models)/[\w/]+\.py` `(\w+)`", section):
            assert re.search(rf"(def|class) {function}\b", _all_source()), f"algorithms.md: no {function}"


def _all_source() -> str:
    return "\n".join(p.read_text() for p in (ROOT / "src" / "rlhfkit").rglob("*.py"))


def trl_rows() -> str:
    """The rows of docs/coming-from-trl.md's name table, from the table the error hints use
    (``python tests/test_readme.py`` prints them)."""
    from rlhfkit.config.trl_names import _BATCH_NOTE, TRL_NAMES

    scope_names = {"online": "ppo/grpo/rloo: ", "dpo": "dpo: "}
    rows = []
    for name, scopes in TRL_NAMES.items():
        cells, notes = [], []
        for scope, (key, note) in scopes.items():
            prefix = (
                ("otherwise: " if len(scopes) > 1 else "")
                if scope == "*"
                else scope_names.get(scope, scope + ": ")
            )
            cells.append(prefix + (f"`{key}`" if key else "none"))
            if note:
                notes.append('per process; see "Batch sizes" below' if note == _BATCH_NOTE else note)
        rows.append(f"| `{name}` | {'; '.join(cells)} | {'; '.join(notes)} |")
    return "\n".join(rows)


def test_coming_from_trl_table_is_in_step_with_the_error_hints():
    from rlhfkit.config.trl_names import TRL_NAMES

    rows = {}
    for line in (DOCS / "coming-from-trl.md").read_text().splitlines():
        match = re.match(r"\| `(\w+)` \| (.*?) \|", line)
        if match:
            rows[match.group(1)] = match.group(2)
    for name, scopes in TRL_NAMES.items():
        assert name in rows, f"docs/coming-from-trl.md has no row for TRL's {name}"
        for key, _ in scopes.values():
            shown = f"`{key}`" if key else "none"
            assert shown in rows[name], f"coming-from-trl.md: {name} -> {shown} missing from {rows[name]!r}"
    assert set(rows) <= set(TRL_NAMES), f"rows the hints do not know: {sorted(set(rows) - set(TRL_NAMES))}"


def test_experiments_summary_points_at_sections_that_exist():
    text = (DOCS / "experiments.md").read_text()
    summary = text.split("## Summary", 1)[1].split("\n## ", 1)[0]
    headings = [h.lower() for h in re.findall(r"^#{2,3} (.+)$", text, re.M)]
    rows = [line for line in summary.splitlines() if line.startswith("| ") and not line.startswith("| claim")]
    assert len(rows) >= 15
    for row in rows:
        section = row.split(" | ")[1].strip().lower()
        assert any(h.startswith(section) for h in headings), f"experiments.md summary: no section {section!r}"
        verdict = row.split(" | ")[2]
        if verdict.strip() == "holds":
            # an interval that the row itself marks "(open)" is a side figure, not the verdict's evidence
            for low, high in re.findall(r"\[([+−-][\d.]+), ([+−-][\d.]+)\](?! \(open\))", row):
                low, high = (float(v.replace("−", "-")) for v in (low, high))
                assert low * high > 0, f"experiments.md summary: 'holds' beside an interval across 0: {row}"


DATA_KINDS = {
    "preferences": "preferences",
    "SFT": "sft",
    "prompts (ppo/grpo/rloo)": "prompts",
    "process supervision": "prm",
}


def test_every_row_of_the_data_table_validates_as_its_kind(tmp_path):
    """docs/data.md's format table: each example row, written to a JSON Lines file, is accepted as its kind."""
    from rlhfkit.data.readers import read_rows
    from rlhfkit.data.records import validate_rows

    table = [line for line in (DOCS / "data.md").read_text().splitlines() if line.startswith("| ")]
    checked = 0
    for line in table:
        cells = [cell.strip() for cell in line.strip("|").split(" | ")]
        if cells[0] not in DATA_KINDS:
            continue
        example = re.search(r"`(\{.*?\})`", cells[2]).group(1)
        path = tmp_path / f"row{checked}.jsonl"
        path.write_text(json.dumps(json.loads(example)) + "\n")
        records = list(validate_rows(read_rows(path), DATA_KINDS[cells[0]]))
        assert len(records) == 1, line
        checked += 1
    assert checked >= 10, f"docs/data.md's table has {checked} example rows"


SECTIONS = "model|data|train|online|refresh|reward|dpo|logging"
NOT_KEYS = {
    "online.num_generations",
    "online.generation_tp",
    "online.generation_url",
}  # named as wrong or unbuilt


def test_every_configuration_key_the_pages_name_exists():
    """A dotted key in the README or a docs page is one of docs/configuration.md's (generated from the code)."""
    keys = set(re.findall(rf"`((?:{SECTIONS})\.\w+)`", (DOCS / "configuration.md").read_text()))
    assert len(keys) > 100
    pages = [page for page in LINKED_PAGES if page.name != "configuration.md"]
    for page in pages:
        for key in set(re.findall(rf"(?<![\w./])((?:{SECTIONS})\.[a-z_]\w*)", page.read_text())):
            if key.rsplit(".", 1)[1] in {"py", "yaml", "md", "jsonl", "json"} or key in NOT_KEYS:
                continue
            assert key in keys, f"{page.relative_to(ROOT)} names {key}, which is not a configuration key"


if __name__ == "__main__":
    print(trl_rows())
