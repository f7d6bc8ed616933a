"""A token-exact multi-turn episode: the policy's turns kept as the ids it sampled, the environment's turns appended
as the ids of the chat template's delta for the new messages.

    ids      the opening prompt (the chat template with the tools and the generation prompt), then the turns
    sampled  True on the tokens the policy sampled (its turns up to and including each stop token): the loss mask
    logp     the sampler's log-prob of each sampled token, 0 elsewhere
    rewards  a turn's own reward (`Reply.reward`) on its last sampled token, 0 elsewhere

Why not re-render the conversation with the chat template after each turn: the text of a sampled turn tokenizes
back to other ids than the sampler produced (another segmentation of the same text), and many templates rewrite
earlier turns (Qwen3's drops the `<think>` block of every turn before the last user message). The trainer would
then compute log-probs of a sequence the sampler never produced, and the importance ratio would compare two
different things. Here nothing already in `ids` is ever re-tokenized.

The delta of the environment's messages is rendered against a fixed two-message anchor conversation and cut right
after the stop token that ends the anchor's assistant turn: it holds whatever the template puts after that token
(a newline, say) and the new messages, up to the next generation prompt. A template that renders the anchor's
turns differently once more messages follow cannot give a delta, and is refused naming the fix.

Limits: `max_turns` assistant turns, and `max_tokens` for each of its samples (prompt included). A turn that runs
out of tokens before its stop token, or an episode that reaches a limit before the environment ends it, is
`truncated`.

Samples. An environment may answer a turn with a conversation that does not extend the one so far
(`Reply(new_sample=True)`: a compacted or edited history, an agent's request that rewrites earlier turns). Its
messages cannot be a delta after ids already sampled without training the policy on tokens it did not sample,
so the ids so far end as one sample (`earlier`) and the next sample opens with the new conversation rendered as
a prompt (with its tools and the generation prompt), all masked. Each sample is its own row of the batch with its
own loss mask; they share the episode's reward and advantage (`rl_core.annotate`), so the group's baseline
counts the episode once. Turns count over the episode (`max_turns`), tokens per sample (`max_tokens`).

The budget before the template: the environment's messages (a tool's output, a reply, the opening) are rendered
and tokenized only as far as the budget left can need (`bounded`). Their text is cut to `CHARS_PER_TOKEN`
characters per token left, plus `MARGIN_TOKENS`, and that prefix is rendered; when it already overflows the
budget by the margin, the whole does too (a text never has fewer tokens than its prefix, less those the cut
splits: the margin), and it is never rendered. When the prefix fits, the bound was too tight for this tokenizer
or template (tokens that span many characters, a template that shows part of a message): the prefix doubles
until it overflows or is the whole. So a reply that fits is never cut, whatever the tokenizer, and one that
does not costs about as much as the budget it overflows, not as much as its length: 20 MB of tool output is
not tokenized whole in the driver. The cut text is only ever measured; a reply that does not fit ends the
episode unrendered (`oversized_replies`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from rl_core.agents.environment import Environment, Turn
from rl_core.agents.host import Answer, LocalEnvironments, Opening
from rl_core.agents.tools import tool_call_format

ANCHOR = ({"role": "user", "content": "1"}, {"role": "assistant", "content": "2"})
CHARS_PER_TOKEN = 8  # the first guess of the characters a token spans (English text: about 4); it only saves renders
MARGIN_TOKENS = 64  # tokens a cut may change at its end (a split word), and more than the first prefix must overflow


def _texts(message: Any) -> list[str]:
    """The text of a message that the cut counts: a string `content`, or the `text` of its content parts."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return [content]
    parts = content if isinstance(content, list) else ()
    return [p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]


def cut_messages(messages: Sequence[Any], chars: int) -> tuple[list[Any], bool]:
    """`messages` with at most `chars` characters of text in all (`_texts`), cut where that runs out and the later
    messages left out; and whether anything was cut."""
    out: list[Any] = []
    for message in messages:
        size = sum(map(len, _texts(message)))
        if size > chars:
            return [*out, _cut(message, chars)], True
        chars -= size
        out.append(message)
    return out, False


