"""Warm start and held-out evaluation of the tiny model."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rl_core.config.schema import ModelConfig
from rl_core.data import make_arithmetic_data
from rl_core.evaluation.heldout import evaluate_accuracy
from rl_core.model.loading import build_tiny_model, load_policy
from rl_core.tasks import Example, load_examples
from rl_core.training.warm_start import encode_supervised_batch, progress_lines, warm_start


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("ws")
    init = build_tiny_model(root / "init", seed=0)
    data = make_arithmetic_data(root / "data", seed=0)
    return root, init, data


def _greedy_text(model, tok, prompt: str, steps: int) -> str:
    """Greedy decoding with uncached full forwards (independent of the rollout engine)."""
    ids = tok(prompt)["input_ids"]
    out = []
    for _ in range(steps):
        with torch.no_grad():
            nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        if nxt == tok.eos_token_id:
            break
        out.append(nxt)
        ids.append(nxt)
    return tok.decode(out, skip_special_tokens=True)


def test_evaluate_accuracy_scores_greedy_completions(setup):
    _, init, _ = setup
    model, tok = load_policy(ModelConfig(name_or_path=str(init)))
    prompts = ["1+2=", "12+34=", "50+50=", "9+0=", "33+44=", "7+77="]
    greedy = [_greedy_text(model, tok, p, 4) for p in prompts]
    # half the answers are the model's own greedy output, half are not
    examples = [Example(p, g if i % 2 == 0 else g + "9") for i, (p, g) in enumerate(zip(prompts, greedy))]
    r = evaluate_accuracy(model, tok, examples, task="arithmetic", max_tokens=4, batch_size=4, num_samples=3)
    assert r["n"] == 6 and r["accuracy"] == 0.5 and r["mean_reward"] == 0.5
    assert [s["completion"] for s in r["samples"]] == greedy[:3]
    assert [s["reward"] for s in r["samples"]] == [1.0, 0.0, 1.0]


def test_supervised_batch_scores_answer_and_eos_only():
    from rl_core.model.loading import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    ids, mask, labels = encode_supervised_batch(tok, [Example("1+2=", "3"), Example("12+34=", "46")])
    assert tok.decode(ids[1]) == "<bos>12+34=46<eos>"
    # row 0: <bos> 1 + 2 = 3 <eos> (7 tokens), right-padded to row 1's 10
    assert (
        ids[0].tolist()
        == tok("1+2=")["input_ids"] + tok.convert_tokens_to_ids(["3", "<eos>"]) + [tok.pad_token_id] * 3
    )
    assert mask[0].tolist() == [1] * 7 + [0] * 3
    scored = [tok.convert_ids_to_tokens(int(t)) for t in labels[1] if t != -100]
    assert scored == ["4", "6", "<eos>"]
    assert labels[0].tolist() == [-100] * 5 + tok.convert_tokens_to_ids(["3", "<eos>"]) + [-100] * 3


@pytest.mark.slow
def test_short_warm_start_is_deterministic_and_saves_a_loadable_model(setup):
    root, init, data = setup
    kw = {"steps": 15, "lr": 1e-3, "batch_size": 16, "seed": 0, "max_val_examples": 20}
    a = warm_start(init, data["train"], data["val"], root / "a", **kw)
    seen: list[tuple[int, float]] = []
    b = warm_start(init, data["train"], data["val"], root / "b", **kw, progress=lambda *step: seen.append(step))
    assert [s for s, _ in seen] == list(range(1, 16))  # after every step, the same bytes with it as without
    assert sum(loss for _, loss in seen[-10:]) / 10 == b["final_loss"]
    wa, wb, w0 = (load_file(d / "model.safetensors") for d in (root / "a", root / "b", init))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(wa[k], w0[k]) for k in wa)
    assert a["final_loss"] == b["final_loss"] and a["steps"] == 15 and a["n_val"] == 20
    model, tok = load_policy(ModelConfig(name_or_path=str(root / "a")))
    assert tok.eos_token_id == 2 and model.config.model_type == "llama"


@pytest.mark.slow
def test_default_warm_start_lands_in_target_band(warm_model, workdir):
    """Random init scores ~0; the quickstart's warm start (params.yaml, the module defaults) lands in its band
    (0.6-0.85): well below the 0.9 RL reaches. Built once per session (conftest `warm_model`). The exact value
    depends on the CPU's float kernels (0.722 and 0.802 were measured on two 2-core machines)."""
    from infra.artifacts import load_params
    from rl_core.training.warm_start import DEFAULT_BATCH_SIZE, DEFAULT_LR, DEFAULT_STEPS

    params = load_params()["warm_start"]
    assert (params["steps"], params["lr"], params["batch_size"]) == (DEFAULT_STEPS, DEFAULT_LR, DEFAULT_BATCH_SIZE)
    warm, m = warm_model
    assert m["val_accuracy_before"] <= 0.02 and m["steps"] == DEFAULT_STEPS
    assert 0.6 <= m["val_accuracy"] <= 0.85, m
    # the saved snapshot reproduces the reported accuracy
    model, tok = load_policy(ModelConfig(name_or_path=str(warm)))
    val = workdir / "data" / "arithmetic" / "val.jsonl"
    again = evaluate_accuracy(model, tok, load_examples(val, "arithmetic"), max_tokens=4)
    assert again["accuracy"] == m["val_accuracy"]


def test_progress_says_a_line_at_every_tenth_with_the_mean_loss_since_the_last():
    lines: list[str] = []
    progress = progress_lines(20, lines.append, what="warm start", every_s=1e9)
    for step in range(1, 21):
        progress(step, float(step))
    assert len(lines) == 10
    assert lines[0].startswith("warm start: step 2/20 (10%), loss 1.500, ")
    assert lines[-1].startswith("warm start: step 20/20 (100%), loss 19.500, ") and lines[-1].endswith("about 0 s left")
    few: list[str] = []
    progress = progress_lines(3, few.append)
    for step in (1, 2, 3):
        progress(step, 1.0)
    assert [line.split(",")[0] for line in few] == ["warm-start: step 1/3 (33%)", "warm-start: step 2/3 (66%)",
                                                    "warm-start: step 3/3 (100%)"]
