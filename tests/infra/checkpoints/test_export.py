"""`posttrain export` (infra/checkpoints/export.py): a step's checkpoint as a directory that transformers and PEFT load alone.

A trainer rank (`PolicyWorker`, in this process: no Ray, no Prefect) trains the tiny model and writes step
checkpoints the way a run does (its shards, the driver's parts, the manifest last). Its own log-probs
(`sequence_token_logprobs` on the trainer's model, the path the objectives use) of greedy continuations are taken
at the checkpointed step, and it trains one step more, so that only a reader of that step's files gives them
back. The export, loaded with `AutoModelForCausalLM.from_pretrained` (or PEFT's `PeftModel.from_pretrained` on
the base), must continue greedily the same way and give the same log-probs; the last step's export holds what
the run's `final_model/` holds (one writer). Then what an export refuses, the CLI, and a step only on S3.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.builders import grpo_batch
from tests.conftest import FAST, recipe

BASE = "artifacts/tiny-model/init"
PROMPTS = ["12+34=", "7+8=", "99+1=", "40+2="]
NEW_TOKENS = 6


def greedy_sequences(model, tokenizer) -> list[torch.Tensor]:
    """Each prompt with its greedy continuation (no padding: one sequence at a time)."""
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            out.append(model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                      do_sample=False, pad_token_id=tokenizer.pad_token_id)[0])
    return out


def trainer_logprobs(model, sequences) -> list[torch.Tensor]:
    """The trainer's log-probs of every token after the first: `sequence_token_logprobs`, the objectives' path."""
    from rl_core.primitives.logprobs import sequence_token_logprobs

    model.eval()
    with torch.no_grad():
        return [sequence_token_logprobs(model, s[None], torch.ones_like(s[None]), temperature=1.0)[0, 1:]
                for s in sequences]


def plain_logprobs(model, sequences) -> list[torch.Tensor]:
    """Log-probs as any transformers user computes them: the full logits, log_softmax, the next token's entry."""
    with torch.no_grad():
        return [torch.log_softmax(model(input_ids=s[None]).logits[0, :-1].float(), -1).gather(-1, s[1:, None])[:, 0]
                for s in sequences]


def save_step(worker, store, cfg, step: int) -> Path:
    """Checkpoint `step` as a run writes it (`Cluster.start_checkpoint`, `tasks.checkpoint`), with one rank."""
    from infra.checkpoints.resume import checkpoint_meta

    tmp = store.begin(step)
    state = worker.start_checkpoint(str(tmp.resolve()))
    store.write_parts(tmp, {"trainer": {k: v for k, v in state.items() if k != "rng"},
                            "rng_rank0": {"rng": state["rng"]}, "driver": {"step": step}})
    return store.commit(tmp, step, checkpoint_meta(cfg), worker.checkpoint_written(True))


def train_run(workdir: Path, name: str, *overrides: str) -> dict:
    """Train 3 steps with checkpoints at 2 and 3; what the trainer gave at step 2 and at the base model."""
    from infra.checkpoints.store import CheckpointStore
    from infra.workers.actor import worker_config
    from infra.workers.policy import PolicyWorker
    from rl_core.config import load_config
    from rl_core.model.loading import load_policy

    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(workdir)
        cfg = load_config(recipe("arithmetic"), [*FAST, f"job.name={name}", "cluster.placement=separate",
                                                 "rl.optimizer.lr=1e-2", "rl.optimizer.warmup_steps=0", *overrides])
        worker = PolicyWorker(worker_config(cfg), 0, 1, 1, 0.0)
        worker.setup(None, None, None)
        trainer, tokenizer = worker.trainer, worker.tokenizer
        base, _ = load_policy(cfg.model)
        store = CheckpointStore(Path(cfg.run_dir) / "checkpoints")
        run: dict = {"run_dir": workdir / cfg.run_dir, "tokenizer": tokenizer, "cfg": cfg}
        for step in (1, 2, 3):
            trainer.model.train()
            trainer.train_step(grpo_batch([3, 5, 2, 4], [2, 3, 4, 2], seed=step, policy_version=step - 1,
                                          vocab_size=len(tokenizer)))
            if step >= 2:
                save_step(worker, store, cfg, step)
            if step == 2:
                run["sequences"] = greedy_sequences(trainer.model, tokenizer)
                run["logp"] = trainer_logprobs(trainer.model, run["sequences"])
                run["base_logp"] = trainer_logprobs(base, run["sequences"])
        run["final_logp"] = trainer_logprobs(trainer.model, run["sequences"])
        worker.save_pretrained(str(run["run_dir"] / "final_model"))  # what a run writes at its end (step 3)
    return run


