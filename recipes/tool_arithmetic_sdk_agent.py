"""The tool-arithmetic job as an agent written with the OpenAI Agents SDK: `examples.tool_arithmetic_agent:
sdk_calculator_agent` is an SDK `Agent` with the calculator as a function tool, run by the SDK's own loop against
the policy behind posttrain's gateway (docs/agents.md, "Bring your own agent"; the SDK is `pip install
openai-agents`, in the dev extra `make` installs). Rows, warm start, limits and schedule are
recipes/tool_arithmetic.py's, so the three learn side by side (docs/benchmarks.md).
"""

from recipes.tool_arithmetic import build_config as tool_arithmetic
from rl_core.config import PosttrainConfig


def build_config() -> PosttrainConfig:
    cfg = tool_arithmetic()
    cfg.job.name = "tool-arithmetic-sdk-agent"
    cfg.data.task = "examples.tool_arithmetic_agent:sdk_calculator_agent"
    return cfg
