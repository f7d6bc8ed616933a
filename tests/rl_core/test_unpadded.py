"""Training on real tokens (rl_core/primitives/logprobs.py, LLMTrainer's token budget): the unpadded layouts equal
the padded forward, no `[B, T, V]` tensor exists, token-budget micro-batches, one host copy per optimizer step,
and the GSPO recipe's bf16 compute against float32. Tiny random models on CPU."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Qwen2Config, Qwen2ForCausalLM

from rl_core.algorithms.context import ObjectiveContext
from rl_core.algorithms.grpo import build_objective
from rl_core.batch.trajectory import Trajectory, TrajectoryError
from rl_core.config import OptimizerConfig, RLConfig, load_config
from rl_core.primitives.chunked_softmax import token_logprobs_and_entropy
from rl_core.primitives.logprobs import (
    forward_layout,
    position_ids_from_mask,
    sequence_token_logprobs,
)
from rl_core.primitives.policy_gradient import clipped_policy_gradient_loss, reduce_policy_gradient_loss
from rl_core.training.trainer import LLMTrainer
from tests.builders import grpo_batch, tiny_model
from tests.ranks import run_ranks

ROOT = Path(__file__).resolve().parents[2]
V = 97
# rows of very different lengths: (prompt, response) tokens; row 3 has no response (weight 0)
ROWS = [(6, 30), (2, 3), (5, 12), (4, 0), (1, 21), (6, 1), (3, 8), (2, 17)]
NO_CLIP = OptimizerConfig(lr=1e-3, max_grad_norm=1e9)


def qwen(seed=0):
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                        tie_word_embeddings=True))


def llama(seed=0):
    return tiny_model(seed, vocab_size=V, max_position_embeddings=128)


def make_batch(rows=ROWS, seed=0) -> Trajectory:
    """Left-padded prompts, responses padded after their end: the rollout layout."""
    return grpo_batch([r for _, r in rows], [p for p, _ in rows], seed, vocab_size=V)


def padded_reference(model, batch, temperature):
    """The padded forward written out here: `[B, T, V]` logits, log_softmax, gather; entropy per position."""
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                position_ids=position_ids_from_mask(batch.attention_mask), use_cache=False)
    logp_all = torch.log_softmax(out.logits[:, :-1].float() / temperature, -1)
    lp = logp_all.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    m = batch.loss_mask[:, 1:]
    zero = lp.new_zeros(lp.shape[0], 1)
    return torch.cat([zero, lp * m], 1), torch.cat([zero, ent.detach() * m], 1)


def grads_of(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


# ---------------------------------------------------------------------------------- the primitive


@pytest.mark.parametrize("make_model", [qwen, llama])
@pytest.mark.parametrize("layout", ["rows", "packed"])
def test_unpadded_layouts_equal_the_padded_forward(make_model, layout):
    batch = make_batch()
    weights = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(1))
    ref_model, model = make_model(), make_model()
    ref_lp, ref_ent = padded_reference(ref_model, batch, 0.7)
    (ref_lp * weights).sum().backward()
    with forward_layout(layout):
        lp, ent = sequence_token_logprobs(model, batch.input_ids, batch.attention_mask, temperature=0.7,
                                          return_entropy=True, loss_mask=batch.loss_mask)
    (lp * weights).sum().backward()
    assert (lp[batch.loss_mask == 0] == 0).all() and (lp[3] == 0).all()  # nothing read off the mask, row 3 empty
    assert (lp - ref_lp).abs().max() <= 1e-5 and (ent - ref_ent).abs().max() <= 1e-5
    assert ref_lp.abs().max() > 1 and ref_ent.max() > 1  # not vacuous
    assert (grads_of(model) - grads_of(ref_model)).abs().max() <= 1e-5
    assert not ent.requires_grad


def test_a_frozen_head_gets_no_weight_gradient_and_the_rest_the_same_gradients():
    """LoRA freezes the LM head: the fused head then skips its float32 weight-gradient accumulator, and every
    trained parameter's gradient is still the padded reference's."""
    batch = make_batch()
    weights = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(1))
    ref_model, model = llama(), llama()
    for m in (ref_model, model):
        m.lm_head.weight.requires_grad_(False)
    (padded_reference(ref_model, batch, 0.7)[0] * weights).sum().backward()
    lp = sequence_token_logprobs(model, batch.input_ids, batch.attention_mask, temperature=0.7,
                                 loss_mask=batch.loss_mask)
    (lp * weights).sum().backward()
    assert model.lm_head.weight.grad is None
    trained = [(a, b) for a, b in zip(model.parameters(), ref_model.parameters()) if a.requires_grad]
    assert len(trained) == len(list(model.parameters())) - 1
    assert max(float((a.grad - b.grad).abs().max()) for a, b in trained) <= 1e-5
    assert max(float(b.grad.abs().max()) for _, b in trained) > 1e-3  # not vacuous


def test_default_read_positions_are_every_real_token_after_the_first():
    batch, model = make_batch(), qwen()
    lp = sequence_token_logprobs(model, batch.input_ids, batch.attention_mask, temperature=1.0)
    with torch.no_grad():
        ref = padded_reference(model, batch.replace(loss_mask=batch.attention_mask.float()), 1.0)[0]
    real = batch.attention_mask.bool()
    read = torch.zeros_like(real)
    read[:, 1:] = real[:, 1:] & real[:, :-1]
    assert torch.equal(lp != 0, read)
    assert (lp - ref * read).abs().max() <= 1e-5


def test_a_loss_token_with_no_predecessor_is_refused():
    batch, model = make_batch(), qwen()
    bad = batch.loss_mask.clone()
    bad[1, 4] = 1  # row 1's prompt starts at column 4: nothing predicts its first token
    with pytest.raises(ValueError, match="follows no real token"):
        sequence_token_logprobs(model, batch.input_ids, batch.attention_mask, temperature=1.0, loss_mask=bad)


def test_chunked_log_softmax_equals_torch_in_value_and_gradient():
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(11, 50, generator=g)).requires_grad_()
    ref_logits = logits.detach().clone().requires_grad_()
    targets = torch.randint(0, 50, (11,), generator=g)
    weights = torch.randn(11, generator=g)
    lp, ent = token_logprobs_and_entropy(logits, targets, 0.7, with_entropy=True, chunk=3)  # 4 chunks
    full = torch.log_softmax(ref_logits / 0.7, -1)
    ref_lp = full.gather(-1, targets[:, None]).squeeze(-1)
    assert torch.allclose(lp, ref_lp, atol=1e-6)
    assert torch.allclose(ent, -(full.exp() * full).sum(-1).detach(), atol=1e-5)
    (lp * weights).sum().backward()
    (ref_lp * weights).sum().backward()
    assert torch.allclose(logits.grad, ref_logits.grad, atol=1e-6) and ref_logits.grad.abs().max() > 0.1
    bf16 = logits.detach().bfloat16().requires_grad_()  # bf16 logits: float32 math, a bf16 gradient
    lp16, _ = token_logprobs_and_entropy(bf16, targets, 0.7, chunk=3)
    lp16.sum().backward()
    assert lp16.dtype == torch.float32 and bf16.grad.dtype == torch.bfloat16


class LargestTensor(TorchDispatchMode):
    """The largest new tensor over the vocabulary (last dimension V) any op makes in the block, forward and backward."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in [*args, *(kwargs or {}).values()]
                  if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == V \
                    and t.untyped_storage().data_ptr() not in inputs:  # views of an input (a weight's .t()) are not new
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("layout", ["rows", "packed"])
def test_no_tensor_spans_every_position_and_the_vocabulary(layout):
    batch, model = make_batch(), qwen()
    read = int(batch.loss_mask[:, 1:].sum())
    b, t = batch.input_ids.shape
    sizes = {}
    for name in (layout, "padded"):
        with LargestTensor() as watch, forward_layout(name):
            lp, _ = sequence_token_logprobs(model, batch.input_ids, batch.attention_mask, temperature=1.0,
                                            return_entropy=True, loss_mask=batch.loss_mask)
            lp.sum().backward()
        sizes[name] = watch.largest
    assert sizes["padded"] >= b * (t - 1) * V  # the measurement sees the padded path's [B, T, V] logits
    assert sizes[layout] <= read * V < b * t * V / 2  # logits (and their gradient) of the read tokens only


