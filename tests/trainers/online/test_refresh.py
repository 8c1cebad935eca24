"""Online reward-model refresh (rlhfkit.trainers.online.refresh): batches, the Bradley-Terry step against a plain
reference, the normalisation re-fit, the stale model's accuracy, labellers, learning, and resume through the
online trainer (bit-identical reward model and state); the quickstart wiring that makes the meter follow it."""

import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from rlhfkit.data import tokenize_preference
from rlhfkit.engine.metrics_writer import read_metrics
from rlhfkit.errors import ConfigError, UserError
from rlhfkit.models import load_causal_lm, load_scalar_model, load_tokenizer, sequence_scores
from rlhfkit.rollout.scoring import reward_normalization
from rlhfkit.tasks.base import Task
from rlhfkit.trainers import online
from rlhfkit.trainers.online import OnlineHooks
from rlhfkit.trainers.online.refresh import RefreshConfig, RewardRefresh
from tests.helpers import tiny_llama
from tests.trainers.online.online_fixtures import PROMPTS, online_config, write_online_problem

WORDS = ["cat", "dog", "mat", "good", "bad", "one", "two", "yes"]


def more_cats(prompt: str, a: str, b: str) -> bool:
    """A labeller with a learnable taste: more 'cat' wins, then the shorter response."""
    ca, cb = a.split().count("cat"), b.split().count("cat")
    return ca > cb or (ca == cb and len(a.split()) < len(b.split()))


class CatTask(Task):
    """A task whose gold score counts 'cat' (its annotators are the base class's Bradley-Terry ones)."""

    name = "cats"

    def gold_score(self, prompt: str, response: str) -> float:
        return float(response.split().count("cat"))


def records(n: int, seed: int = 0, cats: bool = False) -> list[dict]:
    """``n`` preference records over the tiny vocabulary, labelled by :func:`more_cats`; with ``cats``, one side
    of each pair gets one or two more 'cat' than the other, so that the label is the cat count's."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        a, b = (
            " ".join(WORDS[j] for j in torch.randint(len(WORDS), (1 + i % 4,), generator=g).tolist())
            for _ in "ab"
        )
        if cats:
            extra = (
                1 + int(torch.randint(2, (), generator=g)) + b.split().count("cat") - a.split().count("cat")
            )
            words = a.split()
            for _ in range(max(extra, 0)):
                words.insert(int(torch.randint(len(words) + 1, (), generator=g)), "cat")
            a = " ".join(words)
        if a == b:
            b = b + " dog"
        prompt = PROMPTS[i % len(PROMPTS)]
        chosen, rejected = (a, b) if more_cats(prompt, a, b) else (b, a)
        out.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return out


@pytest.fixture(scope="module")
def problem(tmp_path_factory):
    root = tmp_path_factory.mktemp("refresh")
    paths = write_online_problem(root)
    tokenizer = load_tokenizer(str(paths["policy"]))
    return SimpleNamespace(
        paths=paths,
        tokenizer=tokenizer,
        policy=load_causal_lm(str(paths["policy"]), tokenizer=tokenizer).eval(),
    )


def reward_model(problem, seed: int | None = None):
    """The problem's frozen reward model; with ``seed``, a fresh head and body of the same shape (seed 0 is the
    problem's own)."""
    if seed:
        model = tiny_llama(
            "scalar",
            seed=1 + 1000 * seed,
            vocab_size=len(problem.tokenizer),
            pad_token_id=problem.tokenizer.pad_token_id,
        )
    else:
        model = load_scalar_model(str(problem.paths["reward"]), tokenizer=problem.tokenizer)
    return model.eval().requires_grad_(False)


