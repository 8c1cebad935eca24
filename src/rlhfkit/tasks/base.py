"""The interface of a built-in task, and what every task shares: SFT records, annotators, models.

A task subclass supplies the language (prompt splits, a writer of SFT completions, the gold scorer, the
validity check, texts for its tokenizer); this base class turns them into the objects the pipeline
uses. It imports no trainer.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from pathlib import Path

from rlhfkit.tasks import annotators
from rlhfkit.tasks.presets import build_causal_lm, model_config
from rlhfkit.tasks.tokenizer import save_tokenizer, train_tokenizer


def message_text(value) -> str:
    """A rule reward's prompt or completion as text: the last user message of a prompt conversation, the last
    assistant message of a completion conversation (TRL's conversational form), or the string itself."""
    if isinstance(value, list):
        for role in ("assistant", "user"):
            contents = [m.get("content") for m in value if isinstance(m, dict) and m.get("role") == role]
            if contents:
                return str(contents[-1])
        return ""
    return str(value)


class Task:
    """A built-in offline task. Subclasses set ``name`` and implement the five methods that raise.

    Args:
        seed: everything random about the task (corpus, prompt splits, model initialisation) derives
            from it; the language and the gold scorer do not depend on it.
        annotator_temperature: the Bradley-Terry temperature of the simulated annotators.
    """

    name: str = ""

    def __init__(self, seed: int = 0, annotator_temperature: float = 0.5):
        self.seed = int(seed)
        self.annotator_temperature = annotators.check_temperature(annotator_temperature)

    # --- the language: implemented by each task ----------------------------------------------------
    def prompts(self, split: str = "train") -> list[str]:
        """The prompts of a split: ``"train"`` or ``"eval"`` (held out, disjoint from train)."""
        raise NotImplementedError

    def sample_completion(self, prompt: str, rng: random.Random) -> str:
        """One completion in the corpus writer's style (what SFT imitates)."""
        raise NotImplementedError

    def gold_score(self, prompt: str, response: str) -> float:
        """The gold score that stands in for human judgement."""
        raise NotImplementedError

    def is_valid(self, response: str) -> bool:
        """True if the response is well formed in the task's language."""
        raise NotImplementedError

    def tokenizer_texts(self) -> list[str]:
        """The texts the tokenizer is trained on (independent of the seed)."""
        raise NotImplementedError

    # --- data ---------------------------------------------------------------------------------------
    def sft_records(self, n: int = 4096, split: str = "train") -> list[dict]:
        """``n`` SFT records ``{"prompt", "completion"}`` on the prompts of ``split`` (``"eval"`` gives
        held-out records for an evaluation loss); deterministic from the seed, and ``sft_records(m)`` is
        a prefix of ``sft_records(n)`` for m <= n."""
        rng = random.Random(f"{self.name}-sft-{self.seed}" + ("" if split == "train" else f"-{split}"))
        prompts = self.prompts(split)
        records = []
        for _ in range(n):
            prompt = rng.choice(prompts)
            records.append({"prompt": prompt, "completion": self.sample_completion(prompt, rng)})
        return records

    # --- annotators ---------------------------------------------------------------------------------
    def _temperature(self, temperature: float | None) -> float:
        return self.annotator_temperature if temperature is None else temperature

    def gold_compare(self, prompt: str, a: str, b: str) -> int:
        """Noiseless comparator: +1 if ``a`` has the higher gold score, -1 if ``b``, 0 for a tie."""
        return annotators.gold_order(self.gold_score(prompt, a), self.gold_score(prompt, b))

    def preference_probability(self, prompt: str, a: str, b: str, temperature: float | None = None) -> float:
        """P(an annotator prefers ``a``) = sigmoid((gold(a) - gold(b)) / temperature)."""
        return annotators.preference_probability(
            self.gold_score(prompt, a), self.gold_score(prompt, b), self._temperature(temperature)
        )

    def annotate(self, prompt: str, a: str, b: str, rng, temperature: float | None = None) -> dict:
        """One noisy annotator's judgement as a preference record ``{"prompt", "chosen", "rejected"}``.

        ``rng``: a ``random.Random`` or ``numpy.random.Generator`` (one draw per call).
        """
        first = annotators.prefers_first(
            self.gold_score(prompt, a), self.gold_score(prompt, b), self._temperature(temperature), rng
        )
        chosen, rejected = (a, b) if first else (b, a)
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected}

    def annotate_pairs(
        self, pairs: Iterable[tuple[str, str, str]], seed: int | None = None, temperature: float | None = None
    ) -> list[dict]:
        """Label ``(prompt, a, b)`` triples with noisy annotators; deterministic from ``seed``
        (default: the task's seed)."""
        rng = random.Random(f"{self.name}-annotators-{self.seed if seed is None else seed}")
        return [self.annotate(p, a, b, rng, temperature) for p, a, b in pairs]

    def bayes_ceiling(self, pairs: Iterable[tuple[str, str, str]], temperature: float | None = None) -> float:
        """Expected agreement of the annotators' labels with the gold ordering on ``(prompt, a, b)``
        triples, ties excluded: the accuracy against labels of a model that knows the gold scores."""
        gold = [(self.gold_score(p, a), self.gold_score(p, b)) for p, a, b in pairs]
        return annotators.bayes_ceiling_from_scores(gold, self._temperature(temperature))

    # --- tokenizer and models -----------------------------------------------------------------------
    def build_tokenizer(self, out_dir: str | Path | None = None):
        """Train the task's tokenizer; save it to ``out_dir`` when given. Returns a
        ``PreTrainedTokenizerFast`` with distinct ``<pad>``, ``<bos>`` and ``<eos>``."""
        tokenizer = train_tokenizer(self.tokenizer_texts())
        return tokenizer if out_dir is None else save_tokenizer(tokenizer, out_dir)

    def model_config(self, preset: str, tokenizer):
        """The ``LlamaConfig`` of a preset (``"tiny"`` or ``"small"``) for this tokenizer."""
        return model_config(preset, tokenizer)

    def build_model(self, preset: str, tokenizer, seed: int | None = None):
        """A freshly initialised ``LlamaForCausalLM`` of a preset; deterministic from ``seed``
        (default: the task's seed)."""
        return build_causal_lm(self.model_config(preset, tokenizer), self.seed if seed is None else seed)