@pytest.fixture(scope="module")
def full_run(workdir) -> dict:
    return train_run(workdir, "export-full")


@pytest.fixture(scope="module")
def lora_run(workdir) -> dict:
    return train_run(workdir, "export-lora", "model.lora.r=4", "model.lora.alpha=8")


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor], atol: float) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert float((g - w).abs().max()) <= atol, float((g - w).abs().max())


def assert_learned(run: dict) -> None:
    """The checkpointed weights are neither the base model's nor the ones trained after them."""
    for other in ("base_logp", "final_logp"):
        assert max(float((a - b).abs().max()) for a, b in zip(run["logp"], run[other])) > 1e-4, other


def test_an_exported_step_loads_with_from_pretrained_and_gives_the_trainers_logprobs(full_run, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from infra.checkpoints.export import export_checkpoint

    assert_learned(full_run)
    monkeypatch.chdir(tmp_path)  # not the run's working directory: the base model is found from the run's
    done = export_checkpoint(full_run["run_dir"], 2)
    assert done.path == full_run["run_dir"] / "export" / "step-2" and done.step == 2 and done.form == "model"
    names = {p.name for p in done.path.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= names and not any(n.endswith((".bin", ".pt", ".pkl")) for n in names)

    model = AutoModelForCausalLM.from_pretrained(done.path)
    assert [s.tolist() for s in greedy_sequences(model, AutoTokenizer.from_pretrained(done.path))] == \
        [s.tolist() for s in full_run["sequences"]]
    assert_same(trainer_logprobs(model, full_run["sequences"]), full_run["logp"], 0.0)  # bitwise
    assert_same(plain_logprobs(model, full_run["sequences"]), full_run["logp"], 1e-6)

    newest = export_checkpoint(full_run["run_dir"], to=tmp_path / "newest")  # no step: the newest, step 3
    assert newest.step == 3
    assert_same(trainer_logprobs(AutoModelForCausalLM.from_pretrained(newest.path), full_run["sequences"]),
                full_run["final_logp"], 0.0)


def test_a_lora_step_exports_the_adapter_for_peft_and_merged_for_transformers(lora_run, workdir, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from infra.checkpoints.export import export_checkpoint

    assert_learned(lora_run)
    adapter = export_checkpoint(lora_run["run_dir"], 2, tmp_path / "adapter")
    assert adapter.form == "adapter"
    names = {p.name for p in adapter.path.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= names
    assert "model.safetensors" not in names
    config = json.loads((adapter.path / "adapter_config.json").read_text())
    # the run's base model is a local directory (no hub id): named by its path, and the README says so
    assert config["r"] == 4 and config["lora_alpha"] == 8
    local = Path(config["base_model_name_or_path"])
    assert local.is_absolute() and (local / "config.json").is_file()
    assert f"with no hub id, so `adapter_config.json` names it by its path on the\nmachine that wrote it: `{local}`" \
        in (adapter.path / "README.md").read_text()
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(workdir / BASE), adapter.path)
    assert [s.tolist() for s in greedy_sequences(peft, lora_run["tokenizer"])] == \
        [s.tolist() for s in lora_run["sequences"]]
    assert_same(trainer_logprobs(peft, lora_run["sequences"]), lora_run["logp"], 0.0)  # bitwise

    merged = export_checkpoint(lora_run["run_dir"], 2, tmp_path / "merged", merged=True)
    assert merged.form == "merged" and not (merged.path / "adapter_config.json").exists()
    model = AutoModelForCausalLM.from_pretrained(merged.path)  # a plain model: W + (alpha/r) B A
    assert not hasattr(model, "peft_config")
    assert [s.tolist() for s in greedy_sequences(model, lora_run["tokenizer"])] == \
        [s.tolist() for s in lora_run["sequences"]]
    assert_same(plain_logprobs(model, lora_run["sequences"]), lora_run["logp"], 1e-6)

    # the last step exports what the run's final_model/ holds (merged) and its adapter/, tensor for tensor; that
    # adapter names its base model the same way
    final = lora_run["run_dir"] / "final_model"
    assert "with no hub id" in (final / "adapter" / "README.md").read_text()
    for form, exported, written in (("adapter", "adapter_model.safetensors", "adapter/adapter_model.safetensors"),
                                    ("merged", "model.safetensors", "model.safetensors")):
        done = export_checkpoint(lora_run["run_dir"], 3, tmp_path / f"last-{form}", merged=form == "merged")
        got, want = load_file(done.path / exported), load_file(final / written)
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want), form


@pytest.mark.parametrize("hub", [True, False])
def test_an_adapter_names_its_base_by_the_hub_id_and_by_a_local_path_only_without_one(tmp_path, monkeypatch, hub):
    """`adapter_config.json`'s `base_model_name_or_path` and the model card: the run's hub id, which loads anywhere,
    though PEFT writes the path the base was loaded from (a local copy, the hub cache); a local base model by its
    absolute path, the README saying how to load the adapter on another machine. The adapter still loads."""
    from huggingface_hub import ModelCard
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rl_core.config import LoRAConfig
    from rl_core.model import lora
    from rl_core.model.loading import build_tiny_model, name_base_model

    monkeypatch.chdir(tmp_path)
    build_tiny_model(tmp_path / "models" / "base")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "models" / "base")
    name = "my-org/tiny-base" if hub else "models/base"  # the run's model.name_or_path
    lora.save_adapter(lora.wrap(base, LoRAConfig(r=4, alpha=8.0)), str(tmp_path / "adapter"))  # PEFT's files
    assert name_base_model(tmp_path / "adapter", name) == (name if hub else str(tmp_path.resolve() / "models/base"))

    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    card = ModelCard.load(tmp_path / "adapter" / "README.md")
    want = name if hub else str(tmp_path.resolve() / "models" / "base")
    assert config["base_model_name_or_path"] == want and config["r"] == 4
    assert card.data.to_dict().get("base_model") == (name if hub else None)  # a card's base_model is a hub id
    assert card.data.to_dict()["library_name"] == "peft"
    assert [t for t in card.data.tags if t.startswith("base_model:")] == ([f"base_model:adapter:{name}"] if hub else [])
    if hub:
        assert f"`{name}`, the hub id the run trained from" in card.text
    else:
        assert f"a local base model with no hub id, so `adapter_config.json` names it by its path on the\nmachine " \
               f"that wrote it: `{want}`" in card.text
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "models" / "base"),
                                       tmp_path / "adapter")
    assert loaded.peft_config["default"].r == 4


