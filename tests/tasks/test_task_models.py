"""The task's tokenizer (trained with `tokenizers`, saved as a Hugging Face folder) and model presets."""

import json

import pytest
import torch
from transformers import AutoTokenizer

from rlhfkit.errors import ConfigError
from rlhfkit.tasks import MODEL_PRESETS, count_parameters, get_task
from rlhfkit.tasks import reviews as R


@pytest.fixture(scope="module")
def saved_tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    get_task().build_tokenizer(folder)
    return folder, AutoTokenizer.from_pretrained(str(folder))


def test_tokenizer_folder_loads_with_distinct_special_tokens(saved_tokenizer):
    _, tok = saved_tokenizer
    ids = {tok.pad_token_id, tok.bos_token_id, tok.eos_token_id}
    assert None not in ids and len(ids) == 3
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<pad>", "<bos>", "<eos>")
    assert 300 <= len(tok) <= 1024


def test_round_trip_and_boundaries_on_the_corpus(saved_tokenizer):
    _, tok = saved_tokenizer
    for record in get_task(seed=2).sft_records(300):
        prompt, completion = record["prompt"], record["completion"]
        full = tok(prompt + completion).input_ids
        assert full[0] == tok.bos_token_id and tok.eos_token_id not in full  # BOS added, EOS left to trainers
        assert tok.decode(full, skip_special_tokens=True) == prompt + completion
        piece = tok(completion, add_special_tokens=False).input_ids
        assert tok.decode(piece) == completion
        # tokenising prompt and completion apart gives the same tokens as together
        assert tok(prompt).input_ids + piece == full
        # every word and period of the language is a single token
        assert len(piece) == len(completion.split()) + completion.count(".")


@pytest.mark.parametrize("text", ["héllo  wörld\n\ttabs 🙂", "The blender is great!", "  two  spaces  ", ""])
def test_round_trip_on_any_text(saved_tokenizer, text):
    _, tok = saved_tokenizer
    assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text


def test_tokenizer_training_is_deterministic(saved_tokenizer, tmp_path):
    folder, _ = saved_tokenizer
    get_task(seed=7).build_tokenizer(tmp_path)  # the vocabulary does not depend on the seed either
    assert json.loads((tmp_path / "tokenizer.json").read_text()) == json.loads(
        (folder / "tokenizer.json").read_text()
    )


def expected_parameters(vocab, hidden, layers, ffn):
    """Llama with untied embeddings: embeddings + LM head, per layer 4 attention projections, 3 MLP
    projections and 2 RMSNorm weights, and the final norm."""
    return 2 * vocab * hidden + layers * (4 * hidden * hidden + 3 * hidden * ffn + 2 * hidden) + hidden


@pytest.mark.parametrize(
    "preset, low, high", [("tiny", 1_000_000, 3_000_000), ("small", 10_000_000, 30_000_000)]
)
def test_preset_parameter_counts(saved_tokenizer, preset, low, high):
    _, tok = saved_tokenizer
    task = get_task()
    model = task.build_model(preset, tok)
    shape = MODEL_PRESETS[preset]
    n = count_parameters(model)
    assert n == expected_parameters(
        len(tok), shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"]
    )
    assert low <= n <= high


def test_tiny_model_config_and_forward(saved_tokenizer):
    _, tok = saved_tokenizer
    task = get_task()
    config = task.model_config("tiny", tok)
    assert (config.vocab_size, config.pad_token_id, config.bos_token_id, config.eos_token_id) == (
        len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id,
    )  # fmt: skip
    dropouts = {k: v for k, v in config.to_dict().items() if "dropout" in k}
    assert dropouts and all(v == 0 for v in dropouts.values())
    model = task.build_model("tiny", tok)
    batch = tok(
        ["Write a positive review of the red blender.", "Give a negative review of the grey fan."],
        padding=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (2, batch["input_ids"].shape[1], len(tok))  # (B, T, V)
    with pytest.raises(ConfigError, match="unknown model preset 'huge'"):
        task.model_config("huge", tok)


def test_model_initialisation_is_deterministic_and_leaves_the_global_rng_alone(saved_tokenizer):
    _, tok = saved_tokenizer
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    a = get_task(seed=0).build_model("tiny", tok)
    after = torch.rand(3)
    assert torch.equal(before, after)
    b = get_task(seed=0).build_model("tiny", tok)
    c = get_task(seed=0).build_model("tiny", tok, seed=1)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_model_round_trips_through_a_saved_folder(saved_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    _, tok = saved_tokenizer
    model = get_task().build_model("tiny", tok)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = tok(R.all_prompts()[:2], return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
