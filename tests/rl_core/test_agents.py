"""Agents: tools (schemas, Hermes-format calls, failures answered to the model), the environment interface and the
token-exact episode (rl_core.agents), on the tiny character-level tokenizer with chat templates written here."""

from __future__ import annotations

import pytest
import torch

from rl_core.agents import (
    Environment,
    Episode,
    Reply,
    ToolCall,
    Turn,
    parse_tool_calls,
    run_tool_call,
    template_delta,
)
from rl_core.agents.tools import tool_schema, tool_table
from rl_core.model.loading import build_tiny_tokenizer
from rl_core.tasks import Example

# A Hermes-style template for the character tokenizer: tools listed up front, calls as <tool_call>{json}</tool_call>,
# results as <tool_response>...</tool_response>, every assistant turn closed by <eos> and a newline.
HERMES = (
    "{{ bos_token }}{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}assistant: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{{ eos_token }}\n"
    "{% elif m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>\n"
    "{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)
# Qwen3's habit: the reasoning of every assistant turn before the last user message is dropped when rendering.
DROPS_THINK = HERMES.replace(
    "assistant: {{ m.content }}",
    "assistant: {{ m.content.split('</think>')[-1] if loop.index0 < last_user else m.content }}").replace(
    "{% for m in messages %}",
    "{% set ns = namespace(u=0) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.u = loop.index0 %}"
    "{% endif %}{% endfor %}{% set last_user = ns.u %}{% for m in messages %}")
# Renders the final assistant turn unlike the earlier ones: no delta can be cut from it.
LAST_TURN_DIFFERS = HERMES.replace("{% if m.role == 'assistant' %}assistant: ",
                                   "{% if m.role == 'assistant' %}{{ 'assistant' if loop.last else 'earlier' }}: ")


def calculator(expression: str) -> str:
    """Evaluate a sum of integers.

    Args:
        expression: integers joined by +, e.g. "12+30"
    """
    return str(sum(int(x) for x in expression.split("+")))


def no_docstring(x: int) -> int:
    return x


def tokenizer(template: str = HERMES):
    tok = build_tiny_tokenizer()
    tok.chat_template = template
    return tok


def ids_of(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


class Sums(Environment):
    tools = (calculator,)

    def reward(self) -> float:
        return float(self.example.answer in self.turns_text)

    def respond(self, turn):
        self.turns_text = turn.content
        return super().respond(turn)


def sample(episode: Episode, text: str, stop: bool = True) -> None:
    """Hand the episode a turn as an engine would: `text`'s ids (plus the stop token), a log-prob per id."""
    tok = episode.tokenizer
    ids = ids_of(tok, text) + ([tok.eos_token_id] if stop else [])
    episode.add_turn(ids, [-0.5] * len(ids), stopped=stop)


# ------------------------------------------------------------------------------------------------ tools


def test_a_tool_schema_comes_from_type_hints_and_docstring_and_a_bare_function_is_refused():
    schema = tool_schema(calculator)
    assert schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["properties"]["expression"]["type"] == "string"
    assert schema["function"]["parameters"]["required"] == ["expression"]
    with pytest.raises(ValueError, match=r"tool no_docstring \(.*test_agents.py:\d+\): no JSON schema .* docstring"):
        tool_schema(no_docstring)
    with pytest.raises(ValueError, match="two tools are named 'calculator'"):
        tool_table([calculator, calculator])


def test_hermes_calls_are_parsed_in_order_and_each_malformed_one_says_why():
    text = ('Let me add. <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"3+4\\"}"}</tool_call>'
            "<tool_call>{name: calculator}</tool_call><tool_call>[1, 2]</tool_call>"
            '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call> done <tool_call>{"name": "calc')
    content, calls = parse_tool_calls(text)
    assert content == "Let me add.  done"
    assert [(c.name, dict(c.arguments)) for c in calls[:2]] == [("calculator", {"expression": "1+2"}),
                                                              ("calculator", {"expression": "3+4"})]
    assert calls[0].error is None and calls[1].error is None
    assert calls[2].error.startswith("the tool call is not JSON")
    assert calls[3].error == 'a tool call is {"name": <tool name>, "arguments": {...}}'
    assert calls[4].error == "the arguments of calculator are not a JSON object"
    assert calls[5].error == "the <tool_call> block is not closed"
    assert parse_tool_calls("no calls here") == ("no calls here", [])


def test_every_failure_of_a_call_is_an_error_answer_never_an_exception():
    def raises(expression: str) -> str:
        """Fail.

        Args:
            expression: anything
        """
        raise RuntimeError("disk on fire")

    def returns_object(expression: str) -> str:
        """Return something that is not text.

        Args:
            expression: anything
        """
        return object()

    def returns_json(expression: str) -> dict:
        """Return a mapping.

        Args:
            expression: anything
        """
        return {"value": 3}

    table = tool_table([calculator, raises, returns_object, returns_json])
    ok = run_tool_call(table, ToolCall("calculator", {"expression": "12+30"}))
    assert (ok.content, ok.error) == ("42", False)
    assert ok.message() == {"role": "tool", "name": "calculator", "content": "42"}
    assert run_tool_call(table, ToolCall("returns_json", {"expression": ""})).content == '{"value": 3}'
    answers = {
        "unknown": run_tool_call(table, ToolCall("shell", {"cmd": "ls"})),
        "bad arguments": run_tool_call(table, ToolCall("calculator", {"expr": "1"})),
        "raised": run_tool_call(table, ToolCall("raises", {"expression": "1"})),
        "not text": run_tool_call(table, ToolCall("returns_object", {"expression": "1"})),
        "malformed": run_tool_call(table, ToolCall(error="the tool call is not JSON")),
    }
    assert all(a.error and a.content.startswith("error: ") for a in answers.values())
    assert "there is no tool 'shell' (tools: calculator, raises, returns_json, returns_object)" in answers["unknown"].content
    assert answers["bad arguments"].content == "error: calculator: missing a required argument: 'expression'"
    assert answers["raised"].content == "error: raises raised RuntimeError: disk on fire"
    assert "returned a object, which is neither text nor JSON" in answers["not text"].content


# ------------------------------------------------------------------------------------------------ episodes


def test_the_episode_is_the_sampled_ids_plus_template_deltas_and_the_mask_marks_only_sampled_tokens():
    """Sampled turns that are the template's own rendering: the episode's ids are exactly the whole conversation
    rendered by the template (no drift), the mask is 1 on the two turns' tokens only, the log-probs 0 elsewhere."""
    tok = tokenizer()
    env = Sums(Example("What is 12+30?", "42"))
    episode = Episode(env, tok, max_turns=4, max_tokens=400)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12+30"}}</tool_call>'
    sample(episode, call)
    assert not episode.done and episode.messages[-1] == {"role": "tool", "name": "calculator", "content": "42"}
    sample(episode, "It is 42")
    assert episode.done and not episode.truncated and env.reward() == 1.0
    rendered = tok.apply_chat_template(episode.messages, tools=episode.tools, tokenize=False)
    assert rendered.endswith("<eos>\n")
    assert episode.ids == ids_of(tok, rendered[: -len("\n")])  # the template's rendering, token for token
    turns = [ids_of(tok, call) + [tok.eos_token_id], ids_of(tok, "It is 42") + [tok.eos_token_id]]
    marked = [i for i, s in zip(episode.ids, episode.sampled) if s]
    assert marked == turns[0] + turns[1]
    first = episode.ids.index(tok.eos_token_id)  # the first turn ends where the first stop token is
    assert episode.sampled[first - len(turns[0]) + 1: first + 1] == [True] * len(turns[0])
    assert episode.sampled[first + 1] is False  # the template's newline after the stop token is not the policy's
    assert all((lp != 0.0) == s for lp, s in zip(episode.logp, episode.sampled))
    stats = episode.stats()
    assert stats.pop("env_s") > 0  # reset and respond ran, timed
    assert stats == {"turns": 2, "tool_calls": 1, "tool_errors": 0, "refused_requests": 0, "truncated": False, "cut_by": None, "env_errors": 0, "started": True,
                     "oversized_replies": 0, "tokens": len(episode.ids),
                     "sampled_tokens": len(turns[0]) + len(turns[1]), "samples": 1, "last_sample_turns": 2, "turn_tokens": [len(turns[0]), len(turns[1])]}


def test_a_template_that_drops_earlier_reasoning_never_changes_what_was_sampled():
    tok = tokenizer(DROPS_THINK)

    class Chat(Environment):
        def respond(self, turn):
            return Reply(done=True) if len(self.seen) else (self.seen.append(turn) or Reply(
                [{"role": "user", "content": "and 2+2?"}]))

        def reward(self):
            return 0.0

    env = Chat(Example("1+1?", "2"))
    env.seen = []
    episode = Episode(env, tok, max_turns=3, max_tokens=400)
    sample(episode, "<think>one and one</think>2")
    sample(episode, "4")
    text = tok.decode(episode.ids)
    assert "<think>one and one</think>2" in text  # the sampled reasoning stays in the trajectory
    rerendered = tok.apply_chat_template(episode.messages, tokenize=False)
    assert "one and one" not in rerendered  # what re-rendering would have trained on instead


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="renders earlier turns differently .* template that leaves earlier turns"):
        template_delta(tokenizer(LAST_TURN_DIFFERS), [{"role": "user", "content": "x"}], stop_text="<eos>")
    with pytest.raises(ValueError, match="does not end an assistant turn with the stop token '<pad>'"):
        template_delta(tokenizer(), [{"role": "user", "content": "x"}], stop_text="<pad>")


def test_bad_calls_are_answered_and_counted_and_the_limits_truncate():
    tok = tokenizer()
    env = Sums(Example("What is 1+1?", "2"))
    episode = Episode(env, tok, max_turns=2, max_tokens=400)
    sample(episode, '<tool_call>{"name": "calc", "arguments": {}}</tool_call>')
    assert episode.messages[-1]["content"] == "error: there is no tool 'calc' (tools: calculator)"
    sample(episode, "<tool_call>{oops}</tool_call>")  # the second and last turn: the limit ends it
    assert episode.done and episode.truncated and episode.stats()["cut_by"] == "max_turns"
    from rl_core.agents.rollout import conversation_text

    shown = conversation_text(episode.record(0.0))  # what the completions table shows: the calls as written
    assert 'assistant: <tool_call>{"name": "calc", "arguments": {}}</tool_call>' in shown
    assert "assistant: <tool_call>{oops}</tool_call>" in shown
    assert episode.stats()["tool_calls"] == 2 and episode.stats()["tool_errors"] == 2
    with pytest.raises(RuntimeError, match="has ended"):
        sample(episode, "2")

    cut = Episode(Sums(Example("1+1?", "2")), tok, max_turns=4, max_tokens=400)
    sample(cut, "the answer is", stop=False)  # ran out of tokens inside the turn
    assert cut.done and cut.truncated and cut.stats()["turns"] == 1 and cut.cut_by == "max_tokens"

    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
    prompt_len = Episode(Sums(Example("1+1?", "2")), tok, max_turns=4, max_tokens=400).prompt_len
    budget = prompt_len + len(ids_of(tok, call)) + 1 + 10  # the call fits; its answer and the next prompt do not
    short = Episode(Sums(Example("1+1?", "2")), tok, max_turns=4, max_tokens=budget)
    assert short.turn_budget(256) == budget - prompt_len and short.turn_budget(8) == 8
    sample(short, call)
    assert short.done and short.truncated and len(short.ids) == budget - 10 and short.cut_by == "max_episode_tokens"
    assert short.messages[-1]["role"] == "assistant"  # the answer that did not fit is not in the conversation
    with pytest.raises(ValueError, match="the opening prompt has .* tokens, the episode's budget is 5"):
        Episode(Sums(Example("1+1?", "2")), tok, max_turns=4, max_tokens=5)


def test_the_default_environment_opens_with_the_rows_messages_and_a_turn_is_trl_shaped():
    env = Sums(Example("ignored", "2", messages=({"role": "system", "content": "be brief"},
                                                 {"role": "user", "content": "1+1?"})))
    assert env.reset() == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1?"}]
    assert Sums(Example("1+1?", "2")).reset() == [{"role": "user", "content": "1+1?"}]
    turn = Turn.parse('ok <tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>')
    assert turn.message == {"role": "assistant", "content": "ok", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1+1"}}}]}
    assert Turn.parse("plain").message == {"role": "assistant", "content": "plain"}


# ------------------------------------------------------------------------------------------------ on an engine


class Nag(Environment):
    """Answers every turn with another user message until `replies` are used up."""

    replies = 2

    def respond(self, turn):
        self.count = getattr(self, "count", 0) + 1
        return Reply(done=True) if self.count > self.replies else Reply([{"role": "user", "content": "and?"}])

    def reward(self):
        return 0.0


def stopping_policy(tok):
    """A random 2-layer Llama over the tiny tokenizer whose EOS logit is 4x its second hidden unit: some turns stop
    after a few tokens and some run out of them, so episodes take several short turns or are cut."""
    from tests.builders import tiny_model

    model = tiny_model(seed=3, vocab_size=len(tok), max_position_embeddings=512).eval()
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] = 0.0
        model.lm_head.weight[tok.eos_token_id, 1] = 4.0
    return model


def test_episodes_advance_in_batched_calls_and_the_trainer_reads_the_samplers_log_probs_on_them():
    """Six episodes (two prompts x 3) on the HF engine: each turn of all live episodes is one engine call; the
    result has holes in its response mask where the environment's tokens are, and the trainer's log-probs of
    exactly those ids equal the sampler's on every sampled token (float32, <= 1e-5)."""
    from rl_core.agents.rollout import episodes_to_completions, run_episodes
    from rl_core.primitives.logprobs import sequence_token_logprobs
    from rl_core.rollout import HFEngine, SamplingParams

    tok = tokenizer()
    model = stopping_policy(tok)
    rows = [Example("1+1?", "2"), Example("what is 7+8?", "15")]

    def rollout(seed):
        episodes = [Episode(Nag(row), tok, max_turns=4, max_tokens=200) for row in rows for _ in range(3)]
        run = run_episodes(HFEngine(model, tok), episodes, SamplingParams(temperature=1.0, max_tokens=6, seed=seed),
                           schedule="lock_step")
        return episodes, run.calls

    episodes, calls = rollout(seed=11)
    assert calls == max(len(e.turns) for e in episodes) and calls >= 2
    assert any(len(e.turns) == 3 and not e.truncated for e in episodes)  # Nag's two replies, then the end
    assert any(e.truncated for e in episodes)  # a turn that ran out of its 6 tokens ends its episode
    c = episodes_to_completions(episodes, n=3, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                policy_version=0)
    assert c.prompt_index.tolist() == [0, 0, 0, 1, 1, 1]
    for j, e in enumerate(episodes):
        real = c.attention_mask[j] > 0
        assert c.input_ids[j][real].tolist() == e.ids and c.response_mask[j][real].tolist() == [float(s) for s in e.sampled]
        assert c.finish_reason[j] == ("length" if e.truncated else "stop")
    holes = [e for e in episodes if len(e.turns) > 1]
    assert holes and all(not all(e.sampled[e.prompt_len:]) for e in holes)  # the environment's tokens: mask 0
    mask = c.response_mask
    with torch.no_grad():
        trainer = sequence_token_logprobs(model, c.input_ids, c.attention_mask, temperature=1.0, loss_mask=mask)
    gap = ((trainer - c.sampling_logp) * mask).abs().max().item()
    assert gap <= 1e-5, gap
    sampled = c.sampling_logp[mask > 0]
    assert (sampled <= 0).all() and (sampled < -0.1).sum() > 10  # real log-probs, not a table of zeros
    again, _ = rollout(seed=11)
    assert [e.ids for e in again] == [e.ids for e in episodes]  # the same seed: the same episodes


# ------------------------------------------------------------------------------------------------ as a task


class Chatter(Nag):
    """Nag scored by how many times it answered: the environment's own reward."""

    def reward(self):
        return float(getattr(self, "count", 0))


def conversation_length(prompts, completions, **_):
    """A TRL-style reward over the whole conversation: the messages after the opening ones."""
    return [float(len(c)) for c in completions]


def test_an_environment_is_a_task_whose_episodes_are_scored_over_the_conversation_and_pass_the_gate(tmp_path):
    """`data.task` naming an Environment subclass: its rows load as the prompts task's, `rollout.n` episodes per row
    run on the engine, and the reward is the environment's plus `data.rewards` (which read the whole conversation
    in TRL's form); annotate and the gate take the holes, and the gate refuses a loss on a token nobody sampled."""
    import json

    from rl_core.agents.rollout import rollout_episodes
    from rl_core.annotate import annotate
    from rl_core.batch.gate import BatchValidationError, validate_annotations, validate_batch_tensors
    from rl_core.config import RLConfig
    from rl_core.config.schema import DataConfig
    from rl_core.rewards import reward_inputs, score
    from rl_core.rewards.configured import reward_functions
    from rl_core.rollout import Completions, HFEngine, SamplingParams
    from rl_core.tasks import get_task

    rows = tmp_path / "train.jsonl"
    rows.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in [("1+1?", "2"), ("7+8?", "15")]))
    data = DataConfig(task="tests.rl_core.test_agents:Chatter", prompt_template="chat", train=str(rows), val=str(rows),
                      rewards=[{"path": "tests.rl_core.test_agents:conversation_length", "weight": 0.5}])
    task = get_task(data.task)
    assert task.environment is Chatter
    examples = task.load(str(rows), data)
    assert [e.prompt for e in examples] == ["1+1?", "7+8?"] and examples[0].row == f"{rows}:1"
    functions = reward_functions(data)
    assert [(f.name, f.weight) for f in functions] == [("environment", 1.0), ("conversation_length", 0.5)]

    tok = tokenizer()
    completions, _ = rollout_episodes(HFEngine(stopping_policy(tok), tok), task, examples, tok, 3,
                                      SamplingParams(temperature=1.0, max_tokens=6, seed=5), max_turns=4,
                                      max_episode_tokens=200)
    records = completions.episodes
    assert len(records) == 6 and completions.prompt_index.tolist() == [0, 0, 0, 1, 1, 1]
    for j, record in enumerate(records):
        assert record["prompt"] == [{"role": "user", "content": examples[j // 3].prompt}]
        roles = [m["role"] for m in record["completion"]]
        assert roles[0::2] == ["assistant"] * len(roles[0::2]) and set(roles[1::2]) <= {"user"}
        assert record["stats"]["turns"] == len(roles[0::2])
    assert {r["stats"]["turns"] for r in records} != {1}  # some episodes took several turns
    expanded = [examples[i] for i in completions.prompt_index.tolist()]
    values, means = score(functions, reward_inputs(expanded, ["unused"] * 6, records))
    by_hand = [r["reward"] + 0.5 * len(r["completion"]) for r in records]
    assert values == pytest.approx(by_hand)
    assert means["rollout/rewards/environment/mean"] == pytest.approx(sum(r["reward"] for r in records) / 6)

    completions.save(tmp_path / "c.safetensors")  # the rollout cache keeps the episodes
    assert Completions.load(tmp_path / "c.safetensors").episodes == records

    annotated = annotate(completions, values, [0, 1], rl=RLConfig(), first_sample_id=0)
    assert annotated.stats["rollout/turns_mean"] == pytest.approx(sum(r["stats"]["turns"] for r in records) / 6)
    assert annotated.stats["rollout/env_reward_mean"] == pytest.approx(sum(r["reward"] for r in records) / 6)
    validate_annotations(annotated.table, max_tokens=4 * 6)
    validate_batch_tensors(annotated.batch, annotated.table, annotated.sampled)
    real_unsampled = (annotated.batch.attention_mask > 0) & ~annotated.sampled
    row, col = next((int(r), int(c)) for r, c in real_unsampled[:, completions.prompt_length:].nonzero()
                    if annotated.sampled[r].any())
    leaky = annotated.batch.loss_mask.clone()
    leaky[row, completions.prompt_length + col] = 1.0
    table = annotated.table.copy()
    table.loc[row, "response_len"] += 1  # the lengths agree: only the unsampled token is wrong
    with pytest.raises(BatchValidationError, match=r"loss_on_unsampled.*\[the loss mask marks tokens the policy did "
                                                   rf"not sample.*\(rows \[{row}\]\)"):
        validate_batch_tensors(annotated.batch.replace(loss_mask=leaky), table, annotated.sampled)


def test_preflight_refuses_episode_limits_on_a_prompt_task_and_a_plain_template_on_an_environment():
    from pathlib import Path

    from rl_core.config import load_config
    from rl_core.preflight.rules import preflight

    recipe = Path(__file__).parents[2] / "recipes" / "arithmetic.py"
    errors = preflight(load_config(recipe, ["rollout.max_turns=3"])).errors
    assert any(e.startswith("rollout.max_turns=3: read only by agent tasks") for e in errors), errors
    errors = preflight(load_config(recipe, ["data.task=tests.rl_core.test_agents:Chatter"])).errors
    assert any(e.startswith("data.prompt_template='plain': an environment's episode is a chat") for e in errors), errors
    ok = preflight(load_config(recipe, ["data.task=tests.rl_core.test_agents:Chatter", "data.prompt_template=chat",
                                        "rollout.max_turns=3"]))
    assert not [e for e in ok.errors if "max_turns" in e or "prompt_template" in e], ok.errors
    auto = preflight(load_config(recipe, ["data.task=tests.rl_core.test_agents:Chatter", "data.prompt_template=auto",
                                          "rollout.max_turns=3"]))  # auto: an environment's episode is a chat
    assert not [e for e in auto.errors if "prompt_template" in e], auto.errors


def test_the_docs_environment_runs_as_written():
    """docs/agents.md's 20-line environment: a calculator call answered with its result, then the answer scored."""
    import re
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "agents.md").read_text()
    namespace: dict = {}
    exec(re.search(r"```python\n(.*?)```", text, re.DOTALL).group(1), namespace)  # noqa: S102 - the repo's own docs
    env = namespace["Sums"](Example("12+30", "42"))
    assert env.reset() == [{"role": "user", "content": "What is 12+30? Use the calculator."}]
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12+30"}}</tool_call>'
    assert env.respond(Turn.parse(call)).messages == [{"role": "tool", "name": "calculator", "content": "42"}]
    assert env.respond(Turn.parse("42")).done and env.reward() == 1.0
    env.reset()
    env.respond(Turn.parse("41"))
    assert env.reward() == 0.0


def test_a_chat_warm_start_trains_on_the_episode_layout_and_only_the_assistant_turns(tmp_path):
    """`encode_chat_batch` (posttrain warm-start --chats) lays a game out token for token as the rollout's Episode
    does (tools in the opening prompt, each reply as the template's delta), with labels on the assistant turns only;
    a row that is no conversation is refused naming its line."""
    import json

    from examples.tool_arithmetic import TEMPLATE, ToolArithmetic, make_transcripts
    from rl_core.training.warm_start import _conversations, encode_chat_batch

    tok = tokenizer(TEMPLATE)
    calling, direct = (next(t for t in make_transcripts([{"prompt": "123+456+789", "answer": "1368"}] * 8, seed, 0.5)
                            if len(t["messages"]) == k) for seed, k in ((0, 4), (0, 2)))
    ids, mask, labels = encode_chat_batch(tok, [calling, direct])
    episode = Episode(ToolArithmetic(Example("123+456+789", "1368")), tok, max_turns=3, max_tokens=400)
    for message in (m for m in calling["messages"] if m["role"] == "assistant"):
        turn = ids_of(tok, message["content"]) + [tok.eos_token_id]
        episode.add_turn(turn, [-0.1] * len(turn), stopped=True)
    assert episode.done and episode.env.reward() == 1.0
    row = ids[0][mask[0] > 0].tolist()
    assert row == episode.ids  # the warm start sees exactly what the rollout will produce
    learned = labels[0][mask[0] > 0] != -100
    assert learned.tolist() == episode.sampled  # and learns exactly the policy's tokens
    assert tok.decode(labels[1][labels[1] != -100].tolist()) == "1368<eos>"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(calling) + "\n" + json.dumps({"messages": "hi"}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: a conversation row is"):
        _conversations(bad)


class _LosingHost:
    """A host (rl_core.agents.host) whose environments live in this process, except that the first episode's is
    lost at its first turn, as the pool loses the environments of an actor that timed out."""

    def __init__(self):
        from rl_core.agents.host import LocalEnvironments

        self.local, self.gone = LocalEnvironments(), None

    def open(self, environment, items):
        self.gone = items[0][0]
        return self.local.open(environment, items)

    def respond(self, items):
        from rl_core.agents.host import Answer

        answers = self.local.respond(items)
        return [Answer(error="lost with its worker", lost=True) if key == self.gone else a
                for (key, _), a in zip(items, answers)]

    def finish(self, keys):
        from rl_core.agents.host import Answer

        answers = self.local.finish(keys)
        return [Answer(error="lost with its worker", lost=True) if key == self.gone else a
                for key, a in zip(keys, answers)]

    def discard(self, keys):
        self.local.discard(keys)


def test_an_episode_whose_environment_is_lost_ends_as_an_environment_error_with_reward_0():
    from rl_core.agents.rollout import episode_stats, rollout_episodes
    from rl_core.rollout import HFEngine, SamplingParams
    from rl_core.tasks import get_task

    tok = tokenizer()
    task = get_task("tests.rl_core.test_agents:Chatter")
    examples = [Example("1+1?", "2"), Example("7+8?", "15")]
    engine = HFEngine(stopping_policy(tok), tok)
    sampling = SamplingParams(temperature=1.0, max_tokens=6, seed=5)
    plain, _ = rollout_episodes(engine, task, examples, tok, 2, sampling, max_turns=4, max_episode_tokens=200)
    host = _LosingHost()
    lossy, _ = rollout_episodes(engine, task, examples, tok, 2, sampling, max_turns=4, max_episode_tokens=200, host=host)
    first, rest = lossy.episodes[0], lossy.episodes[1:]
    assert first["reward"] == 0.0 and first["error"] == "lost with its worker" and first["stats"]["env_errors"] == 1
    assert first["stats"]["truncated"] and len([m for m in first["completion"] if m["role"] == "assistant"]) == 1
    assert lossy.finish_reason[0] == "length"
    # the other episodes played on: their first turns are the unharmed rollout's, sampled in one call with the lost
    assert [r["completion"][0] for r in rest] == [r["completion"][0] for r in plain.episodes[1:]]
    assert all(r["error"] is None and r["stats"]["env_errors"] == 0 for r in rest)
    assert max(r["stats"]["turns"] for r in rest) > 1
    assert episode_stats(lossy.episodes)["rollout/env_errors"] == 1.0
    assert host.local.live == {}  # every environment dropped


class Tally:
    """An environment written in TRL's `environment_factory` convention (no posttrain import): `reset(**row)`
    returns text for the prompt, the public methods are the tools, `get_reward` scores the episode."""

    def reset(self, **kwargs) -> str:
        self.target, self.total = int(kwargs["answer"]), 0
        return f" (reach {self.target})"

    def add(self, amount: int) -> str:
        """Add to the running total.

        Args:
            amount: how much to add
        """
        self.total += amount
        return str(self.total)

    def _helper(self) -> None:  # private: not a tool
        pass

    def get_reward(self) -> float:
        return float(self.total == self.target)


def test_an_environment_in_trls_convention_runs_unchanged():
    """`data.task` naming a class written for TRL's GRPOTrainer(environment_factory=...): its public methods are the
    tools (their schemas in the prompt), reset's text is appended to the user message, tool calls reach the
    instance, `get_reward` is the environment's reward; a class that is none of the three kinds is refused."""
    from rl_core.agents.host import LocalEnvironments
    from rl_core.tasks import get_task

    task = get_task("tests.rl_core.test_agents:Tally")
    assert task.environment.__name__ == "Tally"
    tok = tokenizer()
    host = LocalEnvironments()
    (opening,) = host.open(task.environment, [("a", Example("Count to 5.", "5", columns={"answer": "5"}))])
    assert opening.error is None
    assert opening.messages == [{"role": "user", "content": "Count to 5. (reach 5)"}]
    assert [t["function"]["name"] for t in opening.tools] == ["add"]
    assert opening.tools[0]["function"]["parameters"]["properties"]["amount"]["type"] == "integer"
    episode = Episode(opening, tok, max_turns=4, max_tokens=400)
    for text in ('<tool_call>{"name": "add", "arguments": {"amount": 2}}</tool_call>',
                 '<tool_call>{"name": "add", "arguments": {"amount": 3}}</tool_call>', "done"):
        turn = episode.take_turn(ids_of(tok, text) + [tok.eos_token_id], [-0.1] * (len(ids_of(tok, text)) + 1), True)
        if turn is not None:
            episode.answer(host.respond([("a", turn)])[0])
    assert episode.done and not episode.truncated
    assert [m["content"] for m in episode.messages if m["role"] == "tool"] == ["2", "5"]
    (finished,) = host.finish(["a"])
    assert finished.reward == 1.0 and finished.tool_calls == 2 and finished.tool_errors == 0

    with pytest.raises(ValueError, match=r"a class with a reset method \(TRL's environment_factory convention\) nor "
                                         r"an agent function"):
        get_task("tests.rl_core.test_agents:HERMES")


class Moody(Chatter):
    """Chatter whose reset fails on the rows that ask about 13, and whose opening is far too long on those asking
    about 99: neither episode can start."""

    def reset(self):
        if "13" in self.example.prompt:
            raise ConnectionError("the sandbox for this row is down")
        if "99" in self.example.prompt:
            return [{"role": "user", "content": "x" * 400}]
        return super().reset()


def test_a_row_whose_episodes_cannot_start_is_left_out_of_the_step_and_the_others_train(caplog):
    """A reset that raises, and an opening prompt over the episode's token budget: those rows' episodes end
    unstarted (no loss token, reward 0, counted, a warning naming the row), the gate takes the batch, and the other
    rows play and train as they would; a step where no row can start stops, naming the rows."""
    import logging

    from rl_core.agents.rollout import EnvironmentFailure, episode_stats, rollout_episodes
    from rl_core.annotate import annotate
    from rl_core.batch.gate import validate_annotations, validate_batch_tensors
    from rl_core.config import RLConfig
    from rl_core.rollout import HFEngine, SamplingParams
    from rl_core.tasks import get_task

    tok = tokenizer()
    task = get_task("tests.rl_core.test_agents:Moody")
    examples = [Example("1+1?", "2", row="rows.jsonl:1"), Example("6+13?", "19", row="rows.jsonl:2"),
                Example("7+8?", "15", row="rows.jsonl:3"), Example("99+1?", "100", row="rows.jsonl:4")]
    engine = HFEngine(stopping_policy(tok), tok)
    sampling = SamplingParams(temperature=1.0, max_tokens=6, seed=5)
    with caplog.at_level(logging.WARNING, logger="posttrain.agents"):
        out, _ = rollout_episodes(engine, task, examples, tok, 2, sampling, max_turns=4, max_episode_tokens=200)
    warned = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("rows.jsonl:2: the episode could not start: Moody.reset") and "sandbox" in m for m in warned)
    assert any(m.startswith("rows.jsonl:4: the episode could not start: the opening prompt has") for m in warned)
    records = out.episodes
    unstarted = [j for j, r in enumerate(records) if not r["stats"]["started"]]
    assert unstarted == [2, 3, 6, 7]
    for j in unstarted:
        assert records[j]["reward"] == 0.0 and records[j]["stats"]["turns"] == 0 and "could not start" in records[j]["error"]
        assert records[j]["completion"] == [{"role": "assistant", "content": ""}] and records[j]["prompt"] == []
        assert float(out.response_mask[j].sum()) == 0 and int(out.attention_mask[j].sum()) == 1
    # the rows that started played as they do with no failing row beside them (their episodes' own seeds)
    alone, _ = rollout_episodes(engine, get_task("tests.rl_core.test_agents:Chatter"), [examples[0], examples[2]], tok, 2,
                                sampling, max_turns=4, max_episode_tokens=200)
    assert [records[j]["completion"][0] for j in (0, 1, 4, 5)] == [r["completion"][0] for r in alone.episodes]
    assert episode_stats(records)["rollout/unstarted_episodes"] == 4.0

    annotated = annotate(out, [r["reward"] + 1.0 * (j % 2) for j, r in enumerate(records)], [0, 1, 2, 3],
                         rl=RLConfig(), first_sample_id=0)
    assert annotated.table["started"].tolist() == [j not in unstarted for j in range(8)]
    validate_annotations(annotated.table, max_tokens=4 * 6)
    validate_batch_tensors(annotated.batch, annotated.table, annotated.sampled)
    assert float(annotated.batch.loss_mask[unstarted].sum()) == 0 and float(annotated.batch.loss_mask.sum()) > 0

    with pytest.raises(EnvironmentFailure, match=r"no episode of this step could start: rows.jsonl:2: .*sandbox.*; "
                                                 r"rows.jsonl:4: the episode could not start: the opening prompt"):
        rollout_episodes(engine, task, [examples[1], examples[3]], tok, 2, sampling, max_turns=4,
                         max_episode_tokens=200)
