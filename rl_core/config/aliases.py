"""The names a config key goes by elsewhere: TRL's `GRPOConfig` (with the `TrainingArguments` it extends and TRL's
`ModelConfig`), and one knob's name under another objective. The one table the unknown-key hints read
(`rl_core.config.loader`); docs/coming_from_trl.md lays it out side by side, and a test checks that every key named
here exists and that the page lists every TRL name.

An entry maps a name to its key here, or to none (`key=None`) with what to do instead; `by_objective` gives the key
where the chosen `rl.objective.type` decides it (TRL's `beta` is the KL weight of GRPO and the beta of DPO), and
`values` the setting a TRL value becomes where the meaning sits in the value (`vllm_mode=server`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Alias:
    key: str | None  # the key here; None: no equivalent, `note` says what to do instead
    note: str = ""  # what it means, or how it differs
    by_objective: Mapping[str, str] = field(default_factory=dict)  # rl.objective.type -> its key
    values: Mapping[str, str] = field(default_factory=dict)  # a value (lower case) -> the setting here
    trl: bool = True  # a TRL name (False: a knob's name under another objective)


KL_WEIGHT = "the weight of the KL to the reference"
ALIASES: dict[str, Alias] = {
    # the model (GRPOTrainer's `model`, TRL's ModelConfig, peft.LoraConfig)
    "model_name_or_path": Alias("model.name_or_path"),
    "torch_dtype": Alias("model.compute_dtype", "float32 or bfloat16; parameters and AdamW state stay float32"),
    "bf16": Alias("model.compute_dtype", "parameters and AdamW state stay float32",
                  values={"true": "model.compute_dtype=bfloat16", "false": "model.compute_dtype=float32"}),
    "gradient_checkpointing": Alias("model.gradient_checkpointing"),
    "use_peft": Alias("model.lora.r", "LoRA is on when model.lora.r > 0"),
    "lora_r": Alias("model.lora.r"),
    "lora_alpha": Alias("model.lora.alpha"),
    "lora_dropout": Alias("model.lora.dropout"),
    "lora_target_modules": Alias("model.lora.target_modules"),
    # the optimizer and the schedule
    "learning_rate": Alias("rl.optimizer.lr"),
    "weight_decay": Alias("rl.optimizer.weight_decay"),
    "adam_beta1": Alias("rl.optimizer.betas", "[beta1, beta2]"),
    "adam_beta2": Alias("rl.optimizer.betas", "[beta1, beta2]"),
    "max_grad_norm": Alias("rl.optimizer.max_grad_norm"),
    "warmup_steps": Alias("rl.optimizer.warmup_steps"),
    "warmup_ratio": Alias(None, "the warmup is counted in optimizer steps: rl.optimizer.warmup_steps"),
    "lr_scheduler_type": Alias(None, "the learning rate rises linearly over rl.optimizer.warmup_steps, then stays "
                                     "constant (TRL's 'constant_with_warmup')"),
    "optim": Alias(None, "the optimizer is AdamW (rl.optimizer)"),
    # steps and batches
    "max_steps": Alias("rl.max_steps", "one rollout batch a step"),
    "num_train_epochs": Alias(None, "training is counted in steps: rl.max_steps, each of rollout.prompts_per_step "
                                    "prompts"),
    "per_device_train_batch_size": Alias("rl.micro_batch_per_replica", "completions per forward/backward chunk per "
                                                                       "worker"),
    "gradient_accumulation_steps": Alias(None, "an optimizer step takes rl.mini_batch_per_replica completions per "
                                               "worker, in chunks of rl.micro_batch_per_replica"),
    "generation_batch_size": Alias(None, "a step samples rollout.prompts_per_step x rollout.n completions"),
    "steps_per_generation": Alias(None, "a step samples one batch; it takes several optimizer steps when "
                                        "rl.mini_batch_per_replica is less than its completions per worker"),
    "num_iterations": Alias(None, "each batch is trained on once; several optimizer steps per batch come from "
                                  "splitting it (rl.mini_batch_per_replica)"),
    "seed": Alias("job.seed", "data order, sampling and initialisation"),
    # generation
    "num_generations": Alias("rollout.n", "completions per prompt: the group size"),
    "max_completion_length": Alias("rollout.max_tokens"),
    "max_prompt_length": Alias(None, "prompts are never truncated; a prompt that with rollout.max_tokens exceeds "
                                     "the model's context is refused when the data loads"),
    "temperature": Alias("rollout.temperature", "of sampling and of the trainer's log-probs, as in TRL"),
    "top_p": Alias("rollout.top_p"),
    "top_k": Alias(None, "sampling is by temperature and rollout.top_p only"),
    "min_p": Alias(None, "sampling is by temperature and rollout.top_p only"),
    "repetition_penalty": Alias(None, "sampling is by temperature and rollout.top_p only"),
    "use_vllm": Alias("rollout.backend", values={"true": "rollout.backend=vllm", "false": "rollout.backend=hf"}),
    "vllm_mode": Alias("cluster.placement", values={"colocate": "cluster.placement=colocated",
                                                    "server": "cluster.placement=separate"}),
    "vllm_gpu_memory_utilization": Alias("rollout.gpu_memory_utilization"),
    "vllm_tensor_parallel_size": Alias("cluster.gpus_per_engine", "GPUs per engine, with cluster.placement=separate"),
    # the objective
    "beta": Alias("rl.objective.kl_beta", KL_WEIGHT, by_objective={"dpo": "rl.objective.beta"}),
    "kl_beta": Alias("rl.objective.kl_beta", "DPO's beta is its KL weight", by_objective={"dpo": "rl.objective.beta"},
                     trl=False),
    "epsilon": Alias("rl.objective.epsilon_low", "TRL's epsilon sets both bounds: set rl.objective.epsilon_high too"),
    "epsilon_high": Alias("rl.objective.epsilon_high"),
    "delta": Alias("rl.objective.lower_bound_ratio", "the dual clip of negative advantages, on at 3.0 for grpo where "
                                                     "TRL's is off; 0 disables it"),
    "loss_type": Alias("rl.objective.loss_type", values={
        "dapo": "rl.objective.loss_type=token-mean", "bnpo": "rl.objective.loss_type=token-mean",
        "grpo": "rl.objective.loss_type=seq-mean-token-mean",
        "dr_grpo": "rl.objective.loss_type=seq-mean-token-sum-fixed (with scale_rewards=False: rl.objective.type=dr_grpo)"}),
    "scale_rewards": Alias("rl.objective.unbiased_advantage", "no scaling by the group's std is unbiased_advantage=true",
                           values={"false": "rl.objective.unbiased_advantage=true",
                                   "none": "rl.objective.unbiased_advantage=true",
                                   "true": "rl.objective.unbiased_advantage=false (the default)",
                                   "group": "rl.objective.unbiased_advantage=false (the default)"}),
    "importance_sampling_level": Alias("rl.objective.importance_sampling_level", values={
        "sequence": "rl.objective.type=gspo", "token": "rl.objective.type=grpo"}),
    "mask_truncated_completions": Alias("rl.objective.mask_truncated", "completions and agent episodes cut by a "
                                                                    "limit; their rewards still count in the group"),
    # rewards
    "reward_funcs": Alias("data.rewards", "a list of {path, weight} entries, or the functions themselves"),
    "reward_weights": Alias("data.rewards", "each entry's weight: {path, weight}"),
    # the run, its checkpoints and its logs
    "output_dir": Alias("job.out_dir", "the run directory is job.out_dir/job.name"),
    "run_name": Alias("job.name"),
    "save_steps": Alias("rl.save_every"),
    "save_total_limit": Alias("tracking.keep_checkpoints"),
    "resume_from_checkpoint": Alias("rl.resume", "auto by default: a run continues from its newest checkpoint"),
    "eval_strategy": Alias(None, "the held-out split is scored every rl.validation.every_steps steps and at the end"),
    "eval_steps": Alias("rl.validation.every_steps"),
    "logging_steps": Alias(None, "every step's metrics are logged (MLflow and metrics.jsonl)"),
    "log_completions": Alias("tracking.sample_completions_every", "steps between logged sample completions; 0 never",
                             values={"false": "tracking.sample_completions_every=0"}),
    "num_completions_to_print": Alias("tracking.sample_completions"),
    "report_to": Alias(None, "every run is tracked in MLflow: tracking.mlflow_uri, tracking.experiment"),
    "push_to_hub": Alias(None, "posttrain export RUN writes a from_pretrained directory"),
}


def alias_key(name: str, objective: str | None = None) -> str | None:
    """The key `name` goes by here, under `rl.objective.type=objective` when that decides; None when it has none."""
    alias = ALIASES.get(name)
    if alias is None:
        return None
    return alias.by_objective.get(objective, alias.key) if objective else alias.key


def alias_hint(name: str, value: Any = None, objective: str | None = None) -> str | None:
    """What `name` is here, as a hint for an unknown key, e.g. "TRL's num_generations is rollout.n (completions per
    prompt (the group size))"; None when the table does not know it."""
    alias = ALIASES.get(name)
    if alias is None:
        return None
    setting = alias.values.get(str(value).lower()) if value is not None else None
    said = f"TRL's {name}" if alias.trl else name
    if setting:
        return f"{said}={value} is {setting} here"
    key = alias_key(name, objective)
    if key is None:
        return f"{said} has no equivalent here: {alias.note}"
    notes = [alias.note] if alias.note else []
    if objective is None:  # the objective is not known here: name the key of each that has its own
        notes += [f"{k} with rl.objective.type={t}" for t, k in alias.by_objective.items()]
    return f"{said} is {key} here" + (f" ({'; '.join(notes)})" if notes else "")
