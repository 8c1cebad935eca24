"""The update's loss terms as configured: the KL loss estimator of ``online.kl_in_loss``, clip-higher and
dual-clip in the policy loss (with clipfrac split into its parts), the importance ratio per sequence (GSPO, also
in a short GRPO run), each key checked to reach the loss (the
tests fail when a key is ignored); the per-epoch clipfrac and approx_kl of ``online.epoch_stats``; and dynamic
sampling (``online.dynamic_sampling``): the replacement of
groups without a score spread, by hand and in a run."""

from types import SimpleNamespace

import pytest
import torch

from rlhfkit.algos import ppo_policy_loss
from rlhfkit.algos.groups import informative_rows
from rlhfkit.config import load_config
from rlhfkit.engine.metrics_writer import read_metrics
from rlhfkit.errors import ConfigError
from rlhfkit.trainers.online import OnlineHooks, train
from rlhfkit.trainers.online.collect import Scores
from rlhfkit.trainers.online.context import StatSums
from rlhfkit.trainers.online.dynamic import concat_rollouts, fill_informative_groups
from rlhfkit.trainers.online.ppo_update import micro_batch_loss, ppo_update
from rlhfkit.types import Rollout
from tests.trainers.online.online_fixtures import make_context, online_config, write_online_problem
from tests.trainers.online.test_online import rollout_for_update


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return write_online_problem(tmp_path_factory.mktemp("loss-terms"), reward_model=False)


def _off_policy_rollout(ctx, seed=0):
    """A rollout whose old log-probs are moved off the current policy by a known delta (the actor has not
    moved, so its log-probs now are the rollout's own): returns (rollout, new log-probs, delta)."""
    rollout = rollout_for_update(ctx)
    new = rollout.logprobs.clone()
    g = torch.Generator().manual_seed(seed)
    delta = (torch.rand(new.shape, generator=g) - 0.5) * torch.where(rollout.mask, 1.0, 0.0)  # (B, T)
    rollout.logprobs = new + delta
    return rollout, new, delta


def _token_mean(per_token, mask):
    return float((per_token * mask).sum() / mask.sum())


@pytest.mark.parametrize("estimator", ["k2", "k3_is", "k3"])
def test_the_kl_loss_estimator_reaches_the_loss(paths, tmp_path, estimator):
    cfg = online_config(
        paths, tmp_path / "g", "online.kl_in_loss=true", f"online.kl_loss_estimator={estimator}", kind="grpo"
    )
    ctx = make_context(cfg)
    with torch.no_grad():  # a reference that differs from the actor, so that the KL is not 0
        for p in ctx.roles.reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    rollout, new, delta = _off_policy_rollout(ctx)
    rollout.advantages = torch.zeros_like(rollout.advantages)  # the loss is then the KL term alone
    ref, mask = rollout.ref_logprobs, rollout.mask
    log_r = ref - new
    k3 = torch.exp(log_r) - 1 - log_r
    weight = torch.exp(-delta)  # pi_theta / pi_old
    expected = {"k2": weight * 0.5 * log_r**2, "k3_is": weight * k3, "k3": k3}[estimator]
    loss, parts, _ = micro_batch_loss(ctx, rollout, float(mask.sum()), StatSums(), True)
    want = _token_mean(expected, mask)
    assert float(parts["loss/kl"].detach()) == pytest.approx(want, rel=1e-4) and want > 0
    assert float(loss.detach()) == pytest.approx(cfg.online.kl_coef * want, rel=1e-4)


REQUIRED = [
    "output_dir=out",
    "model.name_or_path=m",
    "data.train_file=p.jsonl",
    "online.reward_functions=[a:b]",
]


def test_the_default_kl_loss_is_unbiased():
    cfg = load_config(None, [*REQUIRED, "online.group_size=2", "online.kl_in_loss=true"], "grpo")
    assert cfg.online.kl_loss_estimator in ("k2", "k3_is")


