"""The teacher's divergence read-out (rlhfkit.models.distill_readout): equal to the plain computation (both
models' whole logits, processed, token_divergence on every row) in values and in the student's gradient, for
any chunk size, a teacher of another architecture and hidden size; exactly 0 against the student's own weights;
nothing reaches the teacher; no head call ever sees more than a chunk of positions."""

from __future__ import annotations

import copy

import pytest
import torch

from rlhfkit.algos import token_divergence
from rlhfkit.models import Sampling, distill_readout, processed_logits, response_logits, response_readout
from rlhfkit.models.distill_readout import teacher_divergence
from rlhfkit.models.head_chunks import chunkable
from rlhfkit.models.sampling import untruncated
from tests.helpers import tiny_llama
from tests.models.test_head_chunks import unknown_transform
from tests.models.tiny_architectures import bpe_tokenizer, tiny_config

START = 4
SAMPLINGS = {
    "plain": Sampling(),
    "temperature-suppress": Sampling(temperature=0.8, suppress_ids=(3,)),
    "topk-topp": Sampling(temperature=1.2, top_k=9, top_p=0.9),
}
CASES = [("full_reverse_kl", 0.5), ("jsd", 0.5), ("jsd", 0.2)]


def qwen_teacher(vocab=48, hidden=40, seed=1):
    """A tiny Qwen2 causal LM: another architecture and hidden size than the student's Llama, its vocabulary."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    sizes = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=3, num_attention_heads=4)
    config = tiny_config("qwen2", bpe_tokenizer(), **sizes, num_key_value_heads=2, tie_word_embeddings=False)
    return Qwen2ForCausalLM(config).eval()


def batch(vocab=48, seed=0):
    """(3, 11) ids with left padding in row 0 and right padding in row 2; 7 response columns from START."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (3, 11), generator=g)
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[0, :2] = 0
    mask[2, -3:] = 0
    return ids, mask


def plain_divergence(student, teacher, ids, mask, sampling, loss, beta, teacher_start=START):
    """The reference: both models' whole (B, R, V) logits, processed, token_divergence of all B x R rows."""
    labels = ids[:, START:]
    s = processed_logits(response_logits(student, ids, mask, START), sampling, labels)
    with torch.no_grad():
        t = response_logits(teacher, ids, mask, teacher_start)[:, : labels.shape[1]]
        t = processed_logits(t, sampling, labels)
    return token_divergence(s.flatten(0, 1), t.flatten(0, 1), loss, beta).view(labels.shape)


