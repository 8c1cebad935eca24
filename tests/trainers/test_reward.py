"""Reward model: the loss as the formulas say, one forward for both sides, held-out figures by hand,
normalisation, and `rlhfkit train reward` end to end (final/ read by plain transformers, best model, early
stopping, resume, user errors)."""

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rlhfkit.cli import main
from rlhfkit.data import TokenLimits
from rlhfkit.models import load_scalar_model, load_tokenizer, sequence_scores
from rlhfkit.rollout.scoring import BIAS_KEY, GAIN_KEY
from rlhfkit.trainers.best_model import BestKeeper
from rlhfkit.trainers.preference_data import PairCollator, calibration, heldout_metrics, load_heldout
from rlhfkit.trainers.reward import (
    evaluate_heldout,
    fit_normalization,
    length_covariance,
    normalized_scores,
    pair_loss,
    pair_scores,
)
from tests.helpers import pad_batch, tiny_llama, tiny_llama_config, tiny_tokenizer

LN2 = math.log(2.0)
BODY_WORDS = "the cat sat on a mat dog ran fast slow one two three four five six seven".split()


def _bt(c, r, m=0.0):
    return -math.log(1.0 / (1.0 + math.exp(-(c - r - m))))


# ----------------------------------------------------------------------------------------------------------
# The loss


def test_pair_loss_matches_the_formulas_by_hand():
    chosen = torch.tensor([1.0, -0.5, 2.0])
    rejected = torch.tensor([0.0, 0.5, 2.0])
    margin = torch.tensor([0.5, 0.0, 1.0])
    lengths_c, lengths_r = torch.tensor([3, 5, 4]), torch.tensor([6, 2, 4])
    n_total = 5.0  # this micro-batch holds 3 of the step's 5 pairs

    # plain Bradley-Terry: no margin, no centring, no length term
    loss, stats = pair_loss(chosen, rejected, None, n_total)
    expected = sum(_bt(c, r) for c, r in [(1.0, 0.0), (-0.5, 0.5), (2.0, 2.0)]) / n_total
    assert float(loss) == pytest.approx(expected, abs=1e-6)
    assert stats["accuracy"] == pytest.approx((1 + 0 + 0.5) / 3 * 3 / n_total)  # a tie counts 1/2
    assert stats["margin"] == pytest.approx((1 - 1 + 0) / 3 * 3 / n_total)

    # margin and centring: -log sigmoid(c - r - m) + k (c + r)^2
    loss, _ = pair_loss(chosen, rejected, margin, n_total, center_coef=0.1)
    pairs = [(1.0, 0.0, 0.5), (-0.5, 0.5, 0.0), (2.0, 2.0, 1.0)]
    expected = sum(_bt(c, r, m) + 0.1 * (c + r) ** 2 for c, r, m in pairs) / n_total
    assert float(loss) == pytest.approx(expected, abs=1e-6)
    with_margin_only, _ = pair_loss(chosen, rejected, margin, n_total)
    assert float(with_margin_only) > float(
        pair_loss(chosen, rejected, None, n_total)[0]
    )  # margins demand more

    # length term: c * cov(r, z)^2 * n / N with z the standardised lengths of the 6 responses
    scores = [1.0, -0.5, 2.0, 0.0, 0.5, 2.0]
    lengths = [3, 5, 4, 6, 2, 4]
    mean = sum(lengths) / 6
    std = math.sqrt(sum((x - mean) ** 2 for x in lengths) / 6)
    cov = sum(s * (x - mean) / std for s, x in zip(scores, lengths, strict=True)) / 6
    loss, stats = pair_loss(
        chosen,
        rejected,
        margin,
        n_total,
        center_coef=0.1,
        length_bias_coef=0.3,
        chosen_length=lengths_c,
        rejected_length=lengths_r,
    )
    assert float(loss) == pytest.approx(expected + 0.3 * cov**2 * 3 / n_total, abs=1e-6)
    assert stats["loss/length_bias"] == pytest.approx(0.3 * cov**2 * 3 / n_total, abs=1e-7)


