"""Episode scheduling: agent rollouts per episode vs in lock-step, same policy, same engine, same episodes.

An environment with uneven episodes (`Uneven`): episode j plays 1 + j mod 6 turns (the environment answers each turn
with a short user message until then), and one environment call in ten (picked by the episode and the turn, the
same under both schedules) waits a second, as a slow tool does. The policy is the quickstart's warm start with the
tool-use example's chat template and its <eos> logit raised by `--eos-bias` (turns of a few tokens that stop); the
engine is the HF engine in this process (float32, one thread per engine call), the environments answer in this
process too (`data.env_workers=0`). Each schedule rolls the same `--episodes` episodes (`--rounds` times, the first
round a warm-up left out), seeded alike: both sample the same tokens (checked).

Columns: episodes per second, engine calls per round, mean rows per engine call, seconds inside the engine's
generate per round, and the speed-up of per-episode scheduling over lock-step.

    python benchmarks/bench_episode_scheduling.py [--episodes 64] [--rounds 3] [--slow-s 1.0]

The quickstart's tiny model is taken from the checkout when built (`make demo`), else built there first.
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

from rl_core.agents import Environment, Reply

SLOW_S = 1.0


def slow_call(episode: int, turn: int) -> bool:
    """One environment call in ten waits (by the episode and the turn: the same calls under both schedules)."""
    return (episode * 7 + turn * 3) % 10 == 0


class Uneven(Environment):
    """Episode j (its row's `answer`) plays 1 + j mod 6 turns; one call in ten waits `SLOW_S` seconds."""

    def reset(self):
        self.j, self.turn = int(self.example.answer), 0
        return [{"role": "user", "content": self.example.prompt}]

    def respond(self, turn):
        self.turn += 1
        if slow_call(self.j, self.turn):
            time.sleep(SLOW_S)
        if self.turn >= 1 + self.j % 6:
            return Reply(done=True)
        return Reply([{"role": "user", "content": "go on"}])

    def reward(self):
        return 0.0


def policy(eos_bias: float):
    """The quickstart's warm start with the tool example's chat template; its <eos> logit raised by `eos_bias`."""
    import torch

    from examples.tool_arithmetic import TEMPLATE
    from infra.artifacts import ensure_quickstart_artifacts
    from rl_core.config import load_config
    from rl_core.model.loading import load_policy

    cfg = load_config("recipes/arithmetic.py")
    ensure_quickstart_artifacts(cfg)
    torch.set_num_threads(1)
    model, tokenizer = load_policy(cfg.model, device=torch.device("cpu"), dtype="float32")
    tokenizer.chat_template = TEMPLATE
    eos = tokenizer.eos_token_id

    def lift(module, args, out):
        out[..., eos] += eos_bias
        return out

    model.lm_head.register_forward_hook(lift)
    return model.eval(), tokenizer


def rollout(engine, tokenizer, rows, scheduling: str, seed: int):
    from rl_core.agents.rollout import rollout_episodes
    from rl_core.rollout import SamplingParams
    from rl_core.tasks.environment import EnvironmentTask

    task = EnvironmentTask(Uneven, "bench_episode_scheduling:Uneven")
    sampling = SamplingParams(temperature=1.0, max_tokens=8, seed=seed)
    began = time.perf_counter()
    out, generate_s = rollout_episodes(engine, task, rows, tokenizer, 1, sampling, max_turns=6,
                                       max_episode_tokens=512, scheduling=scheduling)
    return out, time.perf_counter() - began, generate_s


class Counting:
    """The engine, counting its calls and rows."""

    def __init__(self, engine):
        self.engine, self.calls, self.rows = engine, 0, 0

    def generate(self, prompt_ids, n, sampling, prompt_offset=0):
        self.calls += 1
        self.rows += len(prompt_ids) * n
        out = self.engine.generate(prompt_ids, n, sampling, prompt_offset)
        self.last_generate_s = self.engine.last_generate_s
        return out


def main() -> int:
    global SLOW_S
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="rollouts per schedule; the first is a warm-up")
    parser.add_argument("--slow-s", type=float, default=1.0, help="seconds a slow environment call waits")
    parser.add_argument("--eos-bias", type=float, default=3.0)
    args = parser.parse_args()
    SLOW_S = args.slow_s

    import torch

    from rl_core.rollout import HFEngine
    from rl_core.tasks import Example

    model, tokenizer = policy(args.eos_bias)
    rows = [Example(f"{j}+{j}=", str(j)) for j in range(args.episodes)]
    results, samples = {}, {}
    for scheduling in ("lock_step", "per_episode"):
        engine = Counting(HFEngine(model, tokenizer))
        walls, gens, calls, rows_n = [], [], 0, 0
        for r in range(args.rounds):
            engine.calls = engine.rows = 0
            out, wall, generate_s = rollout(engine, tokenizer, rows, scheduling, seed=100 + r)
            if r == 0:
                continue  # warm-up
            walls.append(wall)
            gens.append(generate_s)
            calls, rows_n = calls + engine.calls, rows_n + engine.rows
            samples.setdefault(r, {})[scheduling] = out
        measured = args.rounds - 1
        results[scheduling] = {"eps": args.episodes * measured / sum(walls), "calls": calls / measured,
                               "rows": rows_n / max(1, calls), "gen": sum(gens) / measured,
                               "turns": sum(e["stats"]["turns"] for e in out.episodes) / args.episodes}
        print(scheduling, results[scheduling], flush=True)
    for r, pair in samples.items():  # the same episodes under both schedules
        a, b = pair["lock_step"], pair["per_episode"]
        if not torch.equal(a.input_ids, b.input_ids):
            print(f"round {r}: the schedules sampled different tokens", file=sys.stderr)
            return 1
    base = results["lock_step"]["eps"]
    header = ["schedule", "episodes/s", "engine calls / round", "rows / call", "generate s / round",
              "turns / episode", "speed-up"]
    table = [[name, f"{v['eps']:.1f}", f"{v['calls']:.0f}", f"{v['rows']:.1f}", f"{v['gen']:.2f}",
              f"{v['turns']:.2f}", f"{v['eps'] / base:.2f}×"] for name, v in results.items()]
    notes = [(f"{args.episodes} episodes of 1-6 turns (8 tokens at most each), one environment call in ten waiting "
              f"{args.slow_s:g} s; {args.rounds - 1} measured rounds after a warm-up; both schedules sampled the "
              "same tokens.")]
    write_section("episode-scheduling", header, table, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
