"""LoRA (peft) and gradient checkpointing: the roles hold no copy of the base, the disabled adapter is the
base model exactly, the merged folder equals the adapter model, checkpoints hold only what trains, and
gradient checkpointing changes no gradient."""

import json

import pytest
import torch

from rlhfkit.cli import main
from rlhfkit.config import load_config
from rlhfkit.errors import ConfigError, UserError
from rlhfkit.models import (
    AdapterDisabled,
    load_causal_lm,
    load_scalar_model,
    load_tokenizer,
    prepare_trained,
    response_logprobs,
    sequence_scores,
)
from rlhfkit.models.head_chunks import head_transform
from tests.helpers import pad_batch, tiny_llama
from tests.trainers.online.online_fixtures import (
    make_context,
    online_cli_args,
    online_config,
    write_online_problem,
)
from tests.trainers.sft_fixtures import sft_args, write_sft_problem

ROWS = [[1, 5, 6, 7, 8, 9, 2], [1, 10, 11, 12, 2], [1, 13, 14, 15, 16, 2]]


def _batch(pad_id):
    return pad_batch(ROWS, pad_id, side="left")


def _perturb_adapters(model, seed=0):
    """What training does to an adapter: B (zero at the start) and the head copy become non-zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.5)


def _unique_elements(*models):
    seen = {}
    for model in models:
        for p in model.parameters():
            seen[p.data_ptr()] = p.numel()
    return sum(seen.values())


def test_lora_ppo_roles_hold_no_copy_and_disabled_adapter_is_the_base(tmp_path):
    paths = write_online_problem(tmp_path)
    cfg = online_config(
        paths, tmp_path / "run", f"online.reward_model={paths['reward']}", "model.lora_rank=4"
    )
    roles = make_context(cfg).roles
    tokenizer = load_tokenizer(str(paths["policy"]))
    policy = load_causal_lm(str(paths["policy"]), tokenizer=tokenizer)
    reward = load_scalar_model(str(paths["reward"]), tokenizer=tokenizer)
    base_policy, base_reward = (
        sum(p.numel() for p in policy.parameters()),
        sum(p.numel() for p in reward.parameters()),
    )

    # Count the parameters of every role: the four roles together hold one policy and one reward model,
    # plus the adapters and the critic's head copy, and nothing else.
    trained = sum(p.numel() for m in (roles.actor, roles.critic) for p in m.parameters() if p.requires_grad)
    head = reward.score.weight.numel()
    assert (
        _unique_elements(roles.actor, roles.reference, roles.critic, roles.reward_model)
        == base_policy + base_reward + trained
    )
    assert trained - head < 0.25 * (base_policy + base_reward)

    def ptrs(m):
        return {p.data_ptr() for p in m.parameters()}

    assert ptrs(roles.reference) <= ptrs(roles.actor) and ptrs(roles.reward_model) <= ptrs(roles.critic)
    assert not any(p.requires_grad for n, p in roles.actor.named_parameters() if "lora_" not in n)

    # A trained adapter moves the actor and the critic; switched off, they are the loaded SFT policy and
    # reward model exactly.
    _perturb_adapters(roles.actor)
    _perturb_adapters(roles.critic, seed=1)
    ids, attn = _batch(tokenizer.pad_token_id)
    with torch.no_grad():
        actor = response_logprobs(roles.actor, ids, attn, 3)
        ref = response_logprobs(roles.reference, ids, attn, 3)
        plain = response_logprobs(policy, ids, attn, 3)
        assert (actor - plain).abs().max() > 1e-2
        assert torch.equal(ref, plain)
        critic = sequence_scores(roles.critic, ids, attn)
        scored = sequence_scores(roles.reward_model, ids, attn)
        assert (critic - scored).abs().max() > 1e-2
        assert torch.equal(scored, sequence_scores(reward, ids, attn))
    assert isinstance(roles.reference, AdapterDisabled) and roles.reference.config is roles.actor.config

    # Full fine-tuning: four separate models.
    full = make_context(
        online_config(paths, tmp_path / "full", f"online.reward_model={paths['reward']}")
    ).roles
    assert not ptrs(full.reference) & ptrs(full.actor)
    assert _unique_elements(full.actor, full.reference, full.critic, full.reward_model) == 2 * (
        base_policy + base_reward
    )


@pytest.mark.parametrize("train_reward_model", [False, True])
def test_lora_bf16_roles_train_float32_weights_on_a_bf16_base(tmp_path, train_reward_model):
    """bf16 with LoRA: what trains (adapters, the critic's head copy) is float32; the frozen base's linear
    weights are held in bf16 (rlhfkit.models.precision.hold_frozen_linears), embeddings and norms float32; the
    reference is the actor's own weights. When a refresh trains the reward model, the critic gets its own base
    and the reward model, a trained role then, is float32 throughout."""
    from rlhfkit.engine.accel import make_accelerator
    from rlhfkit.trainers.online.roles import build_roles

    paths = write_online_problem(tmp_path)
    cfg = online_config(
        paths,
        tmp_path / "run",
        f"online.reward_model={paths['reward']}",
        "model.lora_rank=4",
        "model.dtype=bfloat16",
    )
    tokenizer = load_tokenizer(str(paths["policy"]))
    roles = build_roles(cfg, tokenizer, make_accelerator(cpu=True).device, train_reward_model)
    for role in (roles.actor, roles.critic):
        linears = {id(m.weight) for m in role.modules() if isinstance(m, torch.nn.Linear)}
        for name, p in role.named_parameters():
            held = not p.requires_grad and id(p) in linears and "embed" not in name
            assert p.dtype == (torch.bfloat16 if held else torch.float32), name
    assert {p.dtype for p in roles.reference.parameters()} == {torch.float32, torch.bfloat16}
    if train_reward_model:
        assert {p.dtype for p in roles.reward_model.parameters()} == {torch.float32}

    def ptrs(m):
        return {p.data_ptr() for p in m.parameters()}

    assert ptrs(roles.reference) <= ptrs(roles.actor)
    assert (ptrs(roles.reward_model) <= ptrs(roles.critic)) is not train_reward_model
    assert isinstance(roles.reward_model, AdapterDisabled) is not train_reward_model
    ids, attn = _batch(tokenizer.pad_token_id)
    with torch.no_grad():  # forwards run under bf16 autocast: the scores come out finite
        assert torch.isfinite(sequence_scores(roles.critic, ids, attn)).all()
        assert torch.isfinite(sequence_scores(roles.reward_model, ids, attn)).all()


def test_lora_sft_final_is_merged_adapter_loads_and_resume_is_bit_identical(tmp_path):
    paths = write_sft_problem(tmp_path)
    out = tmp_path / "run"
    assert (
        main(
            sft_args(
                paths,
                out,
                "train.max_steps=4",
                "model.lora_rank=4",
                "model.lora_alpha=8",
                "train.learning_rate=3e-2",
            )
        )
        == 0
    )
    final, adapter = out / "final", out / "final" / "adapter"
    assert (adapter / "adapter_model.safetensors").is_file() and (adapter / "adapter_config.json").is_file()
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 4

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(str(final))
    ids, attn = _batch(tokenizer.pad_token_id)
    merged = AutoModelForCausalLM.from_pretrained(final).eval()  # plain transformers
    base = AutoModelForCausalLM.from_pretrained(paths["model"]).eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(paths["model"]), adapter).eval()
    from_folder = load_causal_lm(str(adapter), tokenizer=tokenizer)  # an adapter folder as name_or_path
    with torch.no_grad():
        want = response_logprobs(adapted, ids, attn, 3)
        assert (want - response_logprobs(base, ids, attn, 3)).abs().max() > 1e-2  # the adapter learned
        assert (response_logprobs(merged, ids, attn, 3) - want).abs().max() <= 1e-5
        assert (response_logprobs(from_folder, ids, attn, 3) - want).abs().max() <= 1e-5

    # The checkpoint holds the adapters only (no copy of the base), and resuming reproduces the run.
    from safetensors.torch import load_file

    saved = load_file(str(out / "checkpoints" / "step-4" / "model.model.safetensors"))
    assert saved and all("lora_" in k for k in saved)
    part = tmp_path / "part"
    assert (
        main(
            sft_args(
                paths,
                part,
                "train.max_steps=2",
                "model.lora_rank=4",
                "model.lora_alpha=8",
                "train.learning_rate=3e-2",
            )
        )
        == 0
    )
    assert (
        main(
            [
                *sft_args(
                    paths,
                    part,
                    "train.max_steps=4",
                    "model.lora_rank=4",
                    "model.lora_alpha=8",
                    "train.learning_rate=3e-2",
                ),
                "--resume",
            ]
        )
        == 0
    )
    a = load_file(str(out / "final" / "model.safetensors"))
    b = load_file(str(part / "final" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_lora_ppo_resume_and_reward_model_adapter_keep_normalisation(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    paths = write_online_problem(tmp_path)
    extra = (
        "model.lora_rank=4",
        f"online.reward_model={paths['reward']}",
        "train.lr_schedule=linear",
        "logging.progress_bar=false",
    )
    full, part = tmp_path / "full", tmp_path / "part"
    assert main(online_cli_args(paths, full, "train.max_steps=2", *extra)) == 0
    assert main(online_cli_args(paths, part, "train.max_steps=2", *extra, "train.save_steps=1")) == 0
    # Kill after step 1: keep the checkpoint of step 1 only, then resume.
    import shutil

    from safetensors.torch import load_file

    shutil.rmtree(part / "checkpoints" / "step-2")
    shutil.rmtree(part / "final")
    assert (
        main([*online_cli_args(paths, part, "train.max_steps=2", *extra, "train.save_steps=1"), "--resume"])
        == 0
    )
    for folder in ("final", "final_critic"):
        a, b = (
            load_file(str(full / folder / "model.safetensors")),
            load_file(str(part / folder / "model.safetensors")),
        )
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # The critic's adapter folder carries the reward model's normalisation, like the merged folder.
    gain_key = "rlhfkit_reward_gain"
    tokenizer = load_tokenizer(str(paths["policy"]))
    merged = load_scalar_model(str(full / "final_critic"), tokenizer=tokenizer)
    adapter = load_scalar_model(str(full / "final_critic" / "adapter"), tokenizer=tokenizer)
    ids, attn = _batch(tokenizer.pad_token_id)
    with torch.no_grad():
        assert (sequence_scores(merged, ids, attn) - sequence_scores(adapter, ids, attn)).abs().max() <= 1e-5
    assert getattr(merged.config, gain_key, None) == getattr(adapter.config, gain_key, None)


def test_gradient_checkpointing_gives_the_same_gradients_and_recomputes():
    grads, calls, saved = {}, {}, {}
    for checkpointing in (False, True):
        for lora in (0, 4):
            model = tiny_llama(seed=0)
            cfg = load_config(
                None,
                [
                    "output_dir=x",
                    "model.name_or_path=x",
                    "data.train_file=x",
                    f"model.lora_rank={lora}",
                    f"model.gradient_checkpointing={checkpointing}",
                ],
            )
            model = prepare_trained(model, cfg.model)
            model.train()
            head_transform(model)  # the read-out's probe of the head: one no-grad forward, once per model
            count = []
            layer = model.get_base_model().model.layers[0] if lora else model.model.layers[0]
            layer.mlp.down_proj.register_forward_pre_hook(lambda *_, count=count: count.append(1))
            ids, attn = _batch(3)
            stored = []  # elements of the activations autograd keeps for the backward pass
            with torch.autograd.graph.saved_tensors_hooks(
                lambda t, stored=stored: stored.append(t.numel()) or t, lambda t: t
            ):
                logprobs = response_logprobs(model, ids, attn, 3)
            logprobs.sum().backward()
            saved[checkpointing, lora] = sum(stored)
            grads[checkpointing, lora] = {
                n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
            }
            calls[checkpointing, lora] = len(count)
    for lora in (0, 4):
        assert calls[False, lora] == 1 and calls[True, lora] == 2  # the block ran again in the backward pass
        assert saved[True, lora] < 0.5 * saved[False, lora]
        assert grads[False, lora].keys() == grads[True, lora].keys() and grads[True, lora]
        for name, g in grads[False, lora].items():
            torch.testing.assert_close(grads[True, lora][name], g, rtol=0, atol=1e-6)


def test_lora_bad_settings_are_named():
    base = ["output_dir=x", "model.name_or_path=x", "data.train_file=x", "online.reward_functions=[m:f]"]
    with pytest.raises(ConfigError, match="model.lora_dropout"):
        load_config(None, [*base, "model.lora_rank=4", "model.lora_dropout=0.1"], "ppo")
    load_config(None, [*base, "model.lora_rank=4", "model.lora_dropout=0.1"], "sft")  # no ratio in SFT
    cfg = load_config(None, [*base, "model.lora_rank=4", "model.lora_target_modules=nonexistent_proj"], "sft")
    with pytest.raises(UserError, match="lora_target_modules"):
        prepare_trained(tiny_llama(), cfg.model)


@pytest.mark.slow
def test_lora_reward_model_final_and_adapter_folder_score_alike(tmp_path):
    from tests.trainers.test_reward import reward_args, write_reward_problem

    paths = write_reward_problem(tmp_path, n_train=32, n_eval=16)
    out = tmp_path / "rm"
    assert (
        main(reward_args(paths, out, "train.max_steps=4", "model.lora_rank=4", "train.learning_rate=3e-2"))
        == 0
    )
    from transformers import AutoModelForSequenceClassification

    plain = AutoModelForSequenceClassification.from_pretrained(out / "final").eval()  # plain transformers
    merged = load_scalar_model(str(out / "final"), tokenizer=load_tokenizer(str(out / "final")))
    adapter = load_scalar_model(
        str(out / "final" / "adapter"), tokenizer=load_tokenizer(str(out / "final" / "adapter"))
    )
    base = load_scalar_model(str(paths["model"]), tokenizer=load_tokenizer(str(paths["model"])))
    ids, attn = _batch(2)
    with torch.no_grad():
        want = sequence_scores(adapter, ids, attn)
        assert (sequence_scores(merged, ids, attn) - want).abs().max() <= 1e-5
        assert (sequence_scores(plain, ids, attn) - want).abs().max() <= 1e-5
        assert not torch.allclose(
            base.model.layers[0].mlp.up_proj.weight, merged.model.layers[0].mlp.up_proj.weight
        )
    for key in ("rlhfkit_reward_gain", "rlhfkit_reward_bias"):
        assert getattr(adapter.config, key) == getattr(merged.config, key) != getattr(base.config, key, None)


def test_lora_grpo_holds_no_critic_and_no_reference_copy_and_trains_only_the_adapter(tmp_path):
    from transformers import AutoModelForCausalLM

    paths = write_online_problem(tmp_path, reward_model=False)
    cfg = online_config(paths, tmp_path / "grpo", "model.lora_rank=4", kind="grpo")
    roles = make_context(cfg).roles
    assert roles.critic is None and isinstance(roles.reference, AdapterDisabled)
    assert {p.data_ptr() for p in roles.reference.parameters()} <= {
        p.data_ptr() for p in roles.actor.parameters()
    }
    trained = {n for n, p in roles.actor.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)

    cfg = online_config(
        paths,
        tmp_path / "grpo",
        "model.lora_rank=4",
        "train.max_steps=2",
        "train.learning_rate=3e-2",
        kind="grpo",
    )
    from rlhfkit.trainers import online

    online.train(cfg)
    out = tmp_path / "grpo"
    base = AutoModelForCausalLM.from_pretrained(paths["policy"]).eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "final").eval()  # plain transformers, merged
    adapter = load_causal_lm(str(out / "final" / "adapter"), tokenizer=load_tokenizer(str(out / "final")))
    ids, attn = _batch(load_tokenizer(str(out / "final")).pad_token_id)
    with torch.no_grad():
        want = response_logprobs(adapter, ids, attn, 3)
        assert (response_logprobs(merged, ids, attn, 3) - want).abs().max() <= 1e-5
        assert (response_logprobs(base, ids, attn, 3) - want).abs().max() > 1e-4  # the adapter trained


@pytest.mark.slow
def test_lora_prm_final_and_adapter_folder_score_alike(tmp_path):
    import random

    from transformers import AutoModelForSequenceClassification

    from tests.helpers import tiny_tokenizer
    from tests.trainers.test_reward import BODY_WORDS

    tokenizer = tiny_tokenizer()
    tiny_llama(seed=0, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id).save_pretrained(
        tmp_path / "model"
    )
    tokenizer.save_pretrained(tmp_path / "model")
    rng = random.Random(0)
    rows = []
    for _ in range(32):
        labels = [rng.random() < 0.5 for _ in range(rng.randint(1, 3))]
        steps = [" ".join(rng.choices(BODY_WORDS, k=2)) + (" good" if ok else " bad") for ok in labels]
        rows.append({"prompt": " ".join(rng.choices(BODY_WORDS, k=2)), "steps": steps, "labels": labels})
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "prm"
    (tmp_path / "prm.yaml").write_text("seed: 0\n")
    args = [
        "train",
        "prm",
        "--config",
        str(tmp_path / "prm.yaml"),
        f"output_dir={out}",
        f"model.name_or_path={tmp_path / 'model'}",
    ]
    args += [f"data.train_file={tmp_path / 'train.jsonl'}", "train.max_steps=3", "train.batch_size=8"]
    args += [
        "train.learning_rate=3e-2",
        "model.lora_rank=4",
        "logging.progress_bar=false",
        "data.max_length=32",
        "data.max_prompt_length=8",
    ]
    assert main(args) == 0
    plain = AutoModelForSequenceClassification.from_pretrained(out / "final").eval()
    adapter = load_scalar_model(str(out / "final" / "adapter"), tokenizer=load_tokenizer(str(out / "final")))
    base = load_scalar_model(str(tmp_path / "model"), tokenizer=load_tokenizer(str(tmp_path / "model")))
    ids, attn = _batch(tokenizer.pad_token_id)
    with torch.no_grad():
        want = sequence_scores(adapter, ids, attn)
        assert (sequence_scores(plain, ids, attn) - want).abs().max() <= 1e-5
        assert (sequence_scores(base, ids, attn) - want).abs().max() > 1e-4
