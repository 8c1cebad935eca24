"""The student's and the teacher's samples side by side (``teacher_samples.jsonl`` and the report's "Student and
teacher" section): each model's own sample of the same prompt, at the same temperature, in the run and on its
page; nothing of it in a run without a teacher."""

import html
import json
import re

import torch

from rlhfkit.config import load_config
from rlhfkit.data import TokenLimits, prepare_examples
from rlhfkit.engine.seed import get_rng_state, set_rng_state
from rlhfkit.reporting.page import side_by_side_block
from rlhfkit.reporting.report import side_by_side_section
from rlhfkit.reporting.sample_file import TEACHER_SAMPLES_FILE, read_side_by_side
from rlhfkit.rollout import generate_responses
from rlhfkit.trainers.online.side_by_side import SIDE_BY_SIDE_PROMPTS, side_by_side, side_by_side_streams
from tests.trainers.online.online_fixtures import PROMPTS, make_context, write_online_problem
from tests.trainers.online.test_distill import cli, distill_overrides, write_teacher


def reference_texts(ctx, model, examples, step):
    """``model``'s response to each example, sampled in one call from the side-by-side streams of ``step``."""
    ids = torch.nn.utils.rnn.pad_sequence(
        [torch.tensor(x["prompt_ids"]).flip(0) for x in examples],
        batch_first=True,
        padding_value=ctx.tokenizer.pad_token_id,
    ).flip(1)  # left padded
    mask = torch.nn.utils.rnn.pad_sequence(
        [torch.ones(len(x["prompt_ids"]), dtype=torch.long) for x in examples], batch_first=True
    ).flip(1)
    r = generate_responses(
        model,
        ids,
        mask,
        max_new_tokens=ctx.cfg.online.response_length,
        stop_token_ids=ctx.stop_token_ids,
        pad_token_id=ctx.tokenizer.pad_token_id,
        sampling=ctx.sampling,
        streams=side_by_side_streams(ctx.cfg.seed, step, len(examples)),
    )
    rows = [row[m].tolist() for row, m in zip(r.response_ids, r.mask, strict=True)]
    return ctx.tokenizer.batch_decode(rows, skip_special_tokens=True)


