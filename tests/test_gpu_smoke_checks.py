"""benchmarks/gpu_smoke.py's reading of a finished run (`check_run`), on run outputs written here: a healthy
colocated run passes; memory that grows over the sleep/wake cycles, a trainer rank without TF32, a vLLM that does
not give back its memory, and an engine that keeps more asleep than the memory plan counts are each named."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
try:
    import gpu_smoke
finally:
    sys.path.remove(str(REPO / "benchmarks"))

GPU_GIB = 80.0


def write_run(run_dir: Path, *, asleep=(10.0, 10.1, 10.2), rollout=(40.0, 40.0, 40.1), precision="high",
              resident=0.6) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    steps = [{"step": s, "train/loss": 0.1, "train/grad_norm": 0.5, "rollout/logp_abs_diff": 0.01,
              "rollout/logp_abs_diff_max": 0.1, "rollout/sync_probe_logp_abs_diff": 0.02, "rollout/reward_mean": 0.5,
              "rollout/response_len_mean": 100.0, "perf/generate_s": 1.0, "perf/weight_sync_s": 0.1,
              "perf/tokens_per_s": 1000.0, "perf/gpu_rollout_used_gib": rollout[s - 1],
              "perf/gpu_asleep_used_gib": asleep[s - 1], "perf/gpu_train_peak_gib": 30.0} for s in (1, 2, 3)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    placement = {"trainers": [{"device": "cuda:0", "float32_matmul_precision": precision,
                               "vllm_asleep_resident_gib": resident}]}
    (run_dir / "placement.json").write_text(json.dumps(placement))
    return run_dir


def test_a_healthy_colocated_run_passes(tmp_path):
    assert gpu_smoke.check_run(write_run(tmp_path / "ok"), 3, True, GPU_GIB) == []


def test_growth_over_the_cycles_a_trainer_without_tf32_and_memory_not_given_back_are_named(tmp_path):
    grew = gpu_smoke.check_run(write_run(tmp_path / "grew", asleep=(10.0, 10.3, 10.6)), 3, True, GPU_GIB)
    assert len(grew) == 1 and "in use asleep grew over the sleep/wake cycles: [10.0, 10.3, 10.6]" in grew[0]
    leak = gpu_smoke.check_run(write_run(tmp_path / "leak", rollout=(40.0, 41.0, 42.0)), 3, True, GPU_GIB)
    assert len(leak) == 1 and "at rollout grew" in leak[0]
    highest = gpu_smoke.check_run(write_run(tmp_path / "fp32", precision="highest"), 3, True, GPU_GIB)
    assert len(highest) == 1 and "['highest']: TF32" in highest[0]
    # a reservation of 0.3 x 80 GiB = 24 GiB: sleeping must free at least half of it
    kept = gpu_smoke.check_run(write_run(tmp_path / "kept", asleep=(35.0, 35.0, 35.0)), 3, True, GPU_GIB)
    assert len(kept) == 1 and "gave back only [5.0, 5.0, 5.1" in kept[0]
    # what sleep leaves (CUDA graphs, buffers) above the plan's 1 GiB for it, or not measured at all
    graphs = gpu_smoke.check_run(write_run(tmp_path / "graphs", resident=1.5), 3, True, GPU_GIB)
    assert len(graphs) == 1 and "keeps [1.5] GiB on the GPU asleep; the memory plan counts 1.00" in graphs[0]
    unmeasured = gpu_smoke.check_run(write_run(tmp_path / "unmeasured", resident=None), 3, True, GPU_GIB)
    assert len(unmeasured) == 1 and "[None]" in unmeasured[0]
