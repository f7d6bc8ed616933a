"""An episode whose conversation stops extending itself (a compacted or edited history, `Reply(new_sample=True)`, an
agent's request that rewrites earlier turns) goes on in a new sample: the ids so far are one training row, the next
opens with the new conversation rendered as a prompt; every sample of an episode carries the episode's reward and
advantage, a group's statistics count each episode once, and the batch is filled to the ranks' split
(rl_core.agents.episode, rl_core.annotate, rl_core.batch.gate)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rl_core.agents import Environment, Episode, Reply
from rl_core.agents.rollout import episode_stats, episodes_to_completions
from rl_core.annotate import annotate
from rl_core.batch.dynamic_sampling import select_groups
from rl_core.batch.gate import BatchValidationError, validate_annotations, validate_batch_tensors
from rl_core.config import RLConfig
from rl_core.evaluation.closed_forms import group_advantages
from rl_core.rollout.base import Completions, concat_completions
from rl_core.tasks import Example
from tests.rl_core.test_agents import calculator, ids_of, sample, tokenizer


class Compacts(Environment):
    """Its first turn is answered with a compacted conversation (the opening and a note of what the policy said) as a
    new sample without tools, when the row's answer is 'split'; its second turn (or, for 'stay', its first) ends it."""

    tools = (calculator,)

    def reset(self):
        self.answered = 0
        return [{"role": "user", "content": self.example.prompt}]

    def respond(self, turn):
        self.answered += 1
        if self.answered == 1 and self.example.answer == "split":
            return Reply([{"role": "user", "content": self.example.prompt},
                          {"role": "user", "content": "note: " + turn.content}], new_sample=True, tools=[])
        return Reply(done=True)

    def reward(self):
        return 1.0


def played(answers: list[str], turns: list[list[str]], max_tokens: int = 400) -> list[Episode]:
    """One episode per answer, each played with its scripted turns (stopping after each)."""
    tok = tokenizer()
    out = []
    for answer, texts in zip(answers, turns, strict=True):
        episode = Episode(Compacts(Example("2+2", answer)), tok, max_turns=4, max_tokens=max_tokens)
        for text in texts:
            if not episode.done:
                sample(episode, text)
        out.append(episode)
    return out


def test_a_new_sample_keeps_the_sampled_ids_as_one_row_and_opens_the_next_with_the_new_conversation():
    tok = tokenizer()
    (episode,) = played(["split"], [["<x>"]])
    opening = tok.apply_chat_template([{"role": "user", "content": "2+2"}], tools=[{
        "type": "function", "function": {"name": "calculator"}}], tokenize=False, add_generation_prompt=True)
    (first,) = episode.earlier
    turn = ids_of(tok, "<x>") + [tok.eos_token_id]
    assert first.ids == ids_of(tok, opening) + turn  # the opening with its tools, then the turn as sampled
    assert first.sampled == [False] * first.prompt_len + [True] * len(turn)
    assert first.logp == [0.0] * first.prompt_len + [-0.5] * len(turn)
    # the new sample: the compacted conversation rendered as a prompt, without tools, nothing of it the policy's
    compacted = [{"role": "user", "content": "2+2"}, {"role": "user", "content": "note: <x>"}]
    text = tok.apply_chat_template(compacted, tools=None, tokenize=False, add_generation_prompt=True)
    assert "tools:" not in text and episode.tools is None
    assert episode.ids == ids_of(tok, text) and not any(episode.sampled) and episode.prompt_len == len(episode.ids)
    sample(episode, "4")
    assert episode.done and not episode.truncated
    assert episode.ids[episode.prompt_len:] == ids_of(tok, "4") + [tok.eos_token_id]
    record = episode.record(1.0)
    assert record["prompt"] == [{"role": "user", "content": "2+2"}]  # the opening, whatever followed
    assert record["completion"] == [{"role": "user", "content": "note: <x>"}, {"role": "assistant", "content": "4"}]
    assert record["stats"]["samples"] == 2 and record["stats"]["turns"] == 2
    assert record["stats"]["sampled_tokens"] == len(turn) + 2
    assert episode_stats([record, played(["stay"], [["4"]])[0].record(0.0)])["rollout/new_samples"] == 1.0


def test_a_new_sample_that_does_not_fit_or_cannot_render_ends_the_episode_and_keeps_it_one_sample():
    tok = tokenizer()

    class Verbose(Compacts):  # its note repeats the turn three times
        def respond(self, turn):
            return Reply([{"role": "user", "content": "note: " + turn.content * 3}], new_sample=True)

    opening = tok.apply_chat_template([{"role": "user", "content": "2+2"}], tools=[{
        "type": "function", "function": {"name": "calculator"}}], tokenize=False, add_generation_prompt=True)
    turn = "x" * 20
    budget = len(ids_of(tok, opening + turn)) + 1  # the first turn fits to its stop token, the note cannot
    episode = Episode(Verbose(Example("2+2", "split")), tok, max_turns=4, max_tokens=budget)
    sample(episode, turn)
    assert episode.done and episode.truncated and episode.cut_by == "max_episode_tokens"
    assert episode.oversized_replies == 1 and not episode.earlier and len(episode.samples) == 1
    assert len(episode.ids) == budget

    class Unrenderable(Compacts):
        def respond(self, turn):
            return Reply([{"role": "user", "content": None}], new_sample=True)

    strict = tokenizer(tok.chat_template.replace("{% else %}{{ m.role }}: {{ m.content }}",
                                                 "{% else %}{{ m.role }}: {{ m.content + '' }}"))
    episode = Episode(Unrenderable(Example("2+2", "split")), strict, max_turns=4, max_tokens=400)
    sample(episode, "4")
    assert episode.done and episode.cut_by == "environment_error" and not episode.earlier
    assert episode.env_error.startswith("the chat template cannot render the new sample's messages")


