"""A PRM as a dense reward: its scores land on the step-end tokens the PRM trainer reads, whatever the padding,
with the value of the unpadded sequence; and the outcome score still lands on the last token."""

import pytest
import torch

from rlhfkit.algos import shape_rewards
from rlhfkit.data import TokenLimits
from rlhfkit.data.tokenize import tokenize_prm
from rlhfkit.models import token_scores
from rlhfkit.rollout.process_rewards import outcome_and_steps, process_rewards, step_end_table, step_ends
from rlhfkit.tasks import get_task
from tests.helpers import tiny_llama

PROMPTS = ["Compute 7+5-3.", "Compute 9-4+8-6."]
STEPS = [["7+5=12", "12-3=9", "answer=9"], ["9-4=5", "5+8=3"]]  # the second is cut before its answer line


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tok = get_task("arithmetic").build_tokenizer(tmp_path_factory.mktemp("tok"))
    prm = tiny_llama("scalar", seed=3, vocab_size=len(tok), pad_token_id=tok.pad_token_id)
    return tok, prm


def batch(tok, prompts, responses, left_pad, junk):
    """Left-padded prompts (``left_pad`` extra pad columns) then right-padded responses with ``junk`` ids
    after each (outside the mask)."""
    p_ids = [tok(p)["input_ids"] for p in prompts]
    r_ids = [tok(r, add_special_tokens=False)["input_ids"] for r in responses]
    P, T = max(map(len, p_ids)) + left_pad, max(map(len, r_ids)) + 2
    pad = tok.pad_token_id
    q = torch.tensor([[pad] * (P - len(x)) + x for x in p_ids])
    qm = (q != pad).long()
    r = torch.tensor([x + [junk] * (T - len(x)) for x in r_ids])
    m = torch.tensor([[j < len(x) for j in range(T)] for x in r_ids])
    ids = torch.cat([q, r], 1)
    attn = torch.cat([qm, m.long()], 1)
    return ids, attn, P, r, m


@pytest.mark.parametrize("left_pad, junk", [(0, "="), (3, "\n"), (7, "7")])
def test_prm_scores_land_on_the_trainers_step_ends_whatever_the_padding(setup, left_pad, junk):
    tok, prm = setup
    table = step_end_table(tok, TokenLimits().step_separator)
    responses = ["".join(s + "\n" for s in steps) for steps in STEPS]
    responses[1] = responses[1] + "answer="  # an unfinished last step earns nothing
    junk_id = tok(junk, add_special_tokens=False)["input_ids"][0]  # a separator after the end must not count
    ids, attn, start, r, m = batch(tok, PROMPTS, responses, left_pad, junk_id)
    ends = step_ends(r, m, table)
    dense = process_rewards(prm, ids, attn, start, ends)
    for i, (prompt, steps) in enumerate(zip(PROMPTS, STEPS, strict=True)):
        # the positions the PRM was trained to read: tokenize_prm's step ends
        record = tokenize_prm({"prompt": prompt, "steps": steps, "labels": [True] * len(steps)}, tok)
        assert ends[i].nonzero().flatten().tolist() == record["step_ends"]
        # the values of the unpadded sequence there, sigmoid - 1, and exactly 0 elsewhere
        alone = torch.tensor([record["prompt_ids"] + record["completion_ids"]])
        with torch.no_grad():
            logits = token_scores(prm, alone, torch.ones_like(alone))[0, len(record["prompt_ids"]) :]
        at = record["step_ends"]
        assert torch.allclose(dense[i, at], torch.sigmoid(logits[at]) - 1, atol=1e-5)
        others = torch.ones(dense.shape[1], dtype=torch.bool)
        others[at] = False
        assert (dense[i, others] == 0).all()


def test_outcome_on_the_last_token_and_steps_where_they_end_through_shape_rewards():
    mask = torch.tensor([[1, 1, 1, 1, 0], [0, 0, 0, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    dense = torch.tensor([[0.0, 0.5, 0, -0.25, 9.0], [0, 0, 0, 0, 0], [0.75, 0, 0, 0, 0]])
    scores = torch.tensor([1.0, 3.0, -2.0])
    combined = outcome_and_steps(scores, dense, mask)
    expected = torch.tensor([[0.0, 0.5, 0, 0.75, 9.0], [0, 0, 0, 0, 0], [0.75, -2.0, 0, 0, 0]])
    assert torch.equal(combined, expected)
    logprobs, ref = torch.randn(3, 5), torch.randn(3, 5)
    rewards, kl = shape_rewards(combined, logprobs, ref, mask, 0.1, "k1")
    outcome_only, _ = shape_rewards(scores, logprobs, ref, mask, 0.1, "k1")
    step_part = torch.where(mask, dense, 0.0)  # the 9.0 outside the mask never lands
    assert torch.allclose(rewards, outcome_only + step_part, atol=1e-6)


def test_the_table_marks_separator_tokens_only(setup):
    tok, _ = setup
    table = step_end_table(tok, "\n")
    marked = [tok.decode([i]) for i in table.nonzero().flatten().tolist()]
    assert marked and all(t.endswith("\n") for t in marked)
    assert not table[tok.eos_token_id] and not table[tok.pad_token_id]
    with pytest.raises(ValueError, match="separator"):
        step_end_table(tok, "")