def test_what_an_export_refuses_names_the_file_and_what_to_do(full_run, tmp_path):
    from infra.checkpoints.export import ExportError, export_checkpoint

    run_dir = full_run["run_dir"]
    with pytest.raises(ExportError, match=r"no checkpoint of step 7 in .*checkpoints; available steps: 2, 3$"):
        export_checkpoint(run_dir, 7, tmp_path / "x")
    with pytest.raises(ExportError, match="no run directory 'nowhere'"):
        export_checkpoint("nowhere")

    torn = run_dir / "checkpoints" / "step_00000005"
    shutil.copytree(run_dir / "checkpoints" / "step_00000002", torn)
    (torn / "manifest.json").unlink()  # a save cut before its manifest
    try:
        with pytest.raises(ExportError, match=r"step 5 is torn: .*step_00000005/manifest.json is missing.*"
                                              r"export another step \(available steps: 2, 3\)"):
            export_checkpoint(run_dir, 5, tmp_path / "x")
        assert export_checkpoint(run_dir, to=tmp_path / "latest").step == 3  # the newest complete step
    finally:
        shutil.rmtree(torn)

    target = tmp_path / "occupied"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match=r"occupied exists and is not empty; pass --overwrite"):
        export_checkpoint(run_dir, 2, target)
    assert (target / "notes.txt").read_text() == "mine"
    export_checkpoint(run_dir, 2, target, overwrite=True)
    assert (target / "config.json").is_file() and not (target / "notes.txt").exists()
    assert not list(tmp_path.glob(".tmp-*"))  # nothing half-written left beside the targets


