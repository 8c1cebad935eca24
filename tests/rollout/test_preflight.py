"""The pre-flight (:mod:`rlhfkit.rollout.preflight`): each mistake that stops a run before its first model load
stops `rlhfkit config show` with the same message, exit 2, in seconds, and `rlhfkit train` with it too, with
nothing loaded and nothing written."""

import json
import time

import pytest

from rlhfkit import cli
from rlhfkit.data import load_dataset_records
from rlhfkit.errors import ConfigError, DataError
from rlhfkit.rollout.preflight import check_rows, preflight, row_keywords

REWARDS = """
def correct(prompts, completions, answer, **kwargs):
    return [float(answer_ in c) for c, answer_ in zip(completions, answer)]

def by_level(prompts, completions, level=0, **kwargs):
    return [0.0 for _ in completions]
"""
TOOLS = '''
def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b
'''
ENVIRONMENT = '''
class Counter:
    def reset(self, prompt, start, **kwargs):
        self.value = int(start)
        return None

    def step(self, by: int) -> int:
        """Count on.

        Args:
            by: how much to add
        """
        self.value += by
        return self.value

    def get_reward(self) -> float:
        return float(self.value)
'''


@pytest.fixture
def problem(tmp_path, monkeypatch):
    """A folder with a model folder (its config only: nothing here loads it), prompts with an answer column,
    reward functions, a tool and an environment; the working folder for relative names."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "policy").mkdir(parents=True)
    (tmp_path / "models" / "policy" / "config.json").write_text("{}")
    rows = [{"prompt": f"what is {i} + 1?", "answer": str(i + 1), "start": i} for i in range(6)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "rewards.py").write_text(REWARDS)
    (tmp_path / "tools.py").write_text(TOOLS)
    (tmp_path / "env.py").write_text(ENVIRONMENT)

    def nothing_loads(*args, **kwargs):
        raise AssertionError("a model or tokenizer was loaded")

    monkeypatch.setattr("rlhfkit.models.loading._load", nothing_loads)
    return tmp_path


def base(problem, *extra):
    return [
        f"output_dir={problem / 'run'}",
        "model.name_or_path=models/policy",
        "data.train_file=prompts.jsonl",
        "online.reward_functions=rewards.py:correct",
        *extra,
    ]


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


# (what is wrong, how it is set up: extra overrides and files to write, words of the run's own error)
CASES = {
    "missing data.train_file": (["data.train_file=prompt.jsonl"], {}, "prompt.jsonl: file not found"),
    "missing data.eval_file": (["data.eval_file=held.jsonl"], {}, "held.jsonl: file not found"),
    "malformed JSONL": (
        ["data.train_file=bad.jsonl"],
        {"bad.jsonl": [{"prompt": "a", "answer": "1"}, '{"prompt": "b", "answer": ']},
        "bad.jsonl, line 2: not valid JSON",
    ),
    "a row that is not a prompt row": (
        ["data.train_file=bad.jsonl"],
        {"bad.jsonl": [{"prompt": "a", "answer": "1"}, {"question": "b", "answer": "2"}]},
        "bad.jsonl, line 2, field 'prompt': is missing",
    ),
    "reward function needs a column the data lacks": (
        ["data.train_file=bare.jsonl"],
        {"bare.jsonl": [{"prompt": "a"}, {"prompt": "b"}]},
        "online.reward_functions[0]: reward function 'correct' requires 'answer'",
    ),
    "one row lacks the reward function's column": (
        ["data.train_file=holes.jsonl"],
        {
            "holes.jsonl": [{"prompt": "a", "answer": "1"}] * 3
            + [{"prompt": "b"}]
            + [{"prompt": "c", "answer": "2"}]
        },
        "holes.jsonl, line 4, field 'answer': the row has no 'answer', which reward function 'correct' "
        "(online.reward_functions[0]) takes without a default",
    ),
    "one held-out row lacks it": (
        ["data.eval_file=held.jsonl"],
        {"held.jsonl": [{"prompt": "a", "answer": "1"}, {"prompt": "b"}]},
        "held.jsonl, line 2, field 'answer': the row has no 'answer'",
    ),
    "reward .py file that does not exist": (
        ["online.reward_functions=reward.py:correct"],
        {},
        "online.reward_functions[0]: file not found: reward.py (from 'reward.py:correct')",
    ),
    "reward function that does not exist": (
        ["online.reward_functions=[rewards.py:correct, rewards.py:corect]"],
        {},
        "online.reward_functions[1]: 'rewards.py' has no attribute 'corect'",
    ),
    "tool function that does not exist": (
        ["online.tools=tools.py:sub"],
        {},
        "online.tools: 'tools.py' has no attribute 'sub' (from 'tools.py:sub')",
    ),
    "tool file that does not exist": (
        ["online.tools=tool.py:add"],
        {},
        "online.tools: file not found: tool.py",
    ),
    "environment reset needs a column a row lacks": (
        ["online.environment=env.py:Counter", "data.train_file=nostart.jsonl"],
        {"nostart.jsonl": [{"prompt": "a", "answer": "1", "start": 0}, {"prompt": "b", "answer": "2"}]},
        "nostart.jsonl, line 2, field 'start': the row has no 'start', which the environment's reset() "
        "(online.environment) takes without a default",
    ),
    "missing model folder": (
        ["model.name_or_path=models/polcy"],
        {},
        "model.name_or_path: model folder not found: models/polcy (does not exist); did you mean 'models/policy'?",
    ),
    "missing reward model folder": (
        ["online.reward_model=./runs/reward/final"],
        {},
        "online.reward_model: model folder not found: ./runs/reward/final (does not exist)",
    ),
    "a folder that is not a model": (
        ["model.name_or_path=models"],
        {},
        "model.name_or_path: models holds no config.json",
    ),
    "a name that is neither a folder nor a Hub name": (
        ["model.name_or_path=my model"],
        {},
        "model.name_or_path: model 'my model' is neither a local folder nor a Hub model name",
    ),
    "chat template file that does not exist": (
        ["data.chat_template=template.jinja"],
        {},
        "data.chat_template: 'template.jinja' is neither a Jinja template",
    ),
}


def run_both(problem, capsys, overrides):
    """(exit code, error line, seconds) of `config show grpo`, then the same of `train grpo`."""
    out = []
    for command in (["config", "show", "grpo"], ["train", "grpo", "--config", str(problem / "c.yaml")]):
        start = time.perf_counter()
        code = cli.main([*command, *overrides])
        seconds = time.perf_counter() - start
        errors = [
            line for line in capsys.readouterr().err.splitlines() if line.startswith("rlhfkit: error: ")
        ]
        out.append((code, errors, seconds))
    return out


def test_each_mistake_stops_config_show_with_the_runs_own_error_in_seconds(problem, capsys):
    (problem / "c.yaml").write_text("seed: 0\n")
    assert cli.main(["config", "show", "grpo", *base(problem)]) == 0  # the problem itself passes
    assert "6 data rows read" in capsys.readouterr().out
    for name, (extra, files, words) in CASES.items():
        for file, rows in files.items():
            write_jsonl(problem / file, rows)
        (show, show_error, seconds), (train, train_error, _) = run_both(
            problem, capsys, base(problem, *extra)
        )
        assert show == 2 and len(show_error) == 1, (name, show_error)
        assert words in show_error[0], (name, show_error[0])
        assert train == 2 and train_error == show_error, (name, train_error)  # the run's own message
        assert seconds < 5, (name, seconds)
        assert not (problem / "run").exists(), name  # nothing written


def test_a_hub_dataset_is_not_downloaded_by_config_show(problem, capsys):
    assert cli.main(["config", "show", "grpo", *base(problem, "data.train_file=someone/prompts")]) == 0
    out = capsys.readouterr().out
    assert "# not read (a Hub dataset: the run downloads it): someone/prompts" in out
    assert "0 data rows read" in out


def test_preflight_returns_what_it_read_and_checks_every_kind(problem):
    from rlhfkit.config import load_config

    cfg = load_config(
        None, base(problem, "online.tools=tools.py:add", "data.eval_file=prompts.jsonl"), "grpo"
    )
    checked = preflight(cfg)
    assert len(checked.records) == len(checked.heldout) == 6 and checked.records[0]["answer"] == "1"
    assert [name for name, _ in checked.functions] == ["correct"] and checked.toolbox.names == ["add"]
    write_jsonl(problem / "pairs.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "a"}])
    dpo = load_config(
        None, [f"output_dir={problem / 'd'}", "model.name_or_path=m", "data.train_file=pairs.jsonl"], "dpo"
    )
    with pytest.raises(DataError, match="pairs.jsonl, line 2, field 'chosen'"):
        preflight(dpo)
    with pytest.raises(ConfigError, match="dpo.reference_model: model folder not found: ./ref"):
        preflight(
            load_config(
                None,
                [
                    f"output_dir={problem / 'd'}",
                    "model.name_or_path=m",
                    "data.train_file=pairs.jsonl",
                    "dpo.reference_model=./ref",
                ],
                "dpo",
            )
        )


def test_row_checks_need_the_key_and_let_a_null_through(tmp_path):
    path = tmp_path / "p.jsonl"
    write_jsonl(path, [{"prompt": "a", "answer": None}, {"prompt": "b", "answer": "2"}])
    records = load_dataset_records(path, "prompts")
    check_rows([records], {"answer"}, "f")  # null: passed to the function as None, on purpose
    with pytest.raises(DataError, match=r"line 1, field 'level'.*which f takes without a default"):
        check_rows([records], {"answer", "level"}, "f")
    with pytest.raises(DataError, match=r"^the prompt data, row 1, field 'answer': the row has no 'answer'"):
        check_rows([[{"answer": 1}, {"prompt": "b"}]], {"answer"}, "f")  # rows given in memory

    def fn(prompts, completions, completion_ids, answer, level=1, environments=None, **kwargs):
        return []

    assert row_keywords(fn) == {"answer"}
