"""The default micro-batch of the online update (rlhfkit.trainers.online.layout.default_micro_batch): the largest
whose predicted peak fits the budget and the machine's memory, the prediction an upper bound of the peaks that
benchmarks/micro_batch_calibration.py measured (micro_batch_peaks.json beside this file)."""

import dataclasses
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import rlhfkit.trainers.online.layout as layout
from rlhfkit.models.head_chunks import CHUNK_ELEMENTS
from rlhfkit.trainers.online.layout import (
    default_micro_batch,
    even_sizes,
    memory_bytes,
    micro_batches,
    prompts_held,
    readout_bytes,
    update_peak_bytes,
)
from tests.examples.loader import ROOT, load_example
from tests.trainers.online.online_fixtures import make_context, online_config, write_online_problem

CAP = 2048  # the minibatch of most tests: never the bound
PEAKS = Path(__file__).with_name("micro_batch_peaks.json")
SMOLLM2 = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, vocab_size=49152)


def _estimate(record: dict) -> int:
    """The estimate for a measured record, as the calibration benchmark's ``--check`` computes it."""
    return load_example("micro_batch_calibration", ROOT / "benchmarks").estimate(record)


def test_the_estimate_bounds_every_measured_peak():
    """Every recorded peak (three architectures; float32 and bf16; LoRA and full; with and without a critic)
    is at most its estimate, and the estimate of the larger peaks is not far above them (a useful bound)."""
    records = json.loads(PEAKS.read_text())
    assert {r["model"] for r in records} >= {"tiny", "smollm2-135m-instruct"}
    every = {(d, lora) for d in ("float32", "bfloat16") for lora in (True, False)}
    assert {(r["dtype"], r["lora"]) for r in records if not r["critic"]} >= every
    assert {(r["lora"], r["critic"]) for r in records} >= {
        (lora, c) for lora in (True, False) for c in (True, False)
    }
    under = [(r, _estimate(r)) for r in records if _estimate(r) < r["peak_bytes"]]
    assert not under, under
    large = [r for r in records if r["peak_bytes"] >= 100 * 2**20]
    assert large and max(_estimate(r) / r["peak_bytes"] for r in large) < 2.5


class _Model(torch.nn.Module):
    """A stand-in whose config has a given shape and which reports ``trained`` trained parameters."""

    def __init__(self, trained: int = 0, **shape):
        super().__init__()
        self.config = SimpleNamespace(**(shape or SMOLLM2))
        self.trained = trained

    def parameters(self, recurse: bool = True):
        return iter([SimpleNamespace(numel=lambda: self.trained, requires_grad=True)])


def _context(prompt=128, response=48, critic=False, lora=16, trained=0, episodes=None, group=1, half=False):
    estimator = "grpo" if group > 1 else "gae"
    cfg = SimpleNamespace(
        data=SimpleNamespace(max_prompt_length=prompt),
        online=SimpleNamespace(response_length=response, group_size=group, advantage_estimator=estimator),
        train=SimpleNamespace(micro_batch_size=None),
        model=SimpleNamespace(lora_rank=lora),
    )
    roles = SimpleNamespace(actor=_Model(trained), critic=_Model(trained) if critic else None)
    if half:  # what rlhfkit.models.precision.autocast_forward marks
        roles.actor.rlhfkit_autocast = torch.bfloat16
    return SimpleNamespace(cfg=cfg, episodes=episodes, roles=roles, device=torch.device("cpu"))


def _by_hand(prompt, response, budget, critic=False, lora=True, trained=0, chunked=True, group=1, half=False):
    """The largest rows whose peak fits ``budget``, from the formula written out (SmolLM2's shape, sdpa): the
    actor's tokens (``rows`` x T + P per prompt held) and the critic's (rows x (P + T)) x 31 x c x 576, the
    read-out (chunked: blocks x 4 V x min(rows x T, chunk), else 12 V x rows x T), g x trained, the overhead."""
    c = layout.LAYER_BYTES_PER_HIDDEN["16-bit" if half else "float32"]["lora" if lora else "full"]
    chunk = CHUNK_ELEMENTS // 49152

    def peak(rows):
        prompts = rows // group if rows % group == 0 else -(-(rows + group - 1) // group)  # a window
        tokens = min(prompts, rows) * prompt + rows * response + (rows * (prompt + response) if critic else 0)
        return (
            tokens * 31 * c * 576
            + (
                layout.READOUT_BLOCKS * 4 * 49152 * min(rows * response, chunk)
                if chunked
                else 12 * 49152 * rows * response
            )
            + layout.GRADIENT_BYTES_PER_PARAMETER * trained
            + layout.UPDATE_OVERHEAD_BYTES
        )

    return max([rows for rows in range(1, CAP + 1) if peak(rows) <= budget] or [1])


@pytest.fixture
def big_machine(monkeypatch):
    """A machine whose memory does not bind (the budget does); the stand-in models read out in chunks."""
    monkeypatch.setattr(layout, "memory_bytes", lambda device="cpu": 2**50)
    monkeypatch.setattr(layout, "chunkable", lambda model: True)


