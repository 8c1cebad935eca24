"""The student's and the teacher's responses to the same prompts, for the report of a distillation run
(``online.teacher_model``: `train distill`, or any online run with a teacher).

At each evaluation and after the last rollout, the first :data:`SIDE_BY_SIDE_PROMPTS` held-out prompts
(``data.eval_file``; without one, the first training prompts) are sampled once by the student (the actor as it
is then) and once by the teacher, at the run's temperature and processing (``ctx.sampling``), each prompt from
the same per-row random stream for both, seeded from (seed, step). The rows go to
``<run>/teacher_samples.jsonl`` (:data:`rlhfkit.reporting.sample_file.TEACHER_SAMPLES_FILE`), one per prompt::

    {"step": 40, "split": "eval", "prompt": "...", "student": "...", "teacher": "...",
     "student_length": 12, "teacher_length": 9, "student_ended": true, "teacher_ended": true}

A few prompts, one generation call per model: cheap beside a rollout; none with ``logging.samples_per_step``
0, which turns every sample file off. Every process samples the same prompts
(a sharded actor is gathered by all of them); the main process writes. On ``--resume`` the rows after the
checkpoint are dropped, as in ``samples.jsonl``.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhfkit.data import PromptCollator
from rlhfkit.engine.folder import RunDir
from rlhfkit.engine.seed import get_rng_state, seed_everything, set_rng_state
from rlhfkit.models.sampler import RowStreams
from rlhfkit.reporting.sample_file import TEACHER_SAMPLES_FILE
from rlhfkit.rollout import generate_responses
from rlhfkit.rollout.generation import decode_responses
from rlhfkit.rollout.samples import SamplesWriter
from rlhfkit.trainers.online.context import OnlineContext, derived_seed
from rlhfkit.trainers.online.sharding import generation_model

SIDE_BY_SIDE_PROMPTS = 4  # prompts sampled by both models at each evaluation


def side_by_side_streams(seed: int, step: int, rows: int, device: torch.device | str = "cpu") -> RowStreams:
    """The random streams of the side-by-side samples at ``step``: one per prompt, the same for both models."""
    index = torch.arange(rows, device=device)
    return RowStreams(derived_seed("side-by-side", seed, step), index, torch.zeros_like(index))


@torch.no_grad()
def side_by_side(ctx: OnlineContext, examples: list[dict], step: int, split: str) -> list[dict[str, Any]]:
    """One row per example of ``examples`` (prepared prompts): its prompt, the student's and the teacher's
    response (decoded up to the stop token), their lengths in tokens and whether they ended. Every global RNG
    is seeded from (seed, step) and restored afterwards: training samples the same with or without this."""
    collate = PromptCollator(ctx.tokenizer.pad_token_id)
    b = collate(list(examples))
    ids, mask = b["input_ids"].to(ctx.device), b["attention_mask"].to(ctx.device)
    streams = side_by_side_streams(ctx.cfg.seed, step, len(examples), ctx.device)
    common = dict(
        max_new_tokens=ctx.cfg.online.response_length,
        stop_token_ids=ctx.stop_token_ids,
        pad_token_id=ctx.tokenizer.pad_token_id,
        sampling=ctx.sampling,
        streams=streams,
    )
    saved = get_rng_state()
    try:
        seed_everything(derived_seed("side-by-side-rng", ctx.cfg.seed, step) % 2**32)
        with generation_model(ctx) as actor:
            student = generate_responses(actor, ids, mask, **common)
        seed_everything(derived_seed("side-by-side-rng", ctx.cfg.seed, step) % 2**32)
        teacher = generate_responses(ctx.roles.teacher, ids, mask, **common)
    finally:
        set_rng_state(saved)
    texts = {
        name: decode_responses(ctx.tokenizer, r.response_ids, r.mask)
        for name, r in (("student", student), ("teacher", teacher))
    }
    return [
        {
            "step": int(step),
            "split": split,
            "prompt": record.get("prompt"),
            "student": texts["student"][i],
            "teacher": texts["teacher"][i],
            "student_length": int(student.mask[i].sum()),
            "teacher_length": int(teacher.mask[i].sum()),
            "student_ended": bool(student.ended[i]),
            "teacher_ended": bool(teacher.ended[i]),
        }
        for i, record in enumerate(b["records"])
    ]


class SideBySideWriter:
    """Writes :func:`side_by_side` rows of the run's first prompts to ``teacher_samples.jsonl``; does nothing
    in a run without a teacher."""

    def __init__(
        self, ctx: OnlineContext, run: RunDir, examples: list[dict], eval_examples: list[dict] | None
    ):
        self.ctx = ctx
        # with a teacher, unless sample logging is off (logging.samples_per_step 0: a benchmark's runs)
        self.enabled = ctx.roles.teacher is not None and ctx.cfg.logging.samples_per_step > 0
        self.split = "eval" if eval_examples else "train"
        self.prompts = (eval_examples or examples)[:SIDE_BY_SIDE_PROMPTS]
        self.samples = SamplesWriter(
            run.path / TEACHER_SAMPLES_FILE,
            keep_until=run.resume_step if run.resume_checkpoint else -1,
            enabled=self.enabled and ctx.accelerator.is_main_process,
        )

    def __call__(self, step: int) -> None:
        if self.enabled and self.prompts:
            self.samples.write(side_by_side(self.ctx, self.prompts, step, self.split))

    def close(self) -> None:
        self.samples.close()
