"""Bring your own agent: agent functions on the real `openai` client talk to the gateway, which records the ids the
engine sampled (rl_core.agents.gateway). The engine here writes a scripted turn per prompt and scores it with a real
model's log-probs, so what the gateway recorded can be checked against what was "sampled", id for id, and the
trainer's log-probs against the engine's."""

from __future__ import annotations

import json
import re

import httpx
import pytest
import torch

from examples.tool_arithmetic_agent import calculator_agent
from rl_core.agents.gateway import MODEL, agent_environment
from rl_core.agents.gateway.server import MAX_BODY_BYTES
from rl_core.agents.rollout import rollout_episodes
from rl_core.rollout import SamplingParams
from rl_core.rollout.base import build_completions
from rl_core.tasks import Example, get_task
from rl_core.tasks.environment import EnvironmentTask
from tests.rl_core.test_agents import ids_of, stopping_policy, tokenizer

CALC = {"type": "function", "function": {"name": "calculator", "description": "Add integers.", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string", "description": "e.g. 1+2"}},
    "required": ["expression"]}}}


def call_text(expression: str) -> str:
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "</tool_call>"


class ScriptedEngine:
    """Each row's turn is `script(prompt text)` and the stop token, cut to the call's budget; its log-probs are the
    model's (a forward pass over the row alone). Keeps every turn it wrote."""

    def __init__(self, model, tok, script):
        self.model, self.tok, self.script = model, tok, script
        self.turns: list[tuple[list[int], list[int]]] = []
        self.last_generate_s = 0.0

    def generate(self, prompts, n, params):
        responses, logps = [], []
        for prompt in prompts:
            ids = (ids_of(self.tok, self.script(self.tok.decode(prompt))) + [self.tok.eos_token_id])[:params.max_tokens]
            with torch.no_grad():
                logits = self.model(torch.tensor([list(prompt) + ids])).logits[0].float()
            lp = torch.log_softmax(logits / params.temperature, -1)[len(prompt) - 1:-1].gather(
                1, torch.tensor(ids)[:, None])[:, 0]
            responses.append(ids)
            logps.append(lp.tolist())
            self.turns.append((list(prompt), ids))
        return build_completions(prompts, responses, logps, n=n, eos_token_id=self.tok.eos_token_id,
                                 pad_token_id=self.tok.pad_token_id, max_tokens=params.max_tokens, policy_version=0)


def calculator_script(prompt: str) -> str:
    """Call the calculator on the user's sum, then answer with the tool's result."""
    if "<tool_response>" in prompt:
        return prompt.rsplit("<tool_response>", 1)[1].split("</tool_response>")[0]
    return call_text(re.search(r"user: (.*)\n", prompt).group(1))


def run_calls(message) -> list[dict]:
    out = []
    for call in message.tool_calls:
        args = json.loads(call.function.arguments)
        out.append({"role": "tool", "tool_call_id": call.id, "content": str(sum(map(int, args["expression"].split("+"))))})
    return out


def sync_agent(client, row):
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(3):
        message = client.chat.completions.create(model=MODEL, messages=messages, tools=[CALC]).choices[0].message
        messages.append(message.model_dump(include={"role", "content", "tool_calls"}, exclude_none=True))
        if not message.tool_calls:
            return float(message.content.strip() == row["answer"])
        messages += run_calls(message)
    return 0.0


async def streaming_agent(client, row):
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(3):
        stream = await client.chat.completions.create(model=MODEL, messages=messages, tools=[CALC], stream=True)
        content, calls = "", []
        async for chunk in stream:
            for choice in chunk.choices:
                content += choice.delta.content or ""
                calls += [c.model_dump() for c in choice.delta.tool_calls or ()]
        messages.append({"role": "assistant", "content": content or None,
                         **({"tool_calls": [{k: c[k] for k in ("id", "type", "function")} for c in calls]}
                            if calls else {})})
        if not calls:
            return float(content.strip() == row["answer"])
        for c in calls:
            args = json.loads(c["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": c["id"],
                             "content": str(sum(map(int, args["expression"].split("+"))))})
    return 0.0


