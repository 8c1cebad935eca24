"""The hostile-code list inside one GRPO run: a scripted policy sends each program to the ``rlhfkit:python``
tool and answers with another that ``rlhfkit:code_tests`` runs; every attempt is stopped and reported, the
run ends with its checkpoint, and nothing outside the sandbox's own temp folder changes."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from rlhfkit.config import load_config
from rlhfkit.engine.metrics_writer import read_metrics
from rlhfkit.trainers import online
from rlhfkit.trainers.online import collect
from tests.helpers import tiny_llama
from tests.helpers_tools import tool_tokenizer
from tests.trainers.online.test_online import _hand_built_generation

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None and not os.environ.get("CI"), reason="bubblewrap is not installed"
)


def hostile(outside: Path) -> dict[str, str]:
    return {
        "loop": "while True:\n    pass",
        "memory": "x = bytearray(1 << 33)",
        "fork": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        "recursion": "import sys\nsys.setrecursionlimit(10**8)\ndef f(n):\n    return f(n + 1)\nf(0)",
        "output": "import sys\nsys.stdout.write('x' * 100_000_000)",
        "write": f"open({str(outside)!r}, 'w').write('changed')",
        "environ": "import os\nprint(os.environ.get('RLHFKIT_SANDBOX_SECRET'))",
        "socket": "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)",
        "exit": "import os\nos._exit(3)",
        "signal": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
    }


class HostileSampler:
    """Row i of a rollout: first a call of the python tool with program i, then an answer whose code is
    program i + 5 (then EOS)."""

    def __init__(self, tok, programs: list[str]):
        self.tok, self.programs, self.turn_rows = tok, programs, 0

    def __call__(self, model, prompt_ids, prompt_mask, *, max_new_tokens, stop_token_ids, pad_token_id, **_):
        rows = []
        for i, (ids, mask) in enumerate(zip(prompt_ids, prompt_mask, strict=True)):
            text = self.tok.decode(ids[mask.bool()].tolist(), skip_special_tokens=False)
            k = (self.turn_rows + i) % len(self.programs)
            if "<tool_response>" not in text:
                body = json.dumps({"name": "python", "arguments": {"code": self.programs[k]}})
                out = f"<tool_call>\n{body}\n</tool_call>"
            else:
                out = f"```python\n{self.programs[(k + 5) % len(self.programs)]}\n```"
            rows.append(self.tok(out, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id])
        self.turn_rows += len(rows)
        raw = [(r + [pad_token_id] * max_new_tokens)[:max_new_tokens] for r in rows]
        sample = _hand_built_generation(self.tok, raw)
        return sample(
            model, prompt_ids, prompt_mask, stop_token_ids=stop_token_ids, pad_token_id=pad_token_id
        )


def test_hostile_code_through_the_tool_and_the_reward_in_one_run(tmp_path, monkeypatch):
    outside_dir = Path(tempfile.mkdtemp(dir="/var/tmp" if os.path.isdir("/var/tmp") else None))
    outside = outside_dir / "outside.txt"
    outside.write_text("before")
    monkeypatch.setenv("RLHFKIT_SANDBOX_SECRET", "s3cret")
    tok = tool_tokenizer()
    policy = tmp_path / "policy"
    tiny_llama(vocab_size=len(tok), pad_token_id=tok.pad_token_id).save_pretrained(policy)
    tok.save_pretrained(policy)
    prompts = tmp_path / "prompts.jsonl"
    tests = ["assert add(1, 2) == 3"]
    prompts.write_text("".join(json.dumps({"prompt": f"task {i}", "tests": tests}) + "\n" for i in range(5)))
    programs = list(hostile(outside).values())
    sampler = HostileSampler(tok, programs)
    monkeypatch.setattr(collect, "generate_responses", sampler)
    host_tmp = set(os.listdir(tempfile.gettempdir()))
    cfg = load_config(
        None,
        [
            f"output_dir={tmp_path / 'run'}",
            f"model.name_or_path={policy}",
            f"data.train_file={prompts}",
            "online.tools=[rlhfkit:python]",
            "online.reward_functions=[rlhfkit:code_tests]",
            "online.tool_timeout=2",
            "online.tool_memory_mb=256",
            "online.max_turns=2",
            "online.response_length=1200",
            "online.max_tool_response_length=160",
            "online.group_size=2",
            "train.batch_size=5",
            "train.max_steps=1",
            "data.max_prompt_length=64",
            "logging.samples_per_step=10",
        ],
        "grpo",
    )
    online.train(cfg)
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    results = [t["result"] for s in samples for t in s["turns"] if t["role"] == "tool"]
    assert len(results) == 10
    everything = "\n".join(results)
    for seen in (
        "[stopped: no end within",
        "MemoryError",
        "bytes of output]",
        "[exit code 3]",
    ):
        assert seen in everything, seen
    assert "Read-only file system" in everything or "Permission denied" in everything
    assert "s3cret" not in everything
    assert outside.read_text() == "before"
    left = set(os.listdir(tempfile.gettempdir())) - host_tmp
    assert not [p for p in left if p.startswith("rlhfkit-sandbox-")]  # nothing of the runs stays behind
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert metrics[-1]["tools/calls/python"] == 1.0
    assert (tmp_path / "run" / "final").is_dir()
    shutil.rmtree(outside_dir, ignore_errors=True)
