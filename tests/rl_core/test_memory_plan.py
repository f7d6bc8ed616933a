"""The preflight memory plan (rl_core/placement/memory.py) and the GPU-role count (rl_core/preflight/machine.py).

Real computations: the model shapes come from models built on the meta device, the parameter and
AdamW bytes are compared with what a real model and optimizer allocate, the activation formula with
the tensors autograd actually saves (CPU, `saved_tensors_hooks`).
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import weakref
from pathlib import Path

import pytest
import torch

from rl_core.config import load_config
from rl_core.placement import formulas as mem
from rl_core.placement.formulas import ASSUMED_PROMPT_TOKENS, GIB, activation_bytes
from rl_core.placement.memory import memory_plan, plan_for_config
from rl_core.placement.model_shape import model_shape, shape_from_config
from rl_core.preflight.machine import gpu_count_problem, gpu_memory, gpu_roles, gpus_needed, memory_problems

ROOT = Path(__file__).resolve().parents[2]
GRPO = ROOT / "recipes" / "grpo_gsm8k.py"
ARITH = ROOT / "recipes" / "arithmetic.py"
OPD = ROOT / "recipes" / "opd_gsm8k.py"
# Qwen2.5-3B's published dimensions (its config.json on the hub)
QWEN_3B = {"hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
           "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
           "max_position_embeddings": 32768}
# 4 x 80 GB GPUs, vLLM colocated, the GRPO recipe's batch knobs (64 prompts x 8, mini 32, micro 8)
ON_4X80 = ["cluster.gpu_memory_gib=80", "cluster.num_workers=4", "cluster.gpus_per_worker=1",
           "rollout.backend=vllm", "cluster.placement=colocated"]


def no_gpu() -> int | None:
    """The local GPU probe of a machine without one."""
    return None


@pytest.fixture(scope="module")
def qwen3b_dir(tmp_path_factory) -> Path:
    """A directory with only Qwen2.5-3B's config.json (no weights): what the plan reads."""
    from transformers import Qwen2Config

    out = tmp_path_factory.mktemp("qwen2.5-3b-shape")
    Qwen2Config(**QWEN_3B).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from rl_core.model.loading import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def cfg_3b(qwen3b_dir: Path, *overrides: str):
    return load_config(GRPO, [f"model.name_or_path={qwen3b_dir}", *ON_4X80, *overrides])


FP32_UNSHARDED = ("model.compute_dtype=float32", "cluster.sharding=none")
FSDP_BF16_CKPT = ("cluster.sharding=fsdp", "model.compute_dtype=bfloat16", "model.gradient_checkpointing=true")


# ------------------------------------------------------------------------------------ model shape


def test_qwen3b_parameter_count_is_the_published_formula(qwen3b_dir):
    shape = model_shape(str(qwen3b_dir))
    assert shape is not None
    V, h, L, inter = 151936, 2048, 36, 11008
    heads, kv, hd = 16, 2, 2048 // 16
    per_layer = (h * heads * hd + heads * hd  # q_proj (Qwen2 has q/k/v biases)
                 + 2 * (h * kv * hd + kv * hd)  # k_proj, v_proj
                 + heads * hd * h  # o_proj (no bias)
                 + 3 * h * inter  # gate, up, down
                 + 2 * h)  # input and post-attention RMSNorm
    expected = V * h + L * per_layer + h  # embeddings (lm_head tied) + layers + final norm
    assert shape.n_params == expected == 3_085_938_688
    assert shape.n_param_tensors == 1 + L * 12 + 1
    assert (shape.hidden_size, shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim,
            shape.intermediate_size, shape.vocab_size) == (h, L, heads, kv, hd, inter, V)
    assert shape.layer_params == per_layer and shape.root_params == V * h + h
    assert shape.state_elements == expected + V * h  # the tied lm_head is a second name in state_dict()
    assert shape.matmul_params == expected - V * h - L * 2 * h - h + V * h  # Linear params, lm_head included


def test_a_model_neither_local_nor_cached_has_no_shape(tmp_path):
    assert model_shape(str(tmp_path / "missing")) is None
    assert model_shape("posttrain-tests/no-such-model") is None  # HF_HUB_OFFLINE=1: the cache only
    plan, why = plan_for_config(load_config(GRPO, ["model.name_or_path=posttrain-tests/no-such-model"]))
    assert plan is None and "neither a local directory nor in the Hugging Face cache" in why