def student_grads(student, out, weights):
    student.zero_grad()
    (out * weights).sum().backward()
    return {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss, beta", CASES)
@pytest.mark.parametrize("name", list(SAMPLINGS))
@pytest.mark.parametrize("chunk", [4, 5, 21, None])  # 21 = B x R; 4 and 5 leave an uneven last chunk
def test_equals_the_plain_computation_in_values_and_in_the_students_gradient(loss, beta, name, chunk):
    student, teacher = tiny_llama(), qwen_teacher()
    assert chunkable(student) and chunkable(teacher)
    ids, mask = batch()
    sampling = SAMPLINGS[name]
    got = teacher_divergence(student, teacher, ids, mask, START, sampling, loss, beta, chunk_tokens=chunk)
    want = plain_divergence(student, teacher, ids, mask, sampling, loss, beta)
    assert got.shape == (3, 7) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # +inf alike (a truncated reverse KL)
    if loss == "full_reverse_kl" and sampling.truncates:  # +inf at every position of these tiny models
        assert torch.isinf(want).all()
        return
    finite = torch.isfinite(want) & mask[:, START:].bool()
    assert finite.sum() == 18 and (want[finite] > 1e-3).all()
    weights = torch.rand(3, 7, generator=torch.Generator().manual_seed(1)) * finite  # masked and infinite: 0
    got_grads = student_grads(student, torch.where(finite, got, 0.0), weights)
    want_grads = student_grads(student, torch.where(finite, want, 0.0), weights)
    assert got_grads.keys() == want_grads.keys() and "lm_head.weight" in got_grads
    for key, grad in want_grads.items():
        assert torch.isfinite(got_grads[key]).all()
        torch.testing.assert_close(got_grads[key], grad, atol=1e-6, rtol=1e-4)


def test_a_lora_student_reads_out_through_its_adapters_also_on_the_head():
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=2, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    student, teacher = get_peft_model(tiny_llama(), config), qwen_teacher()
    assert chunkable(student)
    ids, mask = batch()
    got = teacher_divergence(
        student, teacher, ids, mask, START, SAMPLINGS["temperature-suppress"], "jsd", 0.3, 4
    )
    want = plain_divergence(student, teacher, ids, mask, SAMPLINGS["temperature-suppress"], "jsd", 0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    weights = mask[:, START:].float()
    got_grads, want_grads = student_grads(student, got, weights), student_grads(student, want, weights)
    assert any("lm_head" in name and "lora_B" in name for name in got_grads)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-6, rtol=1e-4)


def test_a_truncating_sampler_makes_the_reverse_kl_infinite_where_the_teacher_drops_a_token_and_the_jsd_not():
    student, teacher = tiny_llama(), qwen_teacher()
    ids, mask = batch()
    kl = teacher_divergence(
        student, teacher, ids, mask, START, SAMPLINGS["topk-topp"], "full_reverse_kl", 0.5, 4
    )
    jsd = teacher_divergence(student, teacher, ids, mask, START, SAMPLINGS["topk-topp"], "jsd", 0.5, 4)
    assert torch.isinf(kl).any() and torch.isfinite(jsd).all()


@pytest.mark.parametrize("name", ["plain", "topk-topp"])
def test_a_teacher_with_the_students_own_weights_gives_exactly_zero(name):
    student = tiny_llama()
    teacher = copy.deepcopy(student)
    ids, mask = batch()
    for loss, beta in CASES:
        got = teacher_divergence(
            student, teacher, ids, mask, START, SAMPLINGS[name], loss, beta, chunk_tokens=4
        )
        assert torch.equal(got, torch.zeros(3, 7)) and got.requires_grad


@pytest.mark.parametrize("plain_path", [False, True])
def test_no_gradient_reaches_the_teacher(plain_path):
    student, teacher = tiny_llama(), qwen_teacher()
    if plain_path:
        unknown_transform(teacher, lambda logits: logits * 0.5 + 0.1)
    assert chunkable(teacher) != plain_path
    assert all(p.requires_grad for p in teacher.parameters())  # a teacher that could take a gradient
    ids, mask = batch()
    graphs = []  # whether each module of the teacher built a graph (its forward kept for a backward)
    hooks = [
        m.register_forward_hook(lambda _m, _a, out: graphs.append(_graph(out))) for m in teacher.modules()
    ]
    try:
        for loss, beta in CASES:
            out = teacher_divergence(student, teacher, ids, mask, START, SAMPLINGS["plain"], loss, beta, 4)
            out.sum().backward()
            assert all(p.grad is None for p in teacher.parameters())
            assert student.lm_head.weight.grad.abs().sum() > 0
    finally:
        for hook in hooks:
            hook.remove()
    assert graphs and not any(graphs)


def _graph(output) -> bool:
    """Whether a module's output (a tensor, a tuple, a ModelOutput) holds a tensor that requires grad."""
    if isinstance(output, torch.Tensor):
        return output.requires_grad
    return any(_graph(o) for o in (output.values() if isinstance(output, dict) else output or ()))


def test_the_plain_path_of_an_unchunkable_model_equals_the_plain_computation():
    for which in ("student", "teacher"):
        models = {"student": tiny_llama(), "teacher": qwen_teacher()}
        unknown_transform(models[which], lambda logits: logits * 0.7 + 0.2)
        student, teacher = models["student"], models["teacher"]
        assert not chunkable(models[which])
        ids, mask = batch()
        for loss, beta in CASES:
            got = teacher_divergence(
                student, teacher, ids, mask, START, SAMPLINGS["temperature-suppress"], loss, beta, 4
            )
            want = plain_divergence(
                student, teacher, ids, mask, SAMPLINGS["temperature-suppress"], loss, beta
            )
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            weights = mask[:, START:].float()
            got_grads = student_grads(student, got, weights)
            for key, grad in student_grads(student, want, weights).items():
                torch.testing.assert_close(got_grads[key], grad, atol=1e-6, rtol=1e-4)


def test_no_head_call_sees_more_than_a_chunk_and_the_backward_recomputes_each_chunk():
    """Forward hooks on both output modules record the positions of every call: at most chunk_tokens (the
    models' own forwards read one column of 3 rows), 6 chunks of 21 positions in the forward, and the 6 again in
    the backward (checkpointing recomputes them, under no_grad for the teacher)."""
    student, teacher = tiny_llama(), qwen_teacher()
    assert chunkable(student) and chunkable(teacher)  # the probe's own head calls (cached) come first
    ids, mask = batch()
    rows = {"student": [], "teacher": []}
    hooks = [
        model.lm_head.register_forward_hook(
            lambda _m, args, _o, key=key: rows[key].append(args[0].shape[:-1].numel())
        )
        for key, model in (("student", student), ("teacher", teacher))
    ]
    try:
        out = teacher_divergence(student, teacher, ids, mask, START, SAMPLINGS["topk-topp"], "jsd", 0.5, 4)
        forward = {key: list(value) for key, value in rows.items()}
        out.sum().backward()
    finally:
        for hook in hooks:
            hook.remove()
    chunks = [4, 4, 4, 4, 4, 1]
    assert forward == {"student": [3, *chunks], "teacher": [3, *chunks]}
    again = chunks[::-1]  # the backward runs the chunks last first
    assert rows == {"student": [3, *chunks, *again], "teacher": [3, *chunks, *again]}


def test_the_backward_keeps_no_vocabulary_wide_tensor():
    """Every tensor the autograd graph saves is counted through saved-tensor hooks: none is as wide as the
    vocabulary (a chunk's logits, probabilities or log-probs), since each chunk is recomputed in the backward."""
    vocab = 57  # no other width of either model
    student, teacher = tiny_llama(vocab_size=vocab), qwen_teacher(vocab=vocab)
    ids, mask = batch(vocab)
    saved = []

    def pack(tensor):
        saved.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for loss, beta in CASES:
            teacher_divergence(student, teacher, ids, mask, START, SAMPLINGS["topk-topp"], loss, beta, 4)
    head_weight = (32, vocab)  # the student's lm_head weight, transposed, saved by its matrix products
    assert saved and not [shape for shape in saved if shape[-1] == vocab and shape != head_weight]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        plain_divergence(student, teacher, ids, mask, SAMPLINGS["plain"], "jsd", 0.5)
    assert [shape for shape in saved if shape[-1] == vocab]  # the check above can see such a tensor


def test_a_teacher_read_one_position_off_gives_another_value():
    """The equality test above (tolerance 1e-5) sees an off-by-one column of the teacher: it moves the
    divergence by more than 1e-3 somewhere."""
    student, teacher = tiny_llama(), qwen_teacher()
    ids, mask = batch()
    valid = mask[:, START:].bool()
    for loss, beta in CASES:
        got = teacher_divergence(student, teacher, ids, mask, START, SAMPLINGS["plain"], loss, beta, 4)
        # the teacher's state one column to the left of the student's
        off = plain_divergence(student, teacher, ids, mask, SAMPLINGS["plain"], loss, beta, START - 1)
        assert (got - off)[valid].abs().max() > 1e-3


def test_bad_arguments_raise_before_any_forward():
    student, teacher = tiny_llama(), qwen_teacher()
    ids, mask = batch()
    calls = []
    hooks = [m.register_forward_pre_hook(lambda *_: calls.append(1)) for m in (student, teacher)]
    try:
        for loss, beta, start, match in (
            ("reverse_kl", 0.5, START, "full_reverse_kl or jsd"),
            ("jsd", 1.0, START, "beta must be in"),
            ("jsd", 0.5, 0, "start must be in"),
        ):
            with pytest.raises(ValueError, match=match):
                teacher_divergence(student, teacher, ids, mask, start, None, loss, beta)
    finally:
        for hook in hooks:
            hook.remove()
    assert not calls
    with pytest.raises(ValueError, match="one vocabulary"):  # known from the logits: after the forwards
        teacher_divergence(student, qwen_teacher(vocab=50), ids, mask, START, None, "jsd", 0.5, 4)


def jsd_readout(student, teacher, ids, mask, sampling, **kwargs):
    """teacher_divergence with its read-outs: the JSD at beta 0.3, chunks of 4 positions."""
    return teacher_divergence(
        student, teacher, ids, mask, START, sampling, "jsd", 0.3, 4, readout=True, **kwargs
    )


@pytest.mark.parametrize("plain_path", [False, True])
@pytest.mark.parametrize("name", ["temperature-suppress", "topk-topp"])
def test_the_readout_gives_the_students_and_the_teachers_reads_of_the_sampled_tokens(name, plain_path):
    """``readout=True``: the same divergence, and beside it what response_readout reads from the student (log-
    probs with their gradient, entropies) and from the teacher untruncated, from the logits of the same chunks;
    the entropy carries a gradient only when asked for."""
    student, teacher = tiny_llama(), qwen_teacher()
    if plain_path:
        unknown_transform(teacher, lambda logits: logits * 0.5 + 0.1)
    assert chunkable(teacher) != plain_path
    ids, mask = batch()
    sampling = SAMPLINGS[name]  # (top-k / top-p truncate the student's and the teacher's reads differently)
    for entropy_grad in (False, True):
        got = jsd_readout(student, teacher, ids, mask, sampling, entropy_grad=entropy_grad)
        torch.testing.assert_close(
            got.divergence, teacher_divergence(student, teacher, ids, mask, START, sampling, "jsd", 0.3, 4)
        )
        want = response_readout(student, ids, mask, START, sampling, entropy=True)
        torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.entropy, want.entropy, atol=1e-5, rtol=1e-5)
        assert got.entropy.requires_grad == entropy_grad and not got.teacher_logprobs.requires_grad
        with torch.no_grad():
            teacher_want = response_readout(teacher, ids, mask, START, untruncated(sampling)).logprobs
        torch.testing.assert_close(got.teacher_logprobs, teacher_want, atol=1e-5, rtol=1e-5)
    weights = mask[:, START:].float()
    got_grads = student_grads(student, got.logprobs + got.entropy, weights)
    want_grads = student_grads(student, want.logprobs + want.entropy, weights)
    assert got_grads.keys() == want_grads.keys() and "lm_head.weight" in got_grads
    for key, grad in want_grads.items():
        torch.testing.assert_close(got_grads[key], grad, atol=1e-6, rtol=1e-4)


