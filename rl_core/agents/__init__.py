"""Agents: environments the policy talks to over several turns, with tools (`environment`, `tools`), and the
token-exact episode that records what it sampled (`episode`), sampled on a rollout engine (`rollout`)."""

from rl_core.agents.environment import Environment, Reply, Turn
from rl_core.agents.episode import Episode, template_delta
from rl_core.agents.rollout import episodes_to_completions
from rl_core.agents.scheduling import run_episodes
from rl_core.agents.tools import (
           ToolCall,
           ToolResult,
           parse_tool_calls,
           run_tool_call,
           tool_schema,
           tool_table,
)

__all__ = ["Environment", "Episode", "Reply", "ToolCall", "ToolResult", "Turn", "episodes_to_completions",
           "parse_tool_calls", "run_episodes", "run_tool_call", "template_delta", "tool_schema", "tool_table"]
