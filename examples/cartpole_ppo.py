"""PPO on gymnasium's CartPole-v1, with rlhfkit's algorithm core for GAE and every loss.

The same ``rlhfkit.algos`` that trains language models solves classic control: this script
takes ``compute_gae`` (with ``dones``), ``ppo_policy_loss``, ``value_loss``,
``entropy_from_logits``, ``aggregate_loss`` and ``masked_whiten`` from the library and writes
only the environment loop and the network here. Hyper-parameters follow CleanRL's ``ppo.py``
(Huang et al. 2022, "The 37 Implementation Details of PPO"); the algorithm is Schulman et al.
2017 (PPO, eq. 7 and 9) with GAE from Schulman et al. 2016 (eq. 16).

Data layout is rlhfkit's ``(B, T)`` = ``(num_envs, steps)``: row ``b`` is env ``b``'s fragment
of ``steps`` consecutive transitions, which may hold several episodes. ``dones[b, t] = 1`` means
the episode ended after action ``t`` (rlhfkit's convention, docs/design.md). Gymnasium separates two endings:

* ``terminated`` (the pole fell): the true value after it is 0, so nothing is added;
* ``truncated`` (the 500-step time limit): the state still has value, so ``gamma * V(s_final)``
  is added to that step's reward before the episode is cut with ``done = 1`` (docs/design.md,
  "The algorithm core": "to bootstrap a truncated fragment"; Pardo et al. 2018, "Time Limits in RL").

The end of each rollout fragment is a truncation too: the last reward of a row whose episode
goes on gets ``gamma * V(s_T)``.

Departures from CleanRL: time-limit truncation is bootstrapped (CleanRL treats it as a
termination), and the vector env resets in the same step (``AutoresetMode.SAME_STEP``) so that
the final observation of an episode is available for that bootstrap. Rollouts are 8 envs x 64
steps (CleanRL: 4 x 128): the same 512 transitions per update, but one network call serves 8 envs.
(8 x 128 halves the updates per environment step and needed 300-355k steps instead of 160-200k.)

Run (one process, CPU, one torch thread; about 1-3 minutes on an idle core)::

    python examples/cartpole_ppo.py                 # stop at mean return >= 475 (last 20 episodes)
    python examples/cartpole_ppo.py --seed 2 --threads 1 --total-steps 500000
    python examples/cartpole_ppo.py --smoke         # a few thousand steps, seconds

There is no multi-process mode: the network is tiny and the environment step dominates.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import gymnasium as gym
import numpy as np
import torch
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from torch import nn

from rlhfkit.algos import (
    aggregate_loss,
    compute_gae,
    entropy_from_logits,
    masked_whiten,
    ppo_policy_loss,
    value_loss,
)


@dataclass
class Args:
    """Every option of this script, with CleanRL's CartPole defaults."""

    seed: int = field(default=1, metadata={"help": "seed for torch, numpy and the environments"})
    threads: int = field(
        default=1, metadata={"help": "torch intra-op threads (1 is fastest for this tiny net)"}
    )
    total_steps: int = field(
        default=500_000, metadata={"help": "environment-step budget (all envs together)"}
    )
    num_envs: int = field(default=8, metadata={"help": "parallel environments: the batch dimension B"})
    num_steps: int = field(default=64, metadata={"help": "steps per env per rollout: the time dimension T"})
    learning_rate: float = field(default=2.5e-4, metadata={"help": "Adam step size, annealed linearly to 0"})
    anneal_lr: bool = field(default=True, metadata={"help": "anneal the learning rate linearly to 0"})
    gamma: float = field(default=0.99, metadata={"help": "discount factor"})
    lam: float = field(default=0.95, metadata={"help": "GAE lambda"})
    num_minibatches: int = field(default=4, metadata={"help": "minibatches per PPO epoch"})
    ppo_epochs: int = field(default=4, metadata={"help": "passes over each rollout"})
    clip_eps: float = field(default=0.2, metadata={"help": "PPO ratio clip (also the value clip)"})
    ent_coef: float = field(default=0.01, metadata={"help": "entropy bonus coefficient"})
    vf_coef: float = field(default=0.5, metadata={"help": "value loss coefficient"})
    max_grad_norm: float = field(default=0.5, metadata={"help": "global gradient-norm clip"})
    target_return: float = field(default=475.0, metadata={"help": "stop once the mean return reaches this"})
    window: int = field(default=20, metadata={"help": "episodes in the moving mean of the return"})
    log_every: int = field(default=10, metadata={"help": "print progress every N rollouts (0: never)"})
    smoke: bool = field(
        default=False, metadata={"help": "tiny run (4 envs x 64 steps, 4096 steps) for tests"}
    )

    def __post_init__(self):
        if self.smoke:
            self.total_steps = min(self.total_steps, 4096)
            self.num_envs, self.num_steps = 4, 64
        if self.num_envs * self.num_steps % self.num_minibatches:
            raise SystemExit("num_envs * num_steps must be divisible by num_minibatches")