def test_untrained_scores_give_ln2():
    same = torch.zeros(4)
    loss, stats = pair_loss(same, same, None, 4.0)
    assert float(loss) == pytest.approx(LN2) and stats["accuracy"] == pytest.approx(0.5)


def test_length_covariance_against_a_loop_and_its_gradient_direction():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(9, generator=gen, dtype=torch.float64, requires_grad=True)
    lengths = torch.randint(1, 20, (9,), generator=gen)
    xs, ls = scores.tolist(), [float(v) for v in lengths]
    mean_l, mean_s = sum(ls) / 9, sum(xs) / 9
    std_l = math.sqrt(sum((x - mean_l) ** 2 for x in ls) / 9)
    cov = sum((s - mean_s) * (x - mean_l) for s, x in zip(xs, ls, strict=True)) / 9 / std_l
    value = length_covariance(scores, lengths)
    assert float(value.detach()) == pytest.approx(cov, abs=1e-12)
    # cov(r, z) = corr(r, l) * std(r)
    assert float(value.detach()) == pytest.approx(np.corrcoef(xs, ls)[0, 1] * np.std(xs), abs=1e-12)
    # the squared penalty's gradient on longer-than-average responses has the covariance's sign, so a
    # descent step lowers their scores when cov > 0 (and raises them when cov < 0)
    sign = torch.sign(value.detach())
    (value**2).backward()
    longer = lengths.double() > lengths.double().mean()
    assert bool((torch.sign(scores.grad[longer]) == sign).all())
    assert (
        float(length_covariance(scores.detach(), torch.full((9,), 7))) == 0.0
    )  # constant lengths: nothing to fix


def test_micro_batches_add_up_to_the_whole_batch():
    gen = torch.Generator().manual_seed(1)
    chosen = torch.randn(6, generator=gen, requires_grad=True)
    rejected = torch.randn(6, generator=gen)
    margin = torch.rand(6, generator=gen)
    whole, _ = pair_loss(chosen, rejected, margin, 6.0, center_coef=0.05)
    (grad_whole,) = torch.autograd.grad(whole, chosen)
    parts = sum(
        pair_loss(chosen[s], rejected[s], margin[s], 6.0, center_coef=0.05)[0]
        for s in (slice(0, 2), slice(2, 6))
    )
    (grad_parts,) = torch.autograd.grad(parts, chosen)
    assert float(parts.detach()) == pytest.approx(float(whole.detach()), abs=1e-6)
    torch.testing.assert_close(grad_parts, grad_whole)


# ----------------------------------------------------------------------------------------------------------
# Scoring