def test_the_default_is_the_largest_micro_batch_within_the_budget(big_machine):
    budget = layout.ACTIVATION_BUDGET_BYTES
    assert default_micro_batch(_context(128, 48), CAP) == _by_hand(128, 48, budget) == 3
    # GRPO's groups of 4 on SmolLM2-135M with LoRA, prompts of 96 and responses of 48 tokens (the issue's)
    assert default_micro_batch(_context(96, 48, group=4), 32) == _by_hand(96, 48, budget, group=4) == 8
    assert default_micro_batch(_context(128, 48), 2) == 2  # never more than the minibatch
    assert default_micro_batch(_context(128, 48, lora=0), CAP) == _by_hand(128, 48, budget, lora=False)
    assert default_micro_batch(_context(128, 10**6), 32) == 1  # at least one row, however long


def test_bf16_autocast_holds_less_per_token(big_machine):
    """SmolLM2-135M in bf16 with LoRA, GRPO's groups of 4, prompts up to 96 and responses of 48 tokens."""
    budget = layout.ACTIVATION_BUDGET_BYTES
    half = default_micro_batch(_context(96, 48, group=4, half=True), 32)
    assert half == _by_hand(96, 48, budget, group=4, half=True) == 9
    assert half > default_micro_batch(_context(96, 48, group=4), 32)


def test_the_default_micro_batch_counts_the_critics_activations_and_the_gradients(big_machine):
    """PPO's actor and critic forwards make one loss and one backward: a row holds both models' activations
    (the critic's without the vocabulary read-out); the trained parameters' gradients count once each."""
    budget = layout.ACTIVATION_BUDGET_BYTES
    alone = default_micro_batch(_context(64, 32), CAP)
    both = default_micro_batch(_context(64, 32, critic=True), CAP)
    assert both == _by_hand(64, 32, budget, critic=True) < alone == _by_hand(64, 32, budget)
    trained = 100_000_000
    full = default_micro_batch(_context(64, 32, critic=True, lora=0, trained=trained), CAP)
    assert full == _by_hand(64, 32, budget, critic=True, lora=False, trained=2 * trained)  # actor and critic
    assert full < default_micro_batch(_context(64, 32, critic=True, lora=0), CAP)


def test_a_model_without_the_chunked_read_out_counts_its_whole_logits(big_machine, monkeypatch):
    monkeypatch.setattr(layout, "chunkable", lambda model: False)
    rows = default_micro_batch(_context(64, 48), CAP)
    assert rows == _by_hand(64, 48, layout.ACTIVATION_BUDGET_BYTES, chunked=False)
    monkeypatch.setattr(layout, "chunkable", lambda model: True)
    assert rows < default_micro_batch(_context(64, 48), CAP)


def test_a_gpu_takes_the_larger_budget(big_machine):
    """On a GPU larger products pay: the budget there is ACCELERATOR_ACTIVATION_BUDGET_BYTES (the same
    SmolLM2 GRPO shape takes 21 rows there, 9 on a CPU)."""
    gpu = _context(96, 48, group=4, half=True)
    gpu.device = torch.device("cuda", 0)  # memory_bytes is the big machine's: no GPU is touched
    assert layout.ACCELERATOR_ACTIVATION_BUDGET_BYTES > layout.ACTIVATION_BUDGET_BYTES
    assert (
        default_micro_batch(gpu, 32)
        == _by_hand(96, 48, layout.ACCELERATOR_ACTIVATION_BUDGET_BYTES, group=4, half=True)
        == 21
    )


def test_the_default_stays_within_a_share_of_the_machines_memory(big_machine, monkeypatch):
    monkeypatch.setattr(layout, "memory_bytes", lambda device="cpu": 4 * 2**30)  # a budget of 512 MiB
    rows = default_micro_batch(_context(64, 32), CAP)
    assert rows == _by_hand(64, 32, 2**29) < _by_hand(64, 32, layout.ACTIVATION_BUDGET_BYTES)


@pytest.mark.parametrize(
    "rows, group, held",
    [(1, 4, 1), (2, 4, 2), (3, 4, 2), (4, 4, 1), (5, 4, 2), (6, 4, 3), (8, 4, 2), (9, 4, 3), (7, 1, 7)],
)
def test_a_micro_batch_holds_the_prompts_of_the_groups_it_touches(rows, group, held):
    """Rows of a group sit together and micro-batches start at multiples of their size: whole groups when
    the size is a multiple of the group, else a window that may straddle one more group."""
    assert prompts_held(rows, group) == held


def test_a_groups_prompt_is_counted_once(big_machine):
    """GRPO reads a group's prompt once (rlhfkit.models.prompt_cache): more rows fit than without groups."""
    budget = layout.ACTIVATION_BUDGET_BYTES
    grouped = default_micro_batch(_context(256, 48, group=4), CAP)
    assert grouped == _by_hand(256, 48, budget, group=4) > default_micro_batch(_context(256, 48), CAP)
    episodes = SimpleNamespace(prompt_limit=lambda: 256)  # an episode's prompt is its own: no sharing
    assert default_micro_batch(_context(256, 48, group=4, episodes=episodes), CAP) == _by_hand(
        256, 48, budget
    )