def test_the_fused_head_holds_chunks_and_the_unfused_head_equals_it(monkeypatch):
    """The fused LM head never holds more than a chunk of the vocabulary; a head it cannot fuse (a model that
    transforms its logits, or another module type) returns the read positions' logits, with the same values."""
    import rl_core.primitives.logprobs as lp_module
    from rl_core.primitives import chunked_softmax

    batch = make_batch()
    read = int(batch.loss_mask[:, 1:].sum())
    monkeypatch.setattr(chunked_softmax, "CHUNK_ELEMENTS", 8 * V)  # chunks of 8 positions
    results = {}
    for fused in (True, False):
        monkeypatch.setattr(lp_module, "_fusable", lambda model, head, fused=fused: fused)
        model = qwen()
        with LargestTensor() as watch:
            lp, ent = sequence_token_logprobs(model, batch.input_ids, batch.attention_mask, temperature=0.7,
                                              return_entropy=True, loss_mask=batch.loss_mask)
            (lp * torch.arange(lp.numel()).reshape(lp.shape).cos()).sum().backward()
        results[fused] = (lp.detach(), ent, grads_of(model), watch.largest)
    assert results[True][3] <= 8 * V < results[False][3] == read * V
    for a, b in zip(results[True][:3], results[False][:3]):
        assert (a - b).abs().max() <= 1e-5
    with torch.no_grad():
        assert not lp_module._fusable(type("Gemma2Like", (), {"config": type("C", (), {
            "final_logit_softcapping": 30.0})()})(), torch.nn.Linear(2, 3))


