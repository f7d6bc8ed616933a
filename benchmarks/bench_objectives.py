"""Forward + backward time of each policy-gradient surrogate × loss_type on float32 CPU tensors.

    python benchmarks/bench_objectives.py            # B=64,T=1024 and B=256,T=2048
    python benchmarks/bench_objectives.py --quick    # B=16,T=256 (seconds)

Times the loss math only (per-token surrogate, reduction, numerator / weight, backward to the
log-probs), not a model forward: it shows what the objective adds to a training step. Prints the
median over repeats, in milliseconds.
"""

from __future__ import annotations

import argparse
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
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                step(logp, old, adv, mask, surrogate, loss_type, t)
                times.append(time.perf_counter() - t0)
            rows.append((surrogate, loss_type, statistics.median(times) * 1e3))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small shape (B=16, T=256)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per cell (median reported)")
    args = parser.parse_args(argv)
    shapes = [(16, 256)] if args.quick else [(64, 1024), (256, 2048)]
    repeats = args.repeats or (5 if args.quick else 7)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), float32 CPU, median of {repeats}")
    for b, t in shapes:
        print(f"\nB={b}, T={t}: forward + backward, ms")
        rows = bench(b, t, repeats)
        width = max(len(s) for s in SURROGATES)
        print(f"{'surrogate':<{width}}  " + "  ".join(f"{lt:>24}" for lt in LOSS_TYPES))
        for surrogate in SURROGATES:
            cells = [ms for s, _, ms in rows if s == surrogate]
            print(f"{surrogate:<{width}}  " + "  ".join(f"{ms:>24.2f}" for ms in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
