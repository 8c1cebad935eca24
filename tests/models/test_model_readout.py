"""Read-outs: logprobs_from_logits, padding-independent scores, and the p0 + t - 1 alignment."""

from types import SimpleNamespace

import pytest
import torch

from helpers import TEXTS_FOR_SCORES, pad_batch, tiny_gpt2, tiny_llama
from rlhfkit.models import (
    Sampling,
    last_token_index,
    logprobs_from_logits,
    position_ids_from_mask,
    readout,
    response_logprobs,
    response_values,
    sequence_scores,
    token_scores,
)

EOS, PAD = 2, 3


def reference_logprobs(logits, labels, temperature):
    return torch.log_softmax(logits.double() / temperature, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


# ---------------------------------------------------------------- logprobs_from_logits


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_log_softmax_values_and_gradients(temperature):
    torch.manual_seed(0)
    logits = (3 * torch.randn(3, 5, 11)).requires_grad_()
    labels = torch.randint(0, 11, (3, 5))
    weights = torch.randn(3, 5)
    out = logprobs_from_logits(logits, labels, temperature)
    assert out.shape == (3, 5) and out.dtype == torch.float32
    expected = reference_logprobs(logits, labels, temperature)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)
    (grad,) = torch.autograd.grad((out * weights).sum(), logits)
    (grad_ref,) = torch.autograd.grad((expected * weights.double()).sum(), logits)
    torch.testing.assert_close(grad.double(), grad_ref.double(), atol=1e-5, rtol=0)


def test_logprobs_hand_computed():
    # logits [0, log 3] -> probabilities [1/4, 3/4]; at temperature 0.5 -> [1/10, 9/10].
    logits = torch.tensor([[[0.0, torch.log(torch.tensor(3.0)).item()]]])
    one = logprobs_from_logits(logits, torch.tensor([[1]]))
    half = logprobs_from_logits(logits, torch.tensor([[0]]), temperature=0.5)
    torch.testing.assert_close(one, torch.log(torch.tensor([[0.75]])))
    torch.testing.assert_close(half, torch.log(torch.tensor([[0.1]])))


def test_logprobs_chunked_slice_and_bf16(monkeypatch):
    torch.manual_seed(1)
    full = torch.randn(4, 7, 13)
    view = full[:, 2:-1]  # non-contiguous (B, T, V) slice, as response_logits returns
    labels = torch.randint(0, 13, (4, 4))
    expected = reference_logprobs(view, labels, 0.7)
    monkeypatch.setattr(readout, "_CHUNK_ELEMENTS", 30)  # one row per block
    leaf = view.clone().requires_grad_()
    out = logprobs_from_logits(leaf, labels, 0.7)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)
    (grad,) = torch.autograd.grad(out.sum(), leaf)
    (grad_ref,) = torch.autograd.grad(reference_logprobs(leaf, labels, 0.7).sum(), leaf)
    torch.testing.assert_close(grad.double(), grad_ref.double(), atol=1e-5, rtol=0)
    bf16 = logprobs_from_logits(view.bfloat16(), labels, 0.7)
    assert bf16.dtype == torch.float32
    torch.testing.assert_close(
        bf16.double(), reference_logprobs(view.bfloat16().float(), labels, 0.7), atol=1e-5, rtol=0
    )


def test_logprobs_bad_arguments():
    with pytest.raises(ValueError, match="temperature"):
        logprobs_from_logits(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), 0.0)
    with pytest.raises(ValueError, match="do not match"):
        logprobs_from_logits(torch.zeros(1, 2, 3), torch.zeros(1, 3, dtype=torch.long))
    # a -100 label at a masked position must not crash
    assert torch.isfinite(logprobs_from_logits(torch.zeros(1, 2, 3), torch.tensor([[1, -100]]))).all()


def test_position_ids_and_last_index():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 2, 2], [0, 1, 2, 3, 4]]
    assert last_token_index(mask).tolist() == [4, 2, 4]


# ---------------------------------------------------------------- padding independence

TEXTS = TEXTS_FOR_SCORES  # EOS inside a text and at its end


def alone_scores(model, texts):
    return torch.stack(
        [sequence_scores(model, torch.tensor([t]), torch.ones(1, len(t), dtype=torch.long))[0] for t in texts]
    )


@pytest.mark.parametrize("builder", [tiny_llama, tiny_gpt2], ids=["llama-rotary", "gpt2-absolute"])
@pytest.mark.parametrize("pad_id", [PAD, EOS], ids=["pad", "pad-is-eos"])
def test_sequence_scores_padding_independent(builder, pad_id):
    model = builder("scalar", pad_token_id=pad_id)
    alone = alone_scores(model, TEXTS)
    with torch.no_grad():
        for side in ("left", "right"):
            ids, mask = pad_batch(TEXTS, pad_id, side)
            torch.testing.assert_close(sequence_scores(model, ids, mask), alone, atol=1e-5, rtol=0)
            # junk in the padded columns changes nothing
            junk = ids.masked_fill(mask == 0, 7)
            torch.testing.assert_close(sequence_scores(model, junk, mask), alone, atol=1e-5, rtol=0)
    # the scores are really different per text (a constant head would pass trivially)
    assert alone.std() > 1e-3