def test_each_row_is_the_students_and_the_teachers_own_sample_of_its_prompt(tmp_path):
    paths = write_online_problem(tmp_path, reward_model=False)
    teacher_dir = write_teacher(tmp_path, paths, sharpness=5.0)  # samples unlike the student's
    cfg = load_config(None, distill_overrides(paths, tmp_path / "run", teacher_dir), "distill")
    ctx = make_context(cfg)
    examples = prepare_examples(cfg.data.train_file, "prompts", ctx.tokenizer, TokenLimits(16))[:4]
    rng = get_rng_state()
    rows = side_by_side(ctx, examples, 3, "eval")
    after = torch.rand(3)
    set_rng_state(rng)
    assert torch.equal(after, torch.rand(3))  # the global generators are as they were: training unchanged
    student = reference_texts(ctx, ctx.roles.actor, examples, 3)
    teacher = reference_texts(ctx, ctx.roles.teacher, examples, 3)
    assert student != teacher  # else a swap of the columns could not show
    assert [r["prompt"] for r in rows] == PROMPTS[:4]
    assert [r["student"] for r in rows] == student
    assert [r["teacher"] for r in rows] == teacher
    assert all(r["step"] == 3 and r["split"] == "eval" for r in rows)
    lengths = [len(ctx.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in student]
    assert all(r["student_length"] >= n for r, n in zip(rows, lengths, strict=True))


def test_a_distill_run_writes_both_samples_and_its_page_shows_them_side_by_side(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    paths = write_online_problem(tmp_path, reward_model=False)
    teacher_dir = write_teacher(tmp_path, paths, sharpness=5.0)
    out = tmp_path / "run"
    extra = ("train.max_steps=2", "train.eval_steps=2", f"data.eval_file={paths['prompts']}")
    assert cli(out, *distill_overrides(paths, out, teacher_dir, *extra)) == 0
    written = [json.loads(line) for line in (out / TEACHER_SAMPLES_FILE).read_text().splitlines()]
    assert [r["step"] for r in written] == [0] * SIDE_BY_SIDE_PROMPTS + [2] * SIDE_BY_SIDE_PROMPTS
    assert [r["prompt"] for r in written] == PROMPTS[:SIDE_BY_SIDE_PROMPTS] * 2  # the first held-out prompts
    # the last rows are the final student's and the teacher's own samples at step 2
    cfg = load_config(
        None,
        distill_overrides({**paths, "policy": out / "final"}, tmp_path / "again", teacher_dir),
        "distill",
    )
    ctx = make_context(cfg)
    examples = prepare_examples(paths["prompts"], "prompts", ctx.tokenizer, TokenLimits(16))
    again = side_by_side(ctx, examples[:SIDE_BY_SIDE_PROMPTS], 2, "eval")
    assert written[SIDE_BY_SIDE_PROMPTS:] == again
    # the page: one row per prompt and step, the student's text under "student", the teacher's under "teacher"
    page = (out / "report.html").read_text()
    table = re.search(r'<table id="side-by-side-table">(.*?)</table>', page, re.S).group(1)
    cells = [
        [
            html.unescape(c)
            for c in re.findall(r'<td class="?[^>]*?(?:prompt|student|teacher)"?>(.*?)</td>', row)
        ]
        for row in re.findall(r"<tr><td class=num>.*?</tr>", table, re.S)
    ]
    assert cells == [[r["prompt"], r["student"], r["teacher"]] for r in written]
    assert "## Student and teacher" in (out / "report.md").read_text()


def test_the_page_puts_each_text_under_its_own_heading_at_the_first_and_last_step(tmp_path):
    path = tmp_path / TEACHER_SAMPLES_FILE
    rows = [
        {"step": s, "split": "eval", "prompt": f"p{i}", "student": f"s{s}-{i}", "teacher": f"t{s}-{i}"}
        for s in (0, 5, 10)
        for i in range(2)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 1, "stud')  # a partial last line
    read = read_side_by_side(path)
    assert len(read) == 6 and read[0]["student_length"] is None
    block = side_by_side_block(read)
    heads = re.findall(r"<th>(.*?)</th>", block)
    assert heads == ["step", "prompt (held-out)", "student", "teacher"]
    body = re.findall(
        r'<tr><td class=num>(\d+)</td><td class="text prompt">(.*?)</td>'
        r'<td class="text student">(.*?)</td><td class="text teacher">(.*?)</td></tr>',
        block,
    )
    assert body == [(str(s), f"p{i}", f"s{s}-{i}", f"t{s}-{i}") for s in (0, 10) for i in range(2)]
    md = side_by_side_section(read)
    assert md[4] == "| step | split | prompt | student | teacher |"
    assert md[6:] == [f"| {s} | eval | p{i} | s{s}-{i} | t{s}-{i} |" for s in (0, 10) for i in range(2)] + [
        ""
    ]
    assert side_by_side_section([]) == []


def test_a_run_without_a_teacher_writes_and_shows_nothing_of_it(tmp_path, monkeypatch):
    from rlhfkit.cli import main

    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    paths = write_online_problem(tmp_path, reward_model=False)
    out = tmp_path / "run"
    args = [a for a in distill_overrides(paths, out, "x") if not a.startswith("online.teacher_model")]
    args += [f"online.reward_functions=[{paths['rewards']}:words]", "train.max_steps=1"]
    config = tmp_path / "grpo.yaml"
    config.write_text("seed: 0\n")
    assert main(["train", "grpo", "--config", str(config), *args]) == 0
    assert not (out / TEACHER_SAMPLES_FILE).exists()
    assert "side-by-side-table" not in (out / "report.html").read_text()
