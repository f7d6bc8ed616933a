"""HF rollout engine: shapes, masks from EOS, seeded determinism, log-probs == trainer log-probs."""

from __future__ import annotations

import importlib.util
import sys
from types import SimpleNamespace

import pytest
import torch

from rl_core.config.schema import ModelConfig, RolloutConfig
from rl_core.model.loading import build_tiny_model, load_policy
from rl_core.primitives.logprobs import sequence_token_logprobs
from rl_core.rollout import HFEngine, SamplingParams, build_completions, make_engine

PAD, BOS, EOS = 0, 1, 2


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("tiny") / "init", seed=0)
    return load_policy(ModelConfig(name_or_path=str(path)))


@pytest.fixture(scope="module")
def prompts(policy):
    _, tok = policy
    texts = ["1+2=", "12+34=", "5+67=", "99+99=", "Question: how many?\nAnswer:"]
    return [tok(t)["input_ids"] for t in texts]


class ScriptedLM(torch.nn.Module):
    """A causal LM stand-in whose step k puts all mass on `script[row][k]` (for exact mask checks)."""

    def __init__(self, script: list[list[int]], vocab: int = 16):
        super().__init__()
        self.script = torch.tensor(script)
        self.vocab = vocab
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.config = SimpleNamespace(tie_word_embeddings=False)
        self.step = 0

    def forward(
        self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=True, **_
    ):
        if past_key_values is None:
            self.step = 0
        logits = torch.full((input_ids.shape[0], input_ids.shape[1], self.vocab), -1e4)
        logits[torch.arange(input_ids.shape[0]), -1, self.script[:, self.step]] = 0.0
        self.step += 1
        return SimpleNamespace(logits=logits, past_key_values="cache")


def test_shapes_and_layout(policy, prompts):
    model, tok = policy
    n, max_tokens = 3, 6
    c = HFEngine(model, tok).generate(
        prompts, n, SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=0)
    )
    N, P = len(prompts) * n, max(len(p) for p in prompts)
    R = c.input_ids.shape[1] - P
    assert c.input_ids.shape == c.attention_mask.shape == c.response_mask.shape == c.sampling_logp.shape
    assert c.input_ids.shape[0] == N and 1 <= R <= max_tokens and c.prompt_length == P
    assert c.input_ids.dtype == torch.long and c.response_mask.dtype == torch.float32
    assert c.sampling_logp.dtype == torch.float32
    assert c.prompt_index.tolist() == [i for i in range(len(prompts)) for _ in range(n)]
    assert len(c.finish_reason) == N and c.policy_version == 0
    for j in range(N):
        p = prompts[j // n]
        assert c.input_ids[j, P - len(p) : P].tolist() == p  # left-padded prompt
        assert c.input_ids[j, : P - len(p)].eq(PAD).all() and c.attention_mask[j, : P - len(p)].eq(0).all()
        assert c.attention_mask[j, P - len(p) : P].eq(1).all()
    assert c.response_mask[:, :P].eq(0).all() and c.sampling_logp[:, :P].eq(0).all()
    assert torch.equal(c.response_lengths, c.response_mask.sum(-1).long())
    assert int(c.response_lengths.max()) == R


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_sampling_logprobs_equal_trainer_logprobs(policy, prompts, temperature):
    model, tok = policy
    c = HFEngine(model, tok).generate(
        prompts, 8, SamplingParams(temperature=temperature, max_tokens=24, seed=11)
    )
    mask = c.response_mask.bool()
    # the random-init model samples EOS and pad tokens: both paths are exercised
    assert "stop" in c.finish_reason and "length" in c.finish_reason
    assert (c.input_ids.eq(PAD) & mask).any(), "expected a sampled pad token inside a response"
    with torch.no_grad():
        trainer = sequence_token_logprobs(model, c.input_ids, c.attention_mask, temperature=temperature)
    assert (trainer[mask] - c.sampling_logp[mask]).abs().max().item() <= 1e-5
    assert c.sampling_logp[~mask].eq(0).all()
    assert (c.sampling_logp[mask] < 0).all()


def test_masks_come_from_eos_not_pad_ids():
    script = [
        [5, PAD, EOS, 7, 8],  # a sampled pad is an ordinary response token
        [EOS, 9, 9, 9, 9],
        [5, 6, 7, 8, 9],  # never stops
        [PAD, PAD, PAD, EOS, 4],
    ]
    tok = SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD)
    prompts = [[BOS, 10, 11], [BOS, 12], [BOS], [BOS, 13]]
    c = HFEngine(ScriptedLM(script), tok).generate(
        prompts, 1, SamplingParams(temperature=1.0, max_tokens=4, seed=0)
    )
    P = 3
    assert c.response_lengths.tolist() == [3, 1, 4, 4]
    assert c.finish_reason == ["stop", "stop", "length", "stop"]
    assert c.input_ids[:, P:].tolist() == [
        [5, PAD, EOS, PAD],
        [EOS, PAD, PAD, PAD],
        [5, 6, 7, 8],
        [PAD, PAD, PAD, EOS],
    ]
    assert c.response_mask[:, P:].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    assert c.attention_mask[:, P:].tolist() == c.response_mask[:, P:].long().tolist()
    assert c.attention_mask[:, :P].tolist() == [[1, 1, 1], [0, 1, 1], [0, 0, 1], [0, 1, 1]]
    assert c.response_token_ids() == [[5, PAD], [], [5, 6, 7, 8], [PAD, PAD, PAD]]
    assert c.response_token_ids(include_eos=True)[0] == [5, PAD, EOS]
    # all mass on the scripted token: log-prob ~0 on the mask, exactly 0 off it
    assert c.sampling_logp[c.response_mask.bool()].abs().max() < 1e-3
    assert c.sampling_logp[~c.response_mask.bool()].eq(0).all()