@pytest.mark.parametrize(
    "keys",
    [
        ("online.clip_eps_high=0.6",),
        ("online.dual_clip=1.2",),
        ("online.clip_eps_high=0.4", "online.dual_clip=1.1"),
        ("online.importance_sampling_level=sequence",),
        ("online.importance_sampling_level=sequence", "online.clip_eps_high=0.4", "online.dual_clip=1.1"),
    ],
)
def test_clip_higher_dual_clip_and_the_sequence_level_reach_the_policy_loss(paths, tmp_path, keys):
    cfg = online_config(paths, tmp_path / "g", "online.clip_eps=0.05", *keys, kind="grpo")
    ctx = make_context(cfg)
    rollout, new, _ = _off_policy_rollout(ctx, seed=1)
    g = torch.Generator().manual_seed(2)
    rollout.advantages = torch.where(rollout.mask, torch.randn(new.shape, generator=g), 0.0)
    mask = rollout.mask
    stats = StatSums()
    _, parts, _ = micro_batch_loss(ctx, rollout, float(mask.sum()), stats, True)
    online = cfg.online
    args = (new, rollout.logprobs, rollout.advantages, online.clip_eps)
    expected, pg = ppo_policy_loss(
        *args,
        clip_eps_high=online.clip_eps_high,
        dual_clip=online.dual_clip,
        mask=mask,
        importance_sampling_level=online.importance_sampling_level,
    )
    symmetric, _ = ppo_policy_loss(*args, mask=mask)  # per token
    got = float(parts["loss/policy"].detach())
    assert got == pytest.approx(_token_mean(expected, mask), rel=1e-5)
    assert abs(_token_mean(symmetric, mask) - got) > 1e-4  # the keys changed the loss
    means = stats.means(ctx)
    for part in ("clipfrac/low", "clipfrac/high", "clipfrac/dual", "ratio/mean"):
        assert means[part] == pytest.approx(float(pg[part]), abs=1e-6)
    assert means["clipfrac"] == pytest.approx(
        sum(means[p] for p in ("clipfrac/low", "clipfrac/high", "clipfrac/dual"))
    )


def test_a_grpo_run_with_the_sequence_level_runs_end_to_end(paths, tmp_path):
    """Two rollouts of GRPO with GSPO's ratio (two epochs of two minibatches: the later ones off-policy): the
    run finishes, its figures are finite, the ratio is 1 before the first update, the policy moved, and the
    weights differ from the token level's run (the setting reaches the update)."""
    from safetensors.torch import load_file

    finals = {}
    for level in ("sequence", "token"):
        out = tmp_path / level
        train(
            online_config(
                paths, out, "train.max_steps=2", f"online.importance_sampling_level={level}", kind="grpo"
            )
        )
        finals[level] = load_file(str(out / "final" / "model.safetensors"))
        rows = read_metrics(out / "metrics.jsonl")
        assert [r["step"] for r in rows] == [1, 2]
        for row in rows:
            assert all(v is not None for v in row.values()), row  # NaN / inf would be written as null
            assert row["ratio/first_minibatch_max_logprob_diff"] == 0.0
    assert "importance_sampling_level: sequence" in (tmp_path / "sequence" / "config.yaml").read_text()
    initial = load_file(str(paths["policy"] / "model.safetensors"))
    assert any(not torch.equal(initial[k], finals["sequence"][k]) for k in initial)
    assert any(not torch.equal(finals["token"][k], finals["sequence"][k]) for k in initial)


