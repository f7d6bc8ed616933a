"""recipes/tool_arithmetic_agent.py with the agent written on the OpenAI Agents SDK: `examples.tool_arithmetic_agent:
sdk_calculator_agent` is an SDK `Agent` with the calculator as a function tool, run by the SDK's own loop against the
policy behind posttrain's gateway (docs/agents.md, "Bring your own agent"; the SDK is `pip install openai-agents`,
in the dev extra `make` installs). Its learning beside the others: docs/benchmarks.md.
"""

from recipes.tool_arithmetic_agent import build_config as plain_client_agent
from rl_core.config import PosttrainConfig


def build_config() -> PosttrainConfig:
    cfg = plain_client_agent()
    cfg.job.name = "tool-arithmetic-sdk-agent"
    cfg.data.task = "examples.tool_arithmetic_agent:sdk_calculator_agent"
    return cfg