def test_decode_responses_stops_at_eos(policy):
    _model, tok = policy
    digits = [tok.convert_tokens_to_ids(ch) for ch in "46"]
    script = [digits + [EOS, digits[0]], [digits[1], PAD, digits[0], digits[1]]]
    c = HFEngine(ScriptedLM(script, vocab=len(tok)), tok).generate(
        [[BOS], [BOS]], 1, SamplingParams(temperature=1.0, max_tokens=4, seed=0)
    )
    assert c.decode_responses(tok) == ["46", "6" + "4" + "6"]  # pad is special: skipped in text


def test_same_seed_same_samples_and_global_rng_untouched(policy, prompts):
    model, tok = policy
    engine = HFEngine(model, tok)
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=7)
    torch.manual_seed(0)
    rng = torch.get_rng_state()
    a = engine.generate(prompts, 4, params)
    b = HFEngine(model, tok).generate(prompts, 4, params)
    c = engine.generate(prompts, 4, SamplingParams(temperature=1.0, max_tokens=8, seed=8))
    assert torch.equal(rng, torch.get_rng_state())
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.sampling_logp, b.sampling_logp)
    assert not torch.equal(a.input_ids, c.input_ids)
    # seed=None draws from the engine's own generator, which advances between calls
    d = engine.generate(prompts, 4, SamplingParams(temperature=1.0, max_tokens=8))
    e = engine.generate(prompts, 4, SamplingParams(temperature=1.0, max_tokens=8))
    assert not torch.equal(d.input_ids, e.input_ids)


def test_completions_depend_on_seed_and_position_not_on_sharding(policy, prompts):
    """A shard generated with its prompt offset reproduces its rows of the whole batch: the same tokens and masks,
    and log-probs equal up to float rounding (a shard pads its prompts to its own longest one, which changes the
    shapes of the masked attention)."""
    from rl_core.rollout import completion_seeds, concat_completions

    model, tok = policy
    engine = HFEngine(model, tok)
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=11)
    whole = engine.generate(prompts, 3, params)
    parts = [engine.generate(prompts[:2], 3, params, prompt_offset=0),
             engine.generate(prompts[2:3], 3, params, prompt_offset=2),
             engine.generate(prompts[3:], 3, params, prompt_offset=3)]
    joined = concat_completions(parts)
    for field in ("input_ids", "attention_mask", "response_mask", "prompt_index"):
        assert torch.equal(getattr(joined, field), getattr(whole, field)), field
    torch.testing.assert_close(joined.sampling_logp, whole.sampling_logp, atol=1e-5, rtol=0)
    assert joined.finish_reason == whole.finish_reason and joined.prompt_length == whole.prompt_length
    # the same shard at another position samples differently: position is part of the seed
    moved = engine.generate(prompts[2:3], 3, params, prompt_offset=4)
    assert not torch.equal(moved.input_ids[:, -6:], parts[1].input_ids[:, -6:])
    seeds = completion_seeds(11, 0, 64, 8)
    assert len(set(seeds)) == 64 * 8 and all(0 <= x < 2**63 for x in seeds)
    assert completion_seeds(11, 5, 2, 8) == seeds[5 * 8: 7 * 8]


