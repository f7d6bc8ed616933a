"""The memory plan's constants and byte formulas: what one process holds for a model shape and a config."""

from __future__ import annotations

import math

from rl_core.config.schema import PosttrainConfig
from rl_core.placement.model_shape import ModelShape
from rl_core.placement.run_shape import per_replica_batch, rows_per_prompt

GIB = 1024**3
MIB = 1024**2
# The prompt length assumed when only the config is known (`posttrain validate`, preflight): a
# GSM8K chat prompt is ~150-250 Qwen tokens, so 512 leaves room for system prompts and few-shot
# text. A caller that knows the real longest prompt passes it as `prompt_tokens`.
ASSUMED_PROMPT_TOKENS = 512
# Per GPU process, outside the items: the CUDA context and kernels, cuBLAS/NCCL workspaces.
RUNTIME_BYTES = 1 * GIB
# A vLLM engine asleep still holds what no sleep level frees: its model runner's persistent buffers and the CUDA graphs
# it captured (`vllm_asleep_bytes`). rl_core.rollout.vllm measures it as the engine starts (placement.json:
# vllm_asleep_resident_gib) and make gpu-smoke checks the measurement against the plan's figure. vLLM 0.32's defaults
# on a GPU of 70 GiB or more (the LLM class; CUDA graphs on, as on every GPU run here):
VLLM_MAX_BATCHED_TOKENS = 16384  # max_num_batched_tokens (8192 below 70 GiB): the rows of the persistent buffers
VLLM_CAPTURE_SIZES = 51  # decode batch sizes captured: 1, 2, 4, 8..248 by 8, 256..512 by 16
VLLM_LARGEST_CAPTURE = 512
# CUDA graphs' own device memory per captured batch size and decoder layer (+1: embedding and head), the PIECEWISE and
# FULL graphs together: an estimate from vLLM's capture logs (a few MiB per size for a ~30-layer model)
VLLM_GRAPH_LAYER_BYTES = 256 * 1024
VLLM_ASLEEP_FLOOR_BYTES = 1 * GIB  # the least the plan counts: kernels, workspaces and whatever the estimate misses
# The same constants as the code they model (tests/rl_core/test_memory_plan.py checks that they agree):
GRAD_BUCKET_BYTES = 256 * MIB  # rl_core.training.trainer.LLMTrainer.GRAD_BUCKET_BYTES: unsharded gradient all-reduce
WIRE_BUCKET_BYTES = 256 * MIB  # infra.workers.distributed.BUCKET_BYTES (one weight broadcast to separate engines) and
# rl_core.rollout.vllm_workers.RELOAD_CHUNK_BYTES (the host chunk of weights handed to a tensor-parallel engine)
EVAL_PROMPTS_PER_CALL = 128  # rl_core.evaluation.heldout.evaluate_accuracy(batch_size=128): greedy held-out prompts
REFERENCE_CHUNK_ROWS = 256  # flows.dpo.REFERENCE_CHUNK_ROWS: DPO reference rows per forward without a micro-batch
FSDP_LAYERS_IN_FLIGHT = 2
# NCCL's default buffers (NCCL_BUFFSIZE 4 MiB) on 16 channels, to and from both ring neighbours, per communicator
NCCL_COMM_BYTES = 16 * 2 * 2 * 4 * MIB
# A plan may use at most this fraction of a process's GPU share: the rest is for the caching allocator's
# fragmentation, NCCL buffers and whatever the plan does not model (vLLM's default utilisation is 0.9 too).
USABLE_FRACTION = 0.9  # FSDP2 gathers the next decoder layer while the current one computes

FORWARD, STEP, SYNC, GENERATE, REFERENCE, SCORE, CRITIC, REWARD = (
    "forward/backward", "optimizer step", "weight sync", "generation", "reference scoring", "teacher scoring",
    "critic values and step", "reward-model scoring")
PHASE_LETTERS = {FORWARD: "F", STEP: "S", SYNC: "W", GENERATE: "G", REFERENCE: "R", SCORE: "T", CRITIC: "V",
                 REWARD: "M"}


