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


def test_a_local_judge_reads_its_chat_turn_or_with_chat_off_the_request_itself():
    from rl_core.model.loading import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}User: {{ m['content'] }}\n{% endfor %}Assistant: "
    sent: list[list[list[int]]] = []

    class Engine:  # records what the judge is sent; answers nothing
        def generate(self, ids, n, sampling):
            sent.append(ids)
            return type("Out", (), {"decode_responses": lambda self, tok: [""] * len(ids)})()

    for chat in (True, False):
        engine_generate(Engine(), tokenizer, spec(chat=chat))(["7+1=8|8?"])
    assert tokenizer.decode(sent[0][0]) == "User: 7+1=8|8?\nAssistant: "
    assert sent[1] == [list(tokenizer("7+1=8|8?")["input_ids"])]


def test_judge_rows_are_the_requests_a_run_sends_with_their_verdicts(tmp_path):
    import pandas as pd

    from rl_core.data.pair_building import make_judge_rows
    from rl_core.data.preferences import write_pairs_jsonl
    from rl_core.rewards.arithmetic import JUDGE_TEMPLATE
    from tests.builders import PREFERENCE_PAIRS

    pairs = PREFERENCE_PAIRS[:3]
    write_pairs_jsonl(pd.DataFrame([{"pair_id": i, **p} for i, p in enumerate(pairs)]), tmp_path / "pairs.jsonl")
    made = make_judge_rows(tmp_path / "pairs.jsonl", tmp_path / "judge.jsonl", template=JUDGE_TEMPLATE)
    rows = [json.loads(line) for line in (tmp_path / "judge.jsonl").read_text().splitlines()]
    assert made["n_rows"] == 6 and [r["answer"] for r in rows] == ["1", "0"] * 3
    judge = Judge(spec(template=JUDGE_TEMPLATE), lambda texts: texts)
    prompts = [p["prompt"] for p in pairs for _ in range(2)]
    answers = [a for p in pairs for a in (p["chosen"], p["rejected"])]
    sent = [text for text, _ in judge.requests(prompts, answers, [p["chosen"] for p in pairs for _ in range(2)])]
    assert [r["prompt"] for r in rows] == sent and sent[:2] == ["12+34=46|46?", "12+34=47|46?"]


def test_a_vllm_judge_on_a_gpu_is_planned_as_its_reservation_an_hf_one_as_its_weights(tmp_path):
    from rl_core.placement.formulas import REWARD
    from rl_core.placement.memory import memory_plan
    from rl_core.placement.model_shape import model_shape
    from tests.builders import tiny_model

    tiny_model(0).save_pretrained(tmp_path / "m")
    shape, gpu = model_shape(str(tmp_path / "m")), 80 * 2**30
    judges = [{"judge": {"model": str(tmp_path / "m"), "engine": "vllm", "gpu_memory_utilization": 0.3}},
              {"judge": {"model": str(tmp_path / "m")}}]
    cfg = config_from_dict({"model": {"name_or_path": str(tmp_path / "m"), "compute_dtype": "bfloat16"},
                            "cluster": {"gpus_per_worker": 1}, "data": {"rewards": judges}})
    trainer = memory_plan(cfg, shape, prompt_tokens=16, gpu_bytes=gpu, reward_model_shapes=[(0, shape), (1, shape)]
                          ).role("trainer")
    assert trainer.item("judge data.rewards[0]: vLLM gpu_memory_utilization 0.3").bytes == int(0.3 * gpu)
    assert trainer.item("judge data.rewards[1]: frozen weights").bytes == 2 * shape.n_params  # bfloat16
    assert not any(i.name.startswith("judge data.rewards[0] scoring") for i in trainer.items) and REWARD in trainer.phases


def test_judge_entries_are_checked(monkeypatch):
    with pytest.raises(ConfigError, match="exactly one of them"):
        config_from_dict({"data": {"rewards": [{"judge": {"model": "a", "endpoint": "http://x/v1"}}]}})
    with pytest.raises(ConfigError, match="names its model"):
        config_from_dict({"data": {"rewards": [{"judge": {"endpoint": "http://x/v1"}}]}})
    with pytest.raises(ConfigError, match="credentials out of the URL"):
        config_from_dict({"data": {"rewards": [{"judge": {"endpoint": "http://u:p@x/v1", "endpoint_model": "m"}}]}})
    with pytest.raises(ConfigError, match="chat=false applies to a local judge"):
        config_from_dict({"data": {"rewards": [{"judge": {"endpoint": "http://x/v1", "endpoint_model": "m",
                                                          "chat": False}}]}})
    with pytest.raises(ConfigError, match="engine is a local judge's"):
        config_from_dict({"data": {"rewards": [{"judge": {"endpoint": "http://x/v1", "endpoint_model": "m",
                                                          "engine": "vllm"}}]}})
    with pytest.raises(ConfigError, match="apply to engine=vllm"):
        config_from_dict({"data": {"rewards": [{"judge": {"model": "a", "gpu_memory_utilization": 0.5}}]}})
    with pytest.raises(ConfigError, match="exactly one of them"):
        config_from_dict({"data": {"rewards": [{"judge": {"model": "a"}, "path": "rl_core.rewards.arithmetic:exact_match"}]}})
    cfg = config_from_dict({"data": {"rewards": [{"judge": {"endpoint": "http://127.0.0.1:1/v1", "endpoint_model": "m",
                                                           "api_key_env": "NO_SUCH_JUDGE_KEY"}}]}})
    from rl_core.preflight.machine import machine_problems

    assert any(p.startswith("data.rewards[0].judge.api_key_env=NO_SUCH_JUDGE_KEY") for p in machine_problems(cfg, gpus=0))
    from rl_core.preflight import machine

    vllm_judge = config_from_dict({"data": {"rewards": [{"judge": {"model": "a", "engine": "vllm"}}]}})
    for build, why in ((None, "the vllm package is not installed"), ("gpu", "vLLM's GPU build needs a GPU")):
        monkeypatch.setattr(machine, "vllm_build", lambda build=build: build)
        assert why in machine.judge_engine_problem("data.rewards[0]", vllm_judge)
    monkeypatch.setattr(machine, "vllm_build", lambda: "cpu")
    assert machine.judge_engine_problem("data.rewards[0]", vllm_judge) is None



def test_a_missing_local_judge_names_the_pipeline_that_builds_it(tmp_path, monkeypatch):
    from rl_core.preflight.machine import machine_problems

    (tmp_path / "pipelines" / "mine").mkdir(parents=True)
    (tmp_path / "pipelines" / "mine" / "dvc.yaml").write_text(
        "stages:\n  judge_model:\n    wdir: ../..\n    cmd: make it\n    outs:\n      - artifacts/tiny/my-judge\n")
    monkeypatch.chdir(tmp_path)
    for name, hint in (("artifacts/tiny/my-judge", "`dvc repro pipelines/mine/dvc.yaml` builds it"),
                       ("artifacts/tiny/other", "build the tiny model")):
        cfg = config_from_dict({"data": {"rewards": [{"judge": {"model": name}}]}})
        (problem,) = [p for p in machine_problems(cfg, gpus=0) if p.startswith("data.rewards[0].judge.model")]
        assert f"no such local directory; {hint}" in problem
