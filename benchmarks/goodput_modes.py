"""Goodput mode against fixed-batch plans, for published gradient-noise scales.

Noise scales (``B_noise``, samples): Kaplan et al. 2020, "Scaling Laws for
Neural Language Models" (arXiv:2001.08361), fit the critical batch of their
Transformer language models as a function of the loss alone,
``B_crit(L) = B_* / L^(1 / alpha_B)`` with ``B_* ~ 2e8`` tokens and
``alpha_B ~ 0.21`` (their eq. 1.4 / section 5.1), building on McCandlish et al.
2018, "An Empirical Model of Large-Batch Training" (arXiv:1812.06162), where the
critical batch is predicted by the gradient noise scale (``B_crit ~ B_noise``).
We take ``B_noise = B_crit(L)`` at losses 4.0, 3.5, 3.0 and 2.5 nats per token
(early to late in training), divided by our models' 2048-token sequences. These
are their models' numbers (WebText2, 1024-token context), not measurements of
OPT-350M or GPT-Neo-2.7B: they set a realistic range, nothing more.

For each setting and noise scale: the goodput-mode plan (global batch chosen
among multiples of ``STEP`` up to ``MAX_BATCH``; bound and prune), checked
against plain enumeration of the same candidates (every batch planned once per
setting; the noise scale only reweights), and fixed-batch plans at common
choices (the measured runs' global batches). Goodput = samples/s x Pollux's
statistical efficiency relative to ``INIT_BATCH``.

Usage::

    python benchmarks/goodput_modes.py [--out benchmarks/results/goodput_modes.json]
"""

from __future__ import annotations

import time

import stamp

from pipedejavu.core.problem import InfeasibleProblemError
from pipedejavu.planning.batch import (
    candidate_batches,
    efficiency,
    grad_params_from_noise_scale,
    plan_goodput,
)
from pipedejavu.planning.training import plan_training

SEQUENCE = 2048  # tokens per sample of both models (Sailor's training configs)
B_STAR_TOKENS = 2e8  # Kaplan et al. 2020, eq. 1.4
ALPHA_B = 0.21  # Kaplan et al. 2020, eq. 1.4
LOSSES = (4.0, 3.5, 3.0, 2.5)
INIT_BATCH, STEP, MAX_BATCH = 32, 32, 2048
SETTINGS = [
    ("OPT-350", {"GH-96": 16}, (64, 512, 1024)),
    ("GPT-Neo-2.7", {"GH-96": 64}, (256, 1024)),
]


def noise_scale(loss: float) -> float:
    """Kaplan et al.'s critical batch at ``loss``, in 2048-token samples."""
    return B_STAR_TOKENS / loss ** (1 / ALPHA_B) / SEQUENCE


def main() -> None:
    out = stamp.out_option(__doc__, "benchmarks/results/goodput_modes.json")
    started = time.perf_counter()
    rows = []
    batches = candidate_batches(INIT_BATCH, MAX_BATCH, STEP)
    for model, pool, fixed in SETTINGS:
        # Plain enumeration: every candidate planned once.
        t0 = time.perf_counter()
        times = {}
        for batch in sorted(set(batches) | set(fixed)):
            try:
                times[batch] = plan_training(model, pool, batch).iteration_time_s
            except InfeasibleProblemError:
                times[batch] = None
        enumerate_s = time.perf_counter() - t0
        for loss in LOSSES:
            phi = noise_scale(loss)
            grad = grad_params_from_noise_scale(phi, INIT_BATCH)
            t0 = time.perf_counter()
            result = plan_goodput(
                model, pool, grad, INIT_BATCH, MAX_BATCH, batches=batches
            )
            search_s = time.perf_counter() - t0
            gains = dict(
                zip(batches, efficiency(grad, INIT_BATCH, batches), strict=True)
            )
            feasible = [b for b in batches if times[b] is not None]
            enum_best = max(feasible, key=lambda b: (b / times[b] * gains[b], -b))
            assert enum_best == result.global_batch, (enum_best, result.global_batch)
            fixed_rows = []
            for batch in fixed:
                if times[batch] is None:
                    continue
                gain = float(efficiency(grad, INIT_BATCH, [batch])[0])
                value = batch / times[batch] * gain
                fixed_rows.append(
                    {
                        "batch": batch,
                        "throughput": batch / times[batch],
                        "goodput": value,
                        "goodput_mode_gain": result.goodput / value - 1,
                    }
                )
            row = {
                "model": model,
                "gpus": pool,
                "loss_nats": loss,
                "noise_scale_samples": phi,
                "best_batch": result.global_batch,
                "best_plan": result.training.plan.describe(),
                "goodput": result.goodput,
                "throughput": result.throughput,
                "efficiency": result.efficiency,
                "candidates": len(batches),
                "planned": result.planned,
                "pruned": result.pruned,
                "search_s": search_s,
                "enumerate_s": enumerate_s,
                "equals_enumeration": True,
                "fixed": fixed_rows,
            }
            rows.append(row)
            fixed_text = ", ".join(
                f"B={f['batch']}: {f['goodput']:.1f} "
                f"(+{100 * f['goodput_mode_gain']:.0f}%)"
                for f in fixed_rows
            )
            print(
                f"{model} {pool} L={loss} B_noise={phi:.0f}: best B "
                f"{result.global_batch} goodput {result.goodput:.1f}/s "
                f"({result.planned} of {len(batches)} planned, {search_s:.1f} s vs "
                f"enumeration {enumerate_s:.1f} s); fixed {fixed_text}"
            )
    fields = {
        "source": "Kaplan et al. 2020 (arXiv:2001.08361) eq. 1.4: B_crit(L) = "
        "2e8 tokens / L^(1/0.21); B_noise := B_crit (McCandlish et al. 2018)",
        "init_batch": INIT_BATCH,
        "rows": rows,
    }
    stamp.write_opened(out, "goodput_modes", started, fields)


if __name__ == "__main__":
    main()