def test_position_ids_matter_for_absolute_positions():
    """Without mask-derived position ids, left padding shifts GPT-2's scores: the fix is needed."""
    model = tiny_gpt2("scalar")
    ids, mask = pad_batch(TEXTS, PAD, "left")
    with torch.no_grad():
        hidden = model.transformer(input_ids=ids, attention_mask=mask).last_hidden_state
        naive = model.score(hidden)[:, -1, 0]
    assert (naive - alone_scores(model, TEXTS)).abs().max() > 1e-3


def test_transformers_pooling_breaks_when_pad_is_eos():
    """The bug sequence_scores avoids: transformers pools at the last non-pad id, skipping the EOS."""
    model = tiny_llama("scalar", pad_token_id=EOS)
    ids, mask = pad_batch(TEXTS, EOS, "right")
    with torch.no_grad():
        pooled = model(input_ids=ids, attention_mask=mask).logits[:, 0]
    assert (pooled - alone_scores(model, TEXTS)).abs().max() > 1e-4


PROMPTS = [[1, 5, 6, 7], [1, 8], [1, 9, EOS, 10, 11]]
RESPONSES = [[12, 13, EOS], [14, 15, 16, 17, 18], [19]]


def prompt_response_batch(pad_id):
    """Left-padded prompts followed by right-padded responses, as a rollout builds them."""
    prompt_ids, prompt_mask = pad_batch(PROMPTS, pad_id, "left")
    response_ids, response_mask = pad_batch(RESPONSES, pad_id, "right")
    return (
        torch.cat([prompt_ids, response_ids], 1),
        torch.cat([prompt_mask, response_mask], 1),
        prompt_ids.shape[1],
    )


@pytest.mark.parametrize("pad_id", [PAD, EOS], ids=["pad", "pad-is-eos"])
def test_response_logprobs_and_values_padding_independent(pad_id):
    policy = tiny_llama("causal", pad_token_id=pad_id)
    critic = tiny_llama("scalar", seed=1, pad_token_id=pad_id)
    ids, mask, p0 = prompt_response_batch(pad_id)
    junk = ids.masked_fill(mask == 0, 7)  # whatever sits in padded columns must not matter
    with torch.no_grad():
        logprobs = response_logprobs(policy, ids, mask, p0, Sampling(0.7))
        values = response_values(critic, ids, mask, p0)
        valid = mask[:, p0:].bool()
        torch.testing.assert_close(
            response_logprobs(policy, junk, mask, p0, Sampling(0.7))[valid], logprobs[valid]
        )
        torch.testing.assert_close(response_values(critic, junk, mask, p0)[valid], values[valid])
        for i, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
            alone = torch.tensor([prompt + response])
            ones = torch.ones_like(alone)
            n = len(response)
            lp = response_logprobs(policy, alone, ones, len(prompt), Sampling(0.7))[0]
            v = response_values(critic, alone, ones, len(prompt))[0]
            torch.testing.assert_close(logprobs[i, :n], lp, atol=1e-5, rtol=0)
            torch.testing.assert_close(values[i, :n], v, atol=1e-5, rtol=0)
            # the same token log-probs from a plain full forward on the unpadded text
            logits = policy(alone).logits[0, len(prompt) - 1 : -1]
            ref = reference_logprobs(logits, torch.tensor(response), 0.7)
            torch.testing.assert_close(lp.double(), ref, atol=1e-5, rtol=0)


# ---------------------------------------------------------------- alignment with position-encoding stubs


def stub_output(input_ids, attention_mask, position_ids):
    """f(column, position id, token) as one float: every ingredient recoverable by the test."""
    columns = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    return 10000.0 * columns + 100.0 * position_ids + input_ids


class StubCausalLM(torch.nn.Module):
    """Logits at column p: a one-hot of size 50 at token (f(p) mod V)."""

    vocab = 97

    def __init__(self, supports_keep: bool):
        super().__init__()
        self.supports_keep = supports_keep
        self.calls = []
        if not supports_keep:
            self.forward = self._forward_without_keep

    def _logits(self, input_ids, attention_mask, position_ids):
        code = stub_output(input_ids, attention_mask, position_ids).long() % self.vocab
        return 50.0 * torch.nn.functional.one_hot(code, self.vocab).float()

    def forward(self, input_ids, attention_mask, position_ids, use_cache=False, logits_to_keep=0):
        self.calls.append(position_ids)
        logits = self._logits(input_ids, attention_mask, position_ids)
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)

    def _forward_without_keep(self, input_ids, attention_mask, position_ids, use_cache=False):
        self.calls.append(position_ids)
        return SimpleNamespace(logits=self._logits(input_ids, attention_mask, position_ids))