# ------------------------------------------------------------------------------------ the trainer


def trainer_for(model, rl, hook=None):
    return LLMTrainer(copy.deepcopy(model), build_objective(rl, ObjectiveContext(64)), NO_CLIP, dp_reducer=hook)


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-fixed"])
def test_train_step_on_real_tokens_equals_the_padded_step(loss_type):
    """Same loss and gradient as the padded forward: whole batch, 3-row chunks, token budgets, 2 ranks."""
    model, batch = qwen(), make_batch()
    rl = RLConfig(loss_type=loss_type)
    with forward_layout("padded"):
        ref = trainer_for(model, rl)
        ref_metrics = ref.train_step(batch)
    ref_grads = grads_of(ref.model)
    runs = {}
    for layout in ("rows", "packed"):
        with forward_layout(layout):
            for key, micro, budget in (("whole", None, None), ("micro3", 3, None), ("budget40", None, 40),
                                       ("budget80x2", 2, 80)):
                tr = trainer_for(model, rl)
                runs[layout, key] = (tr.train_step(batch, micro, None, budget), grads_of(tr.model))
            ranks = run_ranks(lambda hook: trainer_for(model, rl, hook), [batch.select(range(5)),
                                                                          batch.select(range(5, 8))], None, None, 40)
            for r, (metrics, tr) in enumerate(ranks):
                runs[layout, f"rank{r}"] = (metrics, grads_of(tr.model))
    for key, (metrics, grads) in runs.items():
        assert metrics["train/loss"] == pytest.approx(ref_metrics["train/loss"], abs=1e-5), key
        assert (grads - ref_grads).abs().max() <= 1e-5, key
        if key[1] == "whole":  # a per-chunk diagnostic: equal for the same chunks
            assert metrics["train/entropy"] == pytest.approx(ref_metrics["train/entropy"], abs=1e-5), key
    assert ref_grads.abs().max() > 1e-3


def test_token_budget_split_groups_rows_by_length_under_the_budget():
    batch = make_batch()
    lengths = batch.attention_mask.sum(-1).tolist()  # 36, 5, 17, 4, 22, 7, 11, 19
    chunks = batch.token_budget_split(40)
    seen = [int(s) - 100 for c in chunks for s in c.sample_ids]
    assert sorted(seen) == list(range(8))  # every row once
    assert seen == sorted(range(8), key=lambda i: -lengths[i])  # longest first
    for c in chunks:
        assert len(c) * int(c.attention_mask.sum(-1).max()) <= 40
    # greedy by hand, rows x longest <= 40: 36 | 22 (22+19 would be 2 x 22) | 19,17 | 11,7,5 | 4
    assert [len(c) for c in chunks] == [1, 1, 2, 3, 1]
    assert [len(c) for c in batch.token_budget_split(40, max_rows=2)] == [1, 1, 2, 2, 2]
    with pytest.raises(TrajectoryError, match=r"row 0 holds 36 tokens.*rl.micro_batch_max_tokens"):
        batch.token_budget_split(30)


def test_a_mean_objective_refuses_a_token_budget():
    from rl_core.primitives.objective import MetricAdapter, Objective, Reduction

    def fn(model, batch):
        lp = sequence_token_logprobs(model, batch.input_ids, batch.attention_mask, temperature=1.0,
                                     loss_mask=batch.loss_mask)
        return -lp.sum() / batch.loss_mask.sum().clamp_min(1), {}

    trainer = LLMTrainer(qwen(), Objective(fn, Reduction.MEAN, MetricAdapter({})), NO_CLIP)
    with pytest.raises(ValueError, match="rl.micro_batch_max_tokens"):
        trainer.train_step(make_batch(), None, None, 40)


def test_preflight_refuses_budgets_that_cannot_work():
    from rl_core.preflight.rules import preflight

    grpo = ROOT / "recipes" / "grpo_gsm8k.py"
    cfg = load_config(grpo, ["rollout.max_tokens=256", "rl.micro_batch_max_tokens=256"])
    assert any(e.startswith("rl.micro_batch_max_tokens=256") for e in preflight(cfg).errors)
    assert preflight(load_config(grpo, ["rollout.max_tokens=256", "rl.micro_batch_max_tokens=4096"])).ok
    dpo = load_config(ROOT / "recipes" / "dpo_gsm8k.py", ["rl.micro_batch_max_tokens=4096"])
    assert any("Reduction.MEAN" in e for e in preflight(dpo).errors)


