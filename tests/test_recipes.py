"""Every recipe of examples/recipes/ parses as it is (a Hub model and Hub data) and trains for 2 steps with the
model and the data swapped for local tiny stand-ins: the recipe's own splits, column names, reward functions
and settings, on a tiny Llama and a dataset folder shaped like the Hub dataset it names."""

import json
import random
from pathlib import Path

import pytest
import yaml

from rlhfkit import cli
from rlhfkit.config import load_config
from rlhfkit.tasks.calculator import ToolsTask
from tests.helpers import tiny_llama, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
# file -> kind
RECIPES = {
    "grpo": "grpo",
    "grpo_tools": "grpo",
    "dpo": "dpo",
    "sft": "sft",
    "sft_tools": "sft",
    "reward": "reward",
    "ppo": "ppo",
}


def conversation(user: str, assistant: str) -> list[dict]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]


# Rows in each Hub dataset's own shape: gsm8k (question, answer "... #### N"), Capybara (messages),
# ultrafeedback_binarized (chosen / rejected conversations sharing the user turn).
ROWS = {
    "openai/gsm8k": [
        {"question": q, "answer": f"two and two . #### {a}"}
        for q, a in [("one two", "3"), ("two two", "4"), ("the cat", "1"), ("five six", "11")] * 2
    ],
    "trl-lib/Capybara": [
        {"messages": conversation(u, a)}
        for u, a in [
            ("hello", "world ."),
            ("the cat", "sat on a mat ."),
            ("one two", "three ."),
            ("yes", "no ."),
        ]
        * 2
    ],
    "trl-lib/ultrafeedback_binarized": [
        {
            "chosen": conversation(u, good),
            "rejected": conversation(u, bad),
            "score_chosen": 8.0,
            "score_rejected": 2.0,
        }
        for u, good, bad in [
            ("hello", "world .", "bad !"),
            ("the cat", "sat .", "no"),
            ("one two", "three .", "ten"),
        ]
        * 2
    ],
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipe-models")
    tokenizer = tiny_tokenizer(chat_template=True)
    ids = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    folders = {"policy": root / "policy", "reward": root / "reward", "tools_policy": root / "tools_policy"}
    tiny_llama(seed=0, **ids).save_pretrained(folders["policy"])
    tiny_llama("scalar", seed=1, **ids).save_pretrained(folders["reward"])
    for folder in (folders["policy"], folders["reward"]):
        tokenizer.save_pretrained(folder)
    # a recipe with tools needs a template that writes the model's turns verbatim (Qwen2.5's does): the tools
    # task's tokenizer stands in for it
    tools_tokenizer = ToolsTask(seed=0, num_train_prompts=8, num_eval_prompts=2).build_tokenizer()
    tiny_llama(
        seed=0,
        vocab_size=len(tools_tokenizer),
        pad_token_id=tools_tokenizer.pad_token_id,
        max_position_embeddings=512,  # room for sft_tools' conversations
    ).save_pretrained(folders["tools_policy"])
    tools_tokenizer.save_pretrained(folders["tools_policy"])
    return folders


def stand_in_dataset(recipe: dict, folder: Path) -> Path:
    """A DatasetDict folder with the recipe's splits, in the shape (and column names) of its Hub dataset; a
    file of the repository (a recipe's own data) is used as it is."""
    import datasets

    data = recipe["data"]
    if (ROOT / data["train_file"]).is_file():
        return ROOT / data["train_file"]
    rows = ROWS[data["train_file"]]
    splits = {data.get("train_split", "train"): rows}
    if data.get("eval_split"):
        splits[data["eval_split"]] = rows[:3]
    datasets.DatasetDict({name: datasets.Dataset.from_list(r) for name, r in splits.items()}).save_to_disk(
        str(folder)
    )
    return folder


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_parses_and_trains_two_steps_on_stand_ins(name, models, tmp_path, monkeypatch, capsys):
    path = ROOT / "examples" / "recipes" / f"{name}.yaml"
    kind = RECIPES[name]
    recipe = yaml.safe_load(path.read_text())
    as_written = load_config(path, [], kind)  # the recipe itself, Hub names and all, is a valid configuration
    assert "/" in recipe["model"]["name_or_path"]  # a Hub name, or (ppo, grpo_tools) an earlier recipe's run
    monkeypatch.chdir(ROOT)  # reward functions are named from the repository root, as the recipes say
    out = tmp_path / "run"
    overrides = [
        f"output_dir={out}",
        f"model.name_or_path={models['tools_policy' if uses_tools(recipe) else 'policy']}",
        f"data.train_file={stand_in_dataset(recipe, tmp_path / 'data')}",
        "data.dataset_config=null",
        "data.max_prompt_length=16",
        "train.max_steps=2",
        "train.batch_size=4",
        "train.micro_batch_size=2",
        "logging.progress_bar=false",
    ]
    if kind in ("ppo", "grpo", "rloo"):
        overrides += ["online.response_length=6"]
        if recipe["online"].get("reward_model"):
            overrides.append(f"online.reward_model={models['reward']}")
        if recipe["online"].get("num_minibatches", 1) > 4:
            overrides.append("online.num_minibatches=4")
    elif uses_tools(recipe):  # a question, a call, its result and the answer
        overrides += ["data.max_prompt_length=128", "data.max_length=256"]
    else:
        overrides += ["data.max_length=40"]
    assert cli.main(["train", kind, "--config", str(path), *overrides]) == 0, capsys.readouterr().err
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 2 and (out / "final").is_dir()
    saved = load_config(out / "config.yaml", [], kind)
    # the run trained with the recipe's own settings, only the sizes swapped
    assert saved.train.learning_rate == as_written.train.learning_rate
    assert saved.data.columns == as_written.data.columns and saved.data.tools == as_written.data.tools
    for key in (
        "group_size",
        "kl_coef",
        "kl_in_loss",
        "reward_functions",
        "ppo_epochs",
        "advantage_estimator",
        "tools",
        "max_turns",
    ):
        assert getattr(saved.online, key) == getattr(as_written.online, key), key


def uses_tools(recipe: dict) -> bool:
    return bool(recipe.get("online", {}).get("tools") or recipe["data"].get("tools"))


def test_the_tool_demonstrations_are_the_scripts_and_train_the_calls(tmp_path):
    """tool_demos.jsonl is what tool_demos.py writes, and each row's call turn is trained as the call format
    the episodes read, with the calculator's own result after it."""
    import sys

    from rlhfkit.data import TokenLimits, prepare_examples
    from rlhfkit.data.tool_calls import format_call
    from rlhfkit.rollout.tools import Toolbox

    sys.path.insert(0, str(ROOT / "examples" / "recipes"))
    try:
        import tool_demos
    finally:
        sys.path.pop(0)
    path = ROOT / "examples" / "recipes" / "tool_demos.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rng = random.Random(0)  # tool_demos.main's seed
    assert rows == [tool_demos.demonstration(rng) for _ in rows]
    tokenizer = ToolsTask(seed=0, num_train_prompts=8, num_eval_prompts=2).build_tokenizer()
    schemas = tuple(json.dumps(s) for s in Toolbox.load(["rlhfkit.tasks.calculator:calculator"]).schemas)
    examples = prepare_examples(path, "sft", tokenizer, TokenLimits(512, 1024, tools=schemas))
    for row, example in list(zip(rows, examples, strict=True))[:16]:
        function = row["messages"][1]["tool_calls"][0]["function"]
        ids = example["completion_ids"]
        trained = tokenizer.decode(ids[: min(example["completion_skip"])], skip_special_tokens=False)
        assert trained == format_call("calculator", function["arguments"]) + tokenizer.eos_token
        assert f"<|tool|>{row['messages'][2]['content']}\n" in tokenizer.decode(
            ids, skip_special_tokens=False
        )


def test_the_gsm8k_reward_reads_the_final_answer(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "recipes"))
    from gsm8k_reward import correct

    answers = ["Natalia sold 48/2 = 24 clips.\n#### 72", "#### 1,234", "#### 5"]
    completions = ["so 48 + 24 = 72.", "The answer is 1234", [{"role": "assistant", "content": "6"}]]
    assert correct(prompts=["p"] * 3, completions=completions, answer=answers) == [1.0, 1.0, 0.0]