def parse_args(argv: list[str] | None = None) -> Args:
    """Build the command line from :class:`Args` (one declaration of every option)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in dataclasses.fields(Args):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=f.default, help=f.metadata["help"]
            )
        else:
            kind = {"int": int, "float": float}[f.type] if isinstance(f.type, str) else f.type
            parser.add_argument(flag, type=kind, default=f.default, help=f.metadata["help"])
    return Args(**vars(parser.parse_args(argv)))


def make_envs(num_envs: int, seed: int) -> SyncVectorEnv:
    """``num_envs`` CartPole-v1 copies that reset in the step that ends an episode."""
    envs = SyncVectorEnv(
        [lambda: gym.make("CartPole-v1") for _ in range(num_envs)], autoreset_mode=AutoresetMode.SAME_STEP
    )
    envs.action_space.seed(seed)
    return envs


def _layer(inp: int, out: int, std: float) -> nn.Linear:
    """Orthogonal weights, zero bias (CleanRL's ``layer_init``; detail 2 of "The 37 details")."""
    layer = nn.Linear(inp, out)
    nn.init.orthogonal_(layer.weight, std)
    nn.init.zeros_(layer.bias)
    return layer


class ActorCritic(nn.Module):
    """Separate 64-64 tanh MLPs for the policy logits and the value."""

    def __init__(self, obs_dim: int, num_actions: int):
        super().__init__()
        root2 = float(np.sqrt(2))
        self.actor = nn.Sequential(
            _layer(obs_dim, 64, root2),
            nn.Tanh(),
            _layer(64, 64, root2),
            nn.Tanh(),
            _layer(64, num_actions, 0.01),
        )
        self.critic = nn.Sequential(
            _layer(obs_dim, 64, root2), nn.Tanh(), _layer(64, 64, root2), nn.Tanh(), _layer(64, 1, 1.0)
        )

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """obs (..., obs_dim) -> logits (..., A), values (...)."""
        return self.actor(obs), self.critic(obs).squeeze(-1)


def make_agent(seed: int) -> ActorCritic:
    """A freshly initialised agent for CartPole (4 observations, 2 actions), seeded."""
    torch.manual_seed(seed)
    return ActorCritic(4, 2)


def _logprobs(logits: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """logits (..., A), actions (...) -> log pi(action) (...)."""
    return torch.log_softmax(logits, dim=-1).gather(-1, actions.unsqueeze(-1)).squeeze(-1)


class EpisodeTracker:
    """Returns of finished episodes, and the env step at which the moving mean first hit the target."""

    def __init__(self, num_envs: int, window: int, target: float):
        self.running = np.zeros(num_envs)
        self.returns: list[float] = []
        self.recent: deque[float] = deque(maxlen=window)
        self.target = target
        self.reached_at: int | None = None  # env steps when the moving mean first reached the target
        self.reached_mean = float("-inf")  # the moving mean at that moment

    def step(self, rewards: np.ndarray, done: np.ndarray, env_steps: int) -> None:
        self.running += rewards
        for i in np.flatnonzero(done):
            self.returns.append(float(self.running[i]))
            self.recent.append(float(self.running[i]))
            self.running[i] = 0.0
        if self.reached_at is None and self.mean() >= self.target:
            self.reached_at, self.reached_mean = env_steps, self.mean()

    def mean(self) -> float:
        """Mean of the last ``window`` episodes; -inf before the window is full."""
        return float(np.mean(self.recent)) if len(self.recent) == self.recent.maxlen else float("-inf")


def collect_rollout(
    envs, agent: ActorCritic, obs: np.ndarray, args: Args, tracker: EpisodeTracker, env_steps: int
) -> tuple[dict[str, torch.Tensor], np.ndarray, int]:
    """Play ``num_steps`` steps in every env; return the (B, T) batch, the next observation, env steps.

    Batch keys: ``obs`` (B, T, 4), ``actions``, ``logprobs``, ``values``, ``rewards``, ``dones`` (B, T).
    ``rewards`` already carry the truncation bootstraps described in the module docstring.
    """
    B, T = args.num_envs, args.num_steps
    batch = {"obs": torch.zeros(B, T, 4), "actions": torch.zeros(B, T, dtype=torch.long)}
    batch.update({k: torch.zeros(B, T) for k in ("logprobs", "values", "rewards", "dones")})
    for t in range(T):
        obs_t = torch.as_tensor(obs, dtype=torch.float32)  # (B, 4)
        with torch.no_grad():
            logits, values = agent(obs_t)
            actions = torch.distributions.Categorical(logits=logits).sample()  # (B,)
        obs, rewards, terminated, truncated, info = envs.step(actions.numpy())
        env_steps += B
        done = terminated | truncated
        tracker.step(rewards, done, env_steps)
        rewards = torch.as_tensor(rewards, dtype=torch.float32)
        cut = truncated & ~terminated  # time limit: the state after it still has value
        if cut.any():
            final_obs = torch.as_tensor(np.stack(info["final_obs"][cut]), dtype=torch.float32)
            with torch.no_grad():
                rewards[torch.as_tensor(cut)] += args.gamma * agent(final_obs)[1]
        batch["obs"][:, t], batch["actions"][:, t] = obs_t, actions
        batch["logprobs"][:, t] = _logprobs(logits, actions)
        batch["values"][:, t], batch["rewards"][:, t] = values, rewards
        batch["dones"][:, t] = torch.as_tensor(done, dtype=torch.float32)
    # The fragment ends where the rollout stops: bootstrap rows whose episode goes on.
    with torch.no_grad():
        next_values = agent(torch.as_tensor(obs, dtype=torch.float32))[1]  # (B,)
    batch["rewards"][:, -1] += args.gamma * next_values * (1.0 - batch["dones"][:, -1])
    return batch, obs, env_steps


def ppo_update(
    agent: ActorCritic,
    optimizer: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
    args: Args,
    generator: torch.Generator,
) -> dict[str, float]:
    """PPO epochs over one rollout; ``batch`` must hold ``advantages`` and ``returns`` (B, T).

    Minibatches are random sets of transitions (CleanRL), laid out as one row (1, M) with an all-ones
    mask, so that every per-token loss and ``aggregate_loss("token-mean")`` applies unchanged.
    """
    flat = {k: v.reshape(args.num_envs * args.num_steps, *v.shape[2:]) for k, v in batch.items()}
    n = args.num_envs * args.num_steps
    size = n // args.num_minibatches
    sums: dict[str, float] = {}
    count = 0
    for _ in range(args.ppo_epochs):
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, size):
            mb = {k: v[order[start : start + size]].unsqueeze(0) for k, v in flat.items()}  # (1, M, ...)
            mask = torch.ones_like(mb["rewards"])  # (1, M)
            logits, values = agent(mb["obs"])  # (1, M, 2), (1, M)
            logprobs = _logprobs(logits, mb["actions"])
            advantages = masked_whiten(mb["advantages"], mask)  # per-minibatch (CleanRL detail 7)
            pg, pg_stats = ppo_policy_loss(logprobs, mb["logprobs"], advantages, clip_eps=args.clip_eps)
            vf, vf_stats = value_loss(values, mb["values"], mb["returns"], value_clip_eps=args.clip_eps)
            ent = entropy_from_logits(logits)  # (1, M)
            per_token = pg + args.vf_coef * vf - args.ent_coef * ent
            loss = aggregate_loss(per_token, mask, "token-mean")
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
            optimizer.step()
            stats = {
                "loss/total": loss,
                "loss/policy": aggregate_loss(pg, mask, "token-mean"),
                "loss/value": aggregate_loss(vf, mask, "token-mean"),
                "entropy/mean": aggregate_loss(ent, mask, "token-mean"),
                **{f"policy/{k}": v for k, v in pg_stats.items()},
                **{f"value/{k}": v for k, v in vf_stats.items()},
            }
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + float(torch.as_tensor(v).detach())
            count += 1
    return {k: v / count for k, v in sums.items()}


@dataclass
class Result:
    """What a run returns: the figures printed at the end, plus the per-rollout statistics."""

    agent: ActorCritic
    env_steps: int
    wall_seconds: float
    episode_returns: list[float]
    mean_return: float  # mean of the last ``window`` episodes at the end (-inf if fewer finished)
    reached_at: int | None  # env steps at which the mean first reached the target
    reached_mean: float  # the mean at that moment (the rest of that rollout still adds episodes)
    history: list[dict[str, float]]


def train(args: Args, agent: ActorCritic | None = None) -> Result:
    """Run PPO until the mean return reaches ``args.target_return`` or the step budget runs out."""
    torch.set_num_threads(args.threads)
    np.random.seed(args.seed)
    agent = agent if agent is not None else make_agent(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
    envs = make_envs(args.num_envs, args.seed)
    obs, _ = envs.reset(seed=args.seed)
    tracker = EpisodeTracker(args.num_envs, args.window, args.target_return)
    mask = torch.ones(args.num_envs, args.num_steps)  # (B, T): every transition is real
    num_rollouts = max(1, args.total_steps // (args.num_envs * args.num_steps))
    history, env_steps, start = [], 0, time.perf_counter()
    for rollout in range(num_rollouts):
        if args.anneal_lr:
            optimizer.param_groups[0]["lr"] = args.learning_rate * (1.0 - rollout / num_rollouts)
        # 1. play
        batch, obs, env_steps = collect_rollout(envs, agent, obs, args, tracker, env_steps)
        if tracker.reached_at is not None:
            break
        # 2. advantages: GAE over (B, T) with episode ends inside rows
        batch["advantages"], batch["returns"] = compute_gae(
            batch["rewards"], batch["values"], mask, gamma=args.gamma, lam=args.lam, dones=batch["dones"]
        )
        # 3. PPO epochs
        stats = ppo_update(agent, optimizer, batch, args, generator)
        stats.update(env_steps=env_steps, mean_return=tracker.mean(), episodes=len(tracker.returns))
        history.append(stats)
        if args.log_every and (rollout + 1) % args.log_every == 0:
            sps = env_steps / (time.perf_counter() - start)
            print(
                f"steps {env_steps:7d}  episodes {len(tracker.returns):5d}  "
                f"mean return (last {args.window}) {tracker.mean():6.1f}  "
                f"policy {stats['loss/policy']:+.4f}  value {stats['loss/value']:.3f}  "
                f"entropy {stats['entropy/mean']:.3f}  clip {stats['policy/clipfrac']:.3f}  "
                f"approx-KL {stats['policy/approx_kl']:.4f}  steps/s {sps:.0f}",
                flush=True,
            )
    envs.close()
    return Result(
        agent,
        env_steps,
        time.perf_counter() - start,
        tracker.returns,
        tracker.mean(),
        tracker.reached_at,
        tracker.reached_mean,
        history,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = train(args)
    print(
        f"total env steps {result.env_steps}, wall time {result.wall_seconds:.1f} s, "
        f"threads {args.threads}, seed {args.seed}"
    )
    print(f"mean return over the last {args.window} episodes at the end: {result.mean_return:.1f}")
    if result.reached_at is not None:
        print(
            f"reached a mean of {result.reached_mean:.1f} (target {args.target_return:g}) "
            f"at {result.reached_at} env steps"
        )
        return 0
    print(f"did not reach {args.target_return:g} within {args.total_steps} env steps")
    return 0 if args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