def _cut(message: dict, chars: int) -> dict:
    """`message` with its text (`_texts`) cut after `chars` characters; content parts after the cut left out."""
    if isinstance(message["content"], str):
        return {**message, "content": message["content"][:chars]}
    parts = []
    for part in message["content"]:
        text = part.get("text") if isinstance(part, dict) else None
        if isinstance(text, str) and len(text) > chars:
            parts.append({**part, "text": text[:chars]})
            break
        chars -= len(text) if isinstance(text, str) else 0
        parts.append(part)
    return {**message, "content": parts}


def bounded(render: Callable[[list[Any]], list[int]], messages: Sequence[Any], room: int) -> tuple[list[int], bool]:
    """`(ids, fits)`: `render(messages)`'s ids and whether they are fewer than `room`, without rendering more of the
    messages' text than deciding that needs (module docstring); when they do not fit, `ids` may be a prefix's."""
    chars = (room + MARGIN_TOKENS) * CHARS_PER_TOKEN
    while True:
        shown, cut = cut_messages(messages, chars)
        ids = render(shown)
        if not cut:
            return ids, len(ids) < room
        if len(ids) >= room + MARGIN_TOKENS:
            return ids, False
        chars *= 2


def _render(tokenizer, messages: Sequence[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tools=tools, tokenize=False,
                                         add_generation_prompt=generation_prompt)


def template_delta(tokenizer, messages: Sequence[dict], *, stop_text: str, tools: list[dict] | None = None) -> list[int]:
    """The ids the chat template puts after an assistant turn's stop token `stop_text` for `messages`, through the
    generation prompt of the next assistant turn."""
    before = _render(tokenizer, ANCHOR, tools, False)
    after = _render(tokenizer, [*ANCHOR, *messages], tools, True)
    if not after.startswith(before):
        raise ValueError("the chat template renders earlier turns differently once more messages follow, so the "
                         "environment's turns cannot be appended as a delta; use a template that leaves earlier "
                         "turns as they are (for Qwen3, one that keeps every <think> block)")
    end = before.rfind(stop_text)
    if not stop_text or end < 0:
        raise ValueError(f"the chat template does not end an assistant turn with the stop token {stop_text!r}; "
                         "generation must stop on the token the template closes a turn with")
    return list(tokenizer(after[end + len(stop_text):], add_special_tokens=False)["input_ids"])


@dataclass(frozen=True)
class Sample:
    """One training sample of an episode (module docstring): its ids, which of them the policy sampled, their
    log-probs and policy versions, and the length of its prompt."""

    ids: list[int]
    sampled: list[bool]
    logp: list[float]
    versions: list[int]
    prompt_len: int
    rewards: list[float]


class Episode:
    """One environment's conversation, turn by turn (layout and limits in the module docstring). The engine samples
    from `ids` at most `turn_budget()` tokens; `take_turn` records them, and the environment's answer to the turn
    (`rl_core.agents.host`) goes to `answer`, until `done`.

    `start` is the episode's `Opening` (its environment lives in a host), or an `Environment` to keep in this
    process: then `add_turn` does both halves."""

    def __init__(self, start: Opening | Environment, tokenizer, *, max_turns: int, max_tokens: int):
        if max_turns < 1 or max_tokens < 1:
            raise ValueError(f"max_turns={max_turns} and max_tokens={max_tokens} must be >= 1")
        self.env: Environment | None = None
        if isinstance(start, Environment):
            self.env, self._local = start, LocalEnvironments()
            start = self._local.adopt(0, start)
            if start.error:
                raise RuntimeError(start.error)
        self.tokenizer = tokenizer
        self.tool_format = tool_call_format(getattr(tokenizer, "chat_template", None))  # how its turns write calls
        self.max_turns, self.max_tokens = max_turns, max_tokens
        self.tools = start.tools
        self.turn_cap = start.max_tokens  # the next turn's own cap, if its environment set one
        self.env_s = start.seconds  # seconds inside the environment (reset, respond, reward)
        self.env_error: str | None = None  # why the environment failed, if it did (the episode ended there)
        self.tool_calls = self.tool_errors = self.refused_requests = 0  # the environment's counts, as of its last answer
        self.oversized_replies = 0  # replies that did not fit the budget left (the episode ended there)
        self.messages: list[dict] = list(start.messages)
        self.opening = list(self.messages)  # the opening messages (`record`'s prompt), whatever samples follow
        self.earlier: list[Sample] = []  # the episode's samples before the one in `ids` (module docstring)
        self.sample_turns = 0  # the turns of the earlier samples
        try:
            prompt, fits = self._prompt(self.messages, self.tools)
        except Exception as exc:  # noqa: BLE001 - the template refused what the environment (or an agent) sent
            raise ValueError(f"the chat template cannot render the opening messages and tools "
                             f"({type(exc).__name__}: {exc})") from None
        if not fits:
            chars = sum(len(text) for m in self.messages for text in _texts(m))
            measured = f"{len(prompt)} tokens" if len(prompt) < max_tokens + MARGIN_TOKENS else \
                f"more than {max_tokens} tokens ({chars} characters of text)"
            raise ValueError(f"the opening prompt has {measured}, the episode's budget is {max_tokens}")
        self._open_sample(prompt)
        self.turns: list[Turn] = []
        self.turn_tokens: list[int] = []  # the ids each turn sampled
        self.done = self.truncated = False
        self.cut_by: str | None = None  # what ended a truncated episode: one of CUT_LIMITS, or "environment_error"
        self.started = True
        self._stop_id: int | None = None  # the stop token of the turn waiting for its answer

    @classmethod
    def unstarted(cls, tokenizer, error: str, seconds: float = 0.0) -> Episode:
        """An episode that could not start (its environment's construction or `reset` failed, or its opening prompt
        does not fit the episode's budget): ended, one placeholder token (the tokenizer's BOS, else EOS), nothing
        sampled, `env_error` saying why. It keeps its row's place in the batch with no loss token; its record is no
        opening message and one empty assistant turn."""
        episode = cls.__new__(cls)
        first = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        episode.env, episode.tokenizer, episode.tools = None, tokenizer, None
        episode.max_turns = episode.max_tokens = 0
        episode.env_s, episode.env_error, episode.tool_calls, episode.tool_errors = seconds, error, 0, 0
        episode.refused_requests = 0
        episode.oversized_replies, episode.turn_cap = 0, None
        # what reward functions read: no opening messages, one empty assistant turn (the policy said nothing)
        episode.messages, episode.turns = [{"role": "assistant", "content": ""}], []
        episode.opening, episode.earlier, episode.sample_turns = [], [], 0
        episode.turn_tokens = []
        episode.ids, episode.sampled, episode.logp, episode.prompt_len = [int(first)], [False], [0.0], 1
        episode.versions, episode.rewards = [0], [0.0]
        episode.done, episode.truncated, episode.started, episode._stop_id = True, False, False, None
        episode.cut_by = None
        return episode

    def _prompt(self, messages: Sequence[dict], tools: list[dict] | None) -> tuple[list[int], bool]:
        """A sample's prompt for `messages` and `tools`, and whether it leaves room for a sampled token (`bounded`)."""
        return bounded(lambda shown: list(self.tokenizer.apply_chat_template(
            shown, tools=tools, add_generation_prompt=True, tokenize=True)["input_ids"]), messages, self.max_tokens)

    def _open_sample(self, prompt: list[int]) -> None:
        self.ids, self.sampled, self.logp = prompt, [False] * len(prompt), [0.0] * len(prompt)
        self.versions = [0] * len(prompt)  # the policy version that sampled each token (0 where none did)
        self.rewards = [0.0] * len(prompt)  # a turn's own reward on its last sampled token (Reply.reward)
        self.prompt_len = len(prompt)

    @property
    def samples(self) -> list[Sample]:
        """Every sample of the episode, the one in `ids` last."""
        return [*self.earlier, Sample(self.ids, self.sampled, self.logp, self.versions, self.prompt_len, self.rewards)]

    def turn_budget(self, per_turn: int) -> int:
        """The most tokens the next turn may sample: `per_turn`, less if the episode's budget ends sooner."""
        cap = per_turn if self.turn_cap is None else min(per_turn, self.turn_cap)
        return max(0, min(cap, self.max_tokens - len(self.ids)))

    def add_turn(self, ids: Sequence[int], logps: Sequence[float], stopped: bool,
                 versions: int | Sequence[int] = 0) -> None:
        """`take_turn`, then the answer of the environment this episode keeps in this process."""
        if self.env is None:
            raise RuntimeError("this episode's environment lives in a host: take_turn, then answer with its reply")
        turn = self.take_turn(ids, logps, stopped, versions)
        if turn is not None:
            self.answer(self._local.respond([(0, turn)])[0])

    def take_turn(self, ids: Sequence[int], logps: Sequence[float], stopped: bool,
                  versions: int | Sequence[int] = 0) -> Turn | None:
        """The policy's next turn as sampled; `stopped` when its last id is the stop token (else it ran out of
        tokens, and the episode ends truncated); `versions`: the policy version that sampled each id (or one for
        all). The turn, when the environment is to answer it, else None."""
        if self.done or self._stop_id is not None:
            raise RuntimeError("the episode has ended or waits for an answer; it takes no turn now")
        if len(ids) != len(logps) or not ids:
            raise ValueError(f"a turn needs one log-prob per sampled id and at least one id (got {len(ids)} ids, "
                             f"{len(logps)} log-probs)")
        versions = [int(versions)] * len(ids) if isinstance(versions, int) else [int(v) for v in versions]
        if len(versions) != len(ids):
            raise ValueError(f"a turn needs one policy version per sampled id (got {len(versions)} for {len(ids)})")
        turn = replace(Turn.parse(self.tokenizer.decode(list(ids), skip_special_tokens=True), self.tool_format),
                       sampled_tokens=len(ids), context_tokens=len(self.ids))
        room = self.max_tokens - len(self.ids)  # the turn's budget was the least of this, its cap and per-turn max
        self.ids += [int(i) for i in ids]
        self.sampled += [True] * len(ids)
        self.logp += [float(x) for x in logps]
        self.versions += versions
        self.rewards += [0.0] * len(ids)
        self.turns.append(turn)
        self.turn_tokens.append(len(ids))
        self.messages.append(turn.message)
        if not stopped:
            self._end(truncated=True, cut_by="max_episode_tokens" if len(ids) >= room else
                      "turn_cap" if self.turn_cap is not None and len(ids) >= self.turn_cap else "max_tokens")
            return None
        self._stop_id = int(ids[-1])
        return turn

    def answer(self, answer: Answer) -> None:
        """The environment's answer to the turn `take_turn` gave: its messages are appended as the template's delta,
        or the episode ends (the environment ended it, failed, or a limit is reached)."""
        if self._stop_id is None:
            raise RuntimeError("no turn waits for an answer")
        stop_id, self._stop_id = self._stop_id, None
        self.env_s += answer.seconds
        self.tool_calls, self.tool_errors, self.refused_requests = answer.tool_calls, answer.tool_errors, answer.refused
        if answer.error is not None or answer.reply is None:
            self.env_error = answer.error or "the environment gave no reply"
            self._end(truncated=True, cut_by="environment_error")
            return
        reply = answer.reply
        self.turn_cap = reply.max_tokens
        if reply.reward is not None:  # the answered turn's own reward, on its last sampled token
            self.rewards[-1] += float(reply.reward)
        if reply.done:
            self._end(truncated=False)
            return
        if len(self.turns) >= self.max_turns:
            self._end(truncated=True, cut_by="max_turns")
            return
        if reply.new_sample:
            self._new_sample(reply)
            return
        stop_text = self.tokenizer.decode([stop_id])
        try:
            delta, fits = bounded(lambda shown: template_delta(self.tokenizer, shown, tools=self.tools,
                                                               stop_text=stop_text),
                                  reply.messages, self.max_tokens - len(self.ids))
        except ValueError:
            raise  # the template itself cannot give deltas: a configuration to fix, named by template_delta
        except Exception as exc:  # noqa: BLE001 - the template refused this reply's messages: this episode ends
            self.env_error = f"the chat template cannot render the reply ({type(exc).__name__}: {exc})"
            self._end(truncated=True, cut_by="environment_error")
            return
        if not fits:  # no room left for a token of the next turn
            self.oversized_replies += 1
            self._end(truncated=True, cut_by="max_episode_tokens")
            return
        self.messages += reply.messages
        self.ids += delta
        self.sampled += [False] * len(delta)
        self.logp += [0.0] * len(delta)
        self.versions += [0] * len(delta)
        self.rewards += [0.0] * len(delta)

    def _new_sample(self, reply: Any) -> None:
        """The episode goes on in a new sample that opens with `reply.messages` (module docstring); it ends instead
        when the template cannot render them or they leave no room for a token."""
        tools = self.tools if reply.tools is None else (list(reply.tools) or None)
        try:
            prompt, fits = self._prompt(reply.messages, tools)
        except Exception as exc:  # noqa: BLE001 - the template refused this conversation: this episode ends
            self.env_error = f"the chat template cannot render the new sample's messages ({type(exc).__name__}: {exc})"
            self._end(truncated=True, cut_by="environment_error")
            return
        if not fits:
            self.oversized_replies += 1
            self._end(truncated=True, cut_by="max_episode_tokens")
            return
        self.earlier.append(self.samples[-1])
        self.sample_turns = len(self.turns)
        self.tools, self.messages = tools, list(reply.messages)
        self._open_sample(prompt)

    def _end(self, truncated: bool, cut_by: str | None = None) -> None:
        self.done, self.truncated, self.cut_by = True, truncated, cut_by

    def stats(self) -> dict[str, Any]:
        """Per-episode counts for the step's metrics."""
        return {"turns": len(self.turns), "tool_calls": self.tool_calls, "tool_errors": self.tool_errors,
                "refused_requests": self.refused_requests,
                "truncated": self.truncated, "cut_by": self.cut_by, "env_errors": int(self.env_error is not None),
                "started": self.started,
                "oversized_replies": self.oversized_replies, "tokens": len(self.ids),
                "sampled_tokens": sum(sum(s.sampled) for s in self.samples), "samples": 1 + len(self.earlier),
                "last_sample_turns": len(self.turns) - self.sample_turns,
                "turn_tokens": list(self.turn_tokens), "env_s": self.env_s}

    def record(self, reward: float) -> dict:
        """The episode as JSON: the opening messages (`prompt`), the rest of the conversation in TRL's form
        (`completion`: assistant turns with their tool calls, tool results, the environment's messages), its
        `reward` and `stats`, and each assistant turn's sampled text where one of its calls did not parse
        (`malformed_turns`, None for the others). After a new sample, the conversation is the last sample's, after
        the opening messages it still begins with; its earlier assistant turns are as the environment sent them."""
        start = next((i for i, (a, b) in enumerate(zip(self.messages, self.opening)) if a != b),
                     min(len(self.messages), len(self.opening)))  # the opening messages it still begins with
        completion = self.messages[start:]
        own = [t.text if any(c.error for c in t.calls) else None for t in self.turns[self.sample_turns:]]
        resent = sum(m.get("role") == "assistant" for m in completion) - len(own)
        return {"prompt": self.opening, "completion": completion,
                "reward": reward, "stats": self.stats(), "error": self.env_error,
                # per turn, its text as sampled where a call in it did not parse (TRL's form keeps parsed calls only)
                "malformed_turns": ([None] * max(0, resent) if self.earlier else []) + own}
