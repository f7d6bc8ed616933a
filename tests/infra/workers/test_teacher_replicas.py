"""The OPD teacher role with several replicas (infra/workers/teacher.py) on the session's local Ray: placed in the trainer
ranks' placement group, one process each, and the batch scored in shards equals one replica's whole-batch score,
bit for bit on CPU."""

from __future__ import annotations

import pytest
import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group

from rl_core.config import load_config
from tests.builders import tiny_model
from tests.conftest import recipe
from tests.rl_core.test_opd import make_batch

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # Ray actors loading the model: ~20 s


def test_two_replicas_score_what_one_scores(workdir):
    from infra.workers.teacher import TeacherRole

    model = workdir / "artifacts" / "tiny-model" / "init"
    cfg = load_config(recipe("opd_arithmetic"), [f"model.name_or_path={model}", f"model.teacher={model}",
                                                 "cluster.num_workers=2"])  # default: one replica per rank
    pg = placement_group([{"CPU": 1.0}] * 2)  # the trainer ranks' bundles (infra.cluster.placement.worker_bundles)
    ray.get(pg.ready(), timeout=60)
    batch = make_batch(tiny_model(0), tiny_model(1)).replace(teacher_logp=None)  # 8 rows, token ids < 20
    try:
        with TeacherRole(cfg, pg) as teacher:
            where = teacher.node_map()
            sharded = teacher.score(batch)  # rows 0:4 on replica 0, 4:8 on replica 1, in parallel
            whole = ray.get(teacher.actors[0].score.remote(batch))  # what one replica gives for the whole batch
    finally:
        remove_placement_group(pg)
    assert len(where) == 2 and len({w["pid"] for w in where}) == 2 and {w["device"] for w in where} == {"cpu"}
    assert sharded.shape == batch.loss_mask.shape and bool((sharded[batch.loss_mask > 0] < 0).all())
    assert torch.equal(sharded, whole), (sharded - whole).abs().max()
