"""A process reward model over tool episodes reads the rows the policy reads: the whole row (prompt, model
turns, tool results and template text between them) with positions counted over it, its step rewards on the
model's step ends only."""

from types import SimpleNamespace

import torch

from rlhfkit.data import TokenLimits
from rlhfkit.models import token_scores
from rlhfkit.rollout.process_rewards import step_end_table
from rlhfkit.tasks import get_task
from rlhfkit.trainers.online.shaping import with_process_rewards
from rlhfkit.types import Rollout
from tests.helpers import tiny_llama

PROMPTS = ["Compute 7+5-3.", "Compute 9-4+8-6."]
# (text, the model's) pieces of each episode: model steps with a tool result and template text between them
EPISODES = [
    [("7+5=12\n", True), ("result 12\n", False), ("12-3=9\n", True), ("answer=9\n", True)],
    [("9-4=5\n", True), ("result 5\nresult 13\n", False), ("5+8=13\n", True)],
]


def test_prm_reads_the_whole_row_of_a_tool_episode_and_scores_the_model_steps_only(tmp_path):
    tok = get_task("arithmetic").build_tokenizer(tmp_path / "tok")
    prm = tiny_llama("scalar", seed=3, vocab_size=len(tok), pad_token_id=tok.pad_token_id)
    table = step_end_table(tok, TokenLimits().step_separator)
    pad = tok.pad_token_id
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    pieces = [[(tok(t, add_special_tokens=False)["input_ids"], m) for t, m in e] for e in EPISODES]
    rows = [[i for ids, _ in e for i in ids] for e in pieces]
    model = [[m for ids, m in e for _ in ids] for e in pieces]
    P, T = max(map(len, prompts)) + 2, max(map(len, rows)) + 3  # left padding, and junk after every row
    query = torch.tensor([[pad] * (P - len(p)) + p for p in prompts])
    response = torch.tensor([r + [tok.eos_token_id] * (T - len(r)) for r in rows])
    mask = torch.tensor([m + [False] * (T - len(m)) for m in model])
    response_mask = torch.tensor([[True] * len(r) + [False] * (T - len(r)) for r in rows])
    zeros = torch.zeros(response.shape)
    rollout = Rollout(
        query, (query != pad).long(), response, mask, zeros, zeros, scores=torch.zeros(2),
        response_mask=response_mask,
    )  # fmt: skip
    ctx = SimpleNamespace(
        process_reward_model=prm,
        step_end_table=table,
        cfg=SimpleNamespace(online=SimpleNamespace(rollout_batch_size=1)),
        device=torch.device("cpu"),
    )
    dense, _ = with_process_rewards(ctx, rollout)
    for i, (prompt, row) in enumerate(zip(prompts, rows, strict=True)):
        alone = torch.tensor([prompt + row])  # the row unpadded, every token attended
        with torch.no_grad():
            logits = token_scores(prm, alone, torch.ones_like(alone))[0, len(prompt) :]
        ends = [t for t, (token, own) in enumerate(zip(row, model[i], strict=True)) if own and table[token]]
        assert len(ends) == sum(
            own for _, own in EPISODES[i]
        )  # a step end per model step, none in the results
        assert torch.allclose(dense[i, ends], torch.sigmoid(logits[ends]) - 1, atol=1e-5)
        others = torch.ones(T, dtype=torch.bool)
        others[ends] = False
        assert (dense[i, others] == 0).all()
