"""Bring your own agent: an OpenAI-compatible gateway in front of the policy, and agent functions as a task.

`data.task=package.module:my_agent` names a function that runs an agent written against the OpenAI client
(`agent`); each episode's client talks to this process's gateway (`server`), whose sessions (`session`) hand the
agent's requests to the episode loop and its answers back (`messages`), keeping the policy's token ids as sampled.
"""

from rl_core.agents.gateway.agent import AgentEnvironment, agent_environment, is_agent_function
from rl_core.agents.gateway.messages import MODEL, ApiError

__all__ = ["MODEL", "AgentEnvironment", "ApiError", "agent_environment", "is_agent_function"]
