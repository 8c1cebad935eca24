"""On-policy distillation in the online loop (`rlhfkit train distill`, ``online.teacher_model``): the teacher's
log-probs of the student's own tokens, the per-token term in the rewards, a teacher equal to the student moving
nothing, the vocabulary refusal, and the student moving toward a teacher."""

import json

import pytest
import torch
from safetensors.torch import load_file

from rlhfkit.cli import main
from rlhfkit.config import load_config
from rlhfkit.data import TokenLimits, prepare_examples
from rlhfkit.engine.metrics_writer import read_metrics
from rlhfkit.errors import ConfigError
from rlhfkit.models import distill_readout
from rlhfkit.models.sampling import processed_logits, untruncated
from rlhfkit.rollout.preflight import preflight
from rlhfkit.trainers.online import collect
from rlhfkit.trainers.online import ppo_update as ppo_update_module
from rlhfkit.trainers.online.collect import prompt_batch, sample_rollout, score_rollout, take_scores
from rlhfkit.trainers.online.shaping import shape_rollout
from tests.helpers import tiny_llama, tiny_tokenizer
from tests.trainers.online.online_fixtures import make_context, write_online_problem


def distill_overrides(paths, out, teacher, *extra):
    """A small distillation run: 4 prompts x 2 responses, 6 new tokens, no task reward."""
    return [
        f"output_dir={out}",
        f"model.name_or_path={paths['policy']}",
        f"data.train_file={paths['prompts']}",
        f"online.teacher_model={teacher}",
        "train.batch_size=4",
        "train.micro_batch_size=4",
        "train.learning_rate=1e-3",
        "train.lr_schedule=constant",
        "online.group_size=2",
        "online.response_length=6",
        "data.max_prompt_length=16",
        *extra,
    ]


def cli(out, *args):
    """``rlhfkit train distill --config <seed 0> ARGS``."""
    config = out.parent / f"{out.name}.yaml"
    config.write_text("seed: 0\n")
    return main(["train", "distill", "--config", str(config), *args])


def write_teacher(root, paths, seed=7, hidden=48, sharpness=1.0):
    """A teacher of the policy's vocabulary with other weights and another width (a bigger model in spirit);
    ``sharpness`` scales its output head (a random tiny model is near uniform, as is the student)."""
    tok = tiny_tokenizer()
    teacher = tiny_llama(
        seed=seed,
        vocab_size=len(tok),
        pad_token_id=tok.pad_token_id,
        hidden_size=hidden,
        intermediate_size=96,
    )
    with torch.no_grad():
        teacher.lm_head.weight.mul_(sharpness)
    folder = root / "teacher"
    teacher.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def teacher_logprobs_by_hand(teacher, rollout, sampling):
    """(B, T) log pi_teacher of each sampled token under the run's processing (temperature, suppressed ids),
    one row at a time from the full logits of prompt + response (no padding): the token at response position
    t is read from the logits at the position before it."""
    out = torch.zeros(rollout.mask.shape)
    for i in range(rollout.batch_size):
        prompt = rollout.query_ids[i][rollout.query_mask[i].bool()]
        n = int(rollout.response_mask[i].sum())
        response = rollout.response_ids[i, :n]
        ids = torch.cat([prompt, response])[None]
        logp = torch.log_softmax(processed_logits(teacher(input_ids=ids).logits, sampling)[0], -1)
        for t in range(n):
            out[i, t] = logp[len(prompt) + t - 1, response[t]]
    return out * rollout.mask


