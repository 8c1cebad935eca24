"""On-policy distillation through the online loop's other paths: a LoRA student, bf16,
multi-turn tool episodes, checkpoint and resume, and the report page and headline. The vLLM backend's and the
multi-process runs' distillation tests sit beside their paths' own tests (test_online_vllm.py,
tests/distributed/)."""

import pytest
import torch
from safetensors.torch import load_file

from rlhfkit.config import load_config
from rlhfkit.data import TokenLimits, prepare_examples
from rlhfkit.engine.metrics_writer import read_metrics
from rlhfkit.reporting.headline import headline_keys
from rlhfkit.reporting.panels import PANEL, line_plots
from rlhfkit.reporting.runs import Run, fmt
from rlhfkit.trainers.online.collect import prompt_batch, sample_rollout, score_rollout, take_scores
from rlhfkit.trainers.online.shaping import shape_rollout
from tests.helpers import tiny_llama
from tests.trainers.online.online_fixtures import make_context, write_online_problem
from tests.trainers.online.test_distill import (
    cli,
    distill_overrides,
    teacher_logprobs_by_hand,
    write_teacher,
)
from tests.trainers.online.test_tools_online import (
    check_rollout_rows,
    run_capturing,
    scripted_rollout,
    tools_config,
    tools_overrides,
    write_tools_problem,
)


def first_rollout(ctx, cfg):
    """Stages 1 and 2 of the first rollout, the actor's log-probs read by its own forward."""
    examples = prepare_examples(cfg.data.train_file, "prompts", ctx.tokenizer, TokenLimits(16))
    batch = prompt_batch(ctx, examples, 1)
    rollout = sample_rollout(ctx, batch, step=1, actor_forward=True)
    take_scores(rollout, score_rollout(ctx, rollout, batch["records"]))
    return rollout


def teacher_kl(stats) -> float:
    total, count = stats.sums["distill/teacher_kl"]
    return float(total / count)


@torch.no_grad()
def test_a_lora_student_has_its_own_frozen_teacher_and_its_base_as_teacher_gives_zero(tmp_path):
    """LoRA: the reference is the actor with its adapter off, but the teacher is a model of its own, frozen;
    only the adapters train; the student's own base as the teacher gives a term of exactly 0 at the first
    rollout (the adapter starts as the identity)."""
    paths = write_online_problem(tmp_path, reward_model=False)
    cfg = load_config(
        None, distill_overrides(paths, tmp_path / "run", paths["policy"], "model.lora_rank=4"), "distill"
    )
    ctx = make_context(cfg)
    teacher, actor = ctx.roles.teacher, ctx.roles.actor
    assert teacher is not None and teacher is not actor and not teacher.training
    assert not any(p.requires_grad for p in teacher.parameters())
    actor_storage = {p.data_ptr() for p in actor.parameters()}
    assert not actor_storage & {p.data_ptr() for p in teacher.parameters()}  # no weight shared
    trained = [n for n, p in actor.named_parameters() if p.requires_grad]
    assert trained and all("lora" in n for n in trained), trained
    optimized = {id(p) for group in ctx.optimizers["actor"].param_groups for p in group["params"]}
    assert optimized == {id(p) for p in actor.parameters() if p.requires_grad}
    rollout = first_rollout(ctx, cfg)
    assert rollout.mask.any()
    assert torch.equal(rollout.teacher_logprobs, rollout.logprobs)
    assert teacher_kl(shape_rollout(ctx, rollout, 0.0)) == 0.0


def test_a_lora_student_distils_from_another_teacher(tmp_path):
    """The whole run with a LoRA student: the teacher's term is logged and the adapters alone move."""
    paths = write_online_problem(tmp_path, reward_model=False)
    teacher_dir = write_teacher(tmp_path, paths, sharpness=30.0)
    out = tmp_path / "run"
    extra = ("model.lora_rank=4", "train.max_steps=2", "train.save_steps=2")
    assert cli(out, *distill_overrides(paths, out, teacher_dir, *extra)) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert len(rows) == 2 and all(r["distill/teacher_kl"] > 0 for r in rows)
    trained = load_file(str(out / "checkpoints" / "step-2" / "model.actor.safetensors"))
    assert trained and all("lora" in k for k in trained), list(trained)  # the checkpoint's trained tensors
    initial = load_file(str(paths["policy"] / "model.safetensors"))
    final = load_file(str(out / "final" / "model.safetensors"))  # the adapters merged in
    assert any(not torch.equal(initial[k], final[k]) for k in initial)


