"""The guess-the-number example (examples/guess_number.py): the game's replies, the warm start's games, and the
conversation reward the recipe adds to the environment's, each checked on games written out by hand."""

from __future__ import annotations

from examples.guess_number import GuessNumber, heeds_replies, make_transcripts, prompt
from rl_core.agents import Turn
from rl_core.tasks import Example


def play(secret: int, guesses: list[str], high: int = 9) -> tuple[list[dict], float]:
    """The conversation after the opening message (secrets 1..`high`), and the environment's reward."""
    env = GuessNumber(Example(prompt(high), str(secret), columns={"high": high}))
    assert env.reset() == [{"role": "user", "content": prompt(high)}]
    messages = []
    for guess in guesses:
        messages.append({"role": "assistant", "content": guess})
        reply = env.respond(Turn.parse(guess))
        messages += reply.messages
        if reply.done:
            break
    return messages, env.reward()


def test_a_reply_gives_the_direction_and_the_numbers_left():
    messages, reward = play(7, ["5", "9", "x", "7"])
    assert [m["content"] for m in messages if m["role"] == "user"] == [
        "higher: 6-9", "lower: 6-8", "a number from 1 to 9"]
    assert reward == 1.0
    assert play(7, ["1", "2"])[1] == 0.0
    # a guess outside what is left narrows nothing: 2 after "higher: 6-9" leaves 6-9
    assert [m["content"] for m in play(7, ["5", "2"])[0] if m["role"] == "user"] == ["higher: 6-9", "higher: 6-9"]


def test_the_warm_start_games_are_the_environments_games():
    games = [g["messages"][1:] for g in make_transcripts(seed=1, count=60, high=7, heeding=0.5)]
    won = [turns for turns in games if len(turns) < 7]  # fewer than 4 guesses: the last one named the secret
    assert len(won) > 10
    for turns in won:  # replayed against the environment with that secret, the replies are the same
        guesses = [m["content"] for m in turns if m["role"] == "assistant"]
        assert play(int(guesses[-1]), guesses, high=7) == (turns, 1.0)


def test_heeding_is_the_share_of_later_guesses_within_what_the_replies_leave():
    game = play(7, ["5", "8", "2", "7"])[0]  # 8 within 6-9, 2 outside 6-7, 7 within 6-7
    assert heeds_replies([game], high=[9]) == [2 / 3]
    assert heeds_replies([play(7, ["7"])[0]], high=[9]) == [1.0]  # one guess: nothing to heed
    assert heeds_replies([play(3, ["5", "5", "x", "6"])[0]], high=[9]) == [0.0]  # 5 again, not a number, 6 > 4
