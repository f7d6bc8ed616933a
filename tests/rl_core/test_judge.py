"""Generative judges as rewards: the parsers, the requests of both modes, the cache, the counts of unparsable and
failed judgements, retries, an OpenAI-compatible endpoint on loopback (its key from the environment, never in an
error), a local judge model behind an HF engine, and the config rules."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from rl_core.config import ConfigError, config_from_dict
from rl_core.config.schema import JudgeConfig
from rl_core.rewards.judge import (
    Judge,
    JudgeError,
    JudgeReward,
    endpoint_generate,
    engine_generate,
    parse_score,
    parse_scores,
)


def spec(**kw) -> JudgeConfig:
    return JudgeConfig(**{"model": "unused", **kw})


def test_parsers():
    assert parse_score("Score: 7") == 7.0 and parse_score("between 3 and 4.5") == 4.5 and parse_score("none") is None
    assert parse_scores("1: 3\n2: 9\n3: 0.5", 3) == [3.0, 9.0, 0.5]
    assert parse_scores("2. 5\n1. 4", 2) == [4.0, 5.0]  # numbered lines in any order
    assert parse_scores("8 6", 2) == [8.0, 6.0]  # else the first n numbers
    assert parse_scores("1: 3", 2) is None


def test_pointwise_requests_cache_and_unparsable_counts():
    sent: list[list[str]] = []

    def generate(texts):
        sent.append(texts)
        return ["Score: 9" if "46" in t else "no idea" for t in texts]

    judge = Judge(spec(template="{prompt} -> {completion} (ref {answer})", unparsable_value=-1.0), generate)
    out = judge.score(["12+34=", "12+34=", "5+5="], ["46", "46", "11"], ["46", "46", "10"])
    assert out.values == [9.0, 9.0, -1.0] and out.unparsable == 1 and out.failed == 0 and out.cached == 0
    assert sent == [["12+34= -> 46 (ref 46)", "5+5= -> 11 (ref 10)"]]  # the duplicate asked once
    again = judge.score(["5+5="], ["11"], ["10"])
    assert len(sent) == 1 and again.cached == 1 and again.values == [-1.0]  # from the cache
    assert out.metrics("j") == pytest.approx({"rollout/rewards/j/unparsable": 1 / 3, "rollout/rewards/j/failed": 0.0,
                                              "rollout/rewards/j/cached": 0.0})


def test_group_mode_judges_each_prompt_once_and_a_wrong_count_is_unparsable():
    sent: list[str] = []

    def generate(texts):
        sent.extend(texts)
        return ["1: 2\n2: 8" if "a+b" in t else "1: 5" for t in texts]

    judge = Judge(spec(mode="group", template="{prompt}\n{completions}"), generate)
    out = judge.score(["a+b", "a+b", "c+d", "c+d"], ["x", "y", "z", "w"])
    assert sent == ["a+b\n1. x\n2. y", "c+d\n1. z\n2. w"]
    assert out.values == [2.0, 8.0, 0.0, 0.0] and out.unparsable == 2


def test_retries_then_failures_are_counted(monkeypatch):
    monkeypatch.setattr("rl_core.rewards.judge.time.sleep", lambda s: None)
    calls = []

    def flaky(texts):
        calls.append(1)
        if len(calls) < 3:
            raise JudgeError("down")
        return ["4"] * len(texts)

    assert Judge(spec(retries=2), flaky).score(["p"], ["c"]).values == [4.0] and len(calls) == 3
    calls.clear()
    out = Judge(spec(retries=1, unparsable_value=0.5), flaky).score(["p", "q"], ["c", "d"])
    assert out.values == [0.5, 0.5] and out.failed == 2 and len(calls) == 2


class _Endpoint(BaseHTTPRequestHandler):
    seen: ClassVar[list[dict]] = []
    fail_first = True

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append({"auth": self.headers.get("Authorization"), "body": body})
        if type(self).fail_first:
            type(self).fail_first = False
            self.send_response(500)
            self.end_headers()
            return
        text = body["messages"][0]["content"]
        reply = {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                 "choices": [{"index": 0, "finish_reason": "stop",
                              "message": {"role": "assistant", "content": f"Score: {len(text) % 10}"}}]}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_an_endpoint_judge_on_loopback_with_its_key_from_the_environment(monkeypatch):
    monkeypatch.setattr("rl_core.rewards.judge.time.sleep", lambda s: None)
    monkeypatch.setenv("JUDGE_KEY", "sk-test-0123456789")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Endpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/v1"
        judge_spec = spec(model=None, endpoint=url, endpoint_model="judge-1", api_key_env="JUDGE_KEY", retries=1,
                          template="{completion}")
        out = Judge(judge_spec, endpoint_generate(judge_spec, "data.rewards[0].judge")).score(["p"], ["abc"])
        assert out.values == [3.0] and out.failed == 0  # len("abc") % 10, after one retry of the 500
        assert all(s["auth"] == "Bearer sk-test-0123456789" for s in _Endpoint.seen)
        assert _Endpoint.seen[-1]["body"]["model"] == "judge-1" and _Endpoint.seen[-1]["body"]["temperature"] == 0.0
    finally:
        server.shutdown()
    dead = spec(model=None, endpoint=url, endpoint_model="judge-1", api_key_env="JUDGE_KEY", retries=0, timeout_s=2)
    with pytest.raises(JudgeError) as failed:
        endpoint_generate(dead, "data.rewards[0].judge")(["x"])
    assert url in str(failed.value) and "sk-test" not in str(failed.value)
    monkeypatch.delenv("JUDGE_KEY")
    with pytest.raises(ValueError, match="api_key_env=JUDGE_KEY: that environment variable is not set"):
        endpoint_generate(dead, "data.rewards[0].judge")


def test_a_local_judge_answers_greedily_and_its_text_is_what_is_parsed(tmp_path):
    from rl_core.model.loading import build_tiny_tokenizer, load_policy
    from rl_core.rollout.hf import HFEngine
    from tests.builders import tiny_model

    tokenizer = build_tiny_tokenizer()
    tiny_model(0, vocab_size=len(tokenizer)).save_pretrained(tmp_path / "judge")
    tokenizer.save_pretrained(tmp_path / "judge")
    entry = config_from_dict({"data": {"rewards": [{"judge": {"model": str(tmp_path / "judge"), "max_tokens": 4,
                                                              "template": "{prompt}{completion}="}}]}}).data.rewards[0]
    reward = JudgeReward(entry, "data.rewards[0]")
    values = reward(["1+1=", "2+2="], ["2", "5"])
    model, tok = load_policy(config_from_dict({"model": {"name_or_path": str(tmp_path / "judge")}}).model)
    texts = engine_generate(HFEngine(model.eval(), tok), tok, entry.judge)(["1+1=2=", "2+2=5="])
    expected = [parse_score(t) for t in texts]
    assert values == [0.0 if e is None else e for e in expected]
    assert reward.last.unparsable == sum(e is None for e in expected)


def test_judge_entries_are_checked():
    with pytest.raises(ConfigError, match="exactly one of them"):
        config_from_dict({"data": {"rewards": [{"judge": {"model": "a", "endpoint": "http://x/v1"}}]}})
    with pytest.raises(ConfigError, match="names its model"):
        config_from_dict({"data": {"rewards": [{"judge": {"endpoint": "http://x/v1"}}]}})
    with pytest.raises(ConfigError, match="credentials out of the URL"):
        config_from_dict({"data": {"rewards": [{"judge": {"endpoint": "http://u:p@x/v1", "endpoint_model": "m"}}]}})
    with pytest.raises(ConfigError, match="exactly one of them"):
        config_from_dict({"data": {"rewards": [{"judge": {"model": "a"}, "path": "rl_core.rewards.arithmetic:exact_match"}]}})
    cfg = config_from_dict({"data": {"rewards": [{"judge": {"endpoint": "http://127.0.0.1:1/v1", "endpoint_model": "m",
                                                           "api_key_env": "NO_SUCH_JUDGE_KEY"}}]}})
    from rl_core.preflight.machine import machine_problems

    assert any(p.startswith("data.rewards[0].judge.api_key_env=NO_SUCH_JUDGE_KEY") for p in machine_problems(cfg, gpus=0))