@torch.no_grad()
def test_teacher_scores_the_students_own_tokens_and_its_term_lands_in_the_rewards(tmp_path):
    paths = write_online_problem(tmp_path, reward_model=False)
    teacher_dir = write_teacher(tmp_path, paths)
    cfg = load_config(
        None,
        distill_overrides(
            paths, tmp_path / "run", teacher_dir, f"online.reward_functions=[{paths['rewards']}:words]"
        ),
        "grpo",  # the teacher's term beside a task reward in any run
    )
    cfg.online.teacher_coef = 0.5
    cfg.online.kl_coef = 0.1
    ctx = make_context(cfg)
    assert ctx.roles.teacher is not None and not ctx.roles.teacher.training
    assert not any(p.requires_grad for p in ctx.roles.teacher.parameters())
    examples = prepare_examples(cfg.data.train_file, "prompts", ctx.tokenizer, TokenLimits(16))
    batch = prompt_batch(ctx, examples, 1)
    rollout = sample_rollout(ctx, batch, step=1, actor_forward=True)
    take_scores(rollout, score_rollout(ctx, rollout, batch["records"]))
    mask = rollout.mask
    assert mask.any(1).all()
    expected = teacher_logprobs_by_hand(ctx.roles.teacher, rollout, ctx.sampling)
    torch.testing.assert_close(rollout.teacher_logprobs, expected, atol=1e-5, rtol=1e-5)
    stats = shape_rollout(ctx, rollout, 0.1)
    # r_t = -kl_coef * (logp - ref) - teacher_coef * (logp - teacher) (+ the score on the last real token)
    term = (rollout.logprobs - rollout.teacher_logprobs) * mask
    rewards = -0.1 * (rollout.logprobs - rollout.ref_logprobs) * mask - 0.5 * term
    last = mask.long().cumsum(1).argmax(1)
    rewards[torch.arange(rollout.batch_size), last] += rollout.scores
    torch.testing.assert_close(rollout.rewards, rewards, atol=1e-6, rtol=1e-6)
    sums = stats.sums["distill/teacher_kl"]
    assert float(sums[0] / sums[1]) == pytest.approx(float(term.sum() / mask.sum()), rel=1e-6)


def test_a_teacher_equal_to_the_student_gives_zero_and_the_student_does_not_move(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    paths = write_online_problem(tmp_path, reward_model=False)
    out = tmp_path / "run"
    assert cli(out, *distill_overrides(paths, out, paths["policy"], "train.max_steps=2")) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["distill/teacher_kl"] for r in rows] == [0.0, 0.0]
    assert not any("kl/mean" in r for r in rows)  # no KL to the reference asked for: not read, not logged
    assert all(r["reward/mean"] == 0.0 and r["loss/policy"] == 0.0 for r in rows)
    initial = load_file(str(paths["policy"] / "model.safetensors"))
    final = load_file(str(out / "final" / "model.safetensors"))
    assert all(torch.equal(initial[k], final[k]) for k in initial)
    config = (out / "config.yaml").read_text()
    assert "kind: distill" in config and "advantage_estimator: reinforce_pp" in config