class HostReads(TorchDispatchMode):
    """Device-to-host scalar reads (`item()`, `float(t)`, `bool(t)`: aten._local_scalar_dense) made by the trainer and
    the objective's loss and metric code, by project file; the forward's layout (logprobs.py), batch validation
    (trajectory.py), transformers and torch.optim are not counted."""

    NOT_COUNTED = ("logprobs.py", "trajectory.py")

    def __init__(self):
        super().__init__()
        self.files: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            import traceback

            stack = traceback.extract_stack()
            frames = [f for f in stack if f.filename.startswith(str(ROOT / "rl_core"))]
            if frames and not any("/torch/optim/" in f.filename for f in stack) and not frames[-1].filename.endswith(self.NOT_COUNTED):
                self.files.append(f"{Path(frames[-1].filename).name}:{frames[-1].lineno}")
        return func(*args, **(kwargs or {}))


def test_metrics_and_loss_reach_the_host_once_per_optimizer_step():
    """No scalar read per chunk or per metric: the step's loss, weights and metrics come back in one `tolist()`."""
    model, batch = qwen(), make_batch()
    for micro in (8, 2):  # 1 and 4 chunks
        trainer = LLMTrainer(copy.deepcopy(model), build_objective(RLConfig(kl_beta=0.1), ObjectiveContext(64)),
                             NO_CLIP, auxiliary_models={"reference": qwen(1)})
        with HostReads() as reads:
            metrics = trainer.train_step(batch, micro)
        assert reads.files == [], reads.files
        assert metrics["train/kl"] > 0 and metrics["train/loss"] != 0


# ------------------------------------------------------------------------------------ precision


def test_gspo_recipe_computes_in_bf16_with_ratios_within_tolerance_of_float32():
    """GSPO's sequence ratios and loss under bf16 compute (float32 log-softmax) against float32 compute.

    Stated tolerance: |ratio_bf16 - ratio_fp32| <= 1e-3 and the loss within 1e-3 relative, for a policy
    one small update away from π_old (weights perturbed by 1e-3 relative).
    """
    cfg = load_config(ROOT / "recipes" / "gspo_gsm8k.py", [])
    assert cfg.model.compute_dtype == "bfloat16" and cfg.rl.objective.importance_sampling_level == "sequence"
    old_model = llama()
    model = copy.deepcopy(old_model)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + 1e-3 * torch.randn(p.shape, generator=g))
    batch = make_batch([(6, 40)] * 4 + [(3, 25)] * 4)
    adv = torch.randn(8, generator=g)
    rl, temperature = cfg.rl, cfg.rollout.temperature

    def ratios_and_loss(dtype):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            old = sequence_token_logprobs(old_model, batch.input_ids, batch.attention_mask, temperature=temperature,
                                          loss_mask=batch.loss_mask)
            cur = sequence_token_logprobs(model, batch.input_ids, batch.attention_mask, temperature=temperature,
                                          loss_mask=batch.loss_mask)
        assert cur.dtype == torch.float32  # log-probs are float32 whatever the compute dtype
        m = batch.loss_mask
        ratio = (((cur - old) * m).sum(-1) / m.sum(-1)).exp()
        per, _ = clipped_policy_gradient_loss(cur, old, adv, m, epsilon_low=rl.objective.epsilon_low,
                                              epsilon_high=rl.objective.epsilon_high, lower_bound_ratio=rl.objective.lower_bound_ratio,
                                              importance_sampling_level="sequence")
        num, w = reduce_policy_gradient_loss(per, m, rl.objective.loss_type)
        return ratio, float(num / w)

    r32, l32 = ratios_and_loss(torch.float32)
    r16, l16 = ratios_and_loss(torch.bfloat16)
    assert (r32 - 1).abs().max() > 1e-5  # the policies differ
    assert (r16 - r32).abs().max() <= 1e-3
    assert abs(l16 - l32) <= 1e-3 * abs(l32)


def test_engines_never_run_vllm_in_float32_unless_asked():
    from infra.workers.engines import engine_dtype

    gsm8k = ROOT / "recipes" / "gspo_gsm8k.py"
    f32 = ["model.compute_dtype=float32"]
    vllm = load_config(gsm8k, [*f32, "rollout.backend=vllm"])
    assert engine_dtype(vllm, on_gpu=True) == "bfloat16"
    assert engine_dtype(vllm, on_gpu=False) == "float32"  # vLLM's CPU build follows the trainer
    assert engine_dtype(load_config(gsm8k, [*f32, "rollout.backend=vllm", "rollout.dtype=float32"]), True) == "float32"
    assert engine_dtype(load_config(gsm8k, [*f32, "rollout.backend=hf"]), on_gpu=True) == "float32"
