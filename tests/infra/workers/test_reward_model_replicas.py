"""The reward-model role (infra/workers/reward_model.py) on the session's local Ray: two replicas in the trainer ranks'
bundles score a batch in two shares, equal to one replica's whole-batch score (to float error: the shares pad
differently); a batch not back within
`data.reward_timeout_s` fails naming the entry, and the next batch is scored by new replicas."""

from __future__ import annotations

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from rl_core.config import load_config
from rl_core.rewards import RewardError, RewardInputs
from tests.conftest import recipe
from tests.rl_core.test_reward_model import TOKENIZER, tiny_rm

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # Ray actors loading a model: ~20 s

PROMPTS = [f"{a}+{b}=" for a, b in ((12, 34), (5, 5), (40, 9), (7, 70), (3, 3), (61, 2), (0, 0), (9, 90))]
INPUTS = RewardInputs(PROMPTS, ["46", "11", "49", "7", "6", "63", "0", "99"], {}, ["row"] * 8)
LONG = RewardInputs(PROMPTS * 1200, INPUTS.completions * 1200, {}, ["row"] * 9600)  # 3200 batches of 3: ~5 s


def test_two_replicas_score_what_one_scores_and_a_timeout_replaces_them(tmp_path):
    from infra.workers.reward_model import RewardModelRole

    tiny_rm(0).save_pretrained(tmp_path / "rm")
    TOKENIZER.save_pretrained(tmp_path / "rm")
    cfg = load_config(recipe("arithmetic"), [f"data.rewards=[{{model: '{tmp_path / 'rm'}', batch_size: 3}}]",
                                             "cluster.num_workers=2"])  # one replica per rank
    pg = placement_group([{"CPU": 1.0}] * 2)  # the trainer ranks' bundles (infra.cluster.placement.worker_bundles)
    ray.get(pg.ready(), timeout=60)
    try:
        with RewardModelRole(cfg, pg) as models:
            before = models.node_map()
            shared = models.score(0, INPUTS)  # rows 0:4 on replica 0, 4:8 on replica 1
            whole = ray.get(models.actors[0].score.remote(0, INPUTS))
            # each replica first takes a batch that keeps it busy for seconds: the next shares queue behind it, so no
            # replica answers within the timeout unless this process stalls for seconds between sending and waiting
            busy = [actor.score.remote(0, LONG) for actor in models.actors]
            cfg.data.reward_timeout_s = 1e-4
            with pytest.raises(RewardError, match=r"data.rewards\[0\] did not score completions 0..3 .*replaced"):
                models.score(0, INPUTS)
            assert models.actors == []  # killed
            with pytest.raises(ray.exceptions.RayActorError):  # with the long batch they were still scoring
                ray.get(busy, timeout=60)
            cfg.data.reward_timeout_s = 120.0
            again = models.score(0, INPUTS)
            after = models.node_map()
    finally:
        remove_placement_group(pg)
    assert len(before) == 2 and len({w["pid"] for w in before}) == 2
    assert before[0]["serves"] == {"data.rewards[0]": "reward model"}
    assert shared == pytest.approx(whole, abs=1e-6) and len(shared) == 8 and len(set(shared)) > 1  # padding differs
    assert again == pytest.approx(shared, abs=1e-6) and not {w["pid"] for w in after} & {w["pid"] for w in before}  # new processes
