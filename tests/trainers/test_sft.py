"""SFT: the loss is the completion tokens' NLL, training lowers it, resume is bit-identical, final/ loads."""

import json

import pytest
import torch
from safetensors.torch import load_file

from rlhfkit.cli import main
from rlhfkit.data import SFTCollator
from rlhfkit.trainers.sft import completion_nll
from tests.helpers import tiny_llama, tiny_tokenizer
from tests.trainers.sft_fixtures import sft_args, write_sft_problem


def test_completion_nll_is_computed_on_completion_tokens_only_by_hand():
    tok = tiny_tokenizer()
    model = tiny_llama(seed=1, vocab_size=len(tok), pad_token_id=tok.pad_token_id)
    ex = {"prompt_ids": [1, 10, 11], "completion_ids": [12, 13, 2]}
    short = {"prompt_ids": [1, 10], "completion_ids": [2]}
    batch = SFTCollator(tok.pad_token_id)([ex, short])
    nll, mask, _ = completion_nll(model, batch)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 10, 11, 12, 13, 2]])).logits[0]
    logp = torch.log_softmax(logits, -1)
    expected = [-logp[2, 12], -logp[3, 13], -logp[4, 2]]  # predicted from the column before each token
    assert mask[0].tolist() == [False, False, True, True, True]
    assert mask[1].tolist() == [False, True, False, False, False]  # EOS of the short row, then padding
    assert torch.allclose(nll[0][mask[0]], torch.stack(expected), atol=1e-5)


@pytest.mark.slow
@pytest.mark.learning
def test_sft_lowers_eval_loss_writes_run_folder_and_resumes_bit_identically(
    tmp_path, learning_seed, learning_figures
):
    paths = write_sft_problem(tmp_path, seed=learning_seed)
    full, part = tmp_path / "full", tmp_path / "part"
    assert main(sft_args(paths, full, "train.max_steps=6", seed=learning_seed)) == 0
    # The same run, stopped after its step-3 checkpoint, then resumed.
    assert main(sft_args(paths, part, "train.max_steps=3", seed=learning_seed)) == 0
    assert main([*sft_args(paths, part, "train.max_steps=6", seed=learning_seed), "--resume"]) == 0

    a = load_file(str(full / "checkpoints/step-6/model.model.safetensors"))
    b = load_file(str(part / "checkpoints/step-6/model.model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows_full = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    rows_part = [json.loads(x) for x in (part / "metrics.jsonl").read_text().splitlines()]

    def strip(rows):
        return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]

    assert strip(rows_full) == strip(rows_part)
    assert [r["step"] for r in rows_full] == [1, 2, 3, 4, 5, 6]

    evals = [r["eval/loss"] for r in rows_full if "eval/loss" in r]
    learning_figures(eval_loss_first=evals[0], eval_loss_last=evals[-1], eval_loss_fall=evals[0] - evals[-1])
    # 6 steps lower the eval loss by 0.33-0.35 nats over seeds 0-4 x 1 and 2 threads: half of it is the floor
    assert len(evals) == 2 and evals[0] - evals[1] > 0.15
    summary = json.loads((full / "summary.json").read_text())
    assert summary["kind"] == "sft" and summary["eval_loss"] == pytest.approx(evals[-1])

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(full / "final")
    tok = AutoTokenizer.from_pretrained(full / "final")
    assert tok.pad_token_id != tok.eos_token_id
    assert torch.equal(model.state_dict()["model.embed_tokens.weight"], a["model.embed_tokens.weight"])


def test_sft_bad_data_is_a_user_error_before_training(tmp_path, capsys):
    paths = write_sft_problem(tmp_path)
    paths["train"].write_text('{"prompt": "hello", "completion": "world ."}\n{"prompt": "hello"}\n')
    code = main(sft_args(paths, tmp_path / "run", "train.max_steps=2"))
    err = capsys.readouterr().err
    assert code == 2
    assert "train.jsonl" in err and "line 2" in err and "completion" in err
    assert not (tmp_path / "run" / "checkpoints").exists()