@pytest.mark.parametrize("on", [True, False])
def test_epoch_stats_logs_each_epochs_clipfrac_and_approx_kl(paths, tmp_path, on):
    """Two epochs of one minibatch on a rollout moved off the policy by a known delta: epoch 1 runs before any
    optimizer step, so its clipfrac and approx_kl are ``ppo_policy_loss``'s on (current, old); the token-weighted
    mean of the epochs is the logged total; without the key no per-epoch figure is logged."""
    extra = ("online.clip_eps=0.05", "online.ppo_epochs=2", "online.num_minibatches=1")
    extra += (f"online.epoch_stats={str(on).lower()}",)
    ctx = make_context(online_config(paths, tmp_path / "e", *extra, kind="grpo"))
    rollout, new, _ = _off_policy_rollout(ctx, seed=3)
    g = torch.Generator().manual_seed(4)
    rollout.advantages = torch.where(rollout.mask, torch.randn(new.shape, generator=g), 0.0)
    _, pg = ppo_policy_loss(new, rollout.logprobs, rollout.advantages, 0.05, mask=rollout.mask)
    means = ppo_update(ctx, rollout, step=1).stats.means(ctx)
    if not on:
        assert not [k for k in means if "/epoch" in k]
        return
    for key in ("clipfrac", "approx_kl"):
        assert means[f"{key}/epoch1"] == pytest.approx(float(pg[key]), abs=1e-6)
        # every epoch sees the same tokens: the total is the plain mean of the two
        assert means[key] == pytest.approx((means[f"{key}/epoch1"] + means[f"{key}/epoch2"]) / 2, abs=1e-9)
    assert means["approx_kl/epoch2"] != pytest.approx(means["approx_kl/epoch1"], abs=1e-6)  # the update moved


@pytest.mark.parametrize(
    "kind, keys, named",
    [
        ("grpo", ("online.dual_clip=1.0",), "online.dual_clip"),
        ("grpo", ("online.clip_eps_high=0",), "online.clip_eps_high"),
        ("grpo", ("online.kl_loss_estimator=k1",), "online.kl_loss_estimator"),
        ("grpo", ("online.importance_sampling_level=seq",), "online.importance_sampling_level"),
        ("ppo", ("online.dynamic_sampling=true",), "online.dynamic_sampling"),
        ("grpo", ("online.dynamic_sampling_rounds=0",), "online.dynamic_sampling_rounds"),
    ],
)
def test_bad_loss_keys_are_refused_by_name(kind, keys, named):
    with pytest.raises(ConfigError, match=named):
        load_config(None, [*REQUIRED, "online.group_size=2", *keys], kind)


# ---------------------------------------------------------------------------------------------------------
# dynamic sampling


def test_informative_rows_by_hand():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0, 3.0, float("nan")])
    group_ids = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    kept = torch.tensor(
        [True, True, True, True, True, True, True, False]
    )  # group 3: one kept, junk beside it
    assert informative_rows(scores, group_ids, kept).tolist() == [
        False,
        False,
        True,
        True,
        False,
        False,
        False,
        False,
    ]
    kept[4] = False  # a group of one kept response teaches nothing either
    assert not informative_rows(scores, group_ids, kept)[4:6].any()


def _rollout(scores_per_group, width, prompt_width, first_id=0):
    """A hand-built rollout of groups of 2 (every response kept), responses ``width`` long."""
    n = 2 * len(scores_per_group)
    ids = torch.arange(n * width).reshape(n, width) % 50 + 3
    return Rollout(
        query_ids=torch.full((n, prompt_width), 7),
        query_mask=torch.ones(n, prompt_width, dtype=torch.long),
        response_ids=ids,
        mask=torch.ones(n, width, dtype=torch.bool),
        logprobs=-torch.rand(n, width),
        ref_logprobs=-torch.rand(n, width),
        group_ids=torch.arange(first_id, first_id + len(scores_per_group)).repeat_interleave(2),
        ended=torch.ones(n, dtype=torch.bool),
        response_mask=torch.ones(n, width, dtype=torch.bool),
        entropy=torch.rand(n, width),
    ), Scores(
        torch.tensor([s for pair in scores_per_group for s in pair]),
        torch.tensor([s for pair in scores_per_group for s in pair]),
        {},
        torch.ones(n, dtype=torch.bool),
        None,
    )


def _ctx(rounds):
    online = SimpleNamespace(group_size=2, dynamic_sampling_rounds=rounds)
    return SimpleNamespace(
        cfg=SimpleNamespace(online=online),
        device=torch.device("cpu"),
        accelerator=SimpleNamespace(num_processes=1),
        tokenizer=SimpleNamespace(pad_token_id=0),
        all_sum=lambda x: x.double(),
    )