ROWS = [Example("12+30", "42"), Example("7+8", "15")]


def sampled_runs(out, j: int) -> list[tuple[list[int], list[int]]]:
    """Row j's runs of trained tokens (response mask 1), each with the ids before it."""
    real = out.attention_mask[j] > 0
    ids, mask = out.input_ids[j][real].tolist(), out.response_mask[j][real].tolist()
    starts = [i for i in range(len(ids)) if mask[i] and (i == 0 or not mask[i - 1])]
    return [(ids[:s], ids[s:next((i for i in range(s, len(ids)) if not mask[i]), len(ids))]) for s in starts]


def logp_gap(out, model) -> float:
    """The largest difference, over trained tokens, between the trainer's log-probs and the sampler's."""
    from rl_core.primitives.logprobs import sequence_token_logprobs

    with torch.no_grad():
        trainer = sequence_token_logprobs(model, out.input_ids, out.attention_mask, temperature=1.0,
                                          loss_mask=out.response_mask)
    return ((trainer - out.sampling_logp) * out.response_mask).abs().max().item()


def play(agent, rows=ROWS, n=2, max_turns=3, max_tokens=120, **options):
    tok = tokenizer()
    model = stopping_policy(tok)
    engine = ScriptedEngine(model, tok, calculator_script)
    task = EnvironmentTask(agent_environment(agent), agent.__name__)
    out, _ = rollout_episodes(engine, task, rows, tok, n, SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=3),
                              max_turns=max_turns, max_episode_tokens=400, **options)
    return out, engine, model, tok


@pytest.mark.parametrize("agent", [sync_agent, streaming_agent, calculator_agent])
def test_an_openai_client_agent_trains_on_exactly_the_ids_the_engine_sampled(agent):
    out, engine, model, tok = play(agent)
    assert [r["reward"] for r in out.episodes] == [1.0] * 4  # called the calculator, then answered its result
    for record in out.episodes:
        assert [m["role"] for m in record["completion"]] == ["assistant", "tool", "assistant"]
        assert record["completion"][0]["tool_calls"][0]["function"]["name"] == "calculator"
        assert record["stats"]["turns"] == 2 and not record["stats"]["truncated"]
        assert record["stats"]["tool_calls"] == 1 and record["stats"]["tool_errors"] == 0  # the agent's tool answer
    # every sampled run of a row is a turn the engine wrote for exactly the ids before it
    written = {tuple(prompt): ids for prompt, ids in engine.turns}
    for j in range(len(out.episodes)):
        runs = sampled_runs(out, j)
        assert len(runs) == 2 and all(written[tuple(before)] == run for before, run in runs)
        text = tok.decode(runs[-1][0])
        assert "<tool_response>42</tool_response>" in text or "<tool_response>15</tool_response>" in text
    gap = logp_gap(out, model)
    assert gap <= 1e-5 and (out.sampling_logp[out.response_mask > 0] < -0.1).sum() > 20, gap


SEEN: dict[str, list] = {}


def probing_agent(client, row):
    """Sends bad requests first (each answer's status and code kept in SEEN), then plays as `sync_agent`, sending
    the conversation again without a new message in between."""
    import openai

    seen = SEEN.setdefault(row["prompt"], [])
    base, key = str(client.base_url).rstrip("/"), client.api_key
    good = {"model": MODEL, "messages": [{"role": "user", "content": row["prompt"]}], "tools": [CALC]}

    def post(body, headers=None, url=f"{base}/chat/completions", raw=None):
        r = httpx.post(url, headers={"Authorization": f"Bearer {key}", **(headers or {})},
                       **({"content": raw} if raw is not None else {"json": body}))
        assert "error" in r.json(), (r.status_code, r.text)
        seen.append((r.status_code, r.json()["error"]["code"] or r.json()["error"]["param"]))

    post(good, headers={"Authorization": "Bearer wrong"})
    post(good, url=base.rsplit("/sessions/", 1)[0] + "/sessions/not-a-session/v1/chat/completions")
    post({**good, "model": "gpt-4o"})
    post({**good, "temperature": 0.3})
    post({**good, "n": 2})
    post(None, raw=b"x" * (MAX_BODY_BYTES + 1))
    messages = list(good["messages"])
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[CALC]).choices[0].message
    messages.append(first.model_dump(include={"role", "content", "tool_calls"}, exclude_none=True))
    try:
        client.chat.completions.create(model=MODEL, messages=messages, tools=[CALC])
    except openai.BadRequestError as exc:
        seen.append((exc.status_code, exc.code))
    messages += run_calls(first)
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=[CALC]).choices[0].message
    return float(final.content.strip() == row["answer"])


