"""Built-in offline tasks: a corpus, prompt splits, a tokenizer, model presets and a gold scorer that
plays the human annotators, with nothing downloaded.

    from rlhfkit.tasks import get_task
    task = get_task("reviews", seed=0)
    records = task.sft_records(4096)             # [{"prompt": ..., "completion": ...}, ...]
    tokenizer = task.build_tokenizer("out/tok")  # a Hugging Face tokenizer folder
    model = task.build_model("tiny", tokenizer)  # a fresh LlamaForCausalLM
    task.gold_score(prompt, response)            # the "human" judgement
    task.annotate(prompt, a, b, rng)             # a noisy annotator's preference record

The task is described in `rlhfkit.tasks.reviews` (its gold score and the two proxies that can be hacked);
`rlhfkit.tasks.arithmetic` has step-by-step sums, and `rlhfkit.tasks.calculator` (``"tools"``) products that
a policy answers with a calculator tool over several turns.
"""

from __future__ import annotations

from rlhfkit.errors import ConfigError
from rlhfkit.tasks.arithmetic import ArithmeticTask
from rlhfkit.tasks.base import Task
from rlhfkit.tasks.calculator import ToolsTask
from rlhfkit.tasks.presets import MODEL_PRESETS, count_parameters
from rlhfkit.tasks.reviews import ReviewsTask

TASKS: dict[str, type[Task]] = {"reviews": ReviewsTask, "arithmetic": ArithmeticTask, "tools": ToolsTask}


def get_task(name: str = "reviews", seed: int = 0, **options) -> Task:
    """The task ``name`` with a seed; ``options`` go to its constructor (e.g. ``annotator_temperature``)."""
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; the tasks are {sorted(TASKS)}")
    return TASKS[name](seed=seed, **options)


__all__ = ["MODEL_PRESETS", "TASKS", "Task", "count_parameters", "get_task"]
