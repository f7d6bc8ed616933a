"""A generative judge as the only reward on CPU: GRPO on the quickstart's task, each completion judged by a tiny
language model that answers 1 (right) or 0 (wrong) (docs/rewards.md).

The judge (`artifacts/tiny-model/judge`) is the warm start trained further on the judge's own requests: `posttrain
make-data arithmetic-judge` turns the reward model's preference pairs (`data/arithmetic-rm-pairs`: each right answer
against one the warm model samples) into rows `22+94=116|116?` -> `1`, `22+94=106|116?` -> `0`
(`rl_core.rewards.arithmetic.JUDGE_TEMPLATE`: the problem, the response, the reference answer), then `posttrain
warm-start` teaches it the verdict (DVC stages `judge_data` and `judge_model` of pipelines/judge_arithmetic/dvc.yaml).
In the run the judge is pointwise, served greedily beside the trainer ranks by the reward-model role; its answer's
last number is the reward, an answer without one counts in `rollout/rewards/judge/unparsable`. The rule reward
(exact match) is scored with weight 0: the policy never sees it, and it decides `val/accuracy`.

    dvc repro pipelines/judge_arithmetic/dvc.yaml     # the judge's rows and model, then this run
    posttrain run recipes/judge_arithmetic.py         # once artifacts/tiny-model/judge exists
"""

from recipes.arithmetic import build_config as arithmetic
from rl_core.algorithms.grpo import GRPO
from rl_core.config import PosttrainConfig
from rl_core.config.schema import JudgeConfig, RewardEntry
from rl_core.rewards.arithmetic import JUDGE_TEMPLATE


def build_config() -> PosttrainConfig:
    cfg = arithmetic()
    cfg.job.name = "judge-arithmetic"
    cfg.rl.objective = GRPO()
    # the judge continues the request as it was trained to (chat=False): no chat turn around it
    judge = JudgeConfig(model="artifacts/tiny-model/judge", template=JUDGE_TEMPLATE, chat=False, max_tokens=2)
    cfg.data.rewards = [RewardEntry(judge=judge, name="judge"),
                        RewardEntry(path="rl_core.rewards.arithmetic:exact_match", weight=0.0, name="arithmetic")]
    cfg.data.success_reward = "arithmetic"
    return cfg