def test_the_cli_exports_by_job_name_and_reports_a_refusal(full_run, workdir, tmp_path, monkeypatch, capsys):
    from cli.main import main

    monkeypatch.chdir(workdir)  # the job name is looked up under runs/
    assert main(["export", "export-full", "--step", "3", "--to", str(tmp_path / "cli")]) == 0
    assert capsys.readouterr().out.strip() == f"exported step 3 (model) to {tmp_path / 'cli'}"
    assert (tmp_path / "cli" / "model.safetensors").is_file()
    assert main(["export", "export-full", "--step", "3", "--to", str(tmp_path / "cli")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("posttrain export: ") and "is not empty; pass --overwrite" in err


@pytest.mark.e2e
def test_a_step_that_is_only_on_s3_is_downloaded_verified_and_exported(full_run, bucket, tmp_path):
    """A run directory without its checkpoints (another machine) whose run mirrored them to S3 (moto's server)."""
    from transformers import AutoModelForCausalLM

    from infra.checkpoints.export import ExportError, export_checkpoint
    from infra.checkpoints.resume import checkpoint_prefix, write_run_state
    from infra.checkpoints.store import CheckpointStore
    from rl_core.config import config_from_dict, write_resolved
    from rl_core.config.loader import config_dict

    cfg = config_from_dict(config_dict(full_run["cfg"]), [f"tracking.checkpoint_uri=s3://{bucket}/ckpt"])
    run_dir, run_id = tmp_path / "far" / cfg.job.name, "0123456789abcdef"
    write_resolved(cfg, run_dir)
    write_run_state(run_dir, {"run_id": run_id})
    prefix = checkpoint_prefix(cfg, run_id)
    CheckpointStore(tmp_path / "unused", remote_uri=prefix).upload(full_run["run_dir"] / "checkpoints" / "step_00000002")

    done = export_checkpoint(run_dir, to=tmp_path / "out")  # the newest: the one step on S3
    assert done.step == 2 and not (run_dir / "checkpoints").exists()  # downloaded elsewhere, then removed
    model = AutoModelForCausalLM.from_pretrained(done.path)
    assert_same(trainer_logprobs(model, full_run["sequences"]), full_run["logp"], 0.0)
    with pytest.raises(ExportError, match=rf"no checkpoint of step 3 in .* nor at {prefix}; available steps: 2$"):
        export_checkpoint(run_dir, 3, tmp_path / "out3")


# ------------------------------------------------------------------ what a checkpoint or a --to cannot make it do

PLANTED = '''import pathlib
pathlib.Path({marker!r}).write_text("the checkpoint's code ran")
from transformers import PretrainedConfig


class PlantedConfig(PretrainedConfig):
    model_type = "planted"
'''


def planted_run(root: Path, model: dict) -> Path:
    """A run directory whose one checkpoint (step 1, manifest intact) records `model` as the run's model section."""
    from infra.checkpoints.store import CheckpointStore

    run_dir = root / "runs" / "planted"
    (run_dir / "metrics.jsonl").parent.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    CheckpointStore(run_dir / "checkpoints").save(
        1, {"driver": {"step": 1}}, {"config": {"model": model, "job": {"name": "planted"}}, "run_dir": str(run_dir)})
    return run_dir


class Loaded(Exception):
    """Raised by a stand-in for `load_policy`: the export got past its checks, with this model section."""


@pytest.fixture
def no_load(monkeypatch):
    """`load_policy` replaced by one that raises `Loaded(model_cfg)`: nothing is loaded, the checks before it run."""
    def load_policy(model_cfg, **_):
        raise Loaded(model_cfg)

    monkeypatch.setattr("rl_core.model.loading.load_policy", load_policy)


def test_a_checkpoint_that_asks_for_trust_remote_code_is_refused_and_its_model_code_never_runs(tmp_path, monkeypatch):
    """The audit's attack (issue 44, finding 3): `model.name_or_path` at a directory whose config.json maps
    AutoConfig to a planted module, `model.trust_remote_code=true` in the checkpoint's meta.json, the manifest's
    hashes made to match. The export refuses it naming the file and the flag; the module never runs."""
    from infra.checkpoints.export import ExportError, export_checkpoint

    monkeypatch.setattr("transformers.dynamic_module_utils.HF_MODULES_CACHE", str(tmp_path / "hf-modules"))
    marker, base = tmp_path / "ran", tmp_path / "planted-model"
    base.mkdir()
    (base / "planted.py").write_text(PLANTED.format(marker=str(marker)))
    (base / "config.json").write_text(json.dumps({"model_type": "planted", "auto_map": {
        "AutoConfig": "planted.PlantedConfig", "AutoModelForCausalLM": "planted.PlantedConfig"}}))
    run_dir = planted_run(tmp_path, {"name_or_path": str(base), "trust_remote_code": True})

    with pytest.raises(ExportError, match=r"step_00000001/meta\.json sets model\.trust_remote_code=true; an export "
                                          r"never takes it from a checkpoint.*pass --trust-remote-code"):
        export_checkpoint(run_dir, 1, tmp_path / "out")
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_trust_remote_code_is_the_operators_flag_alone(tmp_path, monkeypatch, no_load, capsys):
    from cli.main import main
    from infra.checkpoints.export import export_checkpoint

    run_dir = planted_run(tmp_path, {"name_or_path": str(tmp_path / "base"), "trust_remote_code": False})
    with pytest.raises(Loaded) as got:
        export_checkpoint(run_dir, 1, tmp_path / "out")
    assert got.value.args[0].trust_remote_code is False
    with pytest.raises(Loaded) as got:
        main(["export", str(run_dir), "--to", str(tmp_path / "out"), "--trust-remote-code"])
    assert got.value.args[0].trust_remote_code is True

    asks = planted_run(tmp_path / "asks", {"name_or_path": str(tmp_path / "base"), "trust_remote_code": True})
    assert main(["export", str(asks), "--to", str(tmp_path / "out")]) == 1
    assert "sets model.trust_remote_code=true" in capsys.readouterr().err
    with pytest.raises(Loaded) as got:  # the operator trusts it: the flag, not the file, decides
        main(["export", str(asks), "--to", str(tmp_path / "out"), "--trust-remote-code"])
    assert got.value.args[0].trust_remote_code is True


def test_an_export_never_writes_over_or_into_its_run_directory(tmp_path, no_load):
    """The audit's attack (issue 44, finding 4): `--to <the run directory> --overwrite` replaced the run with the
    export. The run directory, a directory holding it, a place inside it other than under export/, and symlinks
    to any of them are refused naming the path, before anything is downloaded or loaded; nothing is deleted."""
    from infra.checkpoints.export import ExportError, export_checkpoint

    run_dir = planted_run(tmp_path, {"name_or_path": str(tmp_path / "base")})
    before = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    (tmp_path / "link-to-run").symlink_to(run_dir)
    (tmp_path / "link-to-runs").symlink_to(run_dir.parent)
    holding = r"is the run directory or holds it"
    inside = r"is inside the run directory .*; pass a --to outside it, or under .*/export/"
    for to, refusal in ((run_dir, holding), (run_dir.parent, holding), (tmp_path, holding),
                        (tmp_path / "link-to-run", holding), (tmp_path / "link-to-runs", holding),
                        (run_dir / "checkpoints", inside), (run_dir / "checkpoints" / "step_00000001", inside),
                        (run_dir / "final_model", inside), (run_dir / "export", inside),
                        (tmp_path / "link-to-run" / "checkpoints", inside), (run_dir / "export" / ".." / "x", inside)):
        with pytest.raises(ExportError, match=rf"^{re.escape(str(to))} \(.*\) {refusal}"):
            export_checkpoint(run_dir, 1, to, overwrite=True)
        with pytest.raises(ExportError, match=re.escape(str(to))):
            export_checkpoint(run_dir, None, to, overwrite=True)
    assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")) == before
    assert not list(tmp_path.rglob(".tmp-*"))

    for to in (None, run_dir / "export" / "mine", tmp_path / "elsewhere"):  # the default and its neighbours pass
        with pytest.raises(Loaded):
            export_checkpoint(run_dir, 1, to, overwrite=True)