@pytest.mark.parametrize("lora", [0, 4])
def test_a_bf16_run_holds_the_teacher_in_bf16_like_the_reference(tmp_path, lora):
    paths = write_online_problem(tmp_path, reward_model=False)
    teacher_dir = write_teacher(tmp_path, paths)
    extra = ("model.dtype=bfloat16", f"model.lora_rank={lora}")
    cfg = load_config(None, distill_overrides(paths, tmp_path / "ctx", teacher_dir, *extra), "distill")
    ctx = make_context(cfg)
    assert {p.dtype for p in ctx.roles.teacher.parameters()} == {torch.bfloat16}
    if not lora:  # with LoRA the reference is the actor's float32 base under autocast
        assert {p.dtype for p in ctx.roles.reference.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in ctx.roles.actor.parameters() if p.requires_grad} == {torch.float32}
    out = tmp_path / "run"
    assert cli(out, *distill_overrides(paths, out, teacher_dir, *extra, "train.max_steps=1")) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert len(rows) == 1 and rows[0]["distill/teacher_kl"] != 0


def write_tools_teacher(root, paths):
    """A teacher of the tools task's vocabulary (its tokenizer and chat template), another width and seed."""
    from rlhfkit.models import load_tokenizer

    tok = load_tokenizer(str(paths["policy"]))
    teacher = tiny_llama(
        seed=7, vocab_size=len(tok), pad_token_id=tok.pad_token_id, hidden_size=48, intermediate_size=96
    )
    folder = root / "teacher"
    teacher.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@torch.no_grad()
def test_on_tool_episodes_the_teacher_reads_the_whole_row_and_scores_the_model_tokens_only(
    tmp_path, monkeypatch
):
    """Multi-turn episodes: the teacher reads each row with the tool results and the template's tokens in place
    (its log-prob of a model token after a tool result is a hand read of the whole row), and its log-probs and
    its term are 0 off the model mask: a tool or template token is never graded."""
    paths = write_tools_problem(tmp_path)
    teacher_dir = write_tools_teacher(tmp_path, paths)
    cfg = tools_config(
        paths, tmp_path / "run", f"online.teacher_model={teacher_dir}", "online.teacher_coef=0.5"
    )
    ctx, batch, rollout = scripted_rollout(cfg, monkeypatch, actor_forward=True)
    take_scores(rollout, score_rollout(ctx, rollout, batch["records"], batch["episodes"]))
    stats = shape_rollout(ctx, rollout, ctx.kl_ctl.value)
    mask, gap = rollout.mask, rollout.response_mask & ~rollout.mask
    assert check_rollout_rows(ctx.tokenizer, rollout) > 0 and gap.any()
    after_a_result = mask & (gap.long().cumsum(1) > 0)  # model tokens with a tool result before them
    assert after_a_result.any()
    by_hand = teacher_logprobs_by_hand(ctx.roles.teacher, rollout, ctx.sampling)
    torch.testing.assert_close(rollout.teacher_logprobs, by_hand, atol=1e-5, rtol=1e-5)
    assert bool((rollout.teacher_logprobs[~mask] == 0).all())
    assert bool((rollout.teacher_logprobs[after_a_result] != 0).all())
    # the rewards off the model mask are 0; on it, the KL's and the teacher's terms (+ the score at the end)
    assert bool((rollout.rewards[~mask] == 0).all())
    term = (rollout.logprobs - rollout.teacher_logprobs) * mask
    expected = -cfg.online.kl_coef * rollout.kl - 0.5 * term
    last = mask.long().cumsum(1).argmax(1)
    expected[torch.arange(rollout.batch_size), last] += rollout.scores
    torch.testing.assert_close(rollout.rewards, expected, atol=1e-6, rtol=1e-6)
    assert teacher_kl(stats) == pytest.approx(float(term.sum() / mask.sum()), rel=1e-6)


