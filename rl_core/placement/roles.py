"""What one process of each role holds: a trainer rank (with its colocated engine and OPD teachers) and a
separate rollout engine, itemised per phase of a step (see `rl_core.placement.memory`)."""

from __future__ import annotations

import math

from rl_core.config.schema import PosttrainConfig
from rl_core.model.lora import adapter_counts
from rl_core.placement.formulas import (
    CRITIC,
    FORWARD,
    FSDP_LAYERS_IN_FLIGHT,
    GENERATE,
    GIB,
    GRAD_BUCKET_BYTES,
    NCCL_COMM_BYTES,
    REFERENCE,
    REFERENCE_CHUNK_ROWS,
    REWARD,
    RUNTIME_BYTES,
    SCORE,
    STEP,
    SYNC,
    VLLM_ASLEEP_FLOOR_BYTES,
    WIRE_BUCKET_BYTES,
    activation_bytes,
    compute_bytes,
    generation_rows,
    kv_cache_bytes,
    logits_bytes,
    micro_batch_rows,
    micro_batch_tokens,
    nograd_forward_bytes,
    vllm_asleep_bytes,
    vllm_asleep_parts,
    vllm_reload_bytes,
)
from rl_core.placement.items import RolePlan, gib, params_text
from rl_core.placement.model_shape import ModelShape
from rl_core.placement.run_shape import (
    num_engines,
    rows_per_prompt,
    shard_mesh,
    teacher_replicas,
    teachers_per_rank,
    tensor_parallel_size,
)

RELOAD_ITEM = "vLLM reload: one layer's weights staged anew (layer-by-layer reload)"
RELOAD_NOTE = ("each module is materialised, loaded and copied into the engine's own weights: the larger of a decoder "
               "layer and the embedding")


def vllm_reservation(cfg: PosttrainConfig, gpu_bytes: int | None) -> int:
    """vLLM's budget on one GPU: `rollout.gpu_memory_utilization` of it (0 when the GPU's memory is unknown)."""
    return int(cfg.rollout.gpu_memory_utilization * gpu_bytes) if gpu_bytes else 0