def plain_scores(model, tokenizer, pairs: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw scores of both sides, each sequence on its own (no batching, no padding)."""
    out = []
    for side in ("chosen", "rejected"):
        scores = []
        for r in pairs:
            ex = tokenize_preference(r, tokenizer)
            ids = torch.tensor([ex["prompt_ids"] + ex[f"{side}_ids"]])
            scores.append(sequence_scores(model, ids, torch.ones_like(ids)).squeeze(0))
        out.append(torch.stack(scores))
    return out[0], out[1]


# ----------------------------------------------------------------------------------------------------------
# Construction and labellers


def test_needs_exactly_one_labeller_and_some_prompts(problem):
    with pytest.raises(ConfigError, match="exactly one labeller"):
        RewardRefresh(problem.tokenizer, PROMPTS)
    with pytest.raises(ConfigError, match="exactly one labeller"):
        RewardRefresh(problem.tokenizer, PROMPTS, task=CatTask(), label_fn=more_cats)
    with pytest.raises(ConfigError, match="prompts"):
        RewardRefresh(problem.tokenizer, [], label_fn=more_cats)
    with pytest.raises(ConfigError, match="fresh_fraction"):
        RefreshConfig(fresh_fraction=1.5)


def test_a_labelling_function_that_does_not_return_a_bool_is_a_user_error(problem):
    def score_not_bool(prompt, a, b):
        return 0.7

    refresh = RewardRefresh(problem.tokenizer, PROMPTS, label_fn=score_not_bool)
    pairs = [SimpleNamespace(prompt="hello", a="cat", b="dog")]
    with pytest.raises(UserError, match="score_not_bool returned float"):
        refresh.label(pairs, step=1)
    labelled = RewardRefresh(problem.tokenizer, PROMPTS, label_fn=lambda p, a, b: False).label(pairs, step=1)
    assert labelled == [{"prompt": "hello", "chosen": "dog", "rejected": "cat"}]


# ----------------------------------------------------------------------------------------------------------
# Batches


def test_batches_mix_collected_and_initial_pairs_as_configured(problem):
    config = RefreshConfig(batch_size=8, fresh_fraction=0.25)
    refresh = RewardRefresh(
        problem.tokenizer, PROMPTS, label_fn=more_cats, initial_pairs=records(10), config=config
    )
    assert all(any(ex is i for i in refresh.initial) for ex in refresh.batch(1, 0))  # nothing collected yet
    refresh.load_state_dict({"pairs": records(6, seed=1), "calls": [1], "anchor_size": None})
    fresh_ids = {id(ex) for ex in refresh._collected_examples}
    for step, k in ((2, 0), (2, 1), (5, 3)):
        batch = refresh.batch(step, k)
        assert len(batch) == 8 and sum(id(ex) in fresh_ids for ex in batch) == 2  # round(8 * 0.25)
        assert [id(ex) for ex in refresh.batch(step, k)] == [
            id(ex) for ex in batch
        ]  # a function of (seed, step, k)
    assert [id(ex) for ex in refresh.batch(2, 0)] != [id(ex) for ex in refresh.batch(2, 1)]
    alone = RewardRefresh(problem.tokenizer, PROMPTS, label_fn=more_cats, config=config)
    alone.load_state_dict({"pairs": records(6, seed=1), "calls": [1], "anchor_size": None})
    assert all(
        any(ex is c for c in alone._collected_examples) for ex in alone.batch(2, 0)
    )  # no initial pairs


# ----------------------------------------------------------------------------------------------------------
# The optimizer step against a plain reference


def test_one_step_follows_the_gradient_of_the_mean_bradley_terry_loss(problem, monkeypatch):
    """steps=1 with plain SGD in place of AdamW (Adam's g / (|g| + eps) would amplify rounding in the
    near-zero gradients): the parameters after the refresh equal one SGD step on mean(-logsigmoid(r_c - r_r))
    over the batch, each sequence scored alone (so padding and batching do not matter)."""
    import rlhfkit.trainers.online.refresh as refresh_module

    built = []

    def sgd(named_parameters, lr, weight_decay):
        built.append((lr, weight_decay))
        return torch.optim.SGD([p for _, p in named_parameters if p.requires_grad], lr=lr)

    monkeypatch.setattr(refresh_module, "build_optimizer", sgd)
    config = RefreshConfig(steps=1, batch_size=6, learning_rate=0.5, max_grad_norm=None, fresh_fraction=0.5)
    initial, collected = records(12), records(5, seed=3)
    refresh = RewardRefresh(
        problem.tokenizer, PROMPTS, label_fn=more_cats, initial_pairs=initial, config=config
    )
    refresh.load_state_dict({"pairs": collected, "calls": [], "anchor_size": None})
    model = reward_model(problem)
    reference = copy.deepcopy(model).requires_grad_(True)
    pool = refresh.initial + refresh._collected_examples
    records_of_batch = [
        (initial + collected)[next(i for i, ex in enumerate(pool) if ex is b)] for b in refresh.batch(7, 0)
    ]
    assert 0 < sum(r in collected for r in records_of_batch) < 6  # both kinds in the batch

    metrics = refresh.train(model, step=7)

    chosen, rejected = plain_scores(reference, problem.tokenizer, records_of_batch)
    loss = -F.logsigmoid(chosen - rejected).mean()
    loss.backward()
    assert built == [(0.5, 0.0)]
    assert metrics["refresh/loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
    moved = 0
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.allclose(p, q.detach() - 0.5 * q.grad, atol=1e-6), name
        moved += int(not torch.equal(p, q.detach()))
    assert moved > 0
    assert not any(p.requires_grad for p in model.parameters()) and not model.training  # frozen again


# ----------------------------------------------------------------------------------------------------------
# Normalisation and the stale model's figures


def test_normalisation_is_refitted_on_a_fixed_anchor(problem):
    """After each refresh the anchor's responses score mean 0, std 1 (normalised, each scored alone); without
    initial pairs the anchor is the first refresh's pairs and stays them."""
    config = RefreshConfig(pairs=8, steps=3, batch_size=4, learning_rate=1e-2, max_new_tokens=5)
    initial = records(9)
    for kind in ("initial", "first refresh"):
        refresh = RewardRefresh(
            problem.tokenizer,
            PROMPTS,
            label_fn=more_cats,
            config=config,
            initial_pairs=initial if kind == "initial" else (),
        )
        model = reward_model(problem)
        before = [p.clone() for p in model.parameters()]
        refresh(problem.policy, model, 1)
        anchor = initial if kind == "initial" else list(refresh.collected)
        refresh(problem.policy, model, 2)
        assert len(refresh.collected) > len(anchor) or kind == "initial"
        assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        gain, bias = reward_normalization(model)
        chosen, rejected = plain_scores(model, problem.tokenizer, anchor)
        normalised = torch.cat([chosen, rejected]).double() * gain + bias
        assert float(normalised.mean()) == pytest.approx(0.0, abs=1e-5), kind
        assert float(normalised.std(unbiased=False)) == pytest.approx(1.0, abs=1e-5), kind


def test_the_stale_models_accuracy_on_the_new_pairs_is_reported_with_gold(problem):
    """A task labeller: the records carry gold scores, and accuracy before training is the model's agreement
    with the labels (and with gold, ties excluded) on exactly the new pairs."""
    config = RefreshConfig(pairs=8, steps=0, max_new_tokens=6, temperature=1.0)
    refresh = RewardRefresh(
        problem.tokenizer, PROMPTS, task=CatTask(annotator_temperature=0.2), config=config
    )
    model = reward_model(problem)
    metrics = refresh(problem.policy, model, 3)
    new = refresh.collected
    assert metrics["refresh/new_pairs"] == len(new) == metrics["refresh/pairs"] > 0
    assert all({"gold_chosen", "gold_rejected", "gold_agreement"} <= set(r) for r in new)
    chosen, rejected = plain_scores(model, problem.tokenizer, new)
    right = (chosen > rejected).double() + 0.5 * (chosen == rejected).double()
    assert metrics["refresh/accuracy_before"] == pytest.approx(float(right.mean()), abs=1e-6)
    untied = [i for i, r in enumerate(new) if r["gold_chosen"] != r["gold_rejected"]]
    if untied:
        agree = [
            float((chosen[i] > rejected[i]) == (new[i]["gold_chosen"] > new[i]["gold_rejected"]))
            for i in untied
        ]
        assert metrics["refresh/gold_accuracy_before"] == pytest.approx(sum(agree) / len(agree), abs=1e-6)
    else:
        assert "refresh/gold_accuracy_before" not in metrics
    assert "refresh/loss" not in metrics  # steps=0: nothing trained
    # The same step twice from the same state gives the same pairs (seeded by the step) ...
    again = RewardRefresh(problem.tokenizer, PROMPTS, task=CatTask(annotator_temperature=0.2), config=config)
    again(problem.policy, reward_model(problem), 3)
    assert again.collected == new
    # ... and another step other pairs.
    other = RewardRefresh(problem.tokenizer, PROMPTS, task=CatTask(annotator_temperature=0.2), config=config)
    other(problem.policy, reward_model(problem), 4)
    assert other.collected != new


@pytest.mark.learning
def test_refreshes_teach_the_labellers_taste(problem, learning_seed, learning_figures):
    """Pairs labelled 'more cats wins' (one side has one or two more 'cat'): after a few refreshes the model
    orders held-out pairs of that kind and its loss on them has fallen far.

    Spread over seeds 0-4 x 1, 2 threads (benchmarks/learning_spread.py -k taste): probe loss 0.68-0.72 ->
    0.04-0.21 (fall 0.50-0.67), accuracy -> 0.94-1.00. Thresholds: a fall of 0.25 (half the smallest seen)
    and accuracy 0.85. Without the refresh's training the loss does not move; with the labels reversed it
    rises."""
    config = RefreshConfig(pairs=8, steps=25, batch_size=16, learning_rate=3e-3, max_new_tokens=6)
    refresh = RewardRefresh(
        problem.tokenizer,
        PROMPTS,
        label_fn=more_cats,
        config=config,
        seed=learning_seed,
        initial_pairs=records(48, seed=5 + 1000 * learning_seed, cats=True),
    )
    model = reward_model(problem, seed=learning_seed)
    probe = records(64, seed=99 + 1000 * learning_seed, cats=True)

    def probe_figures():
        chosen, rejected = plain_scores(model, problem.tokenizer, probe)
        return float(-F.logsigmoid(chosen - rejected).mean()), float((chosen > rejected).double().mean())

    start = probe_figures()
    for step in (1, 2, 3):
        metrics = refresh(problem.policy, model, step)
    end = probe_figures()
    learning_figures(
        loss_start=start[0],
        loss_end=end[0],
        loss_drop=start[0] - end[0],
        accuracy_start=start[1],
        accuracy_end=end[1],
    )
    assert math.isfinite(metrics["refresh/loss"]) and metrics["refresh/pairs"] == len(refresh.collected) > 0
    assert end[0] < start[0] - 0.25 and end[1] > 0.85, (start, end)


# ----------------------------------------------------------------------------------------------------------
# Through the online trainer: the hook's state is checkpointed and the resumed run is bit-identical


@pytest.mark.slow
def test_refresh_in_ppo_resumes_bit_identically(problem, tmp_path):
    paths = problem.paths
    args = (
        f"online.reward_model={paths['reward']}",
        "train.save_steps=2",
        "online.critic_learning_rate=3e-3",
        "train.eval_steps=100",
        "refresh.every=2",
    )
    config = RefreshConfig(pairs=4, steps=2, batch_size=4, learning_rate=1e-2, max_new_tokens=6)

    def hook():
        return RewardRefresh(
            problem.tokenizer,
            PROMPTS,
            label_fn=more_cats,
            initial_pairs=records(8),
            config=config,
            seed=5,
            on_refresh=seen.append,
        )

    seen = []
    full = hook()
    online.train(
        online_config(paths, tmp_path / "full", "train.max_steps=4", *args),
        hooks=OnlineHooks(refresh_reward_model=full),
    )
    assert len(seen) == 2 and seen[0] is seen[1]  # the trainer's own reward model, refreshed in place
    online.train(
        online_config(paths, tmp_path / "part", "train.max_steps=2", *args),
        hooks=OnlineHooks(refresh_reward_model=hook()),
    )
    resumed = hook()
    online.train(
        online_config(paths, tmp_path / "part", "train.max_steps=4", *args),
        resume=True,
        hooks=OnlineHooks(refresh_reward_model=resumed),
    )
    assert resumed.state_dict() == full.state_dict() and full.calls == [2, 4]
    saved = json.loads((tmp_path / "full" / "checkpoints" / "step-2" / "trainer_state.json").read_text())
    assert saved["reward_refresh"]["calls"] == [2] and 0 < len(saved["reward_refresh"]["pairs"]) < len(
        full.collected
    )
    for name in ("actor", "critic", "reward_model"):
        a = load_file(str(tmp_path / "full" / "checkpoints" / "step-4" / f"model.{name}.safetensors"))
        b = load_file(str(tmp_path / "part" / "checkpoints" / "step-4" / f"model.{name}.safetensors"))
        assert all(torch.equal(a[k], b[k]) for k in a), name
    initial = load_file(str(paths["reward"] / "model.safetensors"))
    assert not torch.equal(a["score.weight"], initial["score.weight"])  # the refresh trained it
    rows = {d: read_metrics(tmp_path / d / "metrics.jsonl") for d in ("full", "part")}
    keys = ("refresh/loss", "refresh/gain", "refresh/accuracy_before", "refresh/pairs", "score/mean")
    assert [[r.get(k) for k in keys] for r in rows["full"]] == [
        [r.get(k) for k in keys] for r in rows["part"]
    ]
    assert [r.get("refresh/pairs") is not None for r in rows["full"]] == [False, True, False, True]
    # The trainer's reward model carries the last refit normalisation (the one PPO scores with).
    assert rows["full"][3]["refresh/gain"] == pytest.approx(seen[0].config.rlhfkit_reward_gain, rel=1e-12)


# ----------------------------------------------------------------------------------------------------------
# The quickstart's wiring: the meter's proxy follows the refreshed model


def test_quickstart_refresh_hands_the_refreshed_model_to_the_meter(problem, tmp_path):
    from rlhfkit.quickstart.pipeline import PRESETS, task_refresh

    pairs_file = tmp_path / "pairs.jsonl"
    pairs_file.write_text("".join(json.dumps(r) + "\n" for r in records(6)))
    task = CatTask()
    task.prompts = lambda split="train": list(PROMPTS)
    meter = SimpleNamespace(tokenizer=problem.tokenizer, reward_model=None)
    refresh = task_refresh(task, meter, pairs_file, PRESETS["smoke"], seed=0, pairs=4, steps=1, batch_size=4)
    assert refresh.config.max_new_tokens == PRESETS["smoke"].response_length and len(refresh.initial) == 6
    model = reward_model(problem)
    refresh(problem.policy, model, 1)
    assert meter.reward_model is model