class StubScalar(torch.nn.Module):
    """Score head output at column p = f(p); pooled output deliberately wrong."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(pad_token_id=PAD)
        self.score = torch.nn.Identity()

    def forward(self, input_ids, attention_mask, position_ids, use_cache=False):
        per_column = self.score(stub_output(input_ids, attention_mask, position_ids).unsqueeze(-1))
        return SimpleNamespace(logits=per_column[:, 0])


@pytest.mark.parametrize("supports_keep", [True, False])
def test_logprobs_read_at_p0_plus_t_minus_1(supports_keep):
    model = StubCausalLM(supports_keep)
    ids, mask, p0 = prompt_response_batch(PAD)
    positions = position_ids_from_mask(mask)
    # Responses whose token t is exactly what column p0 + t - 1 predicts (built left to right, since
    # that prediction depends on token t - 1): log-prob 0 there, -50 anywhere else.
    for column in range(p0, ids.shape[1]):
        ids[:, column] = stub_output(ids, mask, positions)[:, column - 1].long() % model.vocab
    lp = response_logprobs(model, ids, mask, p0)
    assert lp.shape == (3, ids.shape[1] - p0)
    torch.testing.assert_close(lp, torch.zeros_like(lp), atol=1e-5, rtol=0)
    torch.testing.assert_close(model.calls[0], positions)
    # reading one column too late (p0 + t) or too early (p0 + t - 2) matches nothing
    code = stub_output(ids, mask, positions).long() % model.vocab  # (B, L)
    assert (code[:, p0:] != ids[:, p0:]).all() and (code[:, p0 - 2 : -2] != ids[:, p0:]).all()


def test_values_and_scores_read_at_the_right_columns():
    model = StubScalar()
    ids, mask, p0 = prompt_response_batch(PAD)
    f = stub_output(ids, mask, position_ids_from_mask(mask))  # (B, L)
    values = response_values(model, ids, mask, p0)
    length = ids.shape[1]
    for t in range(length - p0):
        torch.testing.assert_close(values[:, t], f[:, p0 + t - 1])
    scores = sequence_scores(model, ids, mask)
    last = [p0 + len(r) - 1 for r in RESPONSES]  # last valid response token
    torch.testing.assert_close(scores, f[torch.arange(3), last])
    assert token_scores(model, ids, mask).shape == ids.shape


def test_bad_response_start_and_missing_head():
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="response_start"):
        response_values(StubScalar(), ids, ids, 0)
    with pytest.raises(TypeError, match="score"):
        sequence_scores(StubCausalLM(True), ids, ids)


# ---------------------------------------------------------------- length buckets


@pytest.mark.parametrize("side", ["left", "right"])
def test_sequence_scores_length_buckets_equal_one_forward(side):
    """Scoring in length buckets gives every row the score (and the gradient) of one whole-batch forward,
    with each forward cut to its bucket's longest row; junk in padding and extra all-pad columns change
    nothing."""
    from rlhfkit.models.readout import length_buckets

    model = tiny_llama("scalar", pad_token_id=PAD)
    gen = torch.Generator().manual_seed(0)
    lengths = [2 + int(x) for x in torch.randint(0, 29, (40,), generator=gen)]
    rows = [[1, *(3 + torch.randint(0, 40, (n - 1,), generator=gen)).tolist()] for n in lengths]
    ids, mask = pad_batch(rows, PAD, side)
    wide = torch.full((40, 6), PAD, dtype=torch.long)  # six columns that are padding in every row
    ids = torch.cat([wide, ids] if side == "left" else [ids, wide], 1)
    mask = torch.cat([torch.zeros_like(wide), mask] if side == "left" else [mask, torch.zeros_like(wide)], 1)
    ids = ids.masked_fill(mask == 0, 7)  # junk where the mask is 0

    groups = length_buckets(mask)
    assert len(groups) == 4 and sorted(torch.cat(groups).tolist()) == list(range(40))
    widths = []
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kw: widths.append(kw["input_ids"].shape), with_kwargs=True
    )
    bucketed = sequence_scores(model, ids, mask)
    hook.remove()
    assert [w[1] for w in widths] == [max(lengths[i] for i in g.tolist()) for g in groups]
    assert sum(w[0] for w in widths) == 40
    whole = sequence_scores(model, ids, mask, buckets=False)
    torch.testing.assert_close(bucketed, whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(bucketed, alone_scores(model, rows), atol=1e-5, rtol=0)

    weights = torch.randn(40, generator=gen)
    grads = []
    for buckets in (True, False):
        model.zero_grad()
        (sequence_scores(model, ids, mask, buckets=buckets) * weights).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)


def test_length_buckets_choice():
    same = torch.ones(64, 20, dtype=torch.long)  # nothing to gain: one forward
    assert len(length_buckets_of(same)) == 1
    few = torch.zeros(12, 30, dtype=torch.long)  # too few rows for two groups of 8
    for i in range(12):
        few[i, : 1 + i * 2] = 1
    assert len(length_buckets_of(few)) == 1


def length_buckets_of(mask):
    from rlhfkit.models.readout import length_buckets

    return length_buckets(mask)
