"""How a rollout's episodes reach the engines (`rollout.episode_scheduling`): each on its own, or in lock-step.

`per_episode` (the default): every episode is a coroutine of its own. It sends its next turn to its engine as soon
as its environment has answered the last one; each engine keeps a queue, and whenever it is free it takes every
request waiting there as one batched `generate` call (`max_tokens` the largest budget among them; a row that
sampled past its own budget is cut there and counts as not stopped). An episode stays on the engine it started on
for its life (a prefix cache there keeps its context); a new episode goes to the engine with the fewest live
episodes. The environment calls run in threads, one per call in flight (`host.respond` waits on the environment's
actor, `data.env_timeout_s` bounding it): a slow tool holds back only its own episode.

`lock_step`: every live episode advances one turn per batched call over all engines, and the environments answer
all of a call's turns before the next call. It samples the same tokens as `per_episode` (the seeds below), but
which rows share a call is fixed by the data instead of by when the environments answered, so its log-probs repeat
bit for bit from run to run. Under `per_episode` they agree to float rounding (an engine's logits of a row move by
~1e-6 in float32 with the other rows of its batch): choose `lock_step` where an agent run must repeat bit for bit
(an exact resume compared to the uninterrupted run), at the cost of every episode waiting for the slowest turn.

Seeds: turn `t` of episode `j` (its place in the rollout) samples with `episode_seed(seed, j, t)`, whichever rows
share its engine call (`SamplingParams.row_seeds`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, NamedTuple

from rl_core.agents.episode import Episode
from rl_core.rollout.base import Completions, SamplingParams
from rl_core.rollout.seeds import SEED_MODULUS, completion_seeds

SCHEDULES = ("per_episode", "lock_step")


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of turn `turn` of a draw seeded `seed` (unrelated streams for neighbouring turns)."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + (turn + 1) * 0xBF58476D1CE4E5B9) % 2**64
    x ^= x >> 31
    return int(x % SEED_MODULUS)


def episode_seed(seed: int, episode: int, turn: int) -> int:
    """The seed of turn `turn` of episode `episode` (its place in the rollout) in a draw seeded `seed`."""
    return completion_seeds(turn_seed(seed, turn), episode, 1, 1)[0]


class EpisodeRun(NamedTuple):
    calls: int  # engine calls (batches), over all engines
    generate_s: float  # seconds inside the engines' generate: the busiest engine's sum (engines run side by side)
    policy_version: int  # the oldest policy version that sampled a token


class Sampled(NamedTuple):
    """One row of an engine call: the sampled ids, their log-probs and policy versions, how it finished."""

    ids: list[int]
    logps: list[float]
    versions: list[int]
    finish: str


def sampled_rows(out: Completions) -> list[Sampled]:
    """Each row's sampled tokens; their versions are the call's `policy_version`, or `token_version`'s when set."""
    rows = []
    for r, finish in enumerate(out.finish_reason):
        on = out.response_mask[r] > 0
        ids = out.input_ids[r][on].tolist()
        versions = [int(out.policy_version)] * len(ids) if out.token_version is None else \
            out.token_version[r][on].tolist()
        rows.append(Sampled(ids, out.sampling_logp[r][on].tolist(), versions, finish))
    return rows


class Versions:
    """The policy versions that sampled a rollout's tokens. Unless `mixed` (`rl.async_steps`: a weight sync may land
    between two engine calls of an episode, or inside one), every token must come from one version."""

    def __init__(self, mixed: bool):
        self.mixed, self.seen = mixed, set()

    def add(self, row: Sampled) -> None:
        self.seen.update(row.versions)
        if len(self.seen) > 1 and not self.mixed:
            raise RuntimeError(f"the engines' weights changed during the episodes (policy versions "
                               f"{sorted(self.seen)}); an on-policy step's episodes must all be sampled by one policy")

    @property
    def oldest(self) -> int:
        return min(self.seen, default=0)


def turn_params(sampling: SamplingParams, budgets: Sequence[int], seeds: Sequence[int]) -> SamplingParams:
    """One engine call's sampling: the largest budget, and each row's own seed (`episode_seed`) when seeded."""
    return replace(sampling, max_tokens=max(budgets), row_seeds=None if sampling.seed is None else tuple(seeds))