def trainer_role(cfg: PosttrainConfig, s: ModelShape, prompt: int, gpu_bytes: int | None,
             ref: ModelShape) -> RolePlan:
    """One trainer rank: its training state, activations, reference, weight-sync buffers and, colocated, its
    rollout engine; `ref` is the frozen reference's shape."""
    cl, offline = cfg.cluster, cfg.rl.objective.topology == "offline"
    policy = cfg.rl.objective.trains_policy  # else a reward model: no engine, no sync, no LM head
    scores_pairs = offline and cfg.rl.objective.reads_reference  # DPO: the reference scores every pair once
    n = cl.num_workers
    mesh = shard_mesh(cfg)  # None: one full replica per rank (infra.workers.policy.build_trainer)
    fsdp = mesh is not None
    div = mesh[1] if fsdp else 1  # the state is split over a shard group (every rank under fsdp)
    c, seq, rows = compute_bytes(cfg), prompt + cfg.rollout.max_tokens, micro_batch_rows(cfg)
    on_gpu, colocated = cl.gpus_per_worker > 0, cl.placement == "colocated" and policy
    phases = [FORWARD, STEP] + ([SYNC] if policy else []) + ([GENERATE] if colocated else []) \
        + ([REFERENCE] if scores_pairs else [])
    role = RolePlan("trainer", "trainer rank", n, cl.gpus_per_worker, tuple(phases))
    P, T = s.n_params, s.n_param_tensors
    shard = (f", 1/{div} shard ({cl.sharding.upper()})") if fsdp else ""
    A, TA = adapter_counts(s.linears, cfg.model.lora)  # LoRA: the trained parameters are the adapters'
    G, TG = (A, TA) if A else (P, T)  # what has gradients and AdamW state
    what = f" (LoRA r={cfg.model.lora.r}: adapters only, {params_text(A)})" if A else ""

    role.add(f"parameters: float32 master weights{shard}" + (f" + LoRA adapters ({params_text(A)})" if A else ""),
             math.ceil(4 * (P + A) / div))
    if fsdp:
        role.notes.append("built sharded (infra.workers.sharded_load.load_sharded_policy): a meta-device skeleton on every "
                          "rank, each rank reading its own rows of each tensor from the local safetensors (rank 0 "
                          "loads and broadcasts tensor by tensor for a hub id or a converted layout), so no rank ever "
                          "holds the whole model on its GPU; the final export gathers it tensor by tensor into rank "
                          "0's host memory (the host table)")
    role.add(f"gradients: float32{shard}{what}", math.ceil(4 * G / div), (FORWARD, STEP),
             "released after each step")
    role.add(f"AdamW state: exp_avg + exp_avg_sq float32{shard}, step 4 B x {TG} tensors{what}",
             math.ceil(8 * G / div) + 4 * TG)
    if on_gpu:
        role.add("CUDA runtime: context, cuBLAS/NCCL workspaces", RUNTIME_BYTES)
        comms = [name for name, present in (("data-parallel group", n > 1), ("HSDP's two mesh groups", cl.sharding == "hsdp"),
                                            ("weight-sync group (rank 0)", not colocated and cl.gpus_per_engine > 0))
                 if present]
        count = len(comms) + (1 if cl.sharding == "hsdp" else 0)
        if count:
            role.add(f"NCCL buffers: {count} communicator(s): {', '.join(comms)}", count * NCCL_COMM_BYTES, None,
                     "16 channels x 4 MiB (NCCL_BUFFSIZE) each way to both ring neighbours")
    if c == 2 and not fsdp:
        role.add("bf16 weight copies: autocast casts of every Linear weight", 2 * s.matmul, (FORWARD,),
                 "held from forward to backward")
    if fsdp:  # infra.workers.distributed.shard_policy: MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=float32)
        per = 2 * c + (4 if c == 2 else 0)
        role.add(f"FSDP gathered: root + {FSDP_LAYERS_IN_FLIGHT} layers' params and grads in "
                 f"{cfg.model.compute_dtype}{', + float32 reduce-scatter input' if c == 2 else ''}",
                 per * (s.root_params + FSDP_LAYERS_IN_FLIGHT * s.layer), (FORWARD,))
    ckpt = cfg.model.gradient_checkpointing
    tokens, read = micro_batch_tokens(cfg, rows, seq)
    role.add(f"activations: {tokens} tokens{', checkpointed per layer' if ckpt else ''}",
             activation_bytes(s, 1, tokens, c, ckpt), (FORWARD,))
    head_trained = cfg.model.lora.r == 0  # LoRA adapts the Linears below the head; the head stays frozen
    if policy:
        role.add(f"LM head, fused: float32 chunks, {read} read tokens' hidden states"
                 f"{', head-weight gradient' if head_trained else ' (frozen under LoRA: no weight gradient)'}",
                 logits_bytes(s, read, c, True, head_trained), (FORWARD,))
    else:
        role.notes.append("a reward model: its score head gives one number per token (no vocabulary-wide logits), "
                          "and no rollout engine nor weight sync sits beside it")
    if not fsdp and n > 1:
        role.add("gradient all-reduce bucket", min(GRAD_BUCKET_BYTES, 4 * G), (STEP,))
    if on_gpu:  # torch's foreach AdamW (the default on CUDA) allocates sqrt(exp_avg_sq) for all params
        role.add(f"AdamW step temporary: foreach sqrt(exp_avg_sq){shard}", math.ceil(4 * G / div), (STEP,))

    # -- the frozen reference (LoRA without rl.reference: the base with the adapter disabled, no copy)
    own_reference = not (A and cfg.rl.reference is None)
    if own_reference and not offline and cfg.rl.objective.reads_reference:  # the KL anchor
        role.add(f"reference model: frozen, {cfg.model.compute_dtype}", ref.n_params * c, None,
                 "every rank holds it whole")
    if scores_pairs:
        chunk = cfg.rl.micro_batch_per_replica or REFERENCE_CHUNK_ROWS
        if own_reference:
            role.add(f"reference model: frozen, {cfg.model.compute_dtype}", ref.n_params * c, (REFERENCE,),
                     "rank 0 scores every pair once, then frees it")
        role.add(f"reference scoring: fused LM head, {chunk} rows + one layer",
                 logits_bytes(ref, chunk * cfg.rollout.max_tokens, c, False)
                 + nograd_forward_bytes(ref, chunk, seq, c, c, mask=False), (REFERENCE,))

    if not policy:
        return role
    # -- weight sync (LoRA: vLLM takes the adapters, HF engines the merged weights)
    state_c = s.state * c
    if A and cfg.rollout.backend == "vllm":
        state_c = A * c
    elif A and (not colocated or fsdp):
        role.add(f"LoRA merged weights: full state in {cfg.model.compute_dtype}", state_c, (SYNC,),
                 "W + (alpha/r) B A of every adapted weight, sent to the HF engines")
    # infra.workers.distributed.WeightStream: one bucket packed for a colocated engine; two to separate engines (the next
    # is packed while one is broadcast)
    bucket = (1 if colocated else 2) * min(WIRE_BUCKET_BYTES, state_c)
    packed = f"one {cfg.model.compute_dtype} bucket" if colocated else f"two {cfg.model.compute_dtype} buckets"
    if fsdp:  # LLMTrainer.iter_full_model_state: each tensor gathered in float32, cast and packed, then dropped
        role.add(f"weight sync: one gathered float32 tensor + the {packed} it is packed into",
                 4 * s.largest + bucket, (SYNC,),
                 "the engine loads each bucket as it arrives" if colocated else "every rank gathers, rank 0 sends")
    elif not colocated or cfg.rollout.backend == "vllm":
        role.add(f"weight sync: {packed}, cast and packed" + ("" if colocated else " (rank 0)"), bucket, (SYNC,))

    # -- the colocated engine
    if colocated:
        engines = n
        if cfg.rollout.backend == "vllm":
            if on_gpu:
                res = vllm_reservation(cfg, gpu_bytes)
                role.vllm_reservation, role.vllm_weights = (res if gpu_bytes else None), s.n_params * c
                asleep = tuple(p for p in role.phases if p != GENERATE)  # awake, the reservation holds them
                parts = " + ".join(f"{name} {gib(b)}" for name, b in vllm_asleep_parts(s, c).items())
                role.add("vLLM asleep: persistent buffers and CUDA graphs (no sleep level frees them)",
                         vllm_asleep_bytes(s, c), asleep, f"estimate: {parts} GiB, at least "
                         f"{VLLM_ASLEEP_FLOOR_BYTES / GIB:g} GiB; measured as the engine starts: placement.json's "
                         "vllm_asleep_resident_gib")
                if A:  # sleep level 1: the base weights wait in host memory; the sync wakes it whole to add adapters
                    role.add(f"vLLM awake: gpu_memory_utilization {cfg.rollout.gpu_memory_utilization:g} x GPU "
                             "(weights + KV cache)", res, (SYNC, GENERATE),
                             "" if gpu_bytes else "GPU memory unknown: not counted")
                    role.notes.append("vLLM sleeps (level 1: weights to host memory, KV cache freed) during the "
                                      "train step and wakes for the sync")
                else:  # sleep level 2; the sync wakes the weights only, loads them, then the KV cache
                    role.add(f"vLLM weights: {cfg.model.compute_dtype}, woken for the sync (KV cache still freed)",
                             s.n_params * c, (SYNC,))
                    role.add(RELOAD_ITEM, vllm_reload_bytes(s, c), (SYNC,), RELOAD_NOTE)
                    role.add(f"vLLM awake: gpu_memory_utilization {cfg.rollout.gpu_memory_utilization:g} x GPU "
                             "(weights + KV cache)", res, (GENERATE,), "" if gpu_bytes else "GPU memory unknown: not counted")
                    role.vllm_phases = (GENERATE,)
                    role.notes.append("vLLM sleeps (level 2: weights and KV cache freed, nothing kept in host memory) "
                                      "during the train step; the sync wakes its weights, streams the new ones in, "
                                      "then wakes the KV cache")
            else:
                role.notes.append("vLLM's CPU build keeps its KV cache in host memory (VLLM_CPU_KVCACHE_SPACE): "
                                  "not planned")
        else:
            g_rows = generation_rows(cfg, engines)
            if fsdp:
                role.add(f"HF engine's own weights: {cfg.model.compute_dtype}", s.n_params * c)
            elif c == 2:
                role.add("HF sampling under autocast: bf16 casts of the Linear weights", 2 * s.matmul,
                         (GENERATE,), "the engine samples from the trainer's float32 model")
            role.add(f"HF KV cache: {g_rows} rows x {seq} tokens", kv_cache_bytes(s, g_rows, seq, c), (GENERATE,))
            role.add(f"HF prefill: one layer, {g_rows} rows x {prompt} prompt tokens",
                     nograd_forward_bytes(s, g_rows, prompt, c, c if fsdp else 4), (GENERATE,))
    return role