def completions_of(episodes: list[Episode], n: int) -> Completions:
    tok = episodes[0].tokenizer
    out = episodes_to_completions(episodes, n=n, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                  policy_version=0)
    out.episodes = [e.record(1.0) for e in episodes]  # as rollout_episodes attaches them
    return out


def test_earlier_samples_travel_with_their_episodes_rows_through_save_select_and_concat(tmp_path):
    episodes = played(["stay", "split", "split", "stay"], [["4"], ["<x>", "4"], ["<yy>", "5"], ["6"]])
    out = completions_of(episodes, n=2)
    assert len(out) == 4 and out.earlier_samples is not None and out.earlier_samples.prompt_index.tolist() == [1, 2]
    for j, episode in enumerate([episodes[1], episodes[2]]):
        (first,) = episode.earlier
        real = out.earlier_samples.attention_mask[j] > 0
        assert out.earlier_samples.input_ids[j][real].tolist() == first.ids
        assert out.earlier_samples.response_mask[j][real].tolist() == [float(s) for s in first.sampled]
    assert out.earlier_samples.finish_reason == ["stop", "stop"]
    path = tmp_path / "c.safetensors"
    out.save(path)
    back = Completions.load(path)
    for name in ("input_ids", "response_mask", "sampling_logp", "prompt_index"):
        assert torch.equal(getattr(back.earlier_samples, name), getattr(out.earlier_samples, name))
    picked = select_groups(out, [1])  # the second group's two episodes: rows 2 and 3, the earlier sample of row 2
    assert picked.earlier_samples.prompt_index.tolist() == [0]
    assert torch.equal(picked.earlier_samples.input_ids, out.earlier_samples.input_ids[1:])
    assert select_groups(out, [0]).earlier_samples.prompt_index.tolist() == [1]
    assert out.rows([1, 1]).earlier_samples.prompt_index.tolist() == [0]  # a row listed twice: its samples once
    both = concat_completions([out, out])
    assert both.earlier_samples.prompt_index.tolist() == [1, 2, 5, 6]
    # the batch's versions (staleness, lags) count the earlier samples' tokens too
    assert out.sampled_versions().numel() == sum(sum(s.sampled) for e in episodes for s in e.samples)
    assert out.sampled_versions().numel() > int((out.response_mask > 0).sum())


def test_every_sample_of_an_episode_carries_its_reward_and_advantage_and_the_batch_fills_to_its_split():
    episodes = played(["split", "stay", "stay", "split"], [["<x>", "4"], ["4"], ["5"], ["<yy>", "6"]])
    rewards = [1.0, 0.0, 0.5, 0.25]
    annotated = annotate(completions_of(episodes, n=2), rewards, [10, 42], rl=RLConfig(), first_sample_id=100,
                         row_multiple=4)
    batch, table = annotated.batch, annotated.table
    assert batch.batch_size == 8  # 4 episodes, 2 earlier samples, 2 rows of filler to a multiple of 4
    expected = group_advantages(rewards, [0, 0, 1, 1], unbiased=False, eps=1e-6)  # over the episodes, once each
    np.testing.assert_allclose(batch.advantages[:4].numpy(), expected, rtol=1e-6)
    np.testing.assert_allclose(batch.advantages[4:6].numpy(), [expected[0], expected[3]], rtol=1e-6)
    assert batch.advantages[6:].tolist() == [0.0, 0.0] and batch.loss_mask[6:].sum() == 0
    assert batch.rewards.tolist()[:6] == [*rewards, 1.0, 0.25]
    assert table["sample_of"].tolist() == [100, 101, 102, 103, 100, 103, -1, -1]
    assert table["group_size"].tolist()[:6] == [2] * 6 and table["group_id"].tolist()[:6] == [0, 0, 1, 1, 0, 1]
    assert batch.loss_mask[4].sum() == len(ids_of(episodes[0].tokenizer, "<x>")) + 1  # the earlier sample's turn
    assert annotated.stats["rollout/reward_mean"] == pytest.approx(sum(rewards) / 4)
    assert annotated.stats["rollout/new_samples"] == 2.0
    validate_annotations(table, max_tokens=400)
    validate_batch_tensors(batch, table, annotated.sampled)
    wrong = table.copy()
    wrong.loc[4, "advantage"] += 0.5
    with pytest.raises(BatchValidationError, match="shares_its_episode"):
        validate_annotations(wrong, max_tokens=400)
    loose = table.copy()
    loose.loc[6, "masked_len"] = 0
    with pytest.raises(BatchValidationError, match="filler_row"):
        validate_annotations(loose, max_tokens=400)
    missing = table.drop(index=1)  # an episode's row gone: its group is incomplete, whatever its samples
    with pytest.raises(BatchValidationError, match="complete_groups"):
        validate_annotations(missing, max_tokens=400)