def run_episodes(engine: Any, episodes: list[Episode], sampling: SamplingParams, host: Any = None,
                 keys: Sequence[Hashable] | None = None, *, schedule: str = "per_episode",
                 mixed_versions: bool = False) -> EpisodeRun:
    """Sample every episode to its end (`sampling.max_tokens`: per turn), episode j seeded as the j-th. The
    environments answer through `host` (`keys[j]` is episode j's there, `rl_core.agents.host`), or, without a host,
    each episode's own (`Episode.add_turn`). Every token comes from one policy version unless `mixed_versions`."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: one of {SCHEDULES}")
    versions = Versions(mixed_versions)
    if schedule == "lock_step":
        return _lock_step(engine, episodes, sampling, host, keys, versions)
    return _own_loop(_per_episode(engine, episodes, sampling, host, keys, versions))


def _lock_step(engine: Any, episodes: list[Episode], sampling: SamplingParams, host: Any,
               keys: Sequence[Hashable] | None, versions: Versions) -> EpisodeRun:
    calls, generate_s = 0, 0.0
    while live := [j for j, e in enumerate(episodes) if not e.done]:
        budgets = [episodes[j].turn_budget(sampling.max_tokens) for j in live]
        if min(budgets) < 1:
            raise RuntimeError("a live episode has no token left for its next turn")  # Episode ends it before
        seeds = [episode_seed(sampling.seed, j, calls) for j in live] if sampling.seed is not None else []
        out = engine.generate([episodes[j].ids for j in live], 1, turn_params(sampling, budgets, seeds))
        calls += 1
        generate_s += float(getattr(engine, "last_generate_s", 0.0))
        waiting = []
        for (j, budget), row in zip(zip(live, budgets), sampled_rows(out), strict=True):
            versions.add(row)
            stopped = row.finish == "stop" and len(row.ids) <= budget
            taken = row.ids[:budget], row.logps[:budget], stopped, row.versions[:budget]
            if host is None:
                episodes[j].add_turn(*taken)
            elif (turn := episodes[j].take_turn(*taken)) is not None:
                waiting.append((j, turn))
        if waiting:
            answers = host.respond([(keys[j], turn) for j, turn in waiting])
            for (j, _), answer in zip(waiting, answers, strict=True):
                episodes[j].answer(answer)
    return EpisodeRun(calls, generate_s, versions.oldest)


class _Lane:
    """One engine's queue: whenever the engine is free, every request waiting is one batched call (in `thread`)."""

    def __init__(self, engine: Any, sampling: SamplingParams, thread: ThreadPoolExecutor):
        self.engine, self.sampling, self.thread = engine, sampling, thread
        self.waiting: list[tuple[list[int], int, int, asyncio.Future]] = []
        self.draining = False
        self.live = 0  # episodes on this engine, not yet ended
        self.calls, self.busy_s = 0, 0.0

    def sample(self, ids: list[int], budget: int, seed: int) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.waiting.append((ids, budget, seed, future))
        if not self.draining:
            self.draining = True
            loop.create_task(self._drain())
        return future

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> tuple[Completions, float]:
        out = self.engine.generate(prompts, 1, params)
        return out, float(getattr(self.engine, "last_generate_s", 0.0))  # read in the thread that called

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self.waiting:
                await asyncio.sleep(0)  # the episodes ready now join this call
                batch, self.waiting = self.waiting, []
                params = turn_params(self.sampling, [b for _, b, _, _ in batch], [s for _, _, s, _ in batch])
                began = time.perf_counter()
                try:
                    out, seconds = await loop.run_in_executor(self.thread, self._generate, [r[0] for r in batch],
                                                              params)
                    rows = sampled_rows(out)
                except BaseException as exc:  # noqa: BLE001 - every request of the call fails with it
                    for *_, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                self.calls += 1
                self.busy_s += seconds or time.perf_counter() - began
                for (*_, future), row in zip(batch, rows, strict=True):
                    if not future.done():
                        future.set_result(row)
        finally:
            self.draining = False


def _lanes(engine: Any) -> list[Any]:
    """The engines requests go to: an `infra.workers.engines.EnginePool`'s one by one, or the engine itself."""
    return engine.lanes() if hasattr(engine, "lanes") else [engine]


async def _per_episode(engine: Any, episodes: list[Episode], sampling: SamplingParams, host: Any,
                       keys: Sequence[Hashable] | None, versions: Versions) -> EpisodeRun:
    loop = asyncio.get_running_loop()
    engines = _lanes(engine)
    with ThreadPoolExecutor(len(engines), thread_name_prefix="engine") as engine_threads, \
            ThreadPoolExecutor(max(1, len(episodes)), thread_name_prefix="environment") as env_threads:
        lanes = [_Lane(e, sampling, engine_threads) for e in engines]

        def in_thread(fn: Callable, *args: Any) -> asyncio.Future:
            return loop.run_in_executor(env_threads, fn, *args)

        async def play(j: int, episode: Episode) -> None:
            lane = min(lanes, key=lambda lane: lane.live)  # the least loaded engine, for the episode's life
            lane.live += 1
            try:
                turn = 0
                while not episode.done:
                    budget = episode.turn_budget(sampling.max_tokens)
                    if budget < 1:
                        raise RuntimeError("a live episode has no token left for its next turn")
                    seed = episode_seed(sampling.seed, j, turn) if sampling.seed is not None else 0
                    row = await lane.sample(episode.ids, budget, seed)
                    versions.add(row)
                    stopped = row.finish == "stop" and len(row.ids) <= budget
                    taken = row.ids[:budget], row.logps[:budget], stopped, row.versions[:budget]
                    if host is None:  # the episode's own environment answers, in a thread
                        await in_thread(episode.add_turn, *taken)
                    elif (turn_taken := episode.take_turn(*taken)) is not None:
                        (answer,) = await in_thread(host.respond, [(keys[j], turn_taken)])
                        episode.answer(answer)
                    turn += 1
            finally:
                lane.live -= 1

        await asyncio.gather(*(play(j, e) for j, e in enumerate(episodes)))
    busiest = max(lanes, key=lambda lane: lane.busy_s)
    return EpisodeRun(sum(lane.calls for lane in lanes), busiest.busy_s, versions.oldest)


def _own_loop(coroutine: Any) -> Any:
    """Run `coroutine` to its end on an event loop of its own (in a thread of its own when this thread runs one)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(1, thread_name_prefix="episodes") as thread:
        return thread.submit(asyncio.run, coroutine).result()
