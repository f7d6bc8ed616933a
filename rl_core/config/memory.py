"""The preflight memory plan: bytes per process of every role, before anything is placed or loaded.

`memory_plan(cfg, shape, prompt_tokens=...)` itemises what one process of each role holds, per
phase of a step, from the model's dimensions (`ModelShape`) and the config alone:

- trainer rank (`cluster.num_workers` of them): float32 parameters, gradients and AdamW state
  (divided by the ranks under `cluster.sharding=fsdp`), the compute-dtype weight copies, the
  activations and logits of one micro-batch, the frozen reference, the weight-sync buffers,
  colocated, the rollout engine and, OPD, the teacher replicas on the rank's GPU (their own processes:
  frozen weights, CUDA runtime and one scoring chunk each, `teachers_per_rank` of them);
- separate rollout engine (`cluster.placement=separate`): its weights and KV cache or vLLM's reservation.

Phases: forward/backward (F), optimizer step (S), weight sync (W), generation (G), DPO's one-off
reference scoring (R), the OPD teacher's scoring (T). Gradients are released after each step, so
they never meet the rollout; a phase's total is the sum of the items present in it and a role's
peak is its largest phase. The formulas and the measurements behind them are in docs/gpu.md.

`MemoryPlan.render()` is the table `posttrain validate` prints; `MemoryPlan.problems()` lists the
roles whose peak exceeds 90% of their GPU share (`USABLE_FRACTION`), each with the knobs that would make it fit, most effective
first (each one re-planned). Nothing here touches a GPU or downloads anything: `model_shape` reads
`config.json` from a local directory or the Hugging Face cache and builds the model on the meta device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_core.config import host_memory
from rl_core.config.host_memory import HostPlan
from rl_core.config.preflight import (
    num_engines,
    per_replica_batch,
    rows_per_prompt,
    shard_mesh,
    teacher_replicas,
    teachers_per_rank,
    tensor_parallel_size,
)
from rl_core.config.schema import PosttrainConfig
from rl_core.lora import adapter_counts

GIB = 1024**3
MIB = 1024**2
# The prompt length assumed when only the config is known (`posttrain validate`, preflight): a
# GSM8K chat prompt is ~150-250 Qwen tokens, so 512 leaves room for system prompts and few-shot
# text. A caller that knows the real longest prompt passes it as `prompt_tokens`.
ASSUMED_PROMPT_TOKENS = 512
# Per GPU process, outside the items: the CUDA context and kernels, cuBLAS/NCCL workspaces.
RUNTIME_BYTES = 1 * GIB
# The same constants as the code they model (tests/rl_core/test_memory_plan.py checks that they agree):
GRAD_BUCKET_BYTES = 256 * MIB  # rl_core.trainer.LLMTrainer.GRAD_BUCKET_BYTES: unsharded gradient all-reduce
WIRE_BUCKET_BYTES = 256 * MIB  # infra.distributed.BUCKET_BYTES: one weight broadcast to separate engines
EVAL_PROMPTS_PER_CALL = 128  # rl_core.evaluation.evaluate_accuracy(batch_size=128): greedy held-out prompts
REFERENCE_CHUNK_ROWS = 256  # flows.dpo.REFERENCE_CHUNK_ROWS: DPO reference rows per forward without a micro-batch
FSDP_LAYERS_IN_FLIGHT = 2
# NCCL's default buffers (NCCL_BUFFSIZE 4 MiB) on 16 channels, to and from both ring neighbours, per communicator
NCCL_COMM_BYTES = 16 * 2 * 2 * 4 * MIB
# A plan may use at most this fraction of a process's GPU share: the rest is for the caching allocator's
# fragmentation, NCCL buffers and whatever the plan does not model (vLLM's default utilisation is 0.9 too).
USABLE_FRACTION = 0.9  # FSDP2 gathers the next decoder layer while the current one computes

FORWARD, STEP, SYNC, GENERATE, REFERENCE, SCORE = (
    "forward/backward", "optimizer step", "weight sync", "generation", "reference scoring", "teacher scoring")
PHASE_LETTERS = {FORWARD: "F", STEP: "S", SYNC: "W", GENERATE: "G", REFERENCE: "R", SCORE: "T"}
GROUP_FAMILY = ("grpo", "dr_grpo", "gspo", "legacy_pg")  # the objectives with a KL anchor (rl.kl_beta)


# ------------------------------------------------------------------------------------ model shape


@dataclass(frozen=True)
class ModelShape:
    """The dimensions the plan needs. The counts come from the model built on the meta device.

    `n_params` / `n_param_tensors`: `model.parameters()` (tied embeddings counted once).
    `matmul_params`: parameters of `nn.Linear` modules (what autocast casts to bf16; a tied
    lm_head counts its weight). `layer_params`: one decoder layer (the FSDP unit).
    `state_elements`: `state_dict()` (a tied weight under each of its names: what a full-state
    gather materialises). `largest_tensor`: elements of the largest parameter. None: estimated.
    """

    n_params: int
    n_param_tensors: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    matmul_params: int | None = None
    layer_params: int | None = None
    state_elements: int | None = None
    largest_tensor: int | None = None
    architecture: str = ""
    linears: tuple[tuple[str, int, int], ...] = ()  # (name, d_in, d_out) of every Linear but the LM head (LoRA)

    @property
    def matmul(self) -> int:
        return self.n_params if self.matmul_params is None else self.matmul_params

    @property
    def layer(self) -> int:
        if self.layer_params is not None:
            return self.layer_params
        return max(self.n_params - self.vocab_size * self.hidden_size, 0) // max(self.num_layers, 1)

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder layers: embeddings, final norm, an untied lm_head."""
        return max(self.n_params - self.num_layers * self.layer, 0)

    @property
    def state(self) -> int:
        return self.n_params if self.state_elements is None else self.state_elements

    @property
    def largest(self) -> int:
        return self.vocab_size * self.hidden_size if self.largest_tensor is None else self.largest_tensor


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def shape_from_config(config, trust_remote_code: bool = False) -> ModelShape:
    """`ModelShape` of a transformers config: the model is built on the meta device (no memory, no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    params = list(model.parameters())  # deduplicated: a tied lm_head is the embedding
    seen: set[int] = set()
    matmul = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            for p in module.parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    matmul += p.numel()
    head = model.get_output_embeddings()
    linears = tuple((name, m.in_features, m.out_features) for name, m in model.named_modules()
                    if isinstance(m, torch.nn.Linear) and m is not head)
    layer_names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_names]
    text = _text_config(config)
    heads = int(text.num_attention_heads)
    return ModelShape(
        n_params=sum(p.numel() for p in params),
        n_param_tensors=len(params),
        hidden_size=int(text.hidden_size),
        num_layers=int(text.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
        intermediate_size=int(getattr(text, "intermediate_size", None) or 4 * text.hidden_size),
        vocab_size=int(text.vocab_size),
        matmul_params=matmul,
        layer_params=sum(p.numel() for p in layers[0].parameters()) if layers else None,
        state_elements=sum(t.numel() for t in model.state_dict().values()),
        largest_tensor=max(p.numel() for p in params),
        architecture=type(model).__name__,
        linears=linears,
    )


def probe_model_shape(name_or_path: str, trust_remote_code: bool = False) -> tuple[ModelShape | None, str]:
    """`(shape, "")`, or `(None, why not)`: config.json from a local directory or the HF cache only, never a download."""
    from rl_core.models import looks_local

    if looks_local(name_or_path):
        path = Path(name_or_path).expanduser()
        if not (path / "config.json").is_file():
            return None, f"{name_or_path!r} has no config.json (not built or not downloaded yet)"
        source = str(path)
    else:
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(name_or_path, "config.json")
        except Exception:  # noqa: BLE001 - an invalid repo id reads as "not cached"
            cached = None
        if not (isinstance(cached, str) and Path(cached).is_file()):
            return None, (f"{name_or_path!r} is neither a local directory nor in the Hugging Face cache "
                          "(the plan never downloads)")
        source = name_or_path
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(source, local_files_only=True, trust_remote_code=trust_remote_code)
        return shape_from_config(config, trust_remote_code), ""
    except Exception as exc:  # noqa: BLE001 - an unknown architecture, remote code not allowed, a broken file
        return None, f"cannot build {name_or_path!r} from its config ({type(exc).__name__}: {exc})"


def model_shape(name_or_path: str, trust_remote_code: bool = False) -> ModelShape | None:
    """`ModelShape` of a local directory or a cached hub model; None when its config is not on this machine."""
    return probe_model_shape(name_or_path, trust_remote_code)[0]


# ------------------------------------------------------------------------------------- formulas


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
    from rl_core.primitives.logprobs import CHUNK_ELEMENTS

    vh = shape.vocab_size * shape.hidden_size
    chunk = min(CHUNK_ELEMENTS // shape.vocab_size, read_tokens) * shape.vocab_size
    kept = read_tokens * (4 * shape.hidden_size + 12)
    return 2 * 4 * chunk + kept + (4 * vh if backward and head_trained else 0) + (2 * vh if c == 2 else 0)


def nograd_forward_bytes(shape: ModelShape, rows: int, seq: int, c: int, residual: int, mask: bool = True) -> int:
    """One layer's transient tensors in a forward without grad: residual stream + MLP, and for a masked forward
    (generation's prefill) the additive attention mask; unpadded scoring has none."""
    h, q, inter = shape.hidden_size, shape.num_heads * shape.head_dim, shape.intermediate_size
    return rows * seq * (2 * residual * h + c * max(3 * inter, 4 * q)) + (rows * seq * seq * c if mask else 0)


def kv_cache_bytes(shape: ModelShape, rows: int, seq: int, c: int) -> int:
    """K and V of every layer for `rows` sequences of `seq` tokens."""
    return rows * seq * 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * c


def generation_rows(cfg: PosttrainConfig, engines: int) -> int:
    """Rows one engine generates at once: its share of a step's prompts x n, or of a held-out evaluation call."""
    evaluation = min(EVAL_PROMPTS_PER_CALL, cfg.rl.validation.max_prompts or EVAL_PROMPTS_PER_CALL)
    rows = math.ceil(evaluation / engines)
    if cfg.job.algorithm != "dpo":  # DPO trains on offline pairs: its engines only evaluate
        rows = max(rows, math.ceil(cfg.rollout.prompts_per_step / engines) * cfg.rollout.n)
    return rows


# ---------------------------------------------------------------------------------------- plan


@dataclass
class Item:
    name: str
    bytes: int
    phases: tuple[str, ...] | None = None  # None: resident in every phase of the role
    note: str = ""


@dataclass
class RolePlan:
    key: str  # "trainer" | "engine"
    title: str
    processes: int
    gpus: float  # per process; 0 = on CPU (host memory, never enforced)
    phases: tuple[str, ...]
    items: list[Item] = field(default_factory=list)
    vllm_reservation: int | None = None  # vLLM's budget, which must hold its weights
    vllm_weights: int = 0
    vllm_phases: tuple[str, ...] | None = None  # the phases that hold vLLM's reservation (None: every phase)
    notes: list[str] = field(default_factory=list)

    def add(self, name: str, nbytes: int, phases: tuple[str, ...] | None = None, note: str = "") -> None:
        self.items.append(Item(name, int(nbytes), phases, note))

    def item(self, prefix: str) -> Item:
        """The item whose name starts with `prefix` (KeyError when none)."""
        for it in self.items:
            if it.name.startswith(prefix):
                return it
        raise KeyError(prefix)

    def phase_bytes(self) -> dict[str, int]:
        return {ph: sum(it.bytes for it in self.items if it.phases is None or ph in it.phases) for ph in self.phases}

    @property
    def peak_phase(self) -> str:
        totals = self.phase_bytes()
        return max(totals, key=totals.get)

    @property
    def peak(self) -> int:
        return max(self.phase_bytes().values())

    @property
    def on_gpu(self) -> bool:
        return self.gpus > 0


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f}" if nbytes >= GIB / 10 or nbytes == 0 else f"{nbytes / GIB:.3g}"