def test_shards_of_different_policy_versions_keep_each_tokens_version(policy, prompts, tmp_path):
    """Two engines that started a step's shards on versions 0 and 3 (one took new weights between two calls): the
    joined completions are version 0 (the oldest, what the staleness bound checks) and each response token keeps its
    shard's version; a trainer at version 4 sees them 4 and 1 versions behind. The per-token versions survive the
    rollout cache's file."""
    from rl_core.rollout import Completions, concat_completions

    model, tok = policy
    a = HFEngine(model, tok).generate(prompts[:1], 2, SamplingParams(max_tokens=3, seed=1))
    b = HFEngine(model, tok, policy_version=3).generate(prompts[1:2], 2, SamplingParams(max_tokens=3, seed=1))
    assert a.token_version is None and a.staleness(4) == (4.0, 4)  # one version: every token is policy_version's
    joined = concat_completions([a, b])
    assert joined.policy_version == 0
    on = joined.response_mask > 0
    expected = torch.tensor([0, 0, 3, 3]).unsqueeze(1).expand_as(on) * on  # rows 0-1 from a, 2-3 from b
    assert torch.equal(joined.token_version, expected)
    n_a, n_b = int(on[:2].sum()), int(on[2:].sum())
    assert joined.staleness(4) == pytest.approx(((4 * n_a + 1 * n_b) / (n_a + n_b), 4))
    joined.save(tmp_path / "c.safetensors")
    assert torch.equal(Completions.load(tmp_path / "c.safetensors").token_version, expected)
    with pytest.raises(ValueError, match="n or eos/pad"):
        concat_completions([a, HFEngine(model, tok).generate(prompts[:1], 3, SamplingParams(max_tokens=3, seed=1))])


def test_weights_loaded_from_another_thread_land_between_two_decoding_steps(policy, prompts):
    """rollout.in_flight_updates: a load asked for while the engine decodes waits for the forward running, then the
    decoding goes on with the new weights. The new weights zero the final norm, so every logit is 0 and each token
    sampled after the load has log-prob -log(V) exactly; the load is asked for during the forward behind position 2
    (the prefill is position 0's), so positions 0-2 carry version 0 and their model's log-probs, positions 3 on
    version 1 and -log(V)."""
    import copy
    import math
    import threading
    import time

    model, tok = copy.deepcopy(policy[0]), policy[1]
    engine = HFEngine(model, tok)
    new = {k: v.clone() for k, v in model.state_dict().items()}
    new["model.norm.weight"].zero_()
    forwards, loader = [], []

    def during_forward(_module, _args):
        forwards.append(1)
        if len(forwards) == 3:  # the forward behind position 2's logits
            loader.append(threading.Thread(target=engine.update_weights, args=(new, 1)))
            loader[0].start()
            while not engine.swap.load_waiting:  # the load is asked for while this forward runs
                time.sleep(0.001)

    hook = model.register_forward_pre_hook(during_forward)
    try:
        out = engine.generate(prompts, 2, SamplingParams(temperature=1.0, max_tokens=8, seed=3))
    finally:
        hook.remove()
        for t in loader:
            t.join()
    assert engine.policy_version == 1 and out.policy_version == 0
    P, on = out.prompt_length, out.response_mask > 0
    position = torch.arange(out.input_ids.shape[1]).expand_as(on) - P
    assert bool((on & (position >= 3)).any()), "no row decoded past the load"
    assert torch.equal(out.token_version, ((position >= 3) & on).long())
    vocab = model.get_output_embeddings().weight.shape[0]
    after, before = out.sampling_logp[on & (position >= 3)], out.sampling_logp[on & (position < 3)]
    assert torch.allclose(after, torch.full_like(after, -math.log(vocab)), atol=1e-5)
    assert not torch.allclose(before, torch.full_like(before, -math.log(vocab)), atol=1e-3)


