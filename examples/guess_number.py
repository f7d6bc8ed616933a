"""Guess the number: a multi-turn environment where the replies matter (docs/agents.md; recipes/guess_number.py
trains with it).

Each row holds a secret number from 1 to `high` (its `high` column, else `HIGH`, 6; the secret is its `answer`)
behind the same prompt for every row, so nothing but the environment's replies tells the secret: the policy guesses
one number per turn and hears "higher" or "lower", with the numbers the replies so far leave ("higher: 4-6"),
until it names the secret, or `rollout.max_turns` runs out. The reward is 1.0 when it found the number, so the
held-out `val/accuracy` is the success rate. With 1..6 and four guesses, a policy deaf to the replies finds the
number at best 4 times in 6 (never guessing a number twice); one that halves what the replies leave always does,
in three.

The rows (`make_rows`) and the warm start's games (`make_transcripts`: the format, and the replies heeded in a
share of the games) are written by the DVC stage `guess_number`; the stage `guess_warm_start` trains the tiny model on the
games (`dvc repro pipelines/guess_number/dvc.yaml` runs both).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rl_core.agents import Environment, Reply, Turn

HIGH = 6  # secrets are 1..HIGH unless a row says otherwise (its `high` column)


def prompt(high: int) -> str:
    return f"Guess my number from 1 to {high}."


class GuessNumber(Environment):
    """One game: the row's `answer` is the secret; each assistant turn is a guess."""

    def reset(self) -> list[dict]:
        self.secret, self.solved = int(self.example.answer), False
        self.high = int(self.example.columns.get("high", HIGH))
        self.low, self.top = 1, self.high  # what the replies so far leave
        return super().reset()  # the row's prompt as the user's message

    def respond(self, turn: Turn) -> Reply:
        guess = turn.content.strip()
        if guess == str(self.secret):
            self.solved = True
            return Reply(done=True)
        if not guess.isdigit():
            return Reply([{"role": "user", "content": f"a number from 1 to {self.high}"}])
        self.low, self.top = narrowed(self.low, self.top, int(guess), self.secret)
        return Reply([{"role": "user", "content": hint(int(guess), self.secret, self.low, self.top)}])

    def reward(self) -> float:
        return float(self.solved)


def narrowed(low: int, top: int, guess: int, secret: int) -> tuple[int, int]:
    """What is left of `low..top` once `guess` is told to be below or above `secret`."""
    return (max(low, guess + 1), top) if guess < secret else (low, min(top, guess - 1))


def hint(guess: int, secret: int, low: int, top: int) -> str:
    """The reply to a wrong guess: its direction and the numbers left, e.g. "higher: 4-6"."""
    return f"{'higher' if guess < secret else 'lower'}: {low}-{top}"


def _guesses(completion) -> tuple[list[str], list[str]]:
    """An episode's guesses (the assistant messages) and the replies (the user messages) that followed them."""
    return ([m["content"].strip() for m in completion if m["role"] == "assistant"],
            [m["content"].strip() for m in completion if m["role"] == "user"])


def heeds_replies(completions, high, **kwargs) -> list[float]:
    """The share of an episode's guesses after its first that lie within what the replies so far leave (1.0 for
    an episode of one guess): dense credit for listening, which the found-or-not reward gives only at the end."""
    out = []
    for completion, top in zip(completions, high):
        guesses, replies = _guesses(completion)
        low, top, inside = 1, int(top), []
        for i, guess in enumerate(guesses):
            if i:
                inside.append(guess.isdigit() and low <= int(guess) <= top)
            reply = replies[i] if i < len(replies) else ""
            if guess.isdigit() and reply.startswith("higher"):  # the direction; the range is recomputed here
                low = max(low, int(guess) + 1)
            elif guess.isdigit() and reply.startswith("lower"):
                top = min(top, int(guess) - 1)
        out.append(sum(inside) / len(inside) if inside else 1.0)
    return out


def make_rows(seed: int = 0, high: int = HIGH, train_size: int = 2000,
              val_size: int = 200) -> tuple[list[dict], list[dict]]:
    """Secrets drawn uniformly from 1..`high` with `seed`; every row's prompt is `prompt(high)`."""
    import random

    rng = random.Random(seed)
    rows = [{"prompt": prompt(high), "answer": str(rng.randint(1, high)), "high": high}
            for _ in range(train_size + val_size)]
    return rows[val_size:], rows[:val_size]


def make_transcripts(seed: int = 0, count: int = 4000, max_turns: int = 4, high: int = HIGH,
                     heeding: float = 0.0) -> list[dict]:
    """Whole games for the warm start (`posttrain warm-start --chats`), answered as `GuessNumber` answers them: in
    a `heeding` share of them each guess is drawn uniformly from the numbers the replies so far leave, in the others
    from 1..`high` whatever the replies say. They teach the format (a digit, then the end of the turn, after every
    reply) and, in part, to heed the replies; heeding them always is left to RL."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(count):
        secret = rng.randint(1, high)
        heeds = rng.random() < heeding  # guesses within what the replies so far allow
        low, top = 1, high
        messages = [{"role": "user", "content": prompt(high)}]
        for turn in range(max_turns):
            guess = rng.randint(low, top) if heeds else rng.randint(1, high)
            messages.append({"role": "assistant", "content": str(guess)})
            if guess == secret or turn == max_turns - 1:
                break
            low, top = narrowed(low, top, guess, secret)
            messages.append({"role": "user", "content": hint(guess, secret, low, top)})
        out.append({"messages": messages})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="write the guess-the-number example's train.jsonl and val.jsonl")
    parser.add_argument("--out", default="data/guess-number")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--high", type=int, default=HIGH, help="secrets are 1..HIGH")
    parser.add_argument("--max-turns", type=int, default=4, help="guesses per warm-start game")
    parser.add_argument("--heeding", type=float, default=0.0,
                        help="share of warm-start games whose guesses heed the replies (random within the range left)")
    args = parser.parse_args(argv)
    train, val = make_rows(args.seed, args.high)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    games = make_transcripts(args.seed, max_turns=args.max_turns, high=args.high, heeding=args.heeding)
    warm_val = len(games) // 20
    splits = (("train", train), ("val", val), ("warm-train", games[warm_val:]), ("warm-val", games[:warm_val]))
    for name, rows in splits:
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(train)} train and {len(val)} held-out rows, and {len(games)} warm-start games, to {out}/")


if __name__ == "__main__":
    main()