def params_text(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


@dataclass
class MemoryPlan:
    cfg: PosttrainConfig
    shape: ModelShape
    roles: list[RolePlan]
    prompt_tokens: int
    gpu_bytes: int | None = None
    gpu_source: str = ""
    teacher_shape: ModelShape | None = None
    reference_shape: ModelShape | None = None
    assumed_prompt: bool = False
    host: HostPlan | None = None
    remote_ray: bool = False

    @property
    def seq_len(self) -> int:
        return self.prompt_tokens + self.cfg.rollout.max_tokens

    def role(self, key: str) -> RolePlan:
        for r in self.roles:
            if r.key == key:
                return r
        raise KeyError(key)

    def available(self, role: RolePlan) -> int | None:
        """Memory one process of `role` may plan for: `USABLE_FRACTION` of its share of a GPU (a fractional
        GPU shares it)."""
        if self.gpu_bytes is None or not role.on_gpu:
            return None
        return int(self.gpu_bytes * min(role.gpus, 1.0) * USABLE_FRACTION)

    # -- rendering
    def render(self) -> str:
        cfg, s = self.cfg, self.shape
        prompt = f"{self.prompt_tokens} prompt{' (assumed)' if self.assumed_prompt else ''}"
        if not any(r.on_gpu for r in self.roles):
            device = "no GPU role: host memory, not enforced"
        elif self.gpu_bytes is None:
            device = "GPU memory unknown (set cluster.gpu_memory_gib): printed, not enforced"
        else:
            device = f"{gib(self.gpu_bytes)} GiB per GPU ({self.gpu_source})"
        head = (f"memory plan (per process, GiB = 2^30 B): {s.architecture or 'model'} {params_text(s.n_params)} "
                f"params, compute {cfg.model.compute_dtype}, sequence {prompt} + {cfg.rollout.max_tokens} response = "
                f"{self.seq_len} tokens, train micro-batch {micro_batch_rows(cfg)} rows; {device}")
        lines = [
            head,
            "  phases: " + ", ".join(f"{v} {k}" for k, v in PHASE_LETTERS.items()
                                     if any(k in r.phases for r in self.roles)),
        ]
        for role in self.roles:
            where = (f"{role.gpus:g} GPU each" if role.on_gpu else "on CPU: host memory, not checked")
            lines.append(f"  {role.title} (x{role.processes}, {where})")
            lines.append(f"    {'GiB':>8}  {'phases':<6}  item")
            for it in role.items:
                phases = "all" if it.phases is None else "".join(PHASE_LETTERS[p] for p in it.phases)
                note = f"  [{it.note}]" if it.note else ""
                lines.append(f"    {gib(it.bytes):>8}  {phases:<6}  {it.name}{note}")
            totals = role.phase_bytes()
            lines.append("    phase totals: " + ", ".join(f"{ph} {gib(b)}" for ph, b in totals.items()))
            avail = self.available(role)
            verdict = ("" if avail is None else
                       f" of {gib(avail)} GiB usable ({USABLE_FRACTION:.0%} of its GPU): "
                       + ("fits" if role.peak <= avail else "DOES NOT FIT"))
            lines.append(f"    peak {gib(role.peak)} GiB ({role.peak_phase}){verdict}")
            lines += [f"    note: {n}" for n in role.notes]
        if self.host is not None:
            lines += host_memory.render(self.host)
        return "\n".join(lines)

    # -- problems and the knobs that fix them
    def problems(self) -> list[str]:
        """Roles on GPU that do not fit the GPU memory (none when it is unknown), and a node whose host memory does not
        fit its RAM (none when that is unknown), each with its fixes."""
        out = []
        if self.host is not None and not self.host.fits():
            sharded = None
            if shard_mesh(self.cfg) is None and (cfg := _variant(self.cfg, {"cluster.sharding": "fsdp"})) is not None:
                sharded = self._replan(cfg).host.peak
            out.append(host_memory.problem(self.host, self.cfg, sharded))
        for role in self.roles:
            avail = self.available(role)
            if avail is None:
                continue
            if role.vllm_reservation is not None and role.vllm_weights >= role.vllm_reservation:
                need = math.ceil((role.vllm_weights * 1.25 / self.gpu_bytes) * 20) / 20
                dtype_fix = "" if self.cfg.model.compute_dtype == "bfloat16" else " or model.compute_dtype=bfloat16"
                out.append(f"{role.title}: vLLM's weights ({gib(role.vllm_weights)} GiB in "
                           f"{self.cfg.model.compute_dtype}) do not fit its reservation rollout.gpu_memory_utilization="
                           f"{self.cfg.rollout.gpu_memory_utilization:g} x {gib(self.gpu_bytes)} GiB = "
                           f"{gib(role.vllm_reservation)} GiB; set rollout.gpu_memory_utilization={min(need, 0.95):g} "
                           f"(the weights + 25% for the KV cache){dtype_fix}")
            if role.peak <= avail:
                continue
            out.append(f"{role.title} (x{role.processes}): peak {gib(role.peak)} GiB in the {role.peak_phase} phase "
                       f"exceeds the {gib(avail)} GiB usable ({USABLE_FRACTION:.0%} of "
                       f"{self.gpu_source or 'its GPU'}); "
                       f"{self._fixes(role, avail)}")
        return out

    def _source(self) -> str:
        return f" ({self.gpu_source})" if self.gpu_source else ""

    def _replan(self, cfg: PosttrainConfig) -> MemoryPlan:
        host = self.host
        return memory_plan(cfg, self.shape, prompt_tokens=self.prompt_tokens, gpu_bytes=self.gpu_bytes,
                           teacher_shape=self.teacher_shape, reference_shape=self.reference_shape,
                           host_bytes=host.host_bytes if host else None, host_source=host.source if host else "",
                           remote_ray=self.remote_ray)

    def _fixes(self, role: RolePlan, avail: int) -> str:
        tried = []
        for overrides in _knobs(self, role, avail):
            cfg = _variant(self.cfg, overrides)
            if cfg is None:
                continue
            try:
                peak = self._replan(cfg).role(role.key).peak
            except KeyError:  # the role is gone (e.g. no colocated engine)
                continue
            if peak < role.peak:
                tried.append((peak, overrides))
        if not tried:
            return "no knob of this config lowers it: use GPUs with more memory or a smaller model"
        tried.sort(key=lambda t: t[0])
        each = ", ".join(f"{_label(o)} ({gib(p)} GiB{', fits' if p <= avail else ''})" for p, o in tried)
        text = f"knobs that lower it, most effective first (the peak each gives alone): {each}"
        if tried[0][0] <= avail:
            return text
        combined: dict[str, Any] = {}
        peak = role.peak
        for _, overrides in tried:
            cfg = _variant(self.cfg, {**combined, **overrides})
            if cfg is None:
                continue
            new_peak = self._replan(cfg).role(role.key).peak
            if new_peak < peak:
                combined.update(overrides)
                peak = new_peak
            if peak <= avail:
                return f"{text}; together `{_label(combined)}` give {gib(peak)} GiB (fits)"
        return f"{text}; even together `{_label(combined)}` give {gib(peak)} GiB: use GPUs with more memory"


def _label(overrides: dict[str, Any]) -> str:
    def fmt(v: Any) -> str:
        return str(v).lower() if isinstance(v, bool) else f"{v:g}" if isinstance(v, float) else str(v)

    return " ".join(f"{k}={fmt(v)}" for k, v in overrides.items())


def _variant(cfg: PosttrainConfig, overrides: dict[str, Any]) -> PosttrainConfig | None:
    """A copy of `cfg` with dotted `overrides` applied (None when a value is refused)."""
    from pydantic import ValidationError

    new = cfg.model_copy(deep=True)
    try:
        for dotted, value in overrides.items():
            section, key = dotted.split(".")
            setattr(getattr(new, section), key, value)
    except ValidationError:
        return None
    return new


def _smaller_micro_batch(cfg: PosttrainConfig, current: int) -> int | None:
    """The largest micro-batch at most half of `current` that divides the mini-batch (even for DPO)."""
    per = per_replica_batch(cfg)
    mini = cfg.rl.mini_batch_per_replica or per
    step = 2 if cfg.job.algorithm == "dpo" else 1
    for m in range(current // 2, step - 1, -1):
        if m % step == 0 and mini and mini % m == 0:
            return m
    return None


def _fitting_utilization(plan: MemoryPlan, role: RolePlan, avail: int) -> float | None:
    """A lower rollout.gpu_memory_utilization under which the role's vLLM phases fit (None: none helps)."""
    if role.vllm_reservation is None or not plan.gpu_bytes:
        return None
    totals = role.phase_bytes()
    held = [ph for ph in totals if role.vllm_phases is None or ph in role.vllm_phases]
    if any(totals[ph] > avail for ph in totals if ph not in held):
        return None  # a phase without vLLM's reservation does not fit: a lower utilization cannot help
    worst_other = max(totals[ph] - role.vllm_reservation for ph in (SYNC, GENERATE, SCORE) if ph in held)
    util = math.floor((avail - worst_other) / plan.gpu_bytes * 20) / 20
    if util >= plan.cfg.rollout.gpu_memory_utilization or util * plan.gpu_bytes <= role.vllm_weights * 1.25:
        return None
    return util


def _knobs(plan: MemoryPlan, role: RolePlan, avail: int) -> list[dict[str, Any]]:
    cfg = plan.cfg
    cl, model, ro = cfg.cluster, cfg.model, cfg.rollout
    out: list[dict[str, Any]] = []
    if model.compute_dtype == "float32":
        out.append({"model.compute_dtype": "bfloat16"})
    if role.key == "trainer":
        if cl.sharding == "none" and cl.num_workers > 1:
            out.append({"cluster.sharding": "fsdp"})
        if not model.gradient_checkpointing:
            out.append({"model.gradient_checkpointing": True})
        if (m := _smaller_micro_batch(cfg, micro_batch_rows(cfg))) is not None:
            out.append({"rl.micro_batch_per_replica": m})
        if cl.placement == "colocated":
            if (u := _fitting_utilization(plan, role, avail)) is not None:
                out.append({"rollout.gpu_memory_utilization": u})
            out.append({"cluster.placement": "separate", **({"cluster.gpus_per_engine": 1.0} if role.on_gpu else {})})
        total = ro.prompts_per_step * rows_per_prompt(cfg)
        more = cl.num_workers * 2
        if total % more == 0 and (cfg.job.algorithm != "dpo" or ro.prompts_per_step % more == 0):
            out.append({"cluster.num_workers": more})
    elif role.key == "engine":
        if (u := _fitting_utilization(plan, role, avail)) is not None:
            out.append({"rollout.gpu_memory_utilization": u})
        if ro.backend == "hf":
            out.append({"rollout.num_engines": num_engines(cfg) * 2})
    if role.key == "trainer" and teachers_per_rank(cfg) > 1:
        out.append({"cluster.teacher_replicas": cl.num_workers})
    return out


# ---------------------------------------------------------------------------------------- roles


def memory_plan(cfg: PosttrainConfig, shape: ModelShape, *, prompt_tokens: int, gpu_bytes: int | None = None,
                teacher_shape: ModelShape | None = None, reference_shape: ModelShape | None = None,
                gpu_source: str = "", assumed_prompt: bool = False, host_bytes: int | None = None,
                host_source: str = "", remote_ray: bool = False) -> MemoryPlan:
    """The per-role, per-process byte plan of `cfg` for a policy of `shape` (see the module docstring), and the host
    memory of one node (`rl_core.config.host_memory`).

    `prompt_tokens`: the longest prompt (`ASSUMED_PROMPT_TOKENS` when unknown); sequences are that
    plus `rollout.max_tokens`. `gpu_bytes`: memory of one GPU (None: printed, not enforced).
    `teacher_shape` (OPD) and `reference_shape` (`rl.reference`; default: the policy's shape). `host_bytes`: the RAM
    of one node (None: printed, not enforced); `remote_ray`: the ranks run on a Ray cluster's nodes, not here.
    """
    roles = [_trainer(cfg, shape, prompt_tokens, gpu_bytes, reference_shape or shape)]
    if teacher_replicas(cfg):
        _teachers_on_rank(cfg, roles[0], teacher_shape, prompt_tokens)
    if cfg.cluster.placement == "separate":
        roles.append(_separate_engine(cfg, shape, prompt_tokens, gpu_bytes))
    host = host_memory.host_plan(cfg, shape.n_params, shape.n_param_tensors, shape.linears, remote_ray=remote_ray,
                                 host_bytes=host_bytes, source=host_source)
    return MemoryPlan(cfg, shape, roles, prompt_tokens, gpu_bytes, gpu_source, teacher_shape, reference_shape,
                      assumed_prompt, host, remote_ray)


def _vllm_reservation(cfg: PosttrainConfig, gpu_bytes: int | None) -> int:
    return int(cfg.rollout.gpu_memory_utilization * gpu_bytes) if gpu_bytes else 0


def _trainer(cfg: PosttrainConfig, s: ModelShape, prompt: int, gpu_bytes: int | None,
             ref: ModelShape) -> RolePlan:
    cl, algo = cfg.cluster, cfg.job.algorithm
    n = cl.num_workers
    mesh = shard_mesh(cfg)  # None: one full replica per rank (infra.policy_worker.build_trainer)
    fsdp = mesh is not None
    div = mesh[1] if fsdp else 1  # the state is split over a shard group (every rank under fsdp)
    c, seq, rows = compute_bytes(cfg), prompt + cfg.rollout.max_tokens, micro_batch_rows(cfg)
    on_gpu, colocated = cl.gpus_per_worker > 0, cl.placement == "colocated"
    phases = [FORWARD, STEP, SYNC] + ([GENERATE] if colocated else []) + ([REFERENCE] if algo == "dpo" else [])
    role = RolePlan("trainer", "trainer rank", n, cl.gpus_per_worker, tuple(phases))
    P, T = s.n_params, s.n_param_tensors
    shard = (f", 1/{div} shard ({cl.sharding.upper()})") if fsdp else ""
    A, TA = adapter_counts(s.linears, cfg.model.lora)  # LoRA: the trained parameters are the adapters'
    G, TG = (A, TA) if A else (P, T)  # what has gradients and AdamW state
    what = f" (LoRA r={cfg.model.lora.r}: adapters only, {params_text(A)})" if A else ""

    role.add(f"parameters: float32 master weights{shard}" + (f" + LoRA adapters ({params_text(A)})" if A else ""),
             math.ceil(4 * (P + A) / div))
    if fsdp:
        role.notes.append("built sharded (infra.distributed.load_sharded_policy): a meta-device skeleton on every "
                          "rank, rank 0 loads the checkpoint into host memory and broadcasts it tensor by tensor, so "
                          "no rank ever holds the whole model on its GPU; the final export gathers it tensor by tensor "
                          "into rank 0's host memory (the host table)")
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
    if fsdp:  # infra.distributed.shard_policy: MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=float32)
        per = 2 * c + (4 if c == 2 else 0)
        role.add(f"FSDP gathered: root + {FSDP_LAYERS_IN_FLIGHT} layers' params and grads in "
                 f"{cfg.model.compute_dtype}{', + float32 reduce-scatter input' if c == 2 else ''}",
                 per * (s.root_params + FSDP_LAYERS_IN_FLIGHT * s.layer), (FORWARD,))
    ckpt = cfg.model.gradient_checkpointing
    tokens, read = micro_batch_tokens(cfg, rows, seq)
    role.add(f"activations: {tokens} tokens{', checkpointed per layer' if ckpt else ''}",
             activation_bytes(s, 1, tokens, c, ckpt), (FORWARD,))
    head_trained = cfg.model.lora.r == 0  # LoRA adapts the Linears below the head; the head stays frozen
    role.add(f"LM head, fused: float32 chunks, {read} read tokens' hidden states"
             f"{', head-weight gradient' if head_trained else ' (frozen under LoRA: no weight gradient)'}",
             logits_bytes(s, read, c, True, head_trained), (FORWARD,))
    if not fsdp and n > 1:
        role.add("gradient all-reduce bucket", min(GRAD_BUCKET_BYTES, 4 * G), (STEP,))
    if on_gpu:  # torch's foreach AdamW (the default on CUDA) allocates sqrt(exp_avg_sq) for all params
        role.add(f"AdamW step temporary: foreach sqrt(exp_avg_sq){shard}", math.ceil(4 * G / div), (STEP,))

    # -- the frozen reference (LoRA without rl.reference: the base with the adapter disabled, no copy)
    own_reference = not (A and cfg.rl.reference is None)
    if own_reference and algo in GROUP_FAMILY and cfg.rl.kl_beta > 0:
        role.add(f"reference model: frozen, {cfg.model.compute_dtype}", ref.n_params * c, None,
                 "every rank holds it whole")
    if algo == "dpo":
        chunk = cfg.rl.micro_batch_per_replica or REFERENCE_CHUNK_ROWS
        if own_reference:
            role.add(f"reference model: frozen, {cfg.model.compute_dtype}", ref.n_params * c, (REFERENCE,),
                     "rank 0 scores every pair once, then frees it")
        role.add(f"reference scoring: fused LM head, {chunk} rows + one layer",
                 logits_bytes(ref, chunk * cfg.rollout.max_tokens, c, False)
                 + nograd_forward_bytes(ref, chunk, seq, c, c, mask=False), (REFERENCE,))

    # -- weight sync (LoRA: vLLM takes the adapters, HF engines the merged weights)
    state_c = s.state * c
    if A and cfg.rollout.backend == "vllm":
        state_c = A * c
    elif A and (not colocated or fsdp):
        role.add(f"LoRA merged weights: full state in {cfg.model.compute_dtype}", state_c, (SYNC,),
                 "W + (alpha/r) B A of every adapted weight, sent to the HF engines")
    bucket = min(WIRE_BUCKET_BYTES, state_c)
    if fsdp:  # LLMTrainer.iter_full_model_state: each tensor gathered in float32, cast and packed, then dropped
        role.add(f"weight sync: one gathered float32 tensor + the {cfg.model.compute_dtype} bucket it is packed into",
                 4 * s.largest + bucket, (SYNC,),
                 "the engine loads each bucket as it arrives" if colocated else "every rank gathers, rank 0 sends")
    elif not colocated or cfg.rollout.backend == "vllm":
        role.add(f"weight sync: one {cfg.model.compute_dtype} bucket, cast and packed"
                 + ("" if colocated else " (rank 0)"), bucket, (SYNC,))

    # -- the colocated engine
    if colocated:
        engines = n
        if cfg.rollout.backend == "vllm":
            if on_gpu:
                res = _vllm_reservation(cfg, gpu_bytes)
                role.vllm_reservation, role.vllm_weights = (res if gpu_bytes else None), s.n_params * c
                if A:  # sleep level 1: the base weights wait in host memory; the sync wakes it whole to add adapters
                    role.add(f"vLLM awake: gpu_memory_utilization {cfg.rollout.gpu_memory_utilization:g} x GPU "
                             "(weights + KV cache)", res, (SYNC, GENERATE),
                             "" if gpu_bytes else "GPU memory unknown: not counted")
                    role.notes.append("vLLM sleeps (level 1: weights to host memory, KV cache freed) during the "
                                      "train step and wakes for the sync")
                else:  # sleep level 2; the sync wakes the weights only, loads them, then the KV cache
                    role.add(f"vLLM weights: {cfg.model.compute_dtype}, woken for the sync (KV cache still freed)",
                             s.n_params * c, (SYNC,))
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


def _separate_engine(cfg: PosttrainConfig, s: ModelShape, prompt: int, gpu_bytes: int | None) -> RolePlan:
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
            res = _vllm_reservation(cfg, gpu_bytes)
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
            role.add("received bucket: copied to host memory as it arrives", min(WIRE_BUCKET_BYTES, s.state * c),
                     (SYNC,))
            role.notes.append(f"tensor parallel ({tp} GPUs per engine): a sync gathers the received weights in host "
                              f"memory ({gib(s.state * c)} GiB) and hands them to the {tp} workers in one call")
        else:
            role.add("received bucket: loaded by vLLM as it arrives", min(WIRE_BUCKET_BYTES, s.state * c), (SYNC,))
    else:
        rows = generation_rows(cfg, count)
        role.add(f"weights: {cfg.model.compute_dtype}", s.n_params * c)
        role.add("received bucket", min(WIRE_BUCKET_BYTES, s.state * c), (SYNC,))
        role.add(f"HF KV cache: {rows} rows x {seq} tokens", kv_cache_bytes(s, rows, seq, c), (GENERATE,))
        role.add(f"HF prefill: one layer, {rows} rows x {prompt} prompt tokens",
                 nograd_forward_bytes(s, rows, prompt, c, c), (GENERATE,))
    return role


def _teachers_on_rank(cfg: PosttrainConfig, role: RolePlan, t: ModelShape | None, prompt: int) -> None:
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


def plan_for_config(cfg: PosttrainConfig, gpu_bytes: int | None = None, *, gpu_source: str = "",
                    prompt_tokens: int | None = None, host_bytes: int | None = None, host_source: str = "",
                    remote_ray: bool = False) -> tuple[MemoryPlan | None, str]:
    """`(plan, "")` from the model configs on this machine, or `(None, why there is none)`. Never downloads."""
    shape, why = probe_model_shape(cfg.model.name_or_path, cfg.model.trust_remote_code)
    if shape is None:
        return None, f"model.name_or_path={why}"
    teacher = reference = None
    if cfg.job.algorithm == "opd" and cfg.model.teacher:
        teacher = model_shape(cfg.model.teacher, cfg.model.trust_remote_code)
    if cfg.rl.reference:
        reference = model_shape(cfg.rl.reference, cfg.model.trust_remote_code)
    return memory_plan(cfg, shape, prompt_tokens=prompt_tokens or ASSUMED_PROMPT_TOKENS, gpu_bytes=gpu_bytes,
                       teacher_shape=teacher, reference_shape=reference, gpu_source=gpu_source,
                       assumed_prompt=prompt_tokens is None, host_bytes=host_bytes, host_source=host_source,
                       remote_ray=remote_ray), ""
