"""An agent with a sandboxed code tool on CPU: the tiny model learns to write Python that prints sums too long to do
in its head (examples/code_arithmetic.py, docs/agents.md "Sandboxes").

`dvc repro pipelines/code_arithmetic/dvc.yaml` builds the rows, the warm-start games and the warm start
(`artifacts/tiny-model/code-warm`). Every episode starts its own local sandbox (Linux namespaces, or root: see
`rl_core.agents.sandbox.local`); its code runs there with no network, no host file, no inherited variable, and
5 s, 512 MiB and 8 processes per run. An episode is a call, then the answer; the loss is on the policy's turns only.
"""

from recipes.tool_arithmetic import build_config as tool_arithmetic


def build_config():
    cfg = tool_arithmetic()
    cfg.job.name = "code-arithmetic"
    cfg.model.name_or_path = "artifacts/tiny-model/code-warm"
    cfg.rollout.max_tokens = 96  # a call printing the sum (~80 characters) and its end
    cfg.rl.max_steps = 100
    cfg.data.task = "examples.code_arithmetic:CodeArithmetic"
    cfg.data.train = "data/code-arithmetic/train.jsonl"
    cfg.data.val = "data/code-arithmetic/val.jsonl"
    return cfg
