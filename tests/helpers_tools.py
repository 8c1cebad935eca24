"""Builders for the multi-turn tests: a tiny byte-level BPE tokenizer with a chat template that shows tools,
and a scripted sampler that hands back chosen token ids (so a test decides what the "model" sampled).

The tokenizer's merges span everything (no pre-tokenizer regex), so ``encode(decode(ids)) != ids`` for ids
written one character at a time, and re-encoding a row merges across turn boundaries.
"""

from __future__ import annotations

import torch

from rlhfkit.rollout.generation import Responses, truncate_at_stop

SPECIALS = ["<pad>", "<s>", "</s>"]

# Hermes-style: the assistant's text verbatim after the generation prompt, then "</s>\n"; tool results in a
# <|tool|> line. Role markers are plain text, so BPE merges run across them.
TOOL_TEMPLATE = (
    "{% if tools %}<|system|>tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}</s>{{ '\\n' }}"
    "{% elif m['role'] == 'tool' %}<|tool|><tool_response>{{ m['content'] }}</tool_response>{{ '\\n' }}"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}{{ '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# Trains the merges: the shapes of the conversations the tests play.
CORPUS = [
    "<|system|>tools: calculator add boom slow big\n<|user|>What is 12*34?\n<|assistant|>"
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call></s>\n'
    "<|tool|><tool_response>408</tool_response>\n<|assistant|>answer=408</s>\n",
    "<|user|>hello there\n<|assistant|>hello hello answer=7</s>\n<|tool|><tool_response>Error</tool_response>\n",
]


def tool_tokenizer(template: str | None = TOOL_TEMPLATE, marker_tokens: bool = True):
    """A byte-level BPE tokenizer (about 400 tokens) with ``</s>`` as EOS and ``<pad>`` as pad; the tool-call
    markers are single tokens with ``marker_tokens``, else plain text (the model can only end its turn with EOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS * 4, trainer)
    markers = ["<tool_call>", "</tool_call>"] if marker_tokens else []
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=markers,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = template
    return tokenizer


def char_ids(tokenizer, text: str) -> list[int]:
    """Ids of ``text`` written one character at a time (a non-canonical tokenization), special tokens whole."""
    ids = []
    specials = sorted(tokenizer.all_special_tokens, key=len, reverse=True)
    i = 0
    while i < len(text):
        special = next((s for s in specials if text.startswith(s, i)), None)
        if special is not None:
            ids.append(tokenizer.convert_tokens_to_ids(special))
            i += len(special)
            continue
        ids += tokenizer(text[i], add_special_tokens=False)["input_ids"]
        i += 1
    return ids


class ScriptedSampler:
    """Stands in for ``generate_responses``: call k hands back ``turns[k][j]`` to the j-th active row (cut at
    ``max_new_tokens``, then at the first stop token, as generate would), and records the rows it was given."""

    def __init__(self, turns: list[list[list[int]]]):
        self.turns = [list(t) for t in turns]
        self.seen: list[list[list[int]]] = []  # per call, the unpadded rows it was given

    def __call__(self, model, prompt_ids, prompt_mask, *, max_new_tokens, stop_token_ids, pad_token_id, **_):
        rows = self.turns.pop(0)
        assert len(rows) == prompt_ids.shape[0], "the script has a turn for every active row"
        self.seen.append(
            [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask, strict=True)]
        )
        out = torch.full((len(rows), max_new_tokens), pad_token_id, dtype=torch.long)
        for i, row in enumerate(rows):
            row = row[:max_new_tokens]
            out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        response_ids, mask, ended = truncate_at_stop(out, stop_token_ids, pad_token_id)
        input_ids = torch.cat([prompt_ids, response_ids], 1)
        return Responses(
            input_ids,
            torch.cat([prompt_mask, mask.long()], 1),
            response_ids,
            mask,
            ended,
            prompt_ids.shape[1],
        )
