"""The ``arithmetic`` task: the problems, the exact-match and step checkers, the sloppy writer, the tokenizer."""

import random

import pytest

from rlhfkit.errors import ConfigError
from rlhfkit.tasks import TASKS, get_task
from rlhfkit.tasks import arithmetic as A

PROMPT = "Compute 7+5-3."
RIGHT = "7+5=12\n12-3=9\nanswer=9\n"


def test_registered_beside_reviews_and_splits_are_disjoint_and_seeded():
    assert set(TASKS) >= {"reviews", "arithmetic"}
    task = get_task("arithmetic", seed=0)
    train, held = task.prompts("train"), task.prompts("eval")
    assert len(held) == 512 and not set(train) & set(held)
    assert len(train) + len(held) == len(A.all_problems())
    assert get_task("arithmetic", seed=0).prompts("eval") == held
    assert get_task("arithmetic", seed=1).prompts("eval") != held
    assert task.sft_records(50) == get_task("arithmetic", seed=0).sft_records(50)
    assert task.sft_records(20) == task.sft_records(50)[:20]
    with pytest.raises(ConfigError, match="split"):
        task.prompts("test")
    with pytest.raises(ConfigError, match="carry_slip"):
        get_task("arithmetic", carry_slip=1.5)


def test_problems_by_hand():
    p = A.parse_prompt(PROMPT)
    assert p.operands == (7, 5, 3) and p.ops == ("+", "-") and p.answer == 9
    assert p.reference_lines() == ["7+5=12", "12-3=9", "answer=9"]
    assert A.parse_prompt("Compute 9-4+8-6.").answer == 7
    for problem in A.all_problems():
        assert all(0 <= v <= A.MAX_VALUE for v in problem.values())
        assert A.parse_prompt(problem.prompt) == problem
    for bad in ("Compute 7+5.", "Compute 12+5-3.", "7+5-3", "Compute 7*5-3."):
        with pytest.raises(ConfigError, match="arithmetic"):
            A.parse_prompt(bad)


@pytest.mark.parametrize(
    "response, correct, labels",
    [
        (RIGHT, True, [True, True, True]),
        ("7+5=2\n2-3=1\nanswer=1\n", False, [False, False, False]),  # dropped carry, then wrong from there on
        ("7+5=12\n12-3=8\nanswer=8\n", False, [True, False, False]),
        ("7+5=2\n12-3=9\nanswer=9\n", True, [False, False, False]),  # a slip spoils every later line
        ("7+5=12\n12-3=9\nanswer=8\n", False, [True, True, False]),
        ("answer=9\n", True, [False]),  # the right answer without the steps: exact match, no step right
        ("7+5=12\n12-3=9\nanswer=9\nanswer=9\n", True, [True, True, True, False]),  # a line too many
        ("7+5=12\n12-3=9\nanswer=9", True, [True, True, True]),  # cut before the last separator
        ("7+5=12\n12-3=9\n", False, [True, True]),  # no answer line
        ("", False, []),
    ],
)
def test_exact_match_and_step_labels_by_hand(response, correct, labels):
    assert A.is_correct(PROMPT, response) is correct
    assert A.step_labels(PROMPT, response) == labels
    assert A.exact_match_reward(prompts=[PROMPT], completions=[response]) == [1.0 if correct else 0.0]
    expected_steps = sum(labels) / len(labels) if labels else 0.0
    assert A.step_accuracy_reward(prompts=[PROMPT], completions=[response]) == [expected_steps]


def test_reward_function_conventions():
    # TRL's conversational completions, extra columns, and no opinion on a prompt of another task
    out = A.exact_match_reward(
        prompts=[PROMPT, PROMPT, "Write a positive review of the red blender."],
        completions=[[{"role": "assistant", "content": RIGHT}], "answer=8\n", RIGHT],
        answer=[9, 9, None],
    )
    assert out == [1.0, 0.0, None]
    assert A.is_valid(RIGHT) and not A.is_valid("7+5=12\nanswer=9") and not A.is_valid("hello\nanswer=9\n")


def test_writer_drops_carries_at_its_rate_and_nothing_else():
    rng = random.Random(0)
    problem = A.parse_prompt(PROMPT)
    lines = [A.write_solution(problem, rng, 0.6)[0] for _ in range(4000)]
    slips = sum(line == "7+5=2" for line in lines) / len(lines)
    assert set(lines) == {"7+5=12", "7+5=2"} and abs(slips - 0.6) < 0.03
    no_carry = A.parse_prompt("Compute 3+4-2.")
    assert all(A.write_solution(no_carry, rng, 1.0) == no_carry.reference_lines() for _ in range(50))
    task = get_task("arithmetic", carry_slip=0.0)
    assert all(A.is_correct(r["prompt"], r["completion"]) for r in task.sft_records(300))


def test_prm_records_are_labelled_by_the_step_checker():
    task = get_task("arithmetic")
    records = task.prm_records(400)
    assert all(set(r) == {"prompt", "steps", "labels"} for r in records)
    assert all(r["labels"] == A.step_labels(r["prompt"], r["steps"]) for r in records)
    wrong = sum(not all(r["labels"]) for r in records)
    assert 0.2 * len(records) < wrong < 0.9 * len(records)  # both kinds, for the PRM to tell apart


def test_orm_pairs_by_hand_chosen_right_rejected_the_writers_slip():
    task = get_task("arithmetic")
    task._splits = {"train": ["Compute 7+5-3.", "Compute 3+4-2.", "Compute 9+9-9+5."], "eval": [PROMPT]}
    pairs = task.orm_pairs(60)
    assert len(pairs) == 60 and all(set(r) == {"prompt", "chosen", "rejected"} for r in pairs)
    by_prompt = {}
    for r in pairs:
        by_prompt.setdefault(r["prompt"], set()).add((r["chosen"], r["rejected"]))
    assert by_prompt == {  # 3+4-2 carries nothing: the writer never gets it wrong, so it makes no pair
        "Compute 7+5-3.": {(RIGHT, "7+5=2\n2-3=-1\nanswer=-1\n")},
        "Compute 9+9-9+5.": {
            ("9+9=18\n18-9=9\n9+5=14\nanswer=14\n", "9+9=8\n8-9=-1\n-1+5=4\nanswer=4\n"),
            ("9+9=18\n18-9=9\n9+5=14\nanswer=14\n", "9+9=18\n18-9=9\n9+5=4\nanswer=4\n"),
        },
    }
    full = get_task("arithmetic")
    pairs = full.orm_pairs(200)
    assert pairs == get_task("arithmetic").orm_pairs(200)
    assert all(
        A.is_correct(r["prompt"], r["chosen"]) and all(A.step_labels(r["prompt"], r["chosen"])) for r in pairs
    )
    assert not any(A.is_correct(r["prompt"], r["rejected"]) for r in pairs)
    held = {r["prompt"] for r in full.orm_pairs(50, split="eval")}
    assert held <= set(full.prompts("eval"))


def test_tokenizer_writes_digits_one_token_each(tmp_path):
    task = get_task("arithmetic")
    tok = task.build_tokenizer(tmp_path / "tok")
    record = task.sft_records(1)[0]
    text = record["prompt"] + record["completion"]
    ids = tok(text)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == text
    tokens = [tok.decode([i]) for i in tok("12+19=31\nanswer=31\n", add_special_tokens=False)["input_ids"]]
    assert [t for t in tokens if any(c.isdigit() for c in t)] == list("121931" + "31")
    assert tokens.count("\n") == 2