def _reference_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Greedy decoding with full forwards and no cache: an independent reference."""
    ids = list(prompt)
    out = []
    for _ in range(steps):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        nxt = int(logits.argmax())
        out.append(nxt)
        if nxt == EOS:
            break
        ids.append(nxt)
    return out


def test_greedy_matches_uncached_argmax_and_tiny_top_p_is_greedy(policy, prompts):
    model, tok = policy
    engine = HFEngine(model, tok)
    g = engine.generate(prompts, 2, SamplingParams(max_tokens=10, greedy=True, seed=1))
    z = engine.generate(prompts, 1, SamplingParams(temperature=0.0, max_tokens=10, seed=2))
    for i, p in enumerate(prompts):
        expected = _reference_greedy(model, p, 10)
        assert g.response_token_ids(include_eos=True)[2 * i] == expected
        assert g.response_token_ids(include_eos=True)[2 * i + 1] == expected
        assert z.response_token_ids(include_eos=True)[i] == expected
    # top_p so small that only the top token survives: sampling reduces to greedy, while the
    # returned log-prob is still that of the full temperature-scaled distribution
    t = engine.generate(prompts, 2, SamplingParams(temperature=0.8, top_p=1e-6, max_tokens=10, seed=3))
    assert torch.equal(t.input_ids, g.input_ids)
    with torch.no_grad():
        trainer = sequence_token_logprobs(model, t.input_ids, t.attention_mask, temperature=0.8)
    mask = t.response_mask.bool()
    assert (trainer[mask] - t.sampling_logp[mask]).abs().max() <= 1e-5
    assert (t.sampling_logp[mask] < -1e-3).any()  # not the renormalised nucleus (which would be 0)


def test_nucleus_sampling_stays_inside_top_p_mass(policy):
    model, tok = policy
    prompt = [tok("7+8=")["input_ids"]]
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=torch.tensor(prompt)).logits[0, -1].float(), -1)
    top_p = 0.3
    sorted_p, order = probs.sort(descending=True)
    keep = set(order[: int((sorted_p.cumsum(0) < top_p).sum()) + 1].tolist())
    c = HFEngine(model, tok).generate(
        prompt, 200, SamplingParams(temperature=1.0, top_p=top_p, max_tokens=1, seed=0)
    )
    first = set(c.input_ids[:, c.prompt_length].tolist())
    assert first <= keep and len(keep) < len(probs)


def test_update_weights_sets_version_and_changes_samples(policy, tmp_path, prompts):
    _, tok = policy
    model, _ = load_policy(ModelConfig(name_or_path=str(build_tiny_model(tmp_path / "a", seed=0))))
    other, _ = load_policy(ModelConfig(name_or_path=str(build_tiny_model(tmp_path / "b", seed=3))))
    engine = HFEngine(model, tok)
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=0)
    before = engine.generate(prompts, 2, params)
    engine.update_weights(other.state_dict(), version=5)
    after = engine.generate(prompts, 2, params)
    assert engine.policy_version == 5 and after.policy_version == 5 and before.policy_version == 0
    assert all(torch.equal(v, other.state_dict()[k]) for k, v in model.state_dict().items())
    assert not torch.equal(before.input_ids, after.input_ids)
    with pytest.raises(KeyError, match="state dict does not match"):
        engine.update_weights({"bogus.weight": torch.zeros(1)}, version=6)


def test_generate_serves_the_quickstart_batch_with_one_group_per_prompt(policy):
    """The quickstart's batch shape: 8 prompts x 8 completions. (How fast: `make bench`, bench_pipeline's
    `generate` column; a timing bound here failed on loaded CI machines.)"""
    model, tok = policy
    prompts = [
        tok(f"{a}+{b}=")["input_ids"]
        for a, b in [(1, 2), (12, 34), (5, 67), (99, 9), (3, 4), (10, 1), (7, 70), (45, 54)]
    ]
    engine = HFEngine(model, tok)
    c = engine.generate(prompts, 8, SamplingParams(temperature=1.0, max_tokens=4, seed=0))
    assert len(c) == 64
    assert c.prompt_index.tolist() == [i for i in range(8) for _ in range(8)]


def test_build_completions_cuts_after_first_eos():
    c = build_completions(
        [[BOS, 5], [BOS]],
        [[7, EOS, 9], [PAD, 8, 8], [EOS], [6]],
        [[-0.1, -0.2, -0.3], [-1.0, -2.0, -3.0], [-0.5], [-0.7]],
        n=2,
        eos_token_id=EOS,
        pad_token_id=PAD,
        max_tokens=3,
        policy_version=4,
    )
    assert c.input_ids.tolist() == [
        [BOS, 5, 7, EOS, PAD],
        [BOS, 5, PAD, 8, 8],
        [PAD, BOS, EOS, PAD, PAD],
        [PAD, BOS, 6, PAD, PAD],
    ]
    assert c.response_lengths.tolist() == [2, 3, 1, 1]
    assert c.finish_reason == ["stop", "length", "stop", "length"]
    assert c.sampling_logp[0].tolist() == pytest.approx([0, 0, -0.1, -0.2, 0])
    assert c.prompt_index.tolist() == [0, 0, 1, 1] and c.policy_version == 4


def test_make_engine_selects_backend_and_never_imports_vllm_on_cpu(policy, monkeypatch):
    import rl_core.rollout

    model, tok = policy
    assert isinstance(make_engine(RolloutConfig(backend="hf"), model, tok), HFEngine)
    # the module imported afresh, in a process where vllm is not imported (an earlier test of this pytest worker
    # may have loaded an engine): the module import must not import vllm
    for name in [m for m in sys.modules if m.split(".")[0] == "vllm" or m == "rl_core.rollout.vllm"]:
        monkeypatch.delitem(sys.modules, name)
    if hasattr(rl_core.rollout, "vllm"):
        monkeypatch.delattr(rl_core.rollout, "vllm")
    importlib.import_module("rl_core.rollout.vllm")
    assert "vllm" not in sys.modules
    if importlib.util.find_spec("vllm") is None:  # CPU machine: a clear error, not an ImportError
        with pytest.raises(RuntimeError, match="rollout.backend=hf"):
            make_engine(RolloutConfig(backend="vllm"), model, tok, model_path="x")
    with pytest.raises(ValueError, match="model_path"):
        make_engine(RolloutConfig(backend="vllm"), model, tok)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