def compute_bytes(cfg: PosttrainConfig) -> int:
    return 2 if cfg.model.compute_dtype == "bfloat16" else 4


def micro_batch_rows(cfg: PosttrainConfig) -> int:
    """Rows of one trainer forward/backward: `rl.micro_batch_per_replica`, else the mini-batch, else the per-rank batch."""
    per = per_replica_batch(cfg) or math.ceil(cfg.rollout.prompts_per_step * rows_per_prompt(cfg)
                                              / cfg.cluster.num_workers)
    return min(cfg.rl.micro_batch_per_replica or cfg.rl.mini_batch_per_replica or per, per)


def micro_batch_tokens(cfg: PosttrainConfig, rows: int, seq: int) -> tuple[int, int]:
    """`(tokens, read tokens)` of one trainer forward: `rl.micro_batch_max_tokens` when set (rows x longest row
    within it), else `rows` full rows of `seq`; the read (loss) tokens are at most the response tokens in them."""
    budget, responses = cfg.rl.micro_batch_max_tokens, rows * cfg.rollout.max_tokens
    if budget is None:
        return rows * seq, responses
    return budget, budget if cfg.rl.micro_batch_per_replica is None else min(budget, responses)


def layer_activation_bytes(shape: ModelShape, c: int) -> int:
    """Bytes one decoder layer keeps for backward, per token (HF Llama/Qwen2 layer, SDPA attention).

    Measured on CPU with `saved_tensors_hooks` (tests/rl_core/test_memory_plan.py). The residual stream is
    float32 in both modes (float32 master weights; autocast leaves adds and RMSNorm in float32).
    Under FSDP with bf16 compute the gathered weights are bf16 and so is the residual stream: the
    estimate is then an upper bound.
    """
    h, q, inter = shape.hidden_size, shape.num_heads * shape.head_dim, shape.intermediate_size
    norms = 2 * (4 * h + 4 * h) + 2 * 4  # two RMSNorms: float32 input and normalised output (+ rsqrt)
    matmul_inputs = 2 * 4 * h if c == 4 else 5 * c * h  # fp32: the 2 norm outputs; bf16: 5 casts (q,k,v,gate,up)
    kv = shape.num_kv_heads * shape.head_dim
    attention = 2 * c * (q + kv) + 4 * shape.num_heads  # q, k and v (SDPA's native GQA: no mask), output; logsumexp
    mlp = 4 * c * inter  # gate, up, SiLU(gate), SiLU(gate) * up
    return norms + matmul_inputs + attention + mlp


def activation_bytes(shape: ModelShape, rows: int, seq: int, c: int, checkpointing: bool) -> int:
    """Activations kept for backward by one unpadded forward of `rows` x `seq` tokens (not the logits).

    The trainer's forward has no attention mask (`rl_core.primitives.logprobs`: rows left-aligned under
    causal attention, or packed for varlen kernels), so nothing grows with seq². Without checkpointing:
    every layer's `layer_activation_bytes`. With it each layer keeps only its float32 input (4·h per
    token) and one layer at a time is recomputed in backward. Once per model: the final norm and
    lm_head input ((8 + c)·h + 4), rotary cos/sin (8·head_dim) and the input ids (8) per token.
    """
    tokens = rows * seq
    layer = layer_activation_bytes(shape, c)
    once = (8 + c) * shape.hidden_size + 4 + 8 * shape.head_dim + 8
    if checkpointing:
        return tokens * (shape.num_layers * 4 * shape.hidden_size + layer + once)
    return tokens * (shape.num_layers * layer + once)