def test_bad_requests_get_openai_errors_and_the_episode_goes_on():
    SEEN.clear()
    agent_environment(probing_agent).configure(temperature=1.0, top_p=1.0)  # the recipe's (EnvironmentPool does this)
    out, *_ = play(probing_agent, rows=ROWS[:1], n=1)
    assert out.episodes[0]["reward"] == 1.0 and out.episodes[0]["stats"]["turns"] == 2
    # counted on the episode (rollout/refused_requests): those of its session, the wrong key and session are not
    assert out.episodes[0]["stats"]["refused_requests"] == 5
    assert SEEN["12+30"] == [(401, "invalid_api_key"), (404, "session_not_found"), (404, "model_not_found"),
                             (400, "temperature"), (400, "n"), (413, "request_too_large"),
                             (400, "no_new_message")]


def late_agent(client, row):
    """Keeps asking after its episode's turn limit: the second request is refused as the episode has ended."""
    import openai

    messages = [{"role": "user", "content": row["prompt"]}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[CALC]).choices[0].message
    messages += [first.model_dump(include={"role", "content", "tool_calls"}, exclude_none=True), *run_calls(first)]
    try:
        client.chat.completions.create(model=MODEL, messages=messages, tools=[CALC])
    except openai.APIStatusError as exc:
        SEEN.setdefault("late", []).append((exc.status_code, exc.code))
        return 0.5
    return 1.0


def test_a_request_after_the_episodes_limit_is_refused_and_the_function_still_scores():
    SEEN.clear()
    out, *_ = play(late_agent, rows=ROWS[:1], n=1, max_turns=1)
    assert out.episodes[0]["stats"]["turns"] == 1 and out.episodes[0]["stats"]["truncated"]
    assert out.episodes[0]["reward"] == 0.5 and SEEN["late"] == [(409, "episode_ended")]
    assert out.episodes[0]["stats"]["refused_requests"] == 0  # the episode's end, not a bad request


def capped_agent(client, row):
    """Asks for a 5-token turn: the policy's call is cut there, which ends the episode (truncated) unanswered."""
    import openai

    try:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": row["prompt"]}], max_tokens=5)
    except openai.APIStatusError as exc:
        return 0.25 if exc.code == "episode_ended" else 0.0
    return 1.0


def test_a_requests_max_tokens_caps_its_turn_and_a_function_path_is_an_agent_task():
    out, engine, _, _ = play(capped_agent, rows=ROWS[:1], n=1)
    assert len(engine.turns[0][1]) == 5 and out.episodes[0]["stats"]["truncated"]  # the call was cut at 5 tokens
    assert out.episodes[0]["reward"] == 0.25
    task = get_task("tests.rl_core.test_gateway:sync_agent")
    assert isinstance(task, EnvironmentTask) and task.environment is agent_environment(sync_agent)
    with pytest.raises(ValueError, match=r"call_text\(expression: 'str'\) -> 'str': an agent function is called "
                                         r"as fn\(client, row\)"):
        get_task("tests.rl_core.test_gateway:call_text")


def test_an_agent_that_fails_before_asking_cannot_start_its_episode_and_is_named():
    def broken(client, row):
        raise KeyError("no-such-column")

    with pytest.raises(RuntimeError, match="no episode of this step could start.*broken ended before its first "
                                           "request: KeyError"):
        play(broken, rows=ROWS[:1], n=1)


