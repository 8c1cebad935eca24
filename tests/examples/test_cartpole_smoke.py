"""examples/cartpole_ppo.py: the PPO loop runs on rlhfkit.algos, maps episode ends right, and learns.

Tiers (docs/design.md, "Tests"): hand-checked rollout bookkeeping (truncation bootstraps, dones), a smoke run
whose parameters must change with finite losses, a short run that must beat a random policy, and the
command line in-process. The full run (mean return >= 475 within 500k steps) takes minutes and is not
part of the suite; see examples/README.md.
"""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from tests.examples.loader import load_example

cp = load_example("cartpole_ppo")


def _constant_critic(agent, value: float) -> None:
    """Make V(s) = value for every state, so the expected bootstraps are known numbers."""
    last = agent.critic[-1]
    with torch.no_grad():
        last.weight.zero_()
        last.bias.fill_(value)


def test_rollout_bootstraps_truncation_not_termination():
    """Time-limit ends get r + gamma*V(s_final) and done=1; the fragment end gets r + gamma*V(s_T)."""
    args = cp.Args(num_envs=3, num_steps=12, gamma=0.9)
    # A 5-step time limit: a random policy never lets the pole fall that soon, so every episode
    # is truncated at t = 4 and t = 9, and the rows end mid-episode at t = 11.
    envs = SyncVectorEnv(
        [lambda: gym.make("CartPole-v1", max_episode_steps=5) for _ in range(3)],
        autoreset_mode=AutoresetMode.SAME_STEP,
    )
    obs, _ = envs.reset(seed=0)
    agent = cp.make_agent(0)
    _constant_critic(agent, 3.0)
    tracker = cp.EpisodeTracker(3, window=2, target=1e9)
    batch, _, env_steps = cp.collect_rollout(envs, agent, obs, args, tracker, env_steps=0)
    envs.close()

    expected_dones = torch.zeros(3, 12)
    expected_dones[:, [4, 9]] = 1.0
    expected_rewards = torch.ones(3, 12)
    expected_rewards[:, [4, 9, 11]] += 0.9 * 3.0
    torch.testing.assert_close(batch["dones"], expected_dones)
    torch.testing.assert_close(batch["rewards"], expected_rewards)
    assert env_steps == 36 and tracker.returns == [5.0] * 6
    assert batch["obs"].shape == (3, 12, 4) and batch["actions"].shape == (3, 12)


def test_rollout_termination_is_not_bootstrapped():
    """A fallen pole (terminated) keeps reward 1: nothing is added for the state after it."""
    args = cp.Args(num_envs=2, num_steps=60, gamma=0.9)
    envs = cp.make_envs(2, seed=0)
    obs, _ = envs.reset(seed=0)
    agent = cp.make_agent(0)
    _constant_critic(agent, 3.0)
    with torch.no_grad():  # always push left: the pole falls within ~10 steps, never truncates
        agent.actor[-1].weight.zero_()
        agent.actor[-1].bias.copy_(torch.tensor([50.0, -50.0]))
    tracker = cp.EpisodeTracker(2, window=2, target=1e9)
    batch, _, _ = cp.collect_rollout(envs, agent, obs, args, tracker, env_steps=0)
    envs.close()
    done = batch["dones"].bool()
    assert done[:, :-1].sum() >= 4  # several terminations per row
    assert torch.all(batch["rewards"][:, :-1] == 1.0)  # terminations carry no bootstrap
    torch.testing.assert_close(batch["rewards"][:, -1], torch.where(done[:, -1], 1.0, 1.0 + 2.7))


def test_episode_tracker_moving_mean_and_first_reach():
    tracker = cp.EpisodeTracker(2, window=2, target=10.0)
    tracker.step(np.array([4.0, 6.0]), np.array([False, True]), env_steps=2)  # env 1 ends: 6
    assert tracker.returns == [6.0] and tracker.mean() == float("-inf")  # window not full yet
    tracker.step(np.array([10.0, 8.0]), np.array([True, False]), env_steps=4)  # env 0 ends: 14
    assert tracker.returns == [6.0, 14.0] and tracker.mean() == 10.0 and tracker.reached_at == 4
    tracker.step(np.array([1.0, 1.0]), np.array([True, True]), env_steps=6)  # 1 and 9: mean 5
    assert tracker.mean() == 5.0 and (tracker.reached_at, tracker.reached_mean) == (4, 10.0)


def test_smoke_run_changes_parameters_with_finite_losses():
    args = cp.Args(smoke=True, seed=0, log_every=0)
    agent = cp.make_agent(0)
    before = [p.detach().clone() for p in agent.parameters()]
    result = cp.train(args, agent)
    assert result.env_steps == 4096 and len(result.history) == 16
    for stats in result.history:
        for name in (
            "loss/total",
            "loss/policy",
            "loss/value",
            "entropy/mean",
            "policy/clipfrac",
            "policy/approx_kl",
            "value/clipfrac",
        ):
            assert math.isfinite(stats[name]), (name, stats)
        assert 0.0 < stats["entropy/mean"] <= math.log(2) + 1e-6
    for p0, p1 in zip(before, agent.parameters(), strict=True):
        assert not torch.equal(p0, p1)
    assert len(result.episode_returns) > 20


def _random_policy_mean_return(episodes: int, seed: int) -> float:
    env = gym.make("CartPole-v1")
    env.action_space.seed(seed)
    returns = []
    for i in range(episodes):
        env.reset(seed=seed + i)
        total, done = 0.0, False
        while not done:
            _, r, terminated, truncated, _ = env.step(env.action_space.sample())
            total, done = total + r, terminated or truncated
        returns.append(total)
    env.close()
    return float(np.mean(returns))


@pytest.mark.slow
@pytest.mark.learning
def test_short_run_beats_a_random_policy(learning_seed, learning_figures):
    """16k steps (16 PPO updates) roughly double the random policy's ~22: learning goes the right way."""
    random_mean = _random_policy_mean_return(200, seed=learning_seed)
    assert 15 < random_mean < 30
    result = cp.train(cp.Args(seed=learning_seed, total_steps=16_384, log_every=0))
    learning_figures(
        random_mean=random_mean, trained_mean=result.mean_return, ratio=result.mean_return / random_mean
    )
    assert result.mean_return > 1.5 * random_mean, (result.mean_return, random_mean)


def test_command_line(capsys):
    assert (
        cp.main(["--smoke", "--total-steps", "512", "--seed", "3", "--log-every", "1", "--threads", "1"]) == 0
    )
    out = capsys.readouterr().out
    assert "total env steps 512" in out and "wall time" in out and "threads 1, seed 3" in out
    args = cp.parse_args(["--no-anneal-lr", "--lam", "0.9", "--num-envs", "2"])
    assert (args.anneal_lr, args.lam, args.num_envs) == (False, 0.9, 2)