def test_a_batch_without_new_samples_is_annotated_as_before():
    episodes = played(["stay"] * 4, [["4"], ["5"], ["4"], ["6"]])
    plain = annotate(completions_of(episodes, n=2), [1.0, 0.0, 0.5, 0.25], [10, 42], rl=RLConfig(),
                     first_sample_id=0, row_multiple=4)
    assert plain.batch.batch_size == 4 and plain.table["sample_of"].tolist() == [0, 1, 2, 3]


def test_the_batch_row_multiple_is_what_the_ranks_and_their_mini_and_micro_batches_split():
    from rl_core.config import load_config
    from rl_core.placement.run_shape import batch_row_multiple, mini_batch_rows
    from tests.conftest import recipe

    cfg = load_config(recipe("arithmetic"), ["cluster.num_workers=2", "rollout.prompts_per_step=8", "rollout.n=4",
                                             "rl.mini_batch_per_replica=8", "rl.micro_batch_per_replica=2"])
    assert batch_row_multiple(cfg) == 2 * (8 * 4 // 2 // 8) * 2
    assert batch_row_multiple(load_config(recipe("arithmetic"), [])) == 1
    # a rank's 16 rows are 2 optimizer steps of 8 (rl.mini_batch_per_replica); 20 rows of samples, 2 steps of 10
    assert mini_batch_rows(cfg, 16) == 8 and mini_batch_rows(cfg, 20) == 10
    assert mini_batch_rows(load_config(recipe("arithmetic"), []), 20) is None  # the whole shard, one step


def compacting_agent(client, row):
    """Calls the calculator, then sends the conversation with its first assistant turn rewritten (a note in place of
    what the policy wrote, its call kept) and the result: a request that does not extend the recorded conversation."""
    from tests.rl_core.test_gateway import CALC, MODEL, run_calls

    messages = [{"role": "user", "content": row["prompt"]}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[CALC]).choices[0].message
    call = first.model_dump(include={"role", "content", "tool_calls"}, exclude_none=True)
    messages += [{**call, "content": "I will add them."}, *run_calls(first)]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=[CALC]).choices[0].message
    return float(final.content.strip() == row["answer"])


def test_an_agent_that_rewrites_its_conversation_trains_on_two_samples_each_exactly_as_sampled():
    from rl_core.primitives.logprobs import sequence_token_logprobs
    from tests.rl_core.test_gateway import CALC, play

    out, engine, model, tok = play(compacting_agent)
    assert [r["reward"] for r in out.episodes] == [1.0] * 4  # the new sample saw the result and answered it
    assert episode_stats(out.episodes)["rollout/new_samples"] == 4.0
    for record in out.episodes:
        assert record["stats"]["samples"] == 2 and record["stats"]["turns"] == 2 and record["stats"]["tool_calls"] == 1
    earlier = out.earlier_samples
    assert earlier.prompt_index.tolist() == [0, 1, 2, 3]
    written = {tuple(prompt): ids for prompt, ids in engine.turns}
    for rows, j in [(earlier, j) for j in range(4)] + [(out, j) for j in range(4)]:
        real = rows.attention_mask[j] > 0
        ids, mask = rows.input_ids[j][real].tolist(), rows.response_mask[j][real].tolist()
        start = mask.index(1.0)
        assert all(mask[start:]) and written[tuple(ids[:start])] == ids[start:]  # one turn, as the engine wrote it
    for j, example in enumerate(r for r in ("12+30", "7+8") for _ in range(2)):
        real = out.attention_mask[j] > 0
        prompt = out.input_ids[j][real].tolist()[:int(out.response_mask[j][real].tolist().index(1.0))]
        result = str(sum(map(int, example.split("+"))))
        rewritten = [{"role": "user", "content": example},
                     {"role": "assistant", "content": "I will add them.", "tool_calls": [
                         {"type": "function", "function": {"name": "calculator",
                                                           "arguments": {"expression": example}}}]},
                     {"role": "tool", "content": result}]
        assert prompt == ids_of(tok, tok.apply_chat_template(rewritten, tools=[CALC], tokenize=False,
                                                             add_generation_prompt=True))
    with torch.no_grad():
        for rows in (out, earlier):
            trainer = sequence_token_logprobs(model, rows.input_ids, rows.attention_mask, temperature=1.0,
                                              loss_mask=rows.response_mask)
            assert ((trainer - rows.sampling_logp) * rows.response_mask).abs().max().item() <= 1e-5
