"""The tool-arithmetic job as an agent of your own: `examples.tool_arithmetic_agent:calculator_agent` talks to the
policy through the OpenAI client (docs/agents.md, "Bring your own agent"). Rows, warm start, limits and schedule are
recipes/tool_arithmetic.py's, so the two learn side by side (docs/benchmarks.md).
"""

from recipes.tool_arithmetic import build_config as tool_arithmetic
from rl_core.config import PosttrainConfig


def build_config() -> PosttrainConfig:
    cfg = tool_arithmetic()
    cfg.job.name = "tool-arithmetic-agent"
    cfg.data.task = "examples.tool_arithmetic_agent:calculator_agent"
    return cfg
