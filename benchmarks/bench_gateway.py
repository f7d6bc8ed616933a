"""The gateway's cost per turn: the same conversations played by an environment class and by an agent function on the
OpenAI client behind posttrain's gateway (docs/agents.md, "Bring your own agent").

Each episode is `--turns` turns: the policy's turn, then the user message "go on", until the last turn. `Chat` is the
environment class; `chat_agent` is an agent function that sends the same messages through `openai.OpenAI`. Both run
on the HF engine in this process, the environments in this process too (`data.env_workers=0`), with the same rows
and seeds, under each episode schedule. In lock-step the engine calls hold the same rows on both paths, so both
sample the same tokens with the same log-probs (checked): the difference in wall time is what the gateway adds (an
HTTP round trip per turn, the agent's thread, the JSON of the request and answer), paid one episode after another as
lock-step answers a turn's episodes in turn. Per episode (the default), the round trips overlap the other episodes'
turns, and the rows sharing an engine call differ with the timing, so the tokens agree to float rounding only. The policy is the quickstart's warm start with the tool example's chat template and its <eos>
logit raised by `--eos-bias` (turns of a few tokens that stop).

    python benchmarks/bench_gateway.py [--episodes 32] [--turns 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from report import write_section  # benchmarks/ is this script's sys.path[0]

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.chdir(REPO)

from bench_episode_scheduling import policy

from rl_core.agents import Environment, Reply

TURNS = 4


class Chat(Environment):
    """`TURNS` turns, each answered with "go on" but the last."""

    def reset(self):
        self.turn = 0
        return [{"role": "user", "content": self.example.prompt}]

    def respond(self, turn):
        self.turn += 1
        return Reply(done=True) if self.turn >= TURNS else Reply([{"role": "user", "content": "go on"}])

    def reward(self):
        return 0.0


def chat_agent(client, row):
    """`Chat`'s conversation, driven by the agent through the OpenAI client."""
    messages = [{"role": "user", "content": row["prompt"]}]
    for turn in range(TURNS):
        message = client.chat.completions.create(model="policy", messages=messages).choices[0].message
        messages.append({"role": "assistant", "content": message.content})
        if turn + 1 < TURNS:
            messages.append({"role": "user", "content": "go on"})
    return 0.0


def rollout(engine, tokenizer, rows, environment, seed: int, scheduling: str):
    from rl_core.agents.rollout import rollout_episodes
    from rl_core.rollout import SamplingParams
    from rl_core.tasks.environment import EnvironmentTask

    sampling = SamplingParams(temperature=1.0, max_tokens=8, seed=seed)
    began = time.perf_counter()
    out, generate_s = rollout_episodes(engine, EnvironmentTask(environment, environment.__name__), rows, tokenizer, 1,
                                       sampling, max_turns=TURNS, max_episode_tokens=512, scheduling=scheduling)
    return out, time.perf_counter() - began, generate_s


def main() -> int:
    global TURNS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="rollouts per path; the first is a warm-up")
    parser.add_argument("--eos-bias", type=float, default=3.0)
    args = parser.parse_args()
    TURNS = args.turns

    import torch

    from rl_core.agents.gateway import agent_environment
    from rl_core.rollout import HFEngine
    from rl_core.tasks import Example

    model, tokenizer = policy(args.eos_bias)
    engine = HFEngine(model, tokenizer)
    rows = [Example(f"{j}+{j}=", str(2 * j)) for j in range(args.episodes)]
    paths = {"environment class": Chat, "agent function (gateway)": agent_environment(chat_agent)}
    results, outs = {}, {}
    for scheduling in ("lock_step", "per_episode"):
        for name, environment in paths.items():
            walls, gens, turns = [], [], 0
            for r in range(args.rounds):
                out, wall, generate_s = rollout(engine, tokenizer, rows, environment, 100 + r, scheduling)
                outs.setdefault((scheduling, r), {})[name] = out
                if r == 0:
                    continue  # warm-up (the gateway's server starts here)
                walls.append(wall)
                gens.append(generate_s)
                turns += sum(e["stats"]["turns"] for e in out.episodes)
            results[scheduling, name] = {"wall": sum(walls), "gen": sum(gens), "turns": turns}
            print(scheduling, name, results[scheduling, name], flush=True)
    for (scheduling, r), pair in outs.items():
        a, b = pair.values()
        if scheduling == "lock_step" and not (torch.equal(a.input_ids, b.input_ids)
                                              and torch.equal(a.sampling_logp, b.sampling_logp)):
            print(f"lock-step round {r}: the two paths sampled different tokens", file=sys.stderr)
            return 1
    header = ["schedule", "path", "turns", "wall s", "generate s", "ms / turn", "gateway ms / turn"]
    table = []
    for (scheduling, name), v in results.items():
        base = results[scheduling, "environment class"]
        table.append([scheduling, name, str(v["turns"]), f"{v['wall']:.2f}", f"{v['gen']:.2f}",
                      f"{1000 * v['wall'] / v['turns']:.1f}", f"{1000 * (v['wall'] - base['wall']) / v['turns']:.1f}"])
    notes = [(f"{args.episodes} episodes of {args.turns} turns (8 tokens at most each), {args.rounds - 1} measured "
              "rounds after a warm-up; in lock-step both paths sampled the same tokens with the same log-probs "
              "(checked).")]
    write_section("gateway", header, table, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
