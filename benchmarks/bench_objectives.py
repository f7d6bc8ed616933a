"""Forward + backward time of each policy-gradient surrogate × loss_type on float32 CPU tensors.

    python benchmarks/bench_objectives.py              # B=64,T=1024 and B=256,T=2048, then vs verl
    python benchmarks/bench_objectives.py --quick      # B=16,T=256 (seconds)
    python benchmarks/bench_objectives.py --vs-verl    # only the comparison with verl
    python benchmarks/bench_objectives.py --threads 1  # torch.set_num_threads(1) first

Times the loss math only (per-token surrogate, reduction, numerator / weight, backward to the
log-probs), not a model forward: it shows what the objective adds to a training step. Prints the
median over repeats, in milliseconds.

The comparison with verl times, interleaved in one process on the same tensors (B=256,T=2048 and
B=64,T=512; dual clip c=3, token-mean, per-token advantages), our `clipped_policy_gradient_loss` +
`reduce_policy_gradient_loss` against verl's `compute_policy_loss_vanilla` (which aggregates with
`agg_loss`), after checking that the two losses agree to 1e-6. Without an importable `verl` it
prints our figures for those shapes alone.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl_core.primitives.policy_gradient import (
    LOSS_TYPES,
    clipped_policy_gradient_loss,
    legacy_policy_gradient_loss,
    reduce_policy_gradient_loss,
)

SURROGATES = {
    "clipped/token (dual clip 3)": {"importance_sampling_level": "token", "lower_bound_ratio": 3.0,
                                        "epsilon_low": 0.2, "epsilon_high": 0.28},
    "clipped/sequence (GSPO)": {"importance_sampling_level": "sequence", "lower_bound_ratio": 0.0,
                                    "epsilon_low": 3e-4, "epsilon_high": 4e-4},
    "legacy_pg": None,
}


def make_inputs(b: int, t: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g) * 4
    old = logp + (torch.rand(b, t, generator=g) - 0.5) * 0.2
    adv = torch.randn(b, generator=g)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).float()  # ragged responses
    return logp, old, adv, mask


def step(logp_data, old, adv, mask, surrogate, loss_type, max_len):
    logp = logp_data.detach().requires_grad_(True)
    kwargs = SURROGATES[surrogate]
    if kwargs is None:
        per_token = legacy_policy_gradient_loss(logp, adv, mask)
    else:
        per_token, _ = clipped_policy_gradient_loss(logp, old, adv, mask, **kwargs)
    num, weight = reduce_policy_gradient_loss(per_token, mask, loss_type, max_response_length=max_len)
    (num / weight).backward()
    return logp.grad


def bench(b: int, t: int, repeats: int) -> list[tuple[str, str, float]]:
    logp, old, adv, mask = make_inputs(b, t)
    rows = []
    for surrogate in SURROGATES:
        for loss_type in LOSS_TYPES:
            step(logp, old, adv, mask, surrogate, loss_type, t)  # warm-up
            ms = median_ms(functools.partial(step, logp, old, adv, mask, surrogate, loss_type, t), repeats)
            rows.append((surrogate, loss_type, ms))
    return rows


# ------------------------------------------------------------------------------ against verl

VERL_SHAPES = [(256, 2048), (64, 512)]
VERL_EPS_LOW, VERL_EPS_HIGH, VERL_DUAL_CLIP = 0.2, 0.28, 3.0
VERL_VALUE_ATOL = 1e-6


def load_verl():
    """`((compute_policy_loss_vanilla, agg_loss, config), None)` from an importable verl, else `(None, why)`."""
    try:
        from verl.trainer.ppo.core_algos import agg_loss, compute_policy_loss_vanilla
    except Exception as exc:  # noqa: BLE001 - not installed, or a dependency of its own missing: no comparison
        return None, f"{type(exc).__name__}: {exc}"
    fields = {"clip_ratio": VERL_EPS_LOW, "clip_ratio_low": VERL_EPS_LOW, "clip_ratio_high": VERL_EPS_HIGH,
              "clip_ratio_c": VERL_DUAL_CLIP, "loss_agg_mode": "token-mean"}
    try:  # the actor config verl's trainer passes
        from verl.workers.config import ActorConfig
        return (compute_policy_loss_vanilla, agg_loss,
                ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1, **fields)), None
    except Exception as exc:  # noqa: BLE001 - another version's config fields: fall back to a plain DictConfig
        actor_error = f"{type(exc).__name__}: {exc}"
    try:
        from omegaconf import OmegaConf
        return (compute_policy_loss_vanilla, agg_loss, OmegaConf.create({**fields, "global_batch_info": {}})), None
    except Exception as exc:  # noqa: BLE001 - no config verl's loss accepts: no comparison
        return None, f"no config for verl's loss (ActorConfig: {actor_error}; DictConfig: {type(exc).__name__}: {exc})"


def verl_step(verl, logp_data, old, adv_tokens, mask):
    """verl's vanilla PPO loss (dual clip, token-mean) and its backward; returns (loss, ∂/∂ℓ)."""
    compute_policy_loss_vanilla, agg_loss, config = verl
    logp = logp_data.detach().requires_grad_(True)
    loss = compute_policy_loss_vanilla(old, logp, adv_tokens, mask, loss_agg_mode="token-mean", config=config)[0]
    if loss.dim():  # a version that returns the per-token matrix: aggregate it as verl's actor does
        loss = agg_loss(loss_mat=loss, loss_mask=mask, loss_agg_mode="token-mean")
    loss.backward()
    return loss.detach(), logp.grad