def engine_role(cfg: PosttrainConfig, s: ModelShape, prompt: int, gpu_bytes: int | None) -> RolePlan:
    """One separate rollout engine (`cluster.placement=separate`): its weights, KV cache and received weights."""
    cl = cfg.cluster
    count, c, seq = num_engines(cfg), compute_bytes(cfg), prompt + cfg.rollout.max_tokens
    on_gpu, tp = cl.gpus_per_engine > 0, tensor_parallel_size(cfg)
    role = RolePlan("engine", f"rollout engine ({cfg.rollout.backend}, separate)", count, cl.gpus_per_engine,
                    (SYNC, GENERATE))
    if on_gpu:
        role.add("CUDA runtime: context, cuBLAS/NCCL workspaces", RUNTIME_BYTES)
        count = 1 + (1 if tp > 1 else 0)
        role.add(f"NCCL buffers: the weight-sync group{' + the tensor-parallel group' if tp > 1 else ''}",
                 count * NCCL_COMM_BYTES, None, "16 channels x 4 MiB (NCCL_BUFFSIZE) each way to both ring neighbours")
    if cfg.rollout.backend == "vllm":
        if on_gpu:
            res = vllm_reservation(cfg, gpu_bytes)
            role.vllm_reservation, role.vllm_weights = (res if gpu_bytes else None), s.n_params * c // tp
            role.add(f"vLLM: gpu_memory_utilization {cfg.rollout.gpu_memory_utilization:g} x GPU (weights + KV cache)",
                     res, None, "" if gpu_bytes else "GPU memory unknown: not counted")
        else:
            role.add(f"vLLM weights: {cfg.model.compute_dtype}", s.n_params * c, None,
                     "the CPU build's KV cache (VLLM_CPU_KVCACHE_SPACE) is not planned")
        A = adapter_counts(s.linears, cfg.model.lora)[0]
        if A:
            role.add(f"received weights: LoRA adapters in {cfg.model.compute_dtype}", A * c, (SYNC,),
                     "written as a PEFT adapter directory, loaded as a LoRA request")
        elif tp > 1:
            role.add("received buckets, two in flight on each worker's GPU: loaded by vLLM as each arrives",
                     2 * min(WIRE_BUCKET_BYTES, s.state * c), (SYNC,))
            role.notes.append(f"tensor parallel ({tp} GPUs per engine): each of the {tp} workers is a rank of the "
                              "weight-sync group and receives every bucket whole on its own GPU, keeping its slices")
        else:
            role.add("received buckets, two in flight: loaded by vLLM as each arrives",
                     2 * min(WIRE_BUCKET_BYTES, s.state * c), (SYNC,))
        if on_gpu and not A:
            role.add(RELOAD_ITEM + (f", 1/{tp} per GPU" if tp > 1 else ""), vllm_reload_bytes(s, c, tp), (SYNC,),
                     RELOAD_NOTE)
    else:
        rows = generation_rows(cfg, count)
        role.add(f"weights: {cfg.model.compute_dtype}", s.n_params * c)
        role.add("received buckets, two in flight", 2 * min(WIRE_BUCKET_BYTES, s.state * c), (SYNC,))
        role.add(f"HF KV cache: {rows} rows x {seq} tokens", kv_cache_bytes(s, rows, seq, c), (GENERATE,))
        role.add(f"HF prefill: one layer, {rows} rows x {prompt} prompt tokens",
                 nograd_forward_bytes(s, rows, prompt, c, c), (GENERATE,))
    return role