# --------------------------------------------------------------------------- Qwen2.5-3B on 4 x 80 GB


def test_3b_fp32_unsharded_needs_checkpointing_and_fsdp_bf16_checkpointing_fits(qwen3b_dir):
    cfg = cfg_3b(qwen3b_dir, *FP32_UNSHARDED, "model.gradient_checkpointing=false")
    problems = memory_problems(cfg, probe=no_gpu)
    assert len(problems) == 1, problems
    assert problems[0].startswith("trainer rank (x4): peak ") and "cluster.gpu_memory_gib=80" in problems[0]
    assert "cluster.sharding=fsdp" in problems[0]
    assert "model.gradient_checkpointing=true (" in problems[0] and "fits)" in problems[0]
    # the LM head's chunks for the read tokens, not [8, 1536, V] float32 logits three times over
    assert memory_problems(cfg_3b(qwen3b_dir, *FP32_UNSHARDED, "model.gradient_checkpointing=true"),
                           probe=no_gpu) == []
    assert memory_problems(cfg_3b(qwen3b_dir, *FSDP_BF16_CKPT), probe=no_gpu) == []


def test_3b_plan_items(qwen3b_dir):
    gpu = 80 * GIB
    shape = model_shape(str(qwen3b_dir))
    P = shape.n_params
    full = memory_plan(cfg_3b(qwen3b_dir, *FP32_UNSHARDED, "model.gradient_checkpointing=false"), shape,
                       prompt_tokens=ASSUMED_PROMPT_TOKENS, gpu_bytes=gpu)
    sharded = memory_plan(cfg_3b(qwen3b_dir, *FSDP_BF16_CKPT), shape, prompt_tokens=ASSUMED_PROMPT_TOKENS,
                          gpu_bytes=gpu)
    t_full, t_sh = full.role("trainer"), sharded.role("trainer")
    assert t_full.item("parameters").bytes == 4 * P and t_sh.item("parameters").bytes == P  # 4 B / 4 ranks
    hsdp = memory_plan(cfg_3b(qwen3b_dir, *FSDP_BF16_CKPT, "cluster.sharding=hsdp", "cluster.shard_size=2"), shape,
                       prompt_tokens=ASSUMED_PROMPT_TOKENS, gpu_bytes=gpu).role("trainer")
    assert hsdp.item("parameters").bytes == 2 * P  # 4 B over a shard group of 2: replicated across the 2 groups
    assert hsdp.item("AdamW state").bytes == 4 * P + 4 * 434
    assert t_full.item("AdamW state").bytes == 8 * P + 4 * 434
    assert t_sh.item("AdamW state").bytes == 2 * P + 4 * 434
    assert t_full.item("gradient all-reduce bucket").bytes == 256 * 1024**2
    assert t_full.item("vLLM awake").bytes == int(0.4 * gpu)  # rollout.gpu_memory_utilization default
    # FSDP gathers bf16 layers (MixedPrecisionPolicy): no whole-model bf16 copy on a sharded rank
    assert not any(i.name.startswith("bf16 weight copies") for i in t_sh.items)
    gathered = t_sh.item("FSDP gathered").bytes  # bf16 params + bf16 grads + fp32 reduce input, root + 2 layers
    assert gathered == (2 + 2 + 4) * (shape.root_params + 2 * shape.layer_params) < 2 * shape.matmul_params
    assert t_full.peak > gpu >= t_sh.peak
    assert t_full.peak_phase == mem.FORWARD
    assert t_sh.peak_phase == mem.GENERATE
    # the sync streams: one gathered float32 tensor and one bf16 bucket, into vLLM's weights woken alone (level 2)
    assert t_sh.item("weight sync").bytes == 4 * shape.largest_tensor + min(256 * 1024**2, 2 * shape.state_elements)
    assert t_sh.item("vLLM weights").bytes == 2 * P and t_sh.item("vLLM weights").phases == (mem.SYNC,)
    assert t_sh.phase_bytes()[mem.SYNC] == (t_sh.item("parameters").bytes + t_sh.item("AdamW state").bytes
                                            + mem.RUNTIME_BYTES + mem.NCCL_COMM_BYTES + t_sh.item("weight sync").bytes
                                            + 2 * P + mem.GIB + 2 * shape.largest_tensor)  # asleep, one staged tensor
    # what sleep cannot free (CUDA graphs, buffers) is held in every phase but generation, inside the reservation then
    asleep = t_sh.item("vLLM asleep")
    assert asleep.bytes == mem.vllm_asleep_bytes(shape, 2) == mem.GIB and mem.GENERATE not in asleep.phases
    assert set(asleep.phases) == set(t_sh.phases) - {mem.GENERATE}
    # gradients never meet the rollout: the generation phase holds parameters, optimizer and vLLM
    gen = t_sh.phase_bytes()[mem.GENERATE]
    assert gen == (t_sh.item("parameters").bytes + t_sh.item("AdamW state").bytes + mem.RUNTIME_BYTES + mem.NCCL_COMM_BYTES
                   + t_sh.item("vLLM awake").bytes)
    # the fused LM head, by hand: 8 rows x 1024 response tokens read, chunks of 2^24 // V positions
    V, h, K = QWEN_3B["vocab_size"], QWEN_3B["hidden_size"], 8 * 1024
    chunk = (2**24 // V) * V
    head = 2 * 4 * chunk + K * (4 * h + 12) + 4 * V * h  # two float32 chunks, kept hidden + 3 floats, grad acc
    assert t_full.item("LM head").bytes == head
    assert t_sh.item("LM head").bytes == head + 2 * V * h  # + the bf16 cast of the head weight
    # checkpointing keeps each layer's input instead of its activations
    act_full = activation_bytes(shape, 8, 1536, 2, False)
    act_ckpt = activation_bytes(shape, 8, 1536, 2, True)
    assert act_ckpt < act_full / 10


def test_nccl_buffers_count_the_communicators_of_each_process(qwen3b_dir):
    gpu, shape = 80 * GIB, model_shape(str(qwen3b_dir))

    def plan(*overrides):
        return memory_plan(cfg_3b(qwen3b_dir, *FSDP_BF16_CKPT, *overrides), shape,
                           prompt_tokens=ASSUMED_PROMPT_TOKENS, gpu_bytes=gpu)

    assert plan().role("trainer").item("NCCL buffers").bytes == mem.NCCL_COMM_BYTES == 256 * 1024**2  # the FSDP group
    assert plan("cluster.sharding=hsdp", "cluster.shard_size=2").role("trainer").item("NCCL buffers").bytes == \
        3 * mem.NCCL_COMM_BYTES  # + the mesh's replicate and shard groups
    separate = plan("cluster.placement=separate", "rollout.num_engines=1", "cluster.gpus_per_engine=2")
    assert separate.role("trainer").item("NCCL buffers").bytes == 2 * mem.NCCL_COMM_BYTES  # + weight sync
    assert separate.role("engine").item("NCCL buffers").bytes == 2 * mem.NCCL_COMM_BYTES  # weight sync + TP
    alone = plan("cluster.num_workers=1", "cluster.sharding=none")
    assert not any(i.name.startswith("NCCL") for i in alone.role("trainer").items)  # one rank, colocated: none


def test_host_memory_of_a_node_is_planned_and_a_plan_over_its_ram_refused(qwen3b_dir):
    from rl_core.placement.host_memory import EXPORT, PROCESS_BYTES, START, TRAIN

    shape = model_shape(str(qwen3b_dir))
    P, T = shape.n_params, shape.n_param_tensors
    unsharded = cfg_3b(qwen3b_dir, *FP32_UNSHARDED, "model.gradient_checkpointing=true", "cluster.host_memory_gib=48")
    host = plan_for_config(unsharded, 80 * GIB, host_bytes=48 * GIB, host_source="x")[0].host
    assert host.ranks_per_node == 4  # local Ray: the 4 ranks on this node
    moments = host.moment_bytes()
    assert moments[START] == 4 * PROCESS_BYTES + 4 * 4 * P  # every rank reads the float32 model before its GPU
    assert moments[TRAIN] == 4 * PROCESS_BYTES + 4 * (-(-12 * P // 4) + 4 * T)  # the replicas split the staging
    assert moments[EXPORT] == 4 * PROCESS_BYTES + min(4 * P, 5 * 10**9)
    (problem,) = memory_problems(unsharded, probe=no_gpu)  # the GPU fits; one node's host memory does not
    assert problem.startswith(f"host memory: the peak of one node, {moments[START] / GIB:.2f} GiB in the start-up")
    assert "cluster.sharding=fsdp (peak " in problem and "cluster.host_memory_gib=48" in problem

    sharded = cfg_3b(qwen3b_dir, *FSDP_BF16_CKPT, "cluster.host_memory_gib=48")
    host = plan_for_config(sharded, 80 * GIB, host_bytes=48 * GIB, host_source="x")[0].host
    moments = host.moment_bytes()
    assert moments[START] == 4 * PROCESS_BYTES + 4 * P  # rank 0 alone reads it
    assert moments[TRAIN] == 4 * PROCESS_BYTES + 4 * (-(-12 * P // 4) + 4 * T)  # each rank its shards
    assert moments[EXPORT] == 4 * PROCESS_BYTES + 4 * P  # rank 0 gathers the float32 model
    assert memory_problems(sharded, probe=no_gpu) == []
    # this machine's RAM counts only when the plan's GPU is this machine's own
    plain = cfg_3b(qwen3b_dir, *FP32_UNSHARDED, "model.gradient_checkpointing=true")
    assert memory_problems(plain, probe=no_gpu, host_probe=lambda: 16 * GIB) == []  # gpu_memory_gib: not this one
    local = plain.model_copy(update={"cluster": plain.cluster.model_copy(update={"gpu_memory_gib": None})})
    problems = memory_problems(local, probe=lambda: 80 * GIB, host_probe=lambda: 16 * GIB)
    assert any(p.startswith("host memory") and "this machine's RAM" in p for p in problems), problems
    # on a Ray cluster: a node holds as many ranks as 8 GPUs allow, or a shard group under hsdp
    remote = cfg_3b(qwen3b_dir, *FSDP_BF16_CKPT, "cluster.num_workers=16", "cluster.gpus_per_worker=2")
    assert plan_for_config(remote, 80 * GIB, remote_ray=True)[0].host.ranks_per_node == 4
    hsdp = cfg_3b(qwen3b_dir, *FSDP_BF16_CKPT, "cluster.num_workers=16", "cluster.sharding=hsdp",
                  "cluster.shard_size=8")
    assert plan_for_config(hsdp, 80 * GIB, remote_ray=True)[0].host.ranks_per_node == 8


def test_knobs_already_set_are_not_suggested(qwen3b_dir):
    cfg = cfg_3b(qwen3b_dir, *FSDP_BF16_CKPT, "cluster.gpu_memory_gib=24")
    (problem,) = memory_problems(cfg, probe=no_gpu)
    for knob in ("cluster.sharding", "model.compute_dtype", "model.gradient_checkpointing"):
        assert knob not in problem, problem
    knobs = problem.split("(the peak each gives alone): ")[1]
    assert knobs.startswith("cluster.num_workers=8 (") and ", fits)" in knobs, problem


def test_vllm_weights_must_fit_its_reservation(qwen3b_dir):
    cfg = cfg_3b(qwen3b_dir, *FSDP_BF16_CKPT, "rollout.gpu_memory_utilization=0.05")  # 4 GiB < 5.75 GiB of bf16
    problems = memory_problems(cfg, probe=no_gpu)
    assert any("do not fit its reservation" in p and "set rollout.gpu_memory_utilization=0." in p for p in problems)


def test_opd_teacher_and_separate_engines_are_planned(qwen3b_dir):
    cfg = load_config(OPD, [f"model.name_or_path={qwen3b_dir}", f"model.teacher={qwen3b_dir}",
                            "cluster.gpu_memory_gib=80"])
    plan, _ = plan_for_config(cfg, 80 * GIB)
    trainer = plan.role("trainer")  # a teacher copy lives on each rank's GPU, resident in every phase
    assert trainer.item("teacher weights").bytes == 2 * plan.shape.n_params and trainer.gpus == 1
    assert trainer.item("teacher weights").phases is None and mem.SCORE in trainer.phases
    assert [r.key for r in plan.roles] == ["trainer"]  # no teacher GPU of its own
    assert mem.SCORE in trainer.item("vLLM awake").phases  # colocated vLLM sleeps only when the train step starts
    doubled, _ = plan_for_config(cfg.model_copy(update={"cluster": cfg.cluster.model_copy(
        update={"teacher_replicas": 2 * cfg.cluster.num_workers})}), 80 * GIB)
    two = doubled.role("trainer")  # two replicas per rank: two copies, and each scores half the rows
    assert two.item("teacher weights").bytes == 2 * trainer.item("teacher weights").bytes
    assert two.item("teacher CUDA runtime").bytes == 2 * mem.RUNTIME_BYTES
    assert two.peak > trainer.peak
    cfg = cfg_3b(qwen3b_dir, *FSDP_BF16_CKPT, "cluster.placement=separate", "rollout.num_engines=2",
                 "cluster.gpus_per_engine=1")
    plan, _ = plan_for_config(cfg, 80 * GIB)
    engine = plan.role("engine")
    assert engine.processes == 2  # each loads the broadcast one bucket at a time while the next is received
    bucket = min(256 * 1024**2, 2 * plan.shape.state_elements)
    assert engine.item("received buckets, two in flight").bytes == 2 * bucket
    # rank 0 packs the next bf16 bucket while one is broadcast: one gathered float32 tensor and two buckets
    sender = plan.role("trainer").item("weight sync")
    assert "two bfloat16 buckets" in sender.name and sender.bytes == 4 * plan.shape.largest_tensor + 2 * bucket
    tp = plan_for_config(cfg_3b(qwen3b_dir, *FSDP_BF16_CKPT, "cluster.placement=separate", "rollout.num_engines=1",
                                "cluster.gpus_per_engine=2"), 80 * GIB)[0].role("engine")
    assert tp.gpus == 2 and tp.vllm_weights == plan.shape.n_params  # bf16 weights split over 2 GPUs
    # each tensor-parallel worker is a rank of the weight-sync group: the two buckets in flight are on each GPU
    assert tp.item("received buckets, two in flight on each worker's GPU").bytes == 2 * bucket
    assert any("tensor parallel (2 GPUs per engine): each of the 2 workers is a rank of the weight-sync group" in note
               for note in tp.notes)
    assert mem.GENERATE not in plan.role("trainer").phases  # the engines are not on the trainer's GPU
    assert "rollout engine (vllm, separate) (x2, 1 GPU each)" in plan.render()


def test_a_cpu_run_is_never_enforced_and_a_local_gpu_is_read(tiny_dir):
    cpu = load_config(ARITH, [f"model.name_or_path={tiny_dir}", "cluster.gpu_memory_gib=0.001"])
    assert memory_problems(cpu, probe=lambda: 1024) == []  # no GPU role: nothing to enforce
    gpu = load_config(ARITH, [f"model.name_or_path={tiny_dir}", "cluster.gpus_per_worker=1"])
    assert memory_problems(gpu, probe=no_gpu) == []  # GPU memory unknown: printed, not enforced
    assert gpu_memory(gpu, probe=lambda: 80 * GIB) == (80 * GIB, "this machine's GPU 0")
    assert gpu_memory(gpu, probe=lambda: 80 * GIB, remote_ray=True)[0] is None  # the Ray cluster's GPUs
    (problem,) = memory_problems(gpu, probe=lambda: GIB // 2)  # half a GiB: the CUDA runtime alone is 1 GiB
    assert problem.startswith("trainer rank (x1)") and "this machine's GPU 0" in problem


# ------------------------------------------------------------------- exact bytes of the tiny model


def test_parameter_gradient_and_adamw_bytes_equal_what_the_tiny_model_allocates(tiny_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
    opt.step()
    params = list(model.parameters())
    param_bytes = sum(p.nbytes for p in params)
    grad_bytes = sum(p.grad.nbytes for p in params)
    opt_bytes = sum(t.nbytes for state in opt.state.values() for t in state.values() if torch.is_tensor(t))
    assert len(opt.state) == len(params) and all(s["step"].dtype == torch.float32 for s in opt.state.values())

    cfg = load_config(ARITH, [f"model.name_or_path={tiny_dir}"])
    plan, why = plan_for_config(cfg)
    assert plan is not None, why
    trainer = plan.role("trainer")
    assert trainer.item("parameters").bytes == param_bytes
    assert trainer.item("gradients").bytes == grad_bytes
    assert trainer.item("AdamW state").bytes == opt_bytes
    assert plan.shape.n_params == sum(p.numel() for p in params)


# ---------------------------------------------------------------- activations: what autograd keeps


def _live_after_forward(model, rows: int, seq: int, dtype: torch.dtype | None) -> tuple[int, int]:
    """What a training forward leaves alive for backward, measured on CPU: `(activation bytes, bf16 weight casts)`.

    Every tensor the forward creates is watched (a TorchDispatchMode keeping weak references); after
    the forward, still inside autocast as in the trainer, the live ones are what autograd saved (or,
    checkpointed, what the checkpoints keep) plus autocast's weight casts. Parameters, the logits
    (planned separately) and the inputs made outside the forward are not counted.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    from rl_core.primitives.logprobs import read_positions, unpad

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    casts: set[int] = set()
    made: list[tuple[weakref.ref, int, int]] = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    made.append((weakref.ref(t), t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
            if func is torch.ops.aten._to_copy.default and args[0].untyped_storage().data_ptr() in params:
                casts.add(out.untyped_storage().data_ptr())
            return out

    ids = torch.randint(0, model.config.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(rows, seq, dtype=torch.long)
    mask[0, :3] = 0  # left padding, as in a batch of completions
    u = unpad(ids, mask, read_positions(mask, None), "rows")  # the trainer's unpadded forward: no attention mask
    with torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext():
        with Watch():
            out = model(input_ids=u.input_ids, position_ids=u.position_ids, use_cache=False)
        gc.collect()
        live: dict[int, int] = {}
        for ref, ptr, nbytes in made:
            if ref() is not None and ptr not in params and ptr != out.logits.untyped_storage().data_ptr():
                live[ptr] = nbytes
    return (sum(n for p, n in live.items() if p not in casts), sum(n for p, n in live.items() if p in casts))


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["qwen2-gqa", "tiny-llama"])
def test_activation_formula_matches_what_the_forward_keeps(arch, compute, checkpointing, tiny_dir):
    from transformers import AutoModelForCausalLM, Qwen2Config

    if arch == "tiny-llama":
        model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(Qwen2Config(
            hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=100, tie_word_embeddings=True, max_position_embeddings=64))
    model.config._attn_implementation = "sdpa"
    model.train()
    if checkpointing:  # as infra.workers.policy.build_trainer does
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    shape = shape_from_config(model.config)
    rows, seq, c = 3, 12, 2 if compute == "bfloat16" else 4
    measured, casts = _live_after_forward(model, rows, seq, torch.bfloat16 if c == 2 else None)
    planned = activation_bytes(shape, rows, seq, c, checkpointing)
    tokens = rows * seq
    expected = planned - 8 * tokens  # the plan counts the ids, made outside the forward here
    if checkpointing:  # the layer recomputed in backward is not alive after the forward
        expected -= tokens * mem.layer_activation_bytes(shape, c)
    assert measured == expected, (measured, expected)
    # bf16: autocast's copies of every Linear weight and bias stay alive until the autocast region ends
    assert casts == (2 * shape.matmul_params if c == 2 else 0)


# ------------------------------------------------------------------------------ GPU role counting


def test_every_gpu_role_is_counted():
    opd = load_config(OPD, ["cluster.num_workers=4", "cluster.gpus_per_worker=1"])
    assert gpus_needed(opd) == 4 and [g for _, g in gpu_roles(opd)] == [4]  # the teachers share the ranks' GPUs
    separate = load_config(GRPO, ["cluster.num_workers=2", "cluster.placement=separate", "rollout.num_engines=2",
                                  "cluster.gpus_per_engine=1"])
    assert gpus_needed(separate) == 4
    halves = load_config(GRPO, ["cluster.num_workers=1", "cluster.placement=separate", "rollout.num_engines=3",
                                "cluster.gpus_per_engine=0.5"])
    assert gpus_needed(halves) == 3  # 1 + 1.5, rounded up
    assert gpus_needed(load_config(ARITH, [])) == 0 and gpu_roles(load_config(ARITH, [])) == []
    colocated = load_config(GRPO, [])  # colocated engines live in the trainer ranks' GPUs
    assert gpus_needed(colocated) == 4


def test_the_gpu_count_message_lists_each_role_and_the_fix():
    opd = load_config(OPD, ["cluster.num_workers=4", "cluster.gpus_per_worker=1"])
    message = gpu_count_problem(opd, have=3)
    assert message.startswith("4 (trainer ranks: cluster.num_workers=4 x cluster.gpus_per_worker=1) need 4 GPUs; "
                              "this machine has 3; ")
    assert "set cluster.num_workers=3" in message
    assert gpu_count_problem(opd, have=4) is None
    separate = load_config(GRPO, ["cluster.num_workers=2", "cluster.placement=separate", "rollout.num_engines=2",
                                  "cluster.gpus_per_engine=1"])
    message = gpu_count_problem(separate, have=3)
    assert "+ 2 (rollout engines: 2 (rollout.num_engines) x cluster.gpus_per_engine=1) need 4 GPUs" in message
    assert "set cluster.num_workers=1" in message and "rollout.num_engines" in message
    assert "no GPU on this machine" in gpu_count_problem(separate, have=0)


def test_num_engines_rule():
    from rl_core.placement.run_shape import num_engines

    cases = {(): 4, ("cluster.num_workers=2",): 2, ("cluster.placement=separate",): 1,  # the recipe has 4 ranks
             ("cluster.placement=separate", "rollout.num_engines=3"): 3}
    for overrides, expected in cases.items():
        assert num_engines(load_config(GRPO, list(overrides))) == expected


def test_the_plan_constants_are_the_code_s():
    from infra.workers.distributed import BUCKET_BYTES
    from rl_core.evaluation.heldout import evaluate_accuracy
    from rl_core.training.trainer import LLMTrainer

    assert mem.GRAD_BUCKET_BYTES == LLMTrainer.GRAD_BUCKET_BYTES
    assert mem.WIRE_BUCKET_BYTES == BUCKET_BYTES
    assert mem.EVAL_PROMPTS_PER_CALL == inspect.signature(evaluate_accuracy).parameters["batch_size"].default
    dpo_flow = (ROOT / "flows" / "dpo.py").read_text()
    assert f"REFERENCE_CHUNK_ROWS = {mem.REFERENCE_CHUNK_ROWS}" in dpo_flow


# ----------------------------------------------------------------------------------- posttrain validate


def test_validate_prints_the_plan(qwen3b_dir, capsys):
    from cli.main import main

    code = main(["validate", "--no-env", str(GRPO), "--", f"model.name_or_path={qwen3b_dir}", *ON_4X80, *FSDP_BF16_CKPT])
    out = capsys.readouterr()
    assert code == 0, out.err
    plan = out.out[out.out.index("preflight: ok"):]
    assert "memory plan (per process" in plan and "Qwen2ForCausalLM 3.09B params" in plan
    assert "80.00 GiB per GPU (cluster.gpu_memory_gib=80)" in plan
    assert "trainer rank (x4, 1 GPU each)" in plan and "1/4 shard (FSDP)" in plan
    assert "of 72.00 GiB usable (90% of its GPU): fits" in plan

    code = main(["validate", "--no-env", str(GRPO), "--", f"model.name_or_path={qwen3b_dir}", *ON_4X80, *FP32_UNSHARDED,
                 "model.gradient_checkpointing=false"])
    out = capsys.readouterr()
    assert code == 1 and "DOES NOT FIT" in out.out
    assert "memory error: trainer rank (x4)" in out.err and "cluster.sharding=fsdp" in out.err


def test_validate_says_why_there_is_no_plan(capsys):
    from cli.main import main

    code = main(["validate", "--no-env", str(GRPO), "--", "model.name_or_path=posttrain-tests/no-such-model"])
    out = capsys.readouterr()
    assert code == 0
    assert "memory plan: none (model.name_or_path='posttrain-tests/no-such-model' is neither a local directory " \
           "nor in the Hugging Face cache" in out.out


def test_the_flow_rechecks_the_plan_with_the_data_s_longest_prompt(qwen3b_dir):
    """A config that fits at the assumed prompt length is refused once the data's prompts turn out long."""
    from rl_core.config import ConfigError
    from rl_core.preflight.machine import check_memory

    cfg = cfg_3b(qwen3b_dir, *FSDP_BF16_CKPT)
    assert memory_problems(cfg, probe=no_gpu) == []  # 512 assumed prompt tokens: fits
    check_memory(cfg, prompt_tokens=200)  # a GSM8K-sized prompt: fits, no error
    with pytest.raises(ConfigError, match=r"longest prompt \(20000 tokens\)") as err:
        check_memory(cfg, prompt_tokens=20000)
    assert "trainer rank (x4)" in str(err.value) and "rl.micro_batch_per_replica" in str(err.value)


def test_ppo_plans_the_critic_on_every_rank_sharded_like_the_policy(qwen3b_dir):
    """The critic's float32 weights and AdamW state stay resident (the policy's shape, 16 B a parameter sharded
    like the policy's); its gradients and activations live in its own phase V, where the policy's are released."""
    grpo = plan_for_config(cfg_3b(qwen3b_dir, *FSDP_BF16_CKPT), 80 * GIB)[0].role("trainer")
    cfg = cfg_3b(qwen3b_dir, *FSDP_BF16_CKPT, "rl.objective={type: ppo}", "rollout.n=1", "rollout.prompts_per_step=64")
    plan, _ = plan_for_config(cfg, 80 * GIB)
    trainer = plan.role("trainer")
    p, t, shards = plan.shape.n_params, plan.shape.n_param_tensors, cfg.cluster.num_workers
    assert mem.CRITIC in trainer.phases and mem.CRITIC not in grpo.phases
    assert trainer.item("critic parameters").bytes == -(-4 * p // shards) and trainer.item("critic parameters").phases is None
    assert trainer.item("critic AdamW state").bytes == -(-8 * p // shards) + 4 * t
    gradients, activations = trainer.item("critic gradients"), trainer.item("critic activations")
    assert gradients.phases == activations.phases == (mem.CRITIC,)
    assert activations.bytes == trainer.item("activations").bytes  # the same micro-batch through the same backbone
    assert not any(it.name.startswith("critic") for it in grpo.items)
    from rl_core.placement.host_memory import TRAIN

    # on the host: the checkpoint stages the critic's shards beside the policy's, as many bytes
    staged = [it.bytes for it in plan.host.items if it.name.startswith("checkpoint staging copy")]
    assert len(staged) == 2 and staged[0] == staged[1] > 0
    grpo_host = plan_for_config(cfg_3b(qwen3b_dir, *FSDP_BF16_CKPT), 80 * GIB)[0].host
    assert plan.host.moment_bytes()[TRAIN] - grpo_host.moment_bytes()[TRAIN] == staged[1]
    in_v = {it.name for it in trainer.items if it.phases and mem.CRITIC in it.phases}
    assert {name.split(":")[0] for name in in_v} == {  # no policy gradient, activation or awake engine
        "critic gradients", "critic activations", "critic FSDP gathered", "critic AdamW step temporary", "vLLM asleep"}


def test_a_lora_critic_trains_its_adapters_and_value_head(qwen3b_dir):
    from rl_core.model.lora import adapter_counts

    cfg = cfg_3b(qwen3b_dir, "cluster.sharding=none", "model.compute_dtype=bfloat16", "model.lora.r=16",
                 "rl.objective={type: ppo}", "rollout.n=1", "rollout.prompts_per_step=64")
    plan, _ = plan_for_config(cfg, 80 * GIB)
    trainer = plan.role("trainer")
    adapters, tensors = adapter_counts(plan.shape.linears, cfg.model.lora)
    trained = adapters + plan.shape.hidden_size + 1  # the head's weight and bias train whole
    assert trainer.item("critic gradients").bytes == 4 * trained
    assert trainer.item("critic AdamW state").bytes == 8 * trained + 4 * (tensors + 2)
    assert trainer.item("critic parameters").bytes == 4 * (plan.shape.n_params + adapters)