def test_the_machines_memory_is_read_from_the_system():
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 2**28 < memory_bytes("cpu") <= total


def test_tool_episodes_count_the_tokens_their_tools_add_to_a_prompt(big_machine):
    episodes = SimpleNamespace(prompt_limit=lambda: 128 + 1000)
    rows = default_micro_batch(_context(128, 48, episodes=episodes), CAP)
    assert rows == default_micro_batch(_context(1128, 48), CAP) < default_micro_batch(_context(128, 48), CAP)


def test_the_read_out_holds_a_few_chunks_or_the_whole_logits():
    config = SimpleNamespace(**SMOLLM2)
    chunk = CHUNK_ELEMENTS // 49152
    assert readout_bytes(config, 10) == layout.READOUT_BLOCKS * 4 * 49152 * 10
    assert (
        readout_bytes(config, 10**5)
        == readout_bytes(config, chunk)
        == layout.READOUT_BLOCKS * 4 * 49152 * chunk
    )
    assert readout_bytes(config, 1000, chunked=False) == 12 * 49152 * 1000


def _default_layout_context(tmp_path, kind, *overrides):
    """A tiny run of 8 prompts, one minibatch, the default micro-batch."""
    paths = write_online_problem(tmp_path, reward_model=False)
    overrides = ("train.batch_size=8", "online.num_minibatches=1", "train.micro_batch_size=null", *overrides)
    return make_context(online_config(paths, tmp_path / "run", *overrides, kind=kind))


def test_default_micro_batches_follow_the_budget_and_an_explicit_size_wins(tmp_path, monkeypatch):
    ctx = _default_layout_context(tmp_path, "ppo", "online.group_size=1")
    lengths = torch.arange(8)
    (micros,) = micro_batches(ctx, 1, 0, lengths)
    assert [len(m) for m in micros] == [8]  # a tiny model: the whole minibatch in one forward
    trained = sum(p.numel() for m in ctx.trained.values() for p in m.parameters() if p.requires_grad)

    def peak(rows):  # the actor's and the critic's activations (one backward)
        return update_peak_bytes(
            ctx.roles.actor.config,
            rows,
            ctx.cfg.data.max_prompt_length,
            ctx.cfg.online.response_length,
            trained,
            critic_config=ctx.roles.critic.config,
        )

    for budget_rows, sizes in ((3, [3, 3, 2]), (6, [4, 4])):  # [6, 2] would peak at 6 rows in two forwards
        monkeypatch.setattr(layout, "ACTIVATION_BUDGET_BYTES", peak(budget_rows))
        (micros,) = micro_batches(ctx, 1, 0, lengths)
        assert [len(m) for m in micros] == sizes
    explicit = dataclasses.replace(ctx.cfg, train=dataclasses.replace(ctx.cfg.train, micro_batch_size=6))
    (micros,) = micro_batches(dataclasses.replace(ctx, cfg=explicit), 1, 0, lengths)
    assert [len(m) for m in micros] == [6, 2]  # an explicit size is the size asked for


@pytest.mark.parametrize(
    "n, most, sizes",
    [
        (32, 24, [16, 16]),
        (8, 3, [3, 3, 2]),
        (10, 3, [3, 3, 2, 2]),
        (7, 7, [7]),
        (7, 100, [7]),
        (5, 1, [1] * 5),
    ],
)
def test_even_sizes_are_the_fewest_pieces_of_sizes_within_one(n, most, sizes):
    assert even_sizes(n, most) == sizes
    for n in range(1, 40):
        for most in range(1, 12):
            got = even_sizes(n, most)
            assert sum(got) == n and max(got) <= most and len(got) == -(-n // most)
            assert max(got) - min(got) <= 1 and got == sorted(got, reverse=True)


def test_default_micro_batches_of_groups_are_even_in_whole_groups(tmp_path, monkeypatch):
    """GRPO, 16 rows in groups of 2, a budget of 10 rows: two forwards of 4 whole groups each (a group's
    prompt read once), not 10 + 6 rows (a peak of 10); a budget of 7: whole groups, not even rows."""
    ctx = _default_layout_context(tmp_path, "grpo")
    g = ctx.cfg.online.group_size
    assert g == 2
    monkeypatch.setattr(layout, "default_micro_batch", lambda ctx, rows: 10 if rows == 16 else pytest.fail())
    lengths = torch.randint(1, 40, (16,), generator=torch.Generator().manual_seed(1))
    (micros,) = micro_batches(ctx, 1, 0, lengths)
    assert [len(m) for m in micros] == [8, 8]
    for m in micros:
        assert (m.view(-1, g) // g == (m.view(-1, g) // g)[:, :1]).all()  # whole groups
    monkeypatch.setattr(layout, "default_micro_batch", lambda ctx, rows: 7)  # 3 groups a forward at most
    (micros,) = micro_batches(ctx, 1, 0, lengths)
    assert [len(m) for m in micros] == [6, 6, 4]  # 16 rows cut evenly would be 6, 5, 5: a group cut in two
    for m in micros:
        assert (m.view(-1, g) // g == (m.view(-1, g) // g)[:, :1]).all()