def test_groups_without_spread_are_replaced_by_new_groups_with_one():
    rollout, scores = _rollout([(1.0, 1.0), (0.0, 1.0), (2.0, 2.0)], width=3, prompt_width=2)
    batch = {"records": [{"prompt": f"p{i // 2}"} for i in range(6)]}
    extra, extra_scores = _rollout([(5.0, 5.0), (3.0, 4.0), (1.0, 0.0)], width=5, prompt_width=4, first_id=0)
    calls = []

    def draw(round_):
        calls.append(round_)
        return {"records": [{"prompt": f"x{i // 2}"} for i in range(6)]}, extra, extra_scores

    out_batch, out, out_scores, stats = fill_informative_groups(_ctx(3), batch, rollout, scores, draw)
    assert calls == [1]  # one round filled both slots
    assert out.batch_size == 6 and out.response_ids.shape[1] == 5 and out.query_ids.shape[1] == 4
    assert out_scores.scores.tolist() == [3.0, 4.0, 0.0, 1.0, 1.0, 0.0]  # slots 0 and 2 <- new groups 1 and 2
    assert out.group_ids.tolist() == rollout.group_ids.tolist()  # a filled slot keeps its id
    assert [r["prompt"] for r in out_batch["records"]] == ["x1", "x1", "p1", "p1", "x2", "x2"]
    assert torch.equal(out.response_ids[2:4, :3], rollout.response_ids[2:4])  # the kept group, untouched
    assert not out.mask[2:4, 3:].any() and torch.equal(out.logprobs[0], extra.logprobs[2])
    assert torch.equal(out.query_mask[2:4], torch.tensor([[0, 0, 1, 1]] * 2))  # left padded
    means = stats.means(_ctx(3))
    assert means == {"groups/resampled": 2.0, "groups/unfilled": 0.0, "groups/sampling_rounds": 1.0}


def test_dynamic_sampling_stops_at_its_bound_and_says_so():
    rollout, scores = _rollout([(1.0, 1.0), (0.0, 1.0), (2.0, 2.0)], width=3, prompt_width=2)
    batch = {"records": [{"prompt": "p"}] * 6}
    extra, extra_scores = _rollout([(5.0, 5.0)] * 3, width=3, prompt_width=2)
    calls = []

    def draw(round_):
        calls.append(round_)
        return {"records": [{"prompt": "x"}] * 6}, extra, extra_scores

    _, out, out_scores, stats = fill_informative_groups(_ctx(2), batch, rollout, scores, draw)
    assert calls == [1, 2] and out.batch_size == 6  # the bound, and the batch keeps its size
    assert torch.equal(out_scores.scores, scores.scores)
    assert stats.means(_ctx(2)) == {
        "groups/resampled": 0.0,
        "groups/unfilled": 2.0,
        "groups/sampling_rounds": 2.0,
    }


def _prompted(scores_per_group, width, prompt_width, token):
    """:func:`_rollout` whose group j has its own prompt, ``prompt_width`` tokens ``token + j``."""
    rollout, scores = _rollout(scores_per_group, width, prompt_width)
    groups = torch.arange(len(scores_per_group)).repeat_interleave(2)  # (B,)
    rollout.query_ids = (token + groups)[:, None].expand(-1, prompt_width).clone()
    return rollout, scores


def _batch_of(rollout, name):
    return {
        "query_ids": rollout.query_ids,
        "query_mask": rollout.query_mask,
        "group_ids": rollout.group_ids,
        "records": [{"prompt": f"{name}{i // 2}"} for i in range(rollout.batch_size)],
    }


def test_a_replacement_group_carries_its_own_prompt_ids():
    """The filled slot's rows read the new prompt (ids and mask, left padded to the wider batch), in the
    rollout and in the batch the loop goes on with; the kept group keeps its own."""
    rollout, scores = _prompted([(1.0, 1.0), (0.0, 1.0), (2.0, 2.0)], width=3, prompt_width=2, token=10)
    extra, extra_scores = _prompted([(5.0, 5.0), (3.0, 4.0), (1.0, 0.0)], width=3, prompt_width=4, token=40)
    out_batch, out, _, _ = fill_informative_groups(
        _ctx(3),
        _batch_of(rollout, "p"),
        rollout,
        scores,
        lambda r: (_batch_of(extra, "x"), extra, extra_scores),
    )
    pad = _ctx(3).tokenizer.pad_token_id
    assert out.query_ids.tolist() == [
        [41] * 4,  # slot 0 <- new group 1
        [41] * 4,
        [pad, pad, 11, 11],  # kept
        [pad, pad, 11, 11],
        [42] * 4,  # slot 2 <- new group 2
        [42] * 4,
    ]
    assert out.query_mask.tolist() == [[1] * 4, [1] * 4, [0, 0, 1, 1], [0, 0, 1, 1], [1] * 4, [1] * 4]
    assert torch.equal(out_batch["query_ids"], out.query_ids)
    assert torch.equal(out_batch["query_mask"], out.query_mask)
    assert [r["prompt"] for r in out_batch["records"]] == ["x1", "x1", "p1", "p1", "x2", "x2"]