def add_teachers_on_rank(cfg: PosttrainConfig, role: RolePlan, t: ModelShape | None, prompt: int) -> None:
    """The OPD teacher replicas that share a trainer rank's GPU (`teachers_per_rank`, each its own process), added
    to the trainer role: their weights stay resident in every phase; they score (T) while the rank waits."""
    k, replicas = teachers_per_rank(cfg), teacher_replicas(cfg)
    role.phases = (*role.phases, SCORE)
    for it in role.items:  # colocated vLLM sleeps only when the train step starts: awake while the teachers score
        if it.name.startswith("vLLM awake") and it.phases is not None:
            it.phases = (*it.phases, SCORE)
    role.notes.append(f"OPD: {replicas} teacher replica(s) (cluster.teacher_replicas) over "
                      f"{cfg.cluster.num_workers} rank(s): {k} on the busiest rank, planned here")
    if t is None:
        role.notes.append("model.teacher's config is not on this machine: the teachers' memory is not planned")
        return
    c, seq = compute_bytes(cfg), prompt + cfg.rollout.max_tokens
    total = cfg.rollout.prompts_per_step * rows_per_prompt(cfg)
    shard = -(-total // replicas)  # a replica's rows of the batch; it scores them in chunks of the micro-batch
    rows = min(cfg.rl.micro_batch_per_replica or shard, shard)
    each = f" x {k} teachers" if k > 1 else ""
    if role.on_gpu:
        role.add(f"teacher CUDA runtime: its own process{each}", k * RUNTIME_BYTES)
    role.add(f"teacher weights: frozen, {cfg.model.compute_dtype} ({params_text(t.n_params)} params){each}",
             k * t.n_params * c)
    role.add(f"teacher scoring: fused LM head, {rows} rows x {cfg.rollout.max_tokens} response tokens{each}",
             k * logits_bytes(t, rows * cfg.rollout.max_tokens, c, False), (SCORE,))
    role.add(f"teacher scoring: one layer's working set, no grad{each}",
             k * nograd_forward_bytes(t, rows, seq, c, c, mask=False), (SCORE,))


def add_critic_on_rank(cfg: PosttrainConfig, role: RolePlan, s: ModelShape, prompt: int) -> None:
    """PPO's critic on every trainer rank (`infra.workers.critic`): its float32 weights and AdamW state stay resident;
    its gradients, activations and step temporaries live in its own phase (V: its values, then its step, before the
    policy's forward), sharded like the policy. Planned at the policy's shape: an untied LM head the critic does not
    have is counted (an over-estimate of vocab x hidden parameters)."""
    cl, mesh = cfg.cluster, shard_mesh(cfg)
    div = mesh[1] if mesh else 1
    c, P, T = compute_bytes(cfg), s.n_params, s.n_param_tensors
    shard = f", 1/{div} shard ({cl.sharding.upper()})" if mesh else ""
    role.phases = (*role.phases, CRITIC)
    for it in role.items:  # a colocated vLLM engine sleeps for the values phase: its asleep buffers stay
        if it.name.startswith("vLLM asleep") and it.phases is not None:
            it.phases = (*it.phases, CRITIC)
    if cfg.rl.objective.critic_model:
        role.notes.append(f"rl.objective.critic_model={cfg.rl.objective.critic_model}: planned at the policy's shape")
    A, TA = adapter_counts(s.linears, cfg.model.lora)  # LoRA: the adapters and the value head train
    G, TG = (A + s.hidden_size + 1, TA + 2) if A else (P, T)
    what = f" (LoRA: adapters and the value head, {params_text(G)})" if A else ""
    role.add(f"critic parameters: float32 master weights{shard}" + (f" + LoRA adapters ({params_text(A)})" if A else ""),
             math.ceil(4 * (P + A) / div))
    role.add(f"critic AdamW state: exp_avg + exp_avg_sq float32{shard}{what}", math.ceil(8 * G / div) + 4 * TG)
    role.add(f"critic gradients: float32{shard}{what}", math.ceil(4 * G / div), (CRITIC,), "released after its step")
    seq, rows = prompt + cfg.rollout.max_tokens, micro_batch_rows(cfg)
    tokens, _ = micro_batch_tokens(cfg, rows, seq)
    ckpt = cfg.model.gradient_checkpointing
    role.add(f"critic activations: {tokens} tokens{', checkpointed per layer' if ckpt else ''} (a one-output head)",
             activation_bytes(s, 1, tokens, c, ckpt), (CRITIC,))
    if mesh:
        per = 2 * c + (4 if c == 2 else 0)
        role.add("critic FSDP gathered: root + layers in flight", per * (s.root_params + FSDP_LAYERS_IN_FLIGHT * s.layer),
                 (CRITIC,))
    elif c == 2:
        role.add("critic bf16 weight copies: autocast casts of every Linear weight", 2 * s.matmul, (CRITIC,))
    if not mesh and cl.num_workers > 1:
        role.add("critic gradient all-reduce bucket", min(GRAD_BUCKET_BYTES, 4 * G), (CRITIC,))
    if role.on_gpu:
        role.add(f"critic AdamW step temporary: foreach sqrt(exp_avg_sq){shard}", math.ceil(4 * G / div), (CRITIC,))


def add_reward_models_on_rank(cfg: PosttrainConfig, role: RolePlan, shapes: list[tuple[int, ModelShape | None]],
                              prompt: int, gpu_bytes: int | None = None) -> None:
    """The reward-model replica beside each trainer rank (`infra.workers.reward_model`, its own process): every
    `data.rewards` model's frozen weights, resident in every phase, and one scoring forward of `batch_size` rows
    (R, while the rank waits); a vLLM judge on a GPU, its engine's reservation (`judge.gpu_memory_utilization` of
    `gpu_bytes`) instead. `shapes`: `(data.rewards index, shape or None when its config is not here)`."""
    role.phases = (*role.phases, REWARD)
    c = compute_bytes(cfg) if role.on_gpu else 4  # float32 on CPU
    seq = prompt + cfg.rollout.max_response_tokens
    if role.on_gpu:
        role.add("reward model CUDA runtime: its own process", RUNTIME_BYTES)
    for index, shape in shapes:
        entry = cfg.data.rewards[index]
        what = "reward model" if entry.judge is None else "judge"
        if entry.judge is not None and entry.judge.engine == "vllm" and role.on_gpu:
            share = entry.judge.gpu_memory_utilization
            if not gpu_bytes:
                role.notes.append(f"data.rewards[{index}]'s vLLM judge reserves {share:g} of the GPU, whose memory is "
                                  "unknown here: not planned")
                continue
            role.add(f"judge data.rewards[{index}]: vLLM gpu_memory_utilization {share:g} x GPU (weights + KV cache)",
                     int(share * gpu_bytes))
            continue
        if shape is None:
            role.notes.append(f"data.rewards[{index}]'s {what} config is not on this machine: its memory is not planned")
            continue
        role.add(f"{what} data.rewards[{index}]: frozen weights ({params_text(shape.n_params)} params)",
                 shape.n_params * c)
        role.add(f"{what} data.rewards[{index}] scoring: {entry.batch_size} rows x {seq} tokens, one layer, no grad",
                 nograd_forward_bytes(shape, entry.batch_size, seq, c, c, mask=False), (REWARD,))