def _example(prompt, chosen, rejected, **extra):
    return {"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected, **extra}


def test_pair_scores_use_one_forward_and_equal_separate_scores_whatever_the_padding():
    tok = tiny_tokenizer()
    model = tiny_llama("scalar", seed=3, vocab_size=len(tok), pad_token_id=tok.pad_token_id)
    examples = [
        _example([1, 5, 6], [7, 8, 9, 2], [10, 2], margin=0.5),
        _example([1, 11], [12, 2], [13, 14, 15, 16, 17, 2]),
    ]
    collate = PairCollator(tok.pad_token_id, default_margin=0.25)
    batch = collate(examples)
    assert batch["margin"].tolist() == [0.5, 0.25]  # the record's margin, else the default
    assert batch["chosen_length"].tolist() == [4, 2] and batch["rejected_length"].tolist() == [2, 6]

    calls = []
    hook = model.register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        chosen, rejected = pair_scores(model, batch)
    hook.remove()
    assert len(calls) == 1

    with torch.no_grad():
        for side, got in (("chosen", chosen), ("rejected", rejected)):
            rows = [e["prompt_ids"] + e[f"{side}_ids"] for e in examples]
            for pad_side in ("left", "right"):
                ids, mask = pad_batch(rows, tok.pad_token_id, pad_side)
                torch.testing.assert_close(sequence_scores(model, ids, mask), got, atol=1e-5, rtol=0)
        # junk at padded positions changes nothing
        junk = dict(batch)
        for side in ("chosen", "rejected"):
            ids, mask = batch[f"{side}_input_ids"].clone(), batch[f"{side}_attention_mask"]
            ids[mask == 0] = 17
            junk[f"{side}_input_ids"] = ids
        again = pair_scores(model, junk)
    torch.testing.assert_close(again[0], chosen, atol=1e-6, rtol=0)
    torch.testing.assert_close(again[1], rejected, atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------------------------------------
# Held-out figures


def test_heldout_metrics_by_hand():
    chosen = torch.tensor([2.0, 0.0, 1.0, -1.0])
    rejected = torch.tensor([1.0, 0.0, 3.0, -1.5])
    lengths_c, lengths_r = torch.tensor([5, 3, 8, 2]), torch.tensor([4, 3, 2, 6])
    margin = torch.tensor([0.0, 0.0, 0.0, 1.0])
    gold_c = torch.tensor([1.0, 2.0, 0.5, 3.0])
    gold_r = torch.tensor([0.0, 1.0, 0.5, 4.0])
    metrics, bins = heldout_metrics(chosen, rejected, lengths_c, lengths_r, margin, gold_c, gold_r)
    diffs = [1.0, 0.0, -2.0, 0.5]
    assert metrics["accuracy"] == pytest.approx((1 + 0.5 + 0 + 1) / 4)
    assert metrics["margin"] == pytest.approx(sum(diffs) / 4)
    assert metrics["loss"] == pytest.approx((_bt(2, 1) + _bt(0, 0) + _bt(1, 3) + _bt(-1, -1.5, 1.0)) / 4)
    # gold: pair 3 is a gold tie (left out); pair 2 is a model tie (1/2); pair 4: gold prefers rejected
    assert metrics["gold_pairs"] == 3
    assert metrics["gold_accuracy"] == pytest.approx((1 + 0.5 + 0) / 3)
    scores = [2.0, 0.0, 1.0, -1.0, 1.0, 0.0, 3.0, -1.5]
    lengths = [5, 3, 8, 2, 4, 3, 2, 6]
    assert metrics["length_correlation"] == pytest.approx(np.corrcoef(scores, lengths)[0, 1])
    assert metrics["score_mean"] == pytest.approx(np.mean(scores))
    # calibration: confidences sigmoid(|d|) = .731 (right), .5 (tie: 1/2), .881 (wrong), .622 (right)
    conf = [1 / (1 + math.exp(-abs(d))) for d in diffs]
    assert [b["count"] for b in bins] == [1, 1, 1, 1, 0]
    assert bins[0]["confidence"] == pytest.approx(conf[1]) and bins[0]["observed"] == 0.5
    assert bins[3]["confidence"] == pytest.approx(conf[2]) and bins[3]["observed"] == 0.0
    ece = (abs(conf[1] - 0.5) + abs(conf[3] - 1) + abs(conf[0] - 1) + abs(conf[2] - 0)) / 4
    assert metrics["calibration_error"] == pytest.approx(ece)
    assert calibration(torch.tensor([0.0]))[0] == pytest.approx(0.0)  # a tie at 0.5 is calibrated


def test_normalization_fit_gives_mean_0_std_1():
    scores = torch.tensor([3.0, 5.0, 4.5, 9.0, -1.0])
    gain, bias = fit_normalization(scores)
    normalised = scores.double() * gain + bias
    assert float(normalised.mean()) == pytest.approx(0.0, abs=1e-12)
    assert float(normalised.std(unbiased=False)) == pytest.approx(1.0, abs=1e-12)
    assert fit_normalization(torch.full((4,), 2.0)) == (1.0, -2.0)  # constant scores: only the shift


def test_best_keeper_prefers_accuracy_then_loss(tmp_path):
    model = tiny_llama("scalar", seed=0)
    keeper = BestKeeper(tmp_path / "best", keep_existing=False)
    assert keeper.update(model, 2, {"accuracy": 0.6, "loss": 0.7})
    assert not keeper.update(model, 4, {"accuracy": 0.55, "loss": 0.1})
    assert keeper.update(model, 6, {"accuracy": 0.6, "loss": 0.65})  # same accuracy, lower loss
    assert not keeper.update(model, 8, {"accuracy": 0.6, "loss": 0.65})
    assert keeper.step == 6 and json.loads((tmp_path / "best" / "best.json").read_text())["step"] == 6
    assert BestKeeper(tmp_path / "best", keep_existing=True).step == 6  # a resumed run keeps it
    assert BestKeeper(tmp_path / "best", keep_existing=False).step is None  # a fresh run drops it
    assert not (tmp_path / "best" / "best.json").exists()


def test_keep_best_never_keeps_the_untrained_model_and_says_when_the_best_is_the_first(tmp_path):
    from rlhfkit.trainers.best_model import keep_best_warnings

    model = tiny_llama("scalar", seed=0)
    keeper = BestKeeper(tmp_path / "best", keep_existing=False)
    assert not keeper.update(model, 0, {"accuracy": 0.9, "loss": 0.3})  # step 0: the untrained model
    assert keeper.best is None and keeper.untrained == {"accuracy": 0.9, "loss": 0.3}
    assert keeper.update(model, 4, {"accuracy": 0.7, "loss": 0.6})
    assert not keeper.update(model, 8, {"accuracy": 0.6, "loss": 0.7})
    assert keeper.step == 4
    first, untrained = keep_best_warnings(keeper, eval_steps=4, last_step=8)
    assert "came at the first evaluation (step 4)" in first and "up to step 8" in first
    assert "untrained model's held-out accuracy (0.9)" in untrained and "(0.7, step 4)" in untrained
    assert keep_best_warnings(keeper, eval_steps=4, last_step=4)[:1] != [
        first
    ]  # one evaluation: nothing to say
    assert keeper.update(model, 12, {"accuracy": 0.95, "loss": 0.2})
    assert keep_best_warnings(keeper, eval_steps=4, last_step=12) == []


# ----------------------------------------------------------------------------------------------------------
# End to end on a tiny synthetic problem


def _body(rng, k):
    return " ".join(rng.choices(BODY_WORDS, k=k))


def _easy_record(rng):
    """The chosen response says 'good', the rejected one 'bad'; lengths are drawn alike."""
    prompt = _body(rng, rng.randint(1, 3))
    return {
        "prompt": prompt,
        "chosen": f"{_body(rng, rng.randint(1, 4))} good .",
        "rejected": f"{_body(rng, rng.randint(1, 4))} bad .",
    }


def write_reward_problem(
    root: Path, pad: str = "eos", n_train: int = 64, n_eval: int = 48, gold: bool = True, seed: int = 0
):
    """``model/`` (a tiny causal Llama + tokenizer), ``train.jsonl`` and ``eval.jsonl`` (with gold fields)."""
    tokenizer = tiny_tokenizer(pad=pad)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model = tiny_llama(seed=seed, vocab_size=len(tokenizer), pad_token_id=pad_id)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    rng = random.Random(seed)
    train = [_easy_record(rng) for _ in range(n_train)]
    held = [_easy_record(rng) for _ in range(n_eval)]
    if gold:  # gold says the same as the labels, except for two ties
        for i, r in enumerate(held):
            r.update(
                gold_chosen=1.0, gold_rejected=0.0 if i >= 2 else 1.0, gold_agreement=0.9 if i >= 2 else None
            )
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    (root / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held))
    return {"model": root / "model", "train": root / "train.jsonl", "eval": root / "eval.jsonl"}


def reward_args(paths, out: Path, *extra: str, seed: int = 0) -> list[str]:
    config = out.parent / f"{out.name}.yaml"
    config.write_text(f"seed: {seed}\nlogging:\n  progress_bar: false\n")
    return [
        "train",
        "reward",
        "--config",
        str(config),
        f"output_dir={out}",
        f"model.name_or_path={paths['model']}",
        f"data.train_file={paths['train']}",
        f"data.eval_file={paths['eval']}",
        "train.batch_size=16",
        "train.micro_batch_size=8",
        "train.learning_rate=3e-3",
        "train.lr_schedule=constant",
        "train.save_steps=4",
        "train.eval_steps=4",
        "data.max_prompt_length=8",
        "data.max_length=24",
        *extra,
    ]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_untrained_model_scores_ln2_and_half_accuracy_on_unrelated_labels(tmp_path):
    """Step 0: a fresh head (N+ init) on pairs whose labels do not depend on the text."""
    paths = write_reward_problem(tmp_path, gold=False)
    rng = random.Random(5)
    rows = [{"prompt": _body(rng, 2), "chosen": _body(rng, 3), "rejected": _body(rng, 3)} for _ in range(300)]
    (tmp_path / "random.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = load_tokenizer(str(paths["model"]))
    model = load_scalar_model(str(paths["model"]), tokenizer=tokenizer).eval()
    held = load_heldout(str(tmp_path / "random.jsonl"), tokenizer, TokenLimits(8, 24))
    metrics, _ = evaluate_heldout(model, PairCollator(tokenizer.pad_token_id), held, 64, "cpu")
    assert abs(metrics["loss"] - LN2) < 0.05, metrics
    assert abs(metrics["accuracy"] - 0.5) < 0.1, metrics
    assert metrics["score_std"] < 1.0  # std 1/sqrt(d + 1) head: small scores


@pytest.mark.slow
@pytest.mark.learning
def test_train_reward_learns_keeps_the_best_normalises_and_loads_in_plain_transformers(
    tmp_path, learning_seed, learning_figures
):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    # pad == EOS: final/ must get a distinct pad token
    paths = write_reward_problem(tmp_path, seed=learning_seed)
    out = tmp_path / "run"
    assert (
        main(
            reward_args(
                paths,
                out,
                "train.max_steps=12",
                "reward.center_coef=0.01",
                "reward.length_bias_coef=0.1",
                seed=learning_seed,
            )
        )
        == 0
    )
    rows = _rows(out / "metrics.jsonl")
    assert rows[0]["step"] == 0 and abs(rows[0]["eval/loss"] - LN2) < 0.15  # the untrained model
    assert rows[1]["step"] == 1 and {"accuracy", "margin", "loss/length_bias", "grad_norm"} <= rows[1].keys()
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 4, 8, 12]

    summary = json.loads((out / "summary.json").read_text())
    best = max(evals, key=lambda r: (r["eval/accuracy"], -r["eval/loss"]))
    assert summary["final_step"] == best["step"] and summary["steps"] == 12 and not summary["early_stopped"]
    assert summary["heldout_accuracy"] == pytest.approx(best["eval/accuracy"])
    learning_figures(
        start_accuracy=evals[0]["eval/accuracy"],
        heldout_accuracy=summary["heldout_accuracy"],
        heldout_gold_accuracy=summary["heldout_gold_accuracy"],
    )
    assert summary["heldout_accuracy"] >= 0.9 > evals[0]["eval/accuracy"]
    assert summary["heldout_gold_pairs"] == 46 and summary["heldout_gold_accuracy"] >= 0.9
    assert summary["bayes_ceiling"] == pytest.approx(0.9)
    assert summary["pairs_per_second"] > 0 and summary["tokens_per_second"] > 0
    assert sum(b["count"] for b in summary["calibration_bins"]) == 48
    # The final model's held-out scores, for the report's histograms: they give the summary's accuracy.
    scored = _rows(out / "heldout_scores.jsonl")
    assert len(scored) == 48 and {"gold_chosen", "gold_rejected"} <= scored[0].keys()
    assert sum(
        (r["chosen"] > r["rejected"]) + 0.5 * (r["chosen"] == r["rejected"]) for r in scored
    ) / 48 == pytest.approx(summary["heldout_accuracy"])

    # final/ = the best evaluation's weights (raw), with the normalisation in config.json
    best_weights = load_file(str(out / "best" / "model.safetensors"))
    final_weights = load_file(str(out / "final" / "model.safetensors"))
    assert torch.equal(final_weights["score.weight"], best_weights["score.weight"])
    config = json.loads((out / "final" / "config.json").read_text())
    gain, bias = config[GAIN_KEY], config[BIAS_KEY]
    assert gain == summary["normalization"]["gain"] and gain > 0

    # Plain transformers, with the saved tokenizer, gives the RAW scores that sequence_scores gives.
    plain = AutoModelForSequenceClassification.from_pretrained(out / "final").eval()
    plain_tok = AutoTokenizer.from_pretrained(out / "final")
    assert plain_tok.pad_token_id != plain_tok.eos_token_id
    ours_tok = load_tokenizer(str(out / "final"))
    ours = load_scalar_model(str(out / "final"), tokenizer=ours_tok).eval()
    train_rows = _rows(paths["train"])
    texts = [r["prompt"] + " " + r[side] + " </s>" for r in train_rows[:6] for side in ("chosen", "rejected")]
    with torch.no_grad():
        reference = None
        for side in ("right", "left"):
            plain_tok.padding_side = side
            enc = plain_tok(texts, return_tensors="pt", padding=True)
            theirs = plain(**enc).logits[:, 0]
            raw = sequence_scores(ours, enc["input_ids"], enc["attention_mask"])
            torch.testing.assert_close(theirs, raw, atol=1e-5, rtol=0)
            torch.testing.assert_close(
                normalized_scores(ours, enc["input_ids"], enc["attention_mask"]),
                raw * gain + bias,
                atol=1e-6,
                rtol=0,
            )
            reference = raw if reference is None else reference
            torch.testing.assert_close(raw, reference, atol=1e-5, rtol=0)  # left == right padding

        # The summary's held-out figures are final/'s own.
        held = load_heldout(str(paths["eval"]), ours_tok, TokenLimits(8, 24))
        figures, _ = evaluate_heldout(ours, PairCollator(ours_tok.pad_token_id), held, 64, "cpu")
        assert figures["accuracy"] == summary["heldout_accuracy"]
        assert figures["loss"] == pytest.approx(summary["heldout_loss"], abs=1e-6)

        # Normalisation: mean 0, std 1 over its fitting set (every training response here: 64 pairs <= 2048).
        examples = load_heldout(str(paths["train"]), ours_tok, TokenLimits(8, 24)).examples
        batch = PairCollator(ours_tok.pad_token_id)(examples)
        ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])
        mask = torch.cat([batch["chosen_attention_mask"], batch["rejected_attention_mask"]])
        scores = normalized_scores(ours, ids, mask).double()
    assert summary["normalization"]["fit_responses"] == 128
    assert float(scores.mean()) == pytest.approx(0.0, abs=1e-4)
    assert float(scores.std(unbiased=False)) == pytest.approx(1.0, abs=1e-4)


