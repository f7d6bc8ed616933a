"""Guess the number: a multi-turn environment where the replies matter (docs/agents.md; recipes/guess_number.py
trains with it).

Each row holds a secret number from 1 to `high` (9 by default; its `answer` column) behind the same prompt for every row, so nothing
but the environment's replies tells the secret: the policy guesses one number per turn and hears "higher" or
"lower" until it names the secret, or `rollout.max_turns` runs out. The reward is 1.0 when it found the number, so
the held-out `val/accuracy` is the success rate. A policy deaf to the replies finds it in four guesses at best 4
times in 9; one that halves the range every turn always does.

The rows (`make_rows`) and the warm start's games (`make_transcripts`: the format, and the replies heeded in a
share of the games) are written by the DVC stage `guess_number`; the stage `guess_warm_start` trains the tiny model on the
games (`dvc repro pipelines/guess_number/dvc.yaml` runs both).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rl_core.agents import Environment, Reply, Turn


def prompt(high: int) -> str:
    return f"Guess my number from 1 to {high}."


class GuessNumber(Environment):
    """One game: the row's `answer` is the secret; each assistant turn is a guess."""

    def reset(self) -> list[dict]:
        self.secret, self.solved = int(self.example.answer), False
        self.high = int(self.example.columns.get("high", 9))
        return super().reset()  # the row's prompt as the user's message

    def respond(self, turn: Turn) -> Reply:
        guess = turn.content.strip()
        if guess == str(self.secret):
            self.solved = True
            return Reply(done=True)
        if not guess.isdigit():
            hint = f"a number from 1 to {self.high}"
        else:
            hint = "higher" if int(guess) < self.secret else "lower"
        return Reply([{"role": "user", "content": hint}])

    def reward(self) -> float:
        return float(self.solved)


def make_rows(seed: int = 0, high: int = 9, train_size: int = 2000,
              val_size: int = 200) -> tuple[list[dict], list[dict]]:
    """Secrets drawn uniformly from 1..`high` with `seed`; every row's prompt is `prompt(high)`."""
    import random

    rng = random.Random(seed)
    rows = [{"prompt": prompt(high), "answer": str(rng.randint(1, high)), "high": high}
            for _ in range(train_size + val_size)]
    return rows[val_size:], rows[:val_size]


def make_transcripts(seed: int = 0, count: int = 4000, max_turns: int = 4, high: int = 9,
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
            messages.append({"role": "user", "content": "higher" if guess < secret else "lower"})
            low, top = (max(low, guess + 1), top) if guess < secret else (low, min(top, guess - 1))
        out.append({"messages": messages})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="write the guess-the-number example's train.jsonl and val.jsonl")
    parser.add_argument("--out", default="data/guess-number")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--high", type=int, default=9, help="secrets are 1..HIGH")
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