def test_slots_a_partial_round_leaves_empty_are_filled_by_the_next_round():
    """Round 1 has one group with a spread for two empty slots: it fills the first; round 2 fills the
    other; no third round is drawn."""
    rollout, scores = _prompted([(1.0, 1.0), (0.0, 1.0), (2.0, 2.0)], width=3, prompt_width=2, token=10)
    rounds = {
        1: _prompted([(5.0, 5.0), (3.0, 4.0), (6.0, 6.0)], width=3, prompt_width=2, token=40),
        2: _prompted([(7.0, 8.0), (9.0, 9.0), (9.0, 9.0)], width=3, prompt_width=2, token=70),
    }
    calls = []

    def draw(round_):
        calls.append(round_)
        extra, extra_scores = rounds[round_]
        return _batch_of(extra, f"r{round_}-"), extra, extra_scores

    out_batch, out, out_scores, stats = fill_informative_groups(
        _ctx(3), _batch_of(rollout, "p"), rollout, scores, draw
    )
    assert calls == [1, 2]
    assert out_scores.scores.tolist() == [3.0, 4.0, 0.0, 1.0, 7.0, 8.0]
    assert out.query_ids[:, 0].tolist() == [41, 41, 11, 11, 70, 70]
    assert [r["prompt"] for r in out_batch["records"]] == ["r1-1", "r1-1", "p1", "p1", "r2-0", "r2-0"]
    assert out.group_ids.tolist() == rollout.group_ids.tolist()
    assert stats.means(_ctx(3)) == {
        "groups/resampled": 2.0,
        "groups/unfilled": 0.0,
        "groups/sampling_rounds": 2.0,
    }


def test_concat_rollouts_refuses_a_field_set_on_one_side_only():
    a, _ = _rollout([(1.0, 2.0)], 2, 2)
    b, _ = _rollout([(1.0, 2.0)], 2, 2)
    b.values = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="values"):
        concat_rollouts(a, b, 0)


HALF_CONSTANT = '''
def half_constant(prompts, completions, **kwargs):
    """The response's length for prompts of odd length, 1.0 for the others (those groups never spread)."""
    return [float(len(c)) if len(p) % 2 else 1.0 for p, c in zip(prompts, completions)]
'''


def test_a_grpo_run_with_dynamic_sampling_trains_on_groups_that_spread(paths, tmp_path, monkeypatch):
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    rewards = tmp_path / "half.py"
    rewards.write_text(HALF_CONSTANT)
    common = (
        f"online.reward_functions=[{rewards}:half_constant]",
        "train.max_steps=2",
        "online.missing_eos=none",
    )
    zero_std = {}
    for on in (False, True):
        out = tmp_path / f"dyn-{on}"
        cfg = online_config(paths, out, *common, f"online.dynamic_sampling={str(on).lower()}", kind="grpo")
        train(cfg, hooks=OnlineHooks(evaluate_at_start=False))
        rows = [r for r in read_metrics(out / "metrics.jsonl") if "groups/zero_std_fraction" in r]
        zero_std[on] = sum(r["groups/zero_std_fraction"] for r in rows) / len(rows)
        if on:
            assert all(r["groups/resampled"] >= 1 and "groups/unfilled" in r for r in rows)
        else:
            assert all("groups/resampled" not in r for r in rows)
    assert zero_std[False] >= 0.25 and zero_std[True] < zero_std[False]