def test_an_agent_written_with_the_openai_agents_sdk_runs_unchanged():
    from examples.tool_arithmetic_agent import sdk_calculator_agent

    out, _, model, _ = play(sdk_calculator_agent)
    assert [r["reward"] for r in out.episodes] == [1.0] * 4
    for record in out.episodes:
        assert [m["role"] for m in record["completion"]] == ["assistant", "tool", "assistant"]
        assert record["completion"][1]["content"] in ("42", "15")  # the SDK ran the calculator and sent its result
    assert logp_gap(out, model) <= 1e-5


def picky_agent(client, row):
    """Row 0 sends a tool the template refuses (no description), the others `sync_agent`'s calculator."""
    import openai

    if row["prompt"] != "12+30":
        return sync_agent(client, row)
    bare = {"type": "function", "function": {"name": "calculator", "parameters": CALC["function"]["parameters"]}}
    try:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": row["prompt"]}], tools=[bare])
    except openai.APIStatusError as exc:
        SEEN.setdefault("picky", []).append((exc.status_code, exc.code))
    return 0.0


def test_tools_the_template_cannot_render_leave_their_row_out_naming_why_and_the_others_play(caplog):
    from tests.rl_core.test_agents import HERMES

    picky = HERMES.replace("{% for t in tools %}", "{% for t in tools %}{% if not t.function.description %}"
                           "{{ raise_exception('tool ' + t.function.name + ' has no description') }}{% endif %}")
    SEEN.clear()
    tok = tokenizer(picky)
    engine = ScriptedEngine(stopping_policy(tok), tok, calculator_script)
    task = EnvironmentTask(agent_environment(picky_agent), "picky_agent")
    with caplog.at_level("WARNING", logger="posttrain.agents"):
        out, _ = rollout_episodes(engine, task, ROWS, tok, 1, SamplingParams(temperature=1.0, max_tokens=120, seed=3),
                                  max_turns=3, max_episode_tokens=400)
    assert [r["reward"] for r in out.episodes] == [0.0, 1.0]  # row 0 left out, row 1 played to its answer
    assert not out.episodes[0]["stats"]["started"]
    assert "the chat template cannot render the opening messages and tools (TemplateError: tool calculator has no " \
           "description)" in caplog.text
    assert SEEN["picky"] == [(409, "episode_ended")]  # the agent's waiting request is answered, not left hanging


def silent_tool_agent(client, row):
    """Answers the policy's call with an empty tool result, which the template below refuses."""
    messages = [{"role": "user", "content": row["prompt"]}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[CALC]).choices[0].message
    messages += [first.model_dump(include={"role", "content", "tool_calls"}, exclude_none=True),
                 {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": ""}]
    client.chat.completions.create(model=MODEL, messages=messages, tools=[CALC])
    return 1.0


def test_a_reply_the_template_cannot_render_ends_only_its_episode_as_an_environment_error():
    from tests.rl_core.test_agents import HERMES

    strict = HERMES.replace("{% elif m.role == 'tool' %}", "{% elif m.role == 'tool' %}{% if not m.content %}"
                            "{{ raise_exception('an empty tool answer') }}{% endif %}")
    tok = tokenizer(strict)
    engine = ScriptedEngine(stopping_policy(tok), tok, calculator_script)
    out, _ = rollout_episodes(engine, EnvironmentTask(agent_environment(silent_tool_agent), "silent"), ROWS[:1], tok,
                              2, SamplingParams(temperature=1.0, max_tokens=120, seed=3), max_turns=3,
                              max_episode_tokens=400)
    for record in out.episodes:  # both episodes end after their first turn, counted; the rollout goes on
        assert record["stats"]["turns"] == 1 and record["stats"]["env_errors"] == 1 and record["reward"] == 0.0
        assert record["error"] == "the chat template cannot render the reply (TemplateError: an empty tool answer)"
