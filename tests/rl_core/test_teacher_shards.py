"""The OPD teacher's batch sharding (rl_core.algorithms.opd.row_shards / score_in_shards) without Ray: contiguous
shards in order, reassembled into what one teacher gives for the whole batch; and the config around the replicas
(cluster.teacher_replicas: default, preflight, the trainer rank's GPU share)."""

from __future__ import annotations

import pytest
import torch

from rl_core.algorithms.opd import row_shards, score_in_shards, teacher_logprobs
from rl_core.config import load_config
from rl_core.placement.run_shape import TEACHER_GPU_SHARE, teacher_replicas, teachers_per_rank, trainer_gpus
from rl_core.preflight.rules import preflight
from tests.builders import tiny_model
from tests.rl_core.test_opd import make_batch

OPD = "recipes/opd_arithmetic.py"
GRPO = "recipes/arithmetic.py"


def test_row_shards_are_contiguous_balanced_and_in_order():
    assert row_shards(16, 2) == [(0, 8), (8, 16)]
    assert row_shards(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert row_shards(2, 4) == [(0, 1), (1, 2)]  # no empty shard
    assert row_shards(5, 1) == [(0, 5)]
    for rows in range(12):
        for parts in range(1, 6):
            bounds = row_shards(rows, parts)
            assert [i for a, b in bounds for i in range(a, b)] == list(range(rows))  # every row once, in order
            sizes = [b - a for a, b in bounds]
            assert len(bounds) == min(rows, parts) and all(n >= 1 for n in sizes)
            assert max(sizes, default=0) - min(sizes, default=0) <= 1
    with pytest.raises(ValueError, match="cluster.teacher_replicas"):
        row_shards(4, 0)


def test_shards_are_reassembled_in_row_order():
    batch = make_batch(tiny_model(0), tiny_model(1))
    seen = []

    def score(shards):  # each shard's "log-probs" are its own token ids: the reassembly must give the batch's
        seen.append([s.batch_size for s in shards])
        return [s.input_ids.float() for s in reversed(shards)][::-1]

    out = score_in_shards(batch, 3, score)
    assert seen == [[3, 3, 2]] and torch.equal(out, batch.input_ids.float())
    with pytest.raises(ValueError, match="rows 0:3 have shape"):
        score_in_shards(batch, 3, lambda shards: [s.input_ids[:, :-1].float() for s in shards])
    with pytest.raises(ValueError, match="2 shard"):
        score_in_shards(batch, 3, lambda shards: [s.input_ids.float() for s in shards[:2]])


@pytest.mark.parametrize("micro_batch", [None, 2])
def test_sharded_scoring_is_one_teachers(micro_batch):
    """Each replica scores its rows with the same forward: one replica gives one teacher's result bit for bit; more
    replicas run the forward on fewer rows, which some CPU kernels round differently (a row's value depends on the
    rows it is computed with only through the kernel's blocking), so they agree to float32 rounding."""
    student, teacher = tiny_model(0), tiny_model(1)
    batch = make_batch(student, teacher)
    whole = teacher_logprobs(teacher, batch, temperature=0.7, micro_batch_size=micro_batch)
    for replicas in (1, 2, 3):
        sharded = score_in_shards(batch, replicas, lambda shards: [
            teacher_logprobs(teacher, s, temperature=0.7, micro_batch_size=micro_batch) for s in shards])
        if replicas == 1:
            assert torch.equal(sharded, whole)
        torch.testing.assert_close(sharded, whole, rtol=0, atol=1e-5)
        assert torch.equal(sharded == 0, whole == 0)  # the same loss positions, exactly


def test_teacher_replicas_default_to_one_per_rank_and_share_the_ranks_gpu():
    assert teacher_replicas(load_config(OPD, ["cluster.num_workers=2"])) == 2
    assert teacher_replicas(load_config(GRPO, [])) == 0
    cfg = load_config(OPD, ["cluster.num_workers=2", "cluster.teacher_replicas=3", "cluster.gpus_per_worker=1"])
    assert teacher_replicas(cfg) == 3 and teachers_per_rank(cfg) == 2
    assert trainer_gpus(cfg) == pytest.approx(1 - 2 * TEACHER_GPU_SHARE)
    assert trainer_gpus(load_config(GRPO, ["cluster.gpus_per_worker=1"])) == 1.0  # no teacher: the whole bundle
    assert trainer_gpus(load_config(OPD, [])) == 0.0  # on CPU


def test_preflight_refuses_impossible_teacher_replicas():
    cfg = load_config(OPD, [])
    cfg.cluster.gpus_per_worker = 2
    assert any(e.startswith("cluster.gpus_per_worker=2 with rl.objective.type=opd") and "cluster.gpus_per_worker=1" in e
               for e in preflight(cfg).errors)
    cfg = load_config(OPD, [])
    cfg.cluster.gpus_per_worker, cfg.cluster.teacher_replicas = 0.02, 2
    assert any(e.startswith("cluster.teacher_replicas=2") and "no GPU share" in e for e in preflight(cfg).errors)
    cfg = load_config(GRPO, [])
    cfg.cluster.teacher_replicas = 2
    assert any(e.startswith("cluster.teacher_replicas=2: only read by an objective with a teacher")
               for e in preflight(cfg).errors)
    ok = load_config(OPD, ["cluster.num_workers=2", "cluster.gpus_per_worker=1", "cluster.teacher_replicas=4"])
    assert preflight(ok).errors == []
