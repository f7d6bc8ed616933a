"""bench_vs_trl.py's summary of each system's run: step time, held-out accuracy early and at the end, and the steps
and training seconds each took to reach the accuracy thresholds; printed and written as one table."""

from __future__ import annotations

import statistics

THRESHOLDS = (0.9, 0.95)  # held-out accuracies whose first step and training time the table reports


def summarize(result: dict, early_step: int) -> dict:
    step_s, evals = result["step_s"], result["evals"]
    steady = step_s[1:] or step_s
    cumulative, total = [], 0.0
    for s in step_s:
        total += s
        cumulative.append(total)
    reached = {}
    for threshold in THRESHOLDS:
        hit = next((s for s in sorted(evals) if s > 0 and evals[s] >= threshold), None)
        reached[str(threshold)] = None if hit is None else {"step": hit, "train_s": cumulative[hit - 1]}
    trained = sorted(s for s in evals if s > 0)
    early = next((s for s in trained if s >= early_step), trained[-1] if trained else None)
    return {"step_s_median": statistics.median(steady) if steady else float("nan"), "steps": len(step_s),
            "train_s": total, "early_step": early, "acc_early": evals.get(early) if early else None,
            "final_step": trained[-1] if trained else None, "acc_final": evals[trained[-1]] if trained else None,
            "reached": reached}


def table_rows(results: dict[str, dict], summaries: dict[str, dict]) -> tuple[list[str], list[list[str]]]:
    early = {s["early_step"] for s in summaries.values()}
    early_label = f"held-out @{early.pop()}" if len(early) == 1 else "held-out @~25"
    header = ["system", "s/step (median)", early_label, "held-out @final",
              *[f"to {t:.2f}: steps / train s" for t in THRESHOLDS], "train s (all steps)", "threads"]
    rows = []
    for name, s in summaries.items():
        cells = [name, f"{s['step_s_median']:.3f}",
                 "-" if s["acc_early"] is None else f"{s['acc_early']:.3f}",
                 "-" if s["acc_final"] is None else f"{s['acc_final']:.3f} (step {s['final_step']})"]
        for t in THRESHOLDS:
            hit = s["reached"][str(t)]
            cells.append("not reached" if hit is None else f"{hit['step']} / {hit['train_s']:.1f}")
        cells += [f"{s['train_s']:.1f}", str(results[name]["threads"])]
        rows.append(cells)
    return header, rows


def print_table(results: dict[str, dict], summaries: dict[str, dict]) -> None:
    header, rows = table_rows(results, summaries)
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    for cells in rows:
        print(" | ".join(cells))
    if {"trl", "posttrain"} <= summaries.keys():
        ratio = summaries["posttrain"]["step_s_median"] / summaries["trl"]["step_s_median"]
        print(f"posttrain/TRL step time (median): {ratio:.2f}x")