@pytest.mark.slow
def test_resume_reproduces_the_run_and_its_best_model(tmp_path):
    paths = write_reward_problem(tmp_path)
    full, part = tmp_path / "full", tmp_path / "part"
    every = ("train.save_steps=2", "train.eval_steps=2")
    assert main(reward_args(paths, full, "train.max_steps=4", *every)) == 0
    assert main(reward_args(paths, part, "train.max_steps=2", *every)) == 0
    assert main([*reward_args(paths, part, "train.max_steps=4", *every), "--resume"]) == 0
    a, b = (load_file(str(p / "final" / "model.safetensors")) for p in (full, part))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def strip(rows):
        return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]

    assert strip(_rows(full / "metrics.jsonl")) == strip(_rows(part / "metrics.jsonl"))
    s_full, s_part = (json.loads((p / "summary.json").read_text()) for p in (full, part))
    for key in ("final_step", "heldout_accuracy", "heldout_loss", "heldout_gold_accuracy", "normalization"):
        assert s_full[key] == s_part[key], key


@pytest.mark.slow
def test_early_stopping_ends_the_run_and_keeps_the_best(tmp_path, capsys):
    paths = write_reward_problem(tmp_path, gold=False)
    out = tmp_path / "run"
    # A learning rate this small changes no float32 score, so no evaluation beats the first trained one (step 2;
    # the untrained step 0 never counts as the best).
    assert (
        main(
            reward_args(
                paths,
                out,
                "train.max_steps=40",
                "train.eval_steps=2",
                "train.learning_rate=1e-20",
                "reward.early_stopping_patience=2",
            )
        )
        == 0
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["early_stopped"] and summary["final_step"] == 2
    assert (
        "rlhfkit: warning: reward.keep_best: the best held-out accuracy came at the first evaluation (step 2)"
        in capsys.readouterr().err
    )
    assert [r["step"] for r in _rows(out / "metrics.jsonl")][-1] == 6
    assert (out / "checkpoints" / "step-6").is_dir()  # the stopping step is checkpointed
    assert "heldout_gold_accuracy" not in summary and "bayes_ceiling" in summary


# ----------------------------------------------------------------------------------------------------------
# User errors


@pytest.mark.parametrize(
    "which, line, field, bad",
    [
        ("train", 2, "rejected", {"prompt": "the cat", "chosen": "good ."}),
        (
            "train",
            2,
            "margin",
            {"prompt": "the cat", "chosen": "good .", "rejected": "bad .", "margin": "big"},
        ),
        (
            "eval",
            2,
            "gold_chosen",
            {
                "prompt": "the cat",
                "chosen": "good .",
                "rejected": "bad .",
                "gold_chosen": "high",
                "gold_rejected": 0.0,
            },
        ),
        (
            "eval",
            2,
            "gold_rejected",
            {"prompt": "the cat", "chosen": "good .", "rejected": "bad .", "gold_chosen": 1},
        ),
    ],
)
def test_bad_preference_data_exits_2_naming_file_line_and_field(tmp_path, capsys, which, line, field, bad):
    paths = write_reward_problem(tmp_path, n_train=1, n_eval=1)
    with paths[which].open("a") as f:
        f.write(json.dumps(bad) + "\n")
    assert main(reward_args(paths, tmp_path / "run", "train.max_steps=2")) == 2
    err = capsys.readouterr().err
    assert f"{which}.jsonl" in err and f"line {line}" in err and field in err and "Traceback" not in err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_classifier_with_two_labels_is_a_clear_error(tmp_path, capsys):
    from transformers import LlamaForSequenceClassification

    paths = write_reward_problem(tmp_path, n_train=2, n_eval=2)
    two = tmp_path / "two"
    LlamaForSequenceClassification(tiny_llama_config(num_labels=2)).save_pretrained(two)
    tiny_tokenizer().save_pretrained(two)
    assert main(reward_args({**paths, "model": two}, tmp_path / "run", "train.max_steps=2")) == 2
    assert "num_labels=2" in capsys.readouterr().err


def test_early_stopping_without_eval_data_is_refused(tmp_path, capsys):
    paths = write_reward_problem(tmp_path, n_train=2, n_eval=2)
    args = reward_args(paths, tmp_path / "run", "reward.early_stopping_patience=2", "data.eval_file=null")
    assert main(args) == 2 and "needs data.eval_file" in capsys.readouterr().err