def frozen_head_student():
    """A student whose output head takes no gradient (as under LoRA on the blocks): the chunks' gradients are
    taken in the forward, row by row (distill_readout._RowGradients)."""
    student = tiny_llama()
    student.lm_head.weight.requires_grad_(False)
    return student


@pytest.mark.parametrize("loss, beta", CASES)
@pytest.mark.parametrize("name", list(SAMPLINGS))
@pytest.mark.parametrize("chunk", [4, 21])
def test_a_frozen_head_takes_each_rows_gradient_in_the_forward_and_equals_the_plain_computation(
    loss, beta, name, chunk, monkeypatch
):
    student, teacher = frozen_head_student(), qwen_teacher()
    calls = []
    real = distill_readout._RowGradients.apply
    monkeypatch.setattr(distill_readout._RowGradients, "apply", lambda *a: calls.append(1) or real(*a))
    ids, mask = batch()
    sampling = SAMPLINGS[name]
    got = teacher_divergence(student, teacher, ids, mask, START, sampling, loss, beta, chunk_tokens=chunk)
    want = plain_divergence(student, teacher, ids, mask, sampling, loss, beta)
    assert len(calls) == -(-21 // chunk)  # one per chunk: no checkpoint
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    finite = torch.isfinite(want) & mask[:, START:].bool()
    if not finite.any():
        return
    weights = torch.rand(3, 7, generator=torch.Generator().manual_seed(1)) * finite  # each row its own weight
    got_grads = student_grads(student, torch.where(finite, got, 0.0), weights)
    want_grads = student_grads(student, torch.where(finite, want, 0.0), weights)
    assert got_grads.keys() == want_grads.keys() and "lm_head.weight" not in got_grads
    for key, grad in want_grads.items():
        torch.testing.assert_close(got_grads[key], grad, atol=1e-6, rtol=1e-4)


def test_a_frozen_heads_readout_gives_the_gradients_asked_for_and_no_others():
    student, teacher = frozen_head_student(), qwen_teacher()
    ids, mask = batch()
    sampling = SAMPLINGS["temperature-suppress"]
    weights = torch.rand(3, 7, generator=torch.Generator().manual_seed(2)) * mask[:, START:]
    for logprob_grad, entropy_grad in ((True, True), (True, False), (False, True), (False, False)):
        want = response_readout(student, ids, mask, START, sampling, entropy=True)
        got = jsd_readout(
            student, teacher, ids, mask, sampling, entropy_grad=entropy_grad, logprob_grad=logprob_grad
        )
        assert got.logprobs.requires_grad == logprob_grad and got.entropy.requires_grad == entropy_grad
        torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.entropy, want.entropy, atol=1e-5, rtol=1e-5)
        outputs = [got.divergence * 0.0]  # the divergence's own gradient is tested above
        reference = [want.logprobs * 0.0]
        if logprob_grad:
            outputs.append(got.logprobs)
            reference.append(want.logprobs)
        if entropy_grad:
            outputs.append(3.0 * got.entropy)
            reference.append(3.0 * want.entropy)
        got_grads = student_grads(student, sum(outputs), weights)
        want_grads = student_grads(student, sum(reference), weights)
        for key, grad in want_grads.items():
            torch.testing.assert_close(got_grads[key], grad, atol=1e-6, rtol=1e-4)