def test_the_student_moves_toward_the_teacher(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    paths = write_online_problem(tmp_path, reward_model=False)
    teacher_dir = write_teacher(tmp_path, paths, sharpness=5.0)
    out = tmp_path / "run"
    extra = ("train.max_steps=30", "train.learning_rate=1e-2", "online.temperature=1.0", "train.batch_size=8")
    assert cli(out, *distill_overrides(paths, out, teacher_dir, *extra)) == 0
    kl = [r["distill/teacher_kl"] for r in read_metrics(out / "metrics.jsonl")]
    first, last = sum(kl[:5]) / 5, sum(kl[-5:]) / 5
    assert last < 0.8 * first, kl


def test_a_teacher_with_another_vocabulary_is_refused_naming_both(tmp_path):
    paths = write_online_problem(tmp_path, reward_model=False)
    teacher_dir = write_teacher(tmp_path, paths)
    vocab = json.loads((teacher_dir / "tokenizer.json").read_text())
    model_vocab = vocab["model"]["vocab"]
    a, b = sorted(model_vocab, key=model_vocab.get)[5:7]
    model_vocab[a], model_vocab[b] = model_vocab[b], model_vocab[a]  # two tokens swap their ids
    (teacher_dir / "tokenizer.json").write_text(json.dumps(vocab))
    cfg = load_config(None, distill_overrides(paths, tmp_path / "run", teacher_dir), "distill")
    with pytest.raises(ConfigError) as error:
        preflight(cfg)
    message = str(error.value)
    assert "online.teacher_model" in message and str(teacher_dir) in message
    assert str(paths["policy"]) in message and repr(a) in message and repr(b) in message


def test_distill_needs_a_teacher_and_nothing_else_scores(tmp_path, capsys):
    paths = write_online_problem(tmp_path, reward_model=False)
    args = distill_overrides(paths, tmp_path / "run", "x")
    args = [a for a in args if not a.startswith("online.teacher_model")]
    assert cli(tmp_path / "run", *args) != 0
    err = capsys.readouterr().err
    assert "online.teacher_model" in err and "Traceback" not in err


@pytest.mark.parametrize("loss", ["full_reverse_kl", "jsd"])
def test_full_vocabulary_losses_train_the_student_and_vanish_for_its_own_copy(tmp_path, monkeypatch, loss):
    """distill.loss full_reverse_kl / jsd: a loss term of the update (loss/distill), not a reward: the rewards
    stay 0, the divergence falls toward a sharp teacher, and a teacher equal to the student gives exactly 0."""
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    paths = write_online_problem(tmp_path, reward_model=False)
    teacher_dir = write_teacher(tmp_path, paths, sharpness=5.0)
    out = tmp_path / "run"
    extra = (
        f"distill.loss={loss}",
        "train.max_steps=8",
        "train.learning_rate=1e-2",
        "online.temperature=1.0",
    )
    assert cli(out, *distill_overrides(paths, out, teacher_dir, *extra)) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert all(r["reward/mean"] == 0.0 for r in rows)
    divergence = [r["loss/distill"] for r in rows]
    assert divergence[-1] < 0.8 * divergence[0], divergence
    same = tmp_path / "same"
    extra = (f"distill.loss={loss}", "train.max_steps=1")
    assert cli(same, *distill_overrides(paths, same, paths["policy"], *extra)) == 0
    assert read_metrics(same / "metrics.jsonl")[0]["loss/distill"] == 0.0
    initial = load_file(str(paths["policy"] / "model.safetensors"))
    final = load_file(str(same / "final" / "model.safetensors"))
    assert all(torch.equal(initial[k], final[k]) for k in initial)


@torch.no_grad()
def test_with_top_k_the_teacher_reads_every_sampled_token_untruncated(tmp_path):
    """A student sampling with top-k draws tokens the teacher's own top-k may not hold: truncated the same way,
    the teacher would give them probability 0 and the term would be infinite. It reads them at the temperature
    and the suppressed ids alone."""
    paths = write_online_problem(tmp_path, reward_model=False)
    teacher_dir = write_teacher(tmp_path, paths, sharpness=30.0)
    args = distill_overrides(paths, tmp_path / "run", teacher_dir, "online.top_k=8", "online.temperature=1.5")
    cfg = load_config(None, args, "distill")
    ctx = make_context(cfg)
    examples = prepare_examples(cfg.data.train_file, "prompts", ctx.tokenizer, TokenLimits(16))
    rollout = sample_rollout(ctx, prompt_batch(ctx, examples, 1), step=1, actor_forward=True)
    expected = teacher_logprobs_by_hand(ctx.roles.teacher, rollout, untruncated(ctx.sampling))
    assert torch.isfinite(rollout.teacher_logprobs).all()
    torch.testing.assert_close(rollout.teacher_logprobs, expected, atol=1e-5, rtol=1e-5)


def test_full_reverse_kl_is_refused_with_a_truncating_sampler_and_a_teacher_of_another_width(tmp_path):
    paths = write_online_problem(tmp_path, reward_model=False)
    base = distill_overrides(paths, tmp_path / "run", paths["policy"], "distill.loss=full_reverse_kl")
    with pytest.raises(ConfigError, match="distill.loss.*online.top_k=0"):
        load_config(None, [*base, "online.top_p=0.9"], "distill")
    load_config(None, [*base[:-1], "distill.loss=jsd", "online.top_p=0.9"], "distill")  # finite: allowed
    tok = tiny_tokenizer()
    wide = tiny_llama(seed=3, vocab_size=len(tok) + 16, pad_token_id=tok.pad_token_id)  # a padded table
    wide.save_pretrained(tmp_path / "wide")
    tok.save_pretrained(tmp_path / "wide")
    args = distill_overrides(paths, tmp_path / "run", tmp_path / "wide", "distill.loss=jsd")
    with pytest.raises(ConfigError, match=r"output layer has \d+ entries and the teacher's .* \d+"):
        make_context(load_config(None, args, "distill"))
    make_context(load_config(None, args[:-1], "distill"))  # the sampled reverse_kl reads one log-prob a token


@torch.no_grad()
def test_train_distill_reads_no_reference_unless_a_kl_to_it_is_asked_for(tmp_path):
    paths = write_online_problem(tmp_path, reward_model=False)
    teacher_dir = write_teacher(tmp_path, paths)
    for extra, read in (((), False), (("online.kl_coef=0.1",), True)):
        cfg = load_config(None, distill_overrides(paths, tmp_path / "run", teacher_dir, *extra), "distill")
        ctx = make_context(cfg)
        calls = []
        ctx.roles.reference.register_forward_hook(lambda *a, calls=calls: calls.append(1))
        for parameter in ctx.roles.reference.parameters():  # a reference that reads otherwise than the actor
            parameter.mul_(1.5)
        examples = prepare_examples(cfg.data.train_file, "prompts", ctx.tokenizer, TokenLimits(16))
        rollout = sample_rollout(ctx, prompt_batch(ctx, examples, 1), step=1, actor_forward=True)
        assert bool(calls) == read
        same = torch.equal(rollout.ref_logprobs, rollout.logprobs)
        assert same != read  # not read: the actor's own (a KL of exactly 0); read: the reference's


@pytest.mark.parametrize("loss, lora", [("full_reverse_kl", 0), ("jsd", 0), ("full_reverse_kl", 4)])
def test_a_full_vocabulary_update_reads_the_student_once_and_equals_the_two_pass_run(
    tmp_path, monkeypatch, loss, lora
):
    """With one on-policy update a rollout and a full-vocabulary loss, the update's own pass gives the student's
    old log-probs, its entropies and the teacher's log-probs of the sampled tokens (layout.teacher_read_in_update):
    stage 1 reads neither model and the update runs the student once a micro-batch, not twice. The run is the one
    that reads them apart: the same weights and losses, and the teacher KL and entropy to float rounding. LoRA
    (a frozen head: each chunk's gradients taken in its forward, distill_readout._RowGradients) too."""
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    paths = write_online_problem(tmp_path, reward_model=False)
    teacher_dir = write_teacher(tmp_path, paths, sharpness=5.0)
    calls = {"stage 1": 0, "update read-out": 0, "divergence": 0, "row gradients": 0}

    def counted(module, name, key):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[key] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    counted(collect, "response_readout", "stage 1")
    counted(ppo_update_module, "response_readout", "update read-out")
    counted(ppo_update_module, "teacher_divergence", "divergence")
    counted(distill_readout._RowGradients, "apply", "row gradients")  # a chunk's, with a frozen head
    runs = {}
    for fused in (True, False):
        out = tmp_path / f"run-{fused}"
        extra = (
            f"distill.loss={loss}",
            "train.max_steps=2",
            "train.learning_rate=1e-2",
            f"online.old_logprobs_from_update={str(fused).lower()}",
            f"model.lora_rank={lora}",
        )
        calls.update(dict.fromkeys(calls, 0))
        assert cli(out, *distill_overrides(paths, out, teacher_dir, *extra)) == 0
        rows = read_metrics(out / "metrics.jsonl")
        runs[fused] = dict(calls), rows, load_file(str(out / "final" / "model.safetensors"))
    (fused_calls, fused_rows, fused_weights), (plain_calls, plain_rows, plain_weights) = (
        runs[True],
        runs[False],
    )
    # 2 rollouts of 2 micro-batches (8 rows, 4 a micro-batch): stage 1 reads the actor and the teacher apart,
    # and the update the student twice, in the plain run only
    chunks = 4 if lora else 0  # one chunk a micro-batch (a tiny vocabulary)
    assert fused_calls == {"stage 1": 0, "update read-out": 0, "divergence": 4, "row gradients": chunks}
    assert plain_calls == {"stage 1": 8, "update read-out": 4, "divergence": 4, "row gradients": chunks}
    assert len(fused_rows) == len(plain_rows) == 2
    for a, b in zip(fused_rows, plain_rows, strict=True):
        assert a["loss/distill"] == b["loss/distill"] > 0
        assert a["loss/policy"] == b["loss/policy"] == 0.0  # no score: every advantage is 0
        for key in ("distill/teacher_kl", "entropy/mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
        assert a["distill/teacher_kl"] > 0.05  # read after the update, not from the zeros stage 1 left
    assert fused_rows[1]["loss/distill"] < fused_rows[0]["loss/distill"]
    assert all(torch.equal(fused_weights[k], plain_weights[k]) for k in fused_weights)