def posttrain_step(logp_data, old, adv_tokens, mask):
    """Ours on the same inputs: surrogate (dual clip) + token-mean numerator / weight, and its backward."""
    logp = logp_data.detach().requires_grad_(True)
    per_token, _ = clipped_policy_gradient_loss(logp, old, adv_tokens, mask, epsilon_low=VERL_EPS_LOW,
                                                epsilon_high=VERL_EPS_HIGH, lower_bound_ratio=VERL_DUAL_CLIP)
    num, weight = reduce_policy_gradient_loss(per_token, mask, "token-mean")
    loss = num / weight
    loss.backward()
    return loss.detach(), logp.grad


def compare_shape(verl, b: int, t: int, repeats: int, lines: list[str]) -> bool:
    """One shape: ours vs verl interleaved (or ours alone without verl), its line appended to `lines`; False
    when the values disagree."""
    logp, old, adv, mask = make_inputs(b, t)
    inputs = (logp, old, adv.unsqueeze(-1).expand(b, t).contiguous(), mask)  # verl takes per-token advantages
    ours = functools.partial(posttrain_step, *inputs)
    ours_value, ours_grad = ours()  # warm-up, and the values to compare
    if verl is None:
        lines.append(f"B={b}, T={t}: posttrain {median_ms(ours, repeats):.2f} ms")
        print(lines[-1])
        return True
    theirs = functools.partial(verl_step, verl, *inputs)
    verl_value, verl_grad = theirs()
    diff = abs(float(ours_value) - float(verl_value))
    grad_diff = float((ours_grad - verl_grad).abs().max())
    times: dict = {ours: [], theirs: []}
    for i in range(repeats):  # interleaved, alternating which runs first
        for fn in ((ours, theirs) if i % 2 == 0 else (theirs, ours)):
            t0 = time.perf_counter()
            fn()
            times[fn].append(time.perf_counter() - t0)
    ours_ms, verl_ms = (statistics.median(times[fn]) * 1e3 for fn in (ours, theirs))
    agree = diff <= VERL_VALUE_ATOL
    lines.append(f"B={b}, T={t}: posttrain {ours_ms:.2f} ms, verl {verl_ms:.2f} ms, ratio {ours_ms / verl_ms:.2f}× "
                 f"(|loss diff| {diff:.1e} {'<=' if agree else '>'} {VERL_VALUE_ATOL:g}, max |grad diff| "
                 f"{grad_diff:.1e})")
    print(lines[-1])
    return agree


def compare_with_verl(repeats: int, lines: list[str] | None = None) -> int:
    """Ours vs verl on identical tensors at VERL_SHAPES, a line per shape appended to `lines`; exit status 1
    when the values disagree."""
    lines = [] if lines is None else lines
    verl, why = load_verl()
    print(f"\nvs verl: dual clip c={VERL_DUAL_CLIP}, eps {VERL_EPS_LOW}/{VERL_EPS_HIGH}, token-mean, per-token "
          f"advantages [B, T], forward + backward, median of {repeats}, {torch.get_num_threads()} thread(s)")
    if verl is None:
        print(f"verl is not importable ({why}); posttrain alone:")
    agree = [compare_shape(verl, b, t, repeats, lines) for b, t in VERL_SHAPES]
    return 0 if all(agree) else 1


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small shape (B=16, T=256)")
    parser.add_argument("--vs-verl", action="store_true", help="only the comparison with verl")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per cell (median reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads before timing")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.vs_verl:
        return compare_with_verl(args.repeats or 15)
    shapes = [(16, 256)] if args.quick else [(64, 1024), (256, 2048)]
    repeats = args.repeats or (5 if args.quick else 7)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), float32 CPU, median of {repeats}")
    table = []
    for b, t in shapes:
        print(f"\nB={b}, T={t}: forward + backward, ms")
        rows = bench(b, t, repeats)
        width = max(len(s) for s in SURROGATES)
        print(f"{'surrogate':<{width}}  " + "  ".join(f"{lt:>24}" for lt in LOSS_TYPES))
        for surrogate in SURROGATES:
            cells = [ms for s, _, ms in rows if s == surrogate]
            print(f"{surrogate:<{width}}  " + "  ".join(f"{ms:>24.2f}" for ms in cells))
            table.append([f"{b} × {t}", surrogate, *[f"{ms:.2f}" for ms in cells]])
    verl_lines: list[str] = []
    status = 0 if args.quick else compare_with_verl(max(repeats, 15), verl_lines)
    from report import write_section  # benchmarks/ is this script's sys.path[0]

    notes = [(f"Forward + backward of the loss math, ms, median of {repeats}; {torch.get_num_threads()} torch "
             "thread(s), float32.")]
    if verl_lines:
        notes.append("Against verl's `compute_policy_loss_vanilla` + `agg_loss` (dual clip 3, token-mean): "
                     + "; ".join(verl_lines) + ".")
    write_section("objectives", ["B × T", "surrogate", *[f"`{lt}`" for lt in LOSS_TYPES]], table, notes)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
