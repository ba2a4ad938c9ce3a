"""The text table and the plot of elastic mode (:mod:`pipedejavu.planning.elastic`)."""

from __future__ import annotations

from pipedejavu.core.problem import ProblemError
from pipedejavu.planning.elastic import CommonBatch, ElasticPlan

__all__ = ["format_elastic", "panel_names", "plot_elastic"]


def format_elastic(result: ElasticPlan) -> str:
    """The text table of ``pipedejavu plan --elastic``."""
    unit = "goodput" if result.grad_params is not None else "throughput"
    lines = [
        f"elastic plans for {result.model} on {result.gpu_type} "
        f"({result.gpus_per_node} per node), micro-batch sizes "
        f"{list(result.micro_batch_sizes)}, max global batch {result.max_global_batch}"
    ]
    best_of: dict[int, CommonBatch] = {}
    sizes: dict[int, set[int]] = {}
    for c in result.candidates:
        sizes.setdefault(c.batch, set()).add(c.model_parallel_size)
        if c.batch not in best_of or c.valid_counts > best_of[c.batch].valid_counts:
            best_of[c.batch] = c
    for batch, c in sorted(best_of.items()):
        ratio = (
            "" if c.mean_ratio is None else f", mean {unit} ratio {c.mean_ratio:.3f}"
        )
        lines.append(
            f"  DeepSpeed v0.2 batch {batch} (max {c.max_train_batch_size}, "
            f"model-parallel size(s) {', '.join(map(str, sorted(sizes[batch])))}): "
            f"valid for {c.valid_counts} of {len(result.rows)} counts with "
            f"model-parallel size {c.model_parallel_size}{ratio}"
        )
    choice = result.common_choice
    if choice is None:
        lines.append("DeepSpeed's rule gives no batch for this range")
    else:
        mean, worst = result.price()
        lines.append(
            f"common batch {result.common_batch}"
            + ("" if choice.valid_for_all else " (NOT valid for every count)")
            + f": price {100 * mean:.1f}% of {unit} on average, "
            f"{100 * worst:.1f}% at worst"
        )
    lines.append("DS: DeepSpeed's rule makes the common batch valid for the count")
    lines.append(
        f"{'GPUs':>5} {'best B':>7} {'best ' + unit:>16}  {'common ' + unit:>18}  "
        "DS  best plan | plan at common batch"
    )
    for r in result.rows:
        common = "-" if r.common is None else r.common.plan.describe()
        if r.common is not None and r.common.plan.num_gpus < r.gpus:
            common += f" (uses {r.common.plan.num_gpus} of {r.gpus} GPUs)"
        lines.append(
            f"{r.gpus:>5} {r.best.global_batch:>7} {r.best.goodput:>16.2f}  "
            f"{r.common_goodput:>18.2f}  {'yes' if r.deepspeed_valid else 'no ':3} "
            f"{r.best.training.plan.describe()} | {common}"
        )
    return "\n".join(lines)


def panel_names(result: ElasticPlan) -> list[str]:
    """The plot's panels: throughput, and goodput when gradient statistics
    were given (without them goodput is throughput: no duplicate panel)."""
    return ["throughput"] + (["goodput"] if result.grad_params is not None else [])


def plot_elastic(result: ElasticPlan, path: str) -> None:
    """Throughput and goodput against the GPU count (per-count best vs common);
    throughput alone when no gradient statistics were given (goodput equals it).

    Raises:
        ProblemError: matplotlib is not installed (``pip install
            pipedejavu[plot]``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ProblemError(
            "plotting needs matplotlib: pip install 'pipedejavu[plot]'"
        ) from None
    counts = [r.gpus for r in result.rows]
    # Without gradient statistics goodput is throughput: one panel, not two
    # equal ones.
    goodput = panel_names(result) == ["throughput", "goodput"]
    fig, axes = plt.subplots(1, 2 if goodput else 1, figsize=(10 if goodput else 5, 4))
    axes = list(axes) if goodput else [axes]
    axes[0].plot(
        counts,
        [r.best.throughput for r in result.rows],
        "o-",
        label="per-count best batch",
    )
    axes[0].plot(
        counts,
        [r.common_throughput for r in result.rows],
        "s--",
        label=f"common batch {result.common_batch}",
    )
    axes[0].set_ylabel("throughput (samples/s)")
    if not goodput:
        axes[0].set_title("no gradient statistics: goodput = throughput", fontsize=9)
    for ax in axes[1:]:
        ax.plot(
            counts,
            [r.best.goodput for r in result.rows],
            "o-",
            label="per-count best batch",
        )
        ax.plot(
            counts,
            [r.common_goodput for r in result.rows],
            "s--",
            label=f"common batch {result.common_batch}",
        )
        ax.set_ylabel("goodput (samples/s x efficiency)")
    for ax in axes:
        ax.set_xlabel(f"{result.gpu_type} GPUs")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"{result.model}: elastic plans")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