def logits_bytes(shape: ModelShape, read_tokens: int, c: int, backward: bool, head_trained: bool = True) -> int:
    """The LM head's working set for `read_tokens` positions whose log-prob is read (the fused head of
    `rl_core.primitives.logprobs`): no `[tokens, V]` tensor, only chunks of `CHUNK_ELEMENTS` float32.

    Forward: two float32 chunks (the chunk's logits and their exponentials); kept for backward: the
    gathered hidden states (float32) and three float32 numbers per read token (log-prob, entropy,
    log-normaliser). Backward: the head weight's float32 gradient accumulator (`V·h`), when the head is
    trained (not under LoRA, whose adapters leave the head frozen). bf16: the head weight cast to bf16
    (`2·V·h`) while the head runs.
    """
    from rl_core.primitives.chunked_softmax import CHUNK_ELEMENTS

    vh = shape.vocab_size * shape.hidden_size
    chunk = min(CHUNK_ELEMENTS // shape.vocab_size, read_tokens) * shape.vocab_size
    kept = read_tokens * (4 * shape.hidden_size + 12)
    return 2 * 4 * chunk + kept + (4 * vh if backward and head_trained else 0) + (2 * vh if c == 2 else 0)


def nograd_forward_bytes(shape: ModelShape, rows: int, seq: int, c: int, residual: int, mask: bool = True) -> int:
    """One layer's transient tensors in a forward without grad: residual stream + MLP, and for a masked forward
    (generation's prefill) the additive attention mask; unpadded scoring has none."""
    h, q, inter = shape.hidden_size, shape.num_heads * shape.head_dim, shape.intermediate_size
    return rows * seq * (2 * residual * h + c * max(3 * inter, 4 * q)) + (rows * seq * seq * c if mask else 0)


def vllm_asleep_parts(shape: ModelShape, c: int) -> dict[str, int]:
    """What a sleeping vLLM engine keeps, by part: an estimate for vLLM 0.32 until a GPU run measures it.

    - persistent buffers: `VLLM_MAX_BATCHED_TOKENS` rows of the model runner's input buffers, the input embeddings in
      the model dtype (`h·c`) and the token ids, positions and slot mapping (16 B);
    - CUDA graphs: `VLLM_GRAPH_LAYER_BYTES` per captured batch size and decoder layer (+1);
    - the graph pool: the intermediate tensors of the largest captured decode batch through one layer (the pool is
      shared by every graph), `(2h + 2q + 2kv + 3I)·c` per token: residual and normalised stream, q/k/v and the
      attention output, gate/up and their product.
    """
    h, inter = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    return {"persistent buffers": VLLM_MAX_BATCHED_TOKENS * (h * c + 16),
            "CUDA graphs": VLLM_CAPTURE_SIZES * (shape.num_layers + 1) * VLLM_GRAPH_LAYER_BYTES,
            "graph pool": VLLM_LARGEST_CAPTURE * (2 * h + 2 * q + 2 * kv + 3 * inter) * c}


def vllm_asleep_bytes(shape: ModelShape, c: int) -> int:
    """What the plan counts for a sleeping vLLM engine: its parts (`vllm_asleep_parts`), at least
    `VLLM_ASLEEP_FLOOR_BYTES`."""
    return max(VLLM_ASLEEP_FLOOR_BYTES, sum(vllm_asleep_parts(shape, c).values()))


def vllm_reload_bytes(shape: ModelShape, c: int, tensor_parallel: int = 1) -> int:
    """The transient of vLLM's weight reload (`reload_weights`, layer by layer): each module's weights are
    materialised anew, loaded, copied into the engine's own tensors and freed, one module at a time as the weights
    arrive in order. The largest module is at most a decoder layer (a MoE layer's experts are one module) or the
    embedding / head: `max(layer, largest tensor) x c`, split over the tensor-parallel workers."""
    return -(-max(shape.layer, shape.largest) * c // tensor_parallel)


def kv_cache_bytes(shape: ModelShape, rows: int, seq: int, c: int) -> int:
    """K and V of every layer for `rows` sequences of `seq` tokens."""
    return rows * seq * 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * c


def generation_rows(cfg: PosttrainConfig, engines: int) -> int:
    """Rows one engine generates at once: its share of a step's prompts x n, or of a held-out evaluation call."""
    evaluation = min(EVAL_PROMPTS_PER_CALL, cfg.rl.validation.max_prompts or EVAL_PROMPTS_PER_CALL)
    rows = math.ceil(evaluation / engines)
    if cfg.rl.objective.topology != "offline":  # offline pairs (DPO): its engines only evaluate
        rows = max(rows, math.ceil(cfg.rollout.prompts_per_step / engines) * cfg.rollout.n)
    return rows