def test_distill_trains_on_tool_episodes_with_nothing_at_the_tool_tokens(tmp_path, monkeypatch):
    """`train distill` on tool episodes (the teacher alone scores): the update's rollouts hold nothing at the
    tool and template tokens, and the teacher's term is logged."""
    paths = write_tools_problem(tmp_path)
    teacher_dir = write_tools_teacher(tmp_path, paths)
    overrides = [
        s for s in tools_overrides(paths, tmp_path / "run") if not s.startswith("online.reward_functions")
    ]
    cfg = load_config(None, [*overrides, f"online.teacher_model={teacher_dir}"], "distill")
    rollouts, sampler = run_capturing(monkeypatch, cfg)
    assert len(rollouts) == 2 and sum(check_rollout_rows(sampler.tok, r) for r in rollouts) > 0
    for r in rollouts:
        gap = r.response_mask & ~r.mask
        assert gap.any()
        for name in ("logprobs", "teacher_logprobs", "rewards", "advantages"):
            assert bool((getattr(r, name)[gap] == 0).all()), name
        assert bool((r.teacher_logprobs[r.mask] != 0).all())
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 2 and all(row["distill/teacher_kl"] != 0 for row in rows)


def test_a_resumed_distill_run_ends_bit_identical(tmp_path):
    """Two rollouts, then two more after --resume from the step-2 checkpoint, give the weights, the optimizer
    and the metrics (the teacher's term among them) of four uninterrupted ones."""
    paths = write_online_problem(tmp_path, reward_model=False)
    teacher_dir = write_teacher(tmp_path, paths, sharpness=30.0)
    full, part = tmp_path / "full", tmp_path / "part"

    def args(out, steps):
        return distill_overrides(paths, out, teacher_dir, "train.save_steps=2", f"train.max_steps={steps}")

    assert cli(full, *args(full, 4)) == 0
    assert cli(part, *args(part, 2)) == 0
    assert cli(part, *args(part, 4), "--resume") == 0
    for folder, name in (
        ("final", "model.safetensors"),
        ("checkpoints/step-4", "optimizer.actor.safetensors"),
    ):
        a, b = load_file(str(full / folder / name)), load_file(str(part / folder / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (folder, name)

    def timeless(out):
        drop = ("time/", "tokens_per_second", "wall")
        return [
            {k: v for k, v in r.items() if not k.startswith(drop)}
            for r in read_metrics(out / "metrics.jsonl")
        ]

    rows = timeless(full)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and len({r["distill/teacher_kl"] for r in rows}) == 4
    assert timeless(part) == rows


def test_the_report_plots_the_teacher_kl_and_the_headline_prints_it_first(tmp_path, capsys):
    """A distill run's report has a figure of distill/teacher_kl over training, held out beside it
    (report.md and report.html), and `rlhfkit train distill` ends by printing it first -> last, first, and the
    held-out one last, without the scores of 0 nothing else gave."""
    paths = write_online_problem(tmp_path, reward_model=False)
    teacher_dir = write_teacher(tmp_path, paths, sharpness=30.0)
    out = tmp_path / "run"
    extra = ("train.max_steps=3", f"data.eval_file={paths['prompts']}", "train.eval_steps=3")
    assert cli(out, *distill_overrides(paths, out, teacher_dir, *extra)) == 0
    rows = read_metrics(out / "metrics.jsonl")
    kl = [r["distill/teacher_kl"] for r in rows if "distill/teacher_kl" in r]
    held_out = [r["eval/distill/teacher_kl"] for r in rows if "eval/distill/teacher_kl" in r]
    assert len(kl) == 3 and kl[0] != kl[-1] and len(held_out) == 2 and held_out[0] != held_out[-1]
    printed = capsys.readouterr().out.splitlines()
    at = printed.index("  first -> last logged rollout (0 -> 3):")
    assert printed[at + 1] == f"    KL to the teacher (nats / token): {fmt(kl[0])} -> {fmt(kl[-1])}"
    assert printed[-1] == (
        f"    held-out KL to the teacher (nats / token): {fmt(held_out[0])} -> {fmt(held_out[-1])}"
    )
    assert not any("score" in line for line in printed)
    title = "KL to the teacher (on-policy distillation)"
    assert (out / "report" / "teacher_kl.png").stat().st_size > 0
    assert f"## {title}\n\n![{title}](report/teacher_kl.png)" in (out / "report.md").read_text()
    assert title in (out / "report.html").read_text()


def test_a_run_with_a_teacher_beside_a_score_shows_both(tmp_path):
    """GRPO with a reward function and a teacher: the score stays first, the KL to the teacher follows the
    reference's; a run that logged no teacher KL shows none (and draws no teacher figure)."""
    rows = [
        {
            "step": s,
            "score/mean": 0.1 * s,
            "score/words": 0.1 * s,
            "kl/mean": 0.01 * s,
            "distill/teacher_kl": 3.0 / s,
        }
        for s in (1, 2)
    ]
    online = {"reward_functions": ["rewards.py:words"], "teacher_model": "teacher", "missing_eos": "none"}
    run = Run(tmp_path, "run", "grpo", rows, config={"online": online})
    assert headline_keys(run) == ["score/mean", "score/words", "kl/mean", "distill/teacher_kl"]
    spec = next(spec for spec in PANEL if spec.name == "teacher_kl")
    assert [p.name for p in line_plots([run]) if p.name == "teacher_kl"] == ["teacher_kl"]
    plain = Run(
        tmp_path, "run", "grpo", [{k: v for k, v in r.items() if k != "distill/teacher_kl"} for r in rows]
    )
    assert "distill/teacher_kl" not in headline_keys(plain)
    assert spec.name not in [p.name for p in line_plots([plain])]
    rows[-1]["eval/distill/teacher_kl"] = 2.0  # with the held-out one: last, with the held-out figures
    assert headline_keys(run)[-1] == "eval/distill/teacher_kl"


@pytest.mark.parametrize("frozen_models", ["shard", "replicate"])
def test_the_teacher_is_sharded_like_the_reference(tmp_path, frozen_models):
    """train.sharding=full_shard (FSDP2 in a process group of one, its sharded code paths): the teacher's
    weights are sharded exactly where the reference's are (train.frozen_models), frozen either way."""
    from torch.distributed.tensor import DTensor

    from rlhfkit.engine import sharded
    from rlhfkit.models import load_tokenizer
    from rlhfkit.trainers.online.roles import build_roles, shard_roles

    paths = write_online_problem(tmp_path, reward_model=False)
    teacher_dir = write_teacher(tmp_path, paths)
    extra = ("train.sharding=full_shard", f"train.frozen_models={frozen_models}")
    cfg = load_config(None, distill_overrides(paths, tmp_path / "run", teacher_dir, *extra), "distill")
    assert not torch.distributed.is_initialized()
    sharded.single_process_group("cpu")
    try:
        roles = shard_roles(
            build_roles(cfg, load_tokenizer(str(paths["policy"]))), "full_shard", frozen_models
        )
        kinds = {
            name: {isinstance(p, DTensor) for p in getattr(roles, name).parameters()}
            for name in ("actor", "reference", "teacher")
        }
        assert kinds["actor"] == {True}
        assert kinds["teacher"] == kinds["reference"] == {frozen_models == "shard"}
        assert not roles.teacher.training and not any(p.requires_grad for p in roles.teacher.parameters())
    finally:
        torch.distributed.destroy_process_group()


@torch.no_grad()
def test_evaluation_logs_the_held_out_kl_to_the_teacher(tmp_path, monkeypatch):
    """The held-out evaluation's eval/distill/teacher_kl: the mean of log pi - log pi_teacher over the held-out
    responses' tokens, the teacher's log-probs read as in training (a hand read of each row)."""
    from rlhfkit.trainers.online import metrics

    paths = write_online_problem(tmp_path, reward_model=False)
    teacher_dir = write_teacher(tmp_path, paths, sharpness=30.0)
    cfg = load_config(None, distill_overrides(paths, tmp_path / "run", teacher_dir), "distill")
    ctx = make_context(cfg)
    seen, real = [], metrics.sample_rollout

    def recorded(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(metrics, "sample_rollout", recorded)
    examples = prepare_examples(cfg.data.train_file, "prompts", ctx.tokenizer, TokenLimits(16))
    result = metrics.evaluate_prompts(ctx, examples, step=0)
    assert seen
    total, tokens = 0.0, 0
    for rollout in seen:
        by_hand = teacher_logprobs_by_hand(ctx.roles.teacher, rollout, ctx.sampling)
        torch.testing.assert_close(rollout.teacher_logprobs, by_hand, atol=1e-5, rtol=1e-5)
        total += float(((rollout.logprobs - by_hand) * rollout.mask).sum())
        tokens += int(rollout.mask.sum())
    assert result["eval/distill/teacher_kl"] == pytest.approx(total / tokens, rel=1e-5)
    assert result["eval/distill/teacher_kl"] > 0
