"""Bring your own model: fp32 master weights under bf16, sampling = scoring against a checkpoint's generation
config, and a tokenizer without a pad token giving a step-0 KL of exactly 0."""

import torch
from transformers import GenerationConfig

from rlhfkit.trainers.online.ppo_update import ppo_update
from tests.models.tiny_architectures import write_tiny_model
from tests.trainers.online.online_fixtures import make_context, online_config, write_online_problem
from tests.trainers.online.test_online import rollout_for_update


def test_bf16_trains_fp32_master_weights_and_only_frozen_roles_hold_bf16(tmp_path):
    paths = write_online_problem(tmp_path)
    ctx = make_context(
        online_config(
            paths, tmp_path / "run", "model.dtype=bfloat16", f"online.reward_model={paths['reward']}"
        )
    )
    roles = ctx.roles
    assert {p.dtype for p in roles.reference.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in roles.reward_model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in roles.actor.parameters()} == {torch.float32}
    assert {p.dtype for p in roles.critic.parameters()} == {torch.float32}
    ids = torch.tensor([[1, 5, 6, 7]])
    assert roles.actor(input_ids=ids).logits.dtype == torch.bfloat16  # the forward runs under autocast
    actor, optimizer = ctx.trained["actor"], ctx.optimizers["actor"]
    for group in optimizer.param_groups:
        group["lr"] = 1e-6
    before = {k: v.detach().clone() for k, v in actor.named_parameters()}
    for _ in range(20):
        actor(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    changed = sum(int((p.detach() != before[k]).sum()) for k, p in actor.named_parameters())
    assert changed / sum(p.numel() for p in actor.parameters()) >= 0.9
    assert all(s["exp_avg"].dtype == torch.float32 for s in optimizer.state.values())


def test_generation_config_processors_are_neutralised_and_sampling_equals_scoring(tmp_path):
    paths = write_online_problem(tmp_path, reward_model=False)
    GenerationConfig(
        repetition_penalty=1.3,
        no_repeat_ngram_size=2,
        do_sample=True,
        top_k=5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
    ).save_pretrained(paths["policy"])
    ctx = make_context(online_config(paths, tmp_path / "run", "online.response_length=12", reward="words"))
    from rlhfkit.data import TokenLimits, prepare_examples
    from rlhfkit.models import response_logprobs
    from rlhfkit.rollout import generate_responses
    from rlhfkit.trainers.online.collect import prompt_batch

    examples = prepare_examples(ctx.cfg.data.train_file, "prompts", ctx.tokenizer, TokenLimits(16))
    torch.manual_seed(0)
    batch = prompt_batch(ctx, examples, 1)
    r = generate_responses(
        ctx.roles.actor,
        batch["query_ids"],
        batch["query_mask"],
        max_new_tokens=12,
        stop_token_ids=ctx.stop_token_ids,
        pad_token_id=ctx.tokenizer.pad_token_id,
        sampling=ctx.sampling,
        return_logprobs=True,
    )
    with torch.no_grad():
        scored = response_logprobs(
            ctx.roles.actor, r.input_ids, r.attention_mask, r.response_start, ctx.sampling
        )
    torch.testing.assert_close(scored * r.mask, r.sampled_logprobs, atol=1e-5, rtol=0)
    for group in ctx.optimizers["actor"].param_groups:
        group["lr"] = 0.0
    result = ppo_update(ctx, rollout_for_update(ctx), step=1)
    assert result.first_minibatch_logprob_diff[0] == 0.0


def test_tokenizer_without_pad_gives_step_zero_kl_of_exactly_zero(tmp_path):
    for arch in ("llama", "gpt2"):
        paths = write_online_problem(tmp_path / arch, reward_model=False)
        paths["policy"] = write_tiny_model(arch, tmp_path / arch / "nopad", pad=None)
        ctx = make_context(
            online_config(paths, tmp_path / arch / "run", "online.response_length=8", reward="words")
        )
        assert ctx.tokenizer.pad_token == "<|pad|>"
        rollout = rollout_for_update(ctx)
        assert float(rollout.kl.abs().max()) == 0.0
        emb = ctx.roles.actor.get_input_embeddings().weight
        torch.testing.assert_close(emb[-1], emb[:-1].mean(0))
