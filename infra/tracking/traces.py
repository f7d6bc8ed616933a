"""Agent episodes as MLflow traces (`tracking.trace_episodes` per step): the conversation, span by span.

One trace per episode, linked to the run (`run_id`) and tagged with its step:

    episode                 root (AGENT): the opening messages in, the reward out; step, row, reward, turns, tokens,
                            policy version, truncated, error as attributes
      turn 1                LLM: the assistant's message (text and tool calls), its sampled tokens
        tool calculator     TOOL: the call's arguments in, the tool's answer out
      environment           the environment's other messages (a user turn, a reply)
      turn 2 ...

They are read in the MLflow UI under the run's Traces tab (or the experiment's), and with
`MlflowClient().search_traces(experiment_ids=[...], filter_string="trace.tags.`posttrain.step` = '3'")`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from infra.tracking.items import spread, using_tracking_uri


def _json(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


def log_episode_traces(client: Any, tracking_uri: str, experiment_id: str, run_id: str, step: int,
                       records: Sequence[dict], rewards: Sequence[float], count: int,
                       policy_version: int) -> list[str]:
    """`count` of a step's episode records (`rl_core.agents.Episode.record`, spread over the batch) as traces; their
    ids. `rewards[j]`: row j's reward (all functions weighed), the trace's outcome."""
    import mlflow
    from mlflow.entities import SpanType

    ids = []
    with using_tracking_uri(tracking_uri):
        for j in spread(len(records), count):
            record, reward = records[j], float(rewards[j])
            stats = record.get("stats", {})
            attributes = {"posttrain.step": step, "posttrain.row": j, "posttrain.reward": reward,
                          "posttrain.policy_version": policy_version, "posttrain.turns": stats.get("turns", 0),
                          "posttrain.tokens": stats.get("tokens", 0),
                          "posttrain.sampled_tokens": stats.get("sampled_tokens", 0),
                          "posttrain.truncated": bool(stats.get("truncated", False)),
                          "posttrain.error": record.get("error") or ""}
            root = client.start_trace("episode", span_type=SpanType.AGENT, inputs={"messages": record["prompt"]},
                                      attributes=attributes, tags={"posttrain.step": str(step)},
                                      experiment_id=experiment_id, run_id=run_id)
            _turn_spans(client, root, record, stats.get("turn_tokens") or [], policy_version)
            client.end_trace(root.trace_id, outputs={"reward": reward, "completion": record["completion"]})
            ids.append(root.trace_id)
        mlflow.flush_trace_async_logging()  # written to this store before the tracking URI is put back
    return ids


def _turn_spans(client: Any, root: Any, record: dict, turn_tokens: Sequence[int], version: int) -> None:
    """A span per assistant turn, a child span per tool call answered by the tool messages that follow it, and a
    span per other message of the environment."""
    from mlflow.entities import SpanType

    messages = list(record["completion"])
    # after a new sample, the assistant messages before the last sample's own turns are as the agent sent them:
    # no sampled tokens of their own here
    own = record["stats"].get("last_sample_turns", len(turn_tokens))
    resent = sum(m.get("role") == "assistant" for m in messages) - own
    turn, i = 0, 0
    while i < len(messages):
        message = messages[i]
        if message.get("role") != "assistant":
            span = client.start_span("environment", root.trace_id, root.span_id, inputs=None,
                                     attributes={"posttrain.role": str(message.get("role"))})
            client.end_span(root.trace_id, span.span_id, outputs={"message": message})
            i += 1
            continue
        turn += 1
        at = len(turn_tokens) - own + (turn - 1 - resent)  # this message's turn among the episode's
        tokens = turn_tokens[at] if turn > resent and 0 <= at < len(turn_tokens) else None
        span = client.start_span(f"turn {turn}", root.trace_id, root.span_id, span_type=SpanType.LLM,
                                 inputs=None, attributes={"posttrain.turn": turn, "posttrain.policy_version": version,
                                                          **({"posttrain.sampled_tokens": tokens} if tokens else {})})
        calls = message.get("tool_calls") or []
        answers = []
        while i + 1 < len(messages) and messages[i + 1].get("role") == "tool":
            i += 1
            answers.append(messages[i])
        for k, call in enumerate(calls):
            function = call.get("function", {})
            tool = client.start_span(f"tool {function.get('name')}", root.trace_id, span.span_id,
                                     span_type=SpanType.TOOL, inputs={"arguments": function.get("arguments")})
            answer = answers[k]["content"] if k < len(answers) else None
            client.end_span(root.trace_id, tool.span_id, outputs={"content": _json(answer) if answer else None})
        client.end_span(root.trace_id, span.span_id, outputs={"message": message})
        i += 1
