"""A GRPO run whose environment's tools misbehave in turn (raise, hold the interpreter lock for a minute, spin,
sleep past the timeout and then change the environment, return 5,000 characters): the run finishes, each
misbehaviour is counted, no process outlives its call, and the run costs at most one timeout per turn more than
the same run with well-behaved tools."""

from __future__ import annotations

import json
import os
import textwrap
import time

import torch

from rlhfkit.config import load_config
from rlhfkit.engine.metrics_writer import read_metrics
from rlhfkit.trainers import online
from rlhfkit.trainers.online import collect
from tests.helpers import tiny_llama
from tests.helpers_tools import tool_tokenizer
from tests.rollout.test_tool_worker import children
from tests.trainers.online.test_online import _hand_built_generation

ENV = textwrap.dedent(
    '''
    import re, time

    class Moody:
        def reset(self, **row):
            self.state = 0

        def act(self, how: str) -> str:
            """Does something, well or badly.

            Args:
                how: what to do
            """
            if how == "raise":
                raise RuntimeError("kaput")
            if how == "gil":  # catastrophic backtracking: about a minute holding the interpreter lock
                return str(bool(re.match(r"(a+)+$", "a" * 34 + "b")))
            if how == "spin":
                while True:
                    pass
            if how == "late":
                time.sleep(3)
                self.state = 99
                return "late"
            if how == "big":
                return "x" * 5000
            self.state += 1
            return "ok"

        def get_reward(self) -> float:
            return float(self.state)
    '''
)
MISBEHAVIOURS = ["raise", "gil", "spin", "late", "big", "fine"]


class MoodySampler:
    """Row i of a rollout calls act(how=MISBEHAVIOURS[i % 6]) (or "fine" for all, ``calm``), then answers."""

    def __init__(self, tok, calm: bool = False):
        self.tok, self.calm = tok, calm

    def __call__(self, model, prompt_ids, prompt_mask, *, max_new_tokens, stop_token_ids, pad_token_id, **_):
        rows = []
        for i, (ids, mask) in enumerate(zip(prompt_ids, prompt_mask, strict=True)):
            text = self.tok.decode(ids[mask.bool()].tolist(), skip_special_tokens=False)
            if "<tool_response>" in text:
                rows.append(
                    self.tok("answer=1", add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
                )
                continue
            how = "fine" if self.calm else MISBEHAVIOURS[i % len(MISBEHAVIOURS)]
            call = json.dumps({"name": "act", "arguments": {"how": how}})
            rows.append(self.tok(f"<tool_call>\n{call}\n</tool_call>", add_special_tokens=False)["input_ids"])
        raw = [(r + [pad_token_id] * max_new_tokens)[:max_new_tokens] for r in rows]
        sample = _hand_built_generation(self.tok, raw)
        return sample(
            model, prompt_ids, prompt_mask, stop_token_ids=stop_token_ids, pad_token_id=pad_token_id
        )


def run(tmp_path, monkeypatch, name: str, calm: bool) -> tuple[float, list[dict]]:
    tok = tool_tokenizer()
    policy = tmp_path / "policy"
    if not policy.exists():
        tiny_llama(vocab_size=len(tok), pad_token_id=tok.pad_token_id).save_pretrained(policy)
        tok.save_pretrained(policy)
        (tmp_path / "prompts.jsonl").write_text(
            "".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(6))
        )
        (tmp_path / "env.py").write_text(ENV)
    monkeypatch.setattr(collect, "generate_responses", MoodySampler(tok, calm))
    cfg = load_config(
        None,
        [
            f"output_dir={tmp_path / name}",
            f"model.name_or_path={policy}",
            f"data.train_file={tmp_path / 'prompts.jsonl'}",
            f"online.environment={tmp_path / 'env.py'}:Moody",
            "online.tool_timeout=1",
            "online.max_turns=2",
            "online.response_length=200",
            "online.max_tool_response_length=32",
            "online.group_size=1",
            "train.batch_size=6",
            "train.max_steps=2",
            "data.max_prompt_length=32",
            "online.advantage_estimator=reinforce_pp",
        ],
        "ppo",
    )
    start = time.perf_counter()
    online.train(cfg)
    return time.perf_counter() - start, read_metrics(tmp_path / name / "metrics.jsonl")


def test_a_run_with_misbehaving_tools_finishes_counts_them_and_pays_one_timeout_a_turn(tmp_path, monkeypatch):
    torch.manual_seed(0)
    before = children()
    calm_seconds, _ = run(tmp_path, monkeypatch, "calm", calm=True)
    seconds, metrics = run(tmp_path, monkeypatch, "moody", calm=False)
    last = [m for m in metrics if "tools/timeouts" in m][-1]
    # 6 episodes: gil, spin and late time out (3 of 6 calls), raise is an exception, big is cut
    assert last["tools/timeouts"] == 0.5 and last["episodes/stopped_by_tool"] == 0.5
    assert abs(last["tools/errors/timeout"] - 0.5) < 1e-6
    assert abs(last["tools/errors/exception"] - 1 / 6) < 1e-6
    assert abs(last["tools/errors/too_long"] - 1 / 6) < 1e-6
    # one turn with calls per rollout, 2 rollouts: at most one 1 s timeout each (plus the kill and slack)
    assert seconds < calm_seconds + 2 * 1.0 + 3.0, (seconds, calm_seconds)
    time.sleep(0.2)
    assert children() - before == set()  # no tool process outlives the run
    assert os.path.isdir(tmp_path / "moody" / "final")
