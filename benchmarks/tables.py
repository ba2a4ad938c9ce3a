"""Write the measured numbers of the README and the docs from benchmarks/results.

Every measured number the pages quote comes from a results file, through this
script, so that a rerun of a benchmark only needs this script to be run again:

    python benchmarks/tables.py            # rewrite the pages in place
    python benchmarks/tables.py --check    # exit 1 if a page is out of date

Two kinds of generated text live in the pages (README.md and docs/*.md):

* tables, between ``<!-- results:NAME -->`` and ``<!-- /results:NAME -->``,
  each closing with the results file, its date and its machine;
* numbers quoted in prose, between ``<!-- value:NAME -->`` and
  ``<!-- /value -->``, each registered in ``VALUES`` with its results file, the
  path into the JSON and the format.

A results file without a date or a machine is not quoted (``meta`` refuses it).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def pages() -> list[Path]:
    """The pages that may hold generated text."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]


def load(name: str) -> Any:
    return json.loads((RESULTS / name).read_text())


def meta(name: str) -> tuple[str, str]:
    """(date, machine) of a results file; refuses a file that has neither."""
    data = load(name)
    inner = data.get("meta", {}) if isinstance(data.get("meta"), dict) else {}
    date = data.get("date") or inner.get("date")
    machine = data.get("machine") or inner.get("machine")
    header = data.get("header")
    if isinstance(header, str) and (date is None or machine is None):
        parts = [p.strip() for p in header.lstrip("# ").split(",")]
        date = date or parts[0]
        machine = machine or ", ".join(parts[1:3])
    if isinstance(machine, dict):
        arch = "x86_64" if "x86_64" in machine.get("platform", "") else "?"
        cores = machine.get("cpu_count", machine.get("cores", "?"))
        machine = f"{arch}, {cores} cores"
    if not date or not machine:
        raise ValueError(f"{name}: no date or machine; do not quote it")
    date = str(date).replace("T", " ")[:16]
    if re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d", date):
        date += " UTC"
    return date, str(machine)


def source(*names: str) -> str:
    lines = []
    for name in names:
        date, machine = meta(name)
        lines.append(f"`benchmarks/results/{name}`, {date}, {machine}")
    return "\n\n*Source: " + "; ".join(lines) + ".*"


def pct(x: float, digits: int = 1) -> str:
    return f"{100 * x:.{digits}f}%"


def signed(x: float) -> str:
    """A relative error as a signed percentage, ``+1.2%``."""
    return f"{100 * x:+.1f}%"


def fit_errors(fit: dict, loo: dict) -> str:
    """The |error| medians and maxima of a fit on all runs (``fit``) and of
    its leave-one-out (``loo``, in bold)."""
    return (
        f"|error| fitted on all: median {pct(fit['median'])}, max "
        f"{pct(fit['max'])}; **leave-one-out: median {pct(loo['median'])}, max "
        f"{pct(loo['max'])}**"
    )


def median_max(errors: dict) -> str:
    return f"{pct(errors['median'])} / {pct(errors['max'])}"


def span(values, fmt: Callable[[float], str]) -> str:
    lo, hi = min(values), max(values)
    return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo)} to {fmt(hi)}"


def table(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def columns(records, spec: list[tuple[str, Callable[[Any], Any]]]) -> str:
    """:func:`table` of one row per record: ``spec`` pairs each column's head
    with the function of a record that gives its cell."""
    rows = [[cell(record) for _, cell in spec] for record in records]
    return table([head for head, _ in spec], rows)


def field_cell(field: str, fmt: Callable[[Any], str], missing: str):
    """The cell function that shows ``fmt`` of a record's ``field``, or
    ``missing`` where that field is None."""

    def cell(record) -> str:
        value = record[field]
        return missing if value is None else fmt(value)

    return cell


# --------------------------------------------------------------------- tables


def _knob_gain() -> float:
    data = load("plan_knobs.json")
    entries = [*data["settings"].values(), *data["published"].values()]
    return statistics.geometric_mean(
        e["spaces"]["today"]["iteration_time_s"]
        / e["spaces"]["all"]["iteration_time_s"]
        for e in entries
    )


def t_headline() -> str:
    dp = [r for r in load("dp_scaling.json")["rows"] if r.get("alpa_cost_ratio")]
    q = [r for r in load("search_vs_dp_quality.json")["rows"] if "cost_ratio" in r]
    het = load("hetero_vs_alpa.json")["rows"]
    runs = load("predict_real_runs.json")["summary"]
    sailor = [s for s in load("plan_vs_sailor.json")["settings"] if "sailor" in s]
    mbs = load("mbs_choice.json")["summary"]
    good = load("goodput_modes.json")["rows"]
    gains = [
        f["goodput_mode_gain"] for r in good for f in r["fixed"] if f["batch"] == 1024
    ]
    gh, rtx = runs["gh200-opt350"]["time_error"], runs["rtx-opt350"]["time_error"]
    published = load("published_runs.json")["sc21"]["leave_one_out"]
    moe = load("moe_published.json")["leave_one_out"]
    titan = load("torchtitan_published.json")["leave_one_out"]
    knobs = load("plan_knobs.json")
    rows = [
        [
            "exact DP against Alpa's algorithm (L = 16, where Alpa's finished)",
            f"{span([r['time_ratio'] for r in dp], lambda x: f'{x:.0f}x')} faster, "
            "same plan cost",
            "dp_scaling.json",
        ],
        [
            "differentiable engine, plan cost / exact optimum",
            f"{sum(r['cost_ratio'] <= 1 + 1e-9 for r in q)} of {len(q)} instances "
            "at the optimum",
            "search_vs_dp_quality.json",
        ],
        [
            "heterogeneous, 1F1B objective: Alpa's way / exact search's plan",
            span(
                [r["alpa_cost"] / r["oracle_cost"] for r in het], lambda x: f"{x:.2f}x"
            ),
            "hetero_vs_alpa.json",
        ],
        [
            "Megatron-style predictor vs measured iterations, median / max error",
            f"GH200 {pct(gh['median'])} / {pct(gh['max'])}; "
            f"RTX {pct(rtx['median'])} / {pct(rtx['max'])}",
            "predict_real_runs.json",
        ],
        [
            "any model from its Megatron-LM flags, no profiles: SC'21 Table 1 "
            "TFLOP/s per GPU, leave-one-out median / max error",
            f"{pct(published['median'])} / {pct(published['max'])} (10 runs, "
            "32 to 3,072 A100s)",
            "published_runs.json",
        ],
        [
            "mixtures of experts from their Megatron-LM launches: 13 published H100 "
            "runs (Qwen3-30B-A3B, Qwen3-235B-A22B, GPT-OSS-120B), tokens/s per GPU, "
            "leave-one-out median / max error (targets 8% / 15%: not met yet)",
            f"{pct(moe['median'])} / {pct(moe['max'])}",
            "moe_published.json",
        ],
        [
            "mixtures of experts planned with expert parallelism and its proof: "
            "DeepSeek-V3 on 1,024 H100 / Qwen3-235B-A22B on 256 H100 (targets "
            "proven in 60 s / 10 s)",
            " / ".join(
                f"{r['seconds']:.0f} s, "
                + (
                    "proven"
                    if r["proven"]
                    else "within " + pct(r["iteration_time_s"] / r["lower_bound_s"] - 1)
                )
                for r in sorted(
                    load("moe_planning.json")["settings"], key=lambda r: -r["gpus"]
                )[:2]
            ),
            "moe_planning.json",
        ],
        [
            "torchtitan jobs from their job files: 7 published Llama 3.1 8B runs "
            "(FSDP2, CP 1-8 at 32k-256k tokens, 8 H100), tokens/s per GPU, "
            "leave-one-out median / max error (targets 8% / 15%: the maximum not "
            "met yet)",
            f"{pct(titan['median'])} / {pct(titan['max'])}",
            "torchtitan_published.json",
        ],
        [
            "CP and FSDP/HSDP searched beside the pipelines, proven: Llama-3-8B at "
            "131,072 tokens on 64 H100 / Llama-3.1-405B at 8,192 on 2,048 H100 "
            "(targets 10 s / 60 s)",
            " / ".join(
                f"{r['search_seconds']:.1f} s, "
                + ("proven" if r["proven"] else "not proven")
                for r in load("sharded_planning.json")["runs"]
                if r["export"] is None
            ),
            "sharded_planning.json",
        ],
        [
            "large pools planned with the proof: Llama-3.1-405B on 131,072 H100 "
            "(batch 16,384) / on 16,384 H100 (batch 1,024) (targets 120 s / 30 s: "
            "the second not met yet)",
            " / ".join(
                f"{min(r['seconds']['after']):.0f} s, "
                + ("proven" if r["proven"] else "not proven")
                for gpus in (131072, 16384)
                for r in load("large_pools.json")["settings"]
                if r["gpus"] == gpus and r["model"] == "Llama-3.1-405B"
            ),
            "large_pools.json",
        ],
        [
            "what to rent: Llama-3-70B on 1T tokens over every GPU type of the "
            "sheet x 12 counts (264 pools), least cost within 90 days, two local "
            "processes (target 300 s)",
            (
                lambda d: (
                    f"{d['seconds']['2']:.0f} s, the same answer as every pool "
                    f"planned ({d.get('every_plan_s', float('nan')):.0f} s)"
                    if d.get("same_as_every_plan")
                    else f"{d['seconds']['2']:.0f} s"
                )
            )(load("capacity_sheet.json")),  # fmt: skip
            "capacity_sheet.json",
        ],
        [
            "schedule (interleaved, zero bubble), recomputation, SP, optimizer "
            "sharding and rank order searched with the plan: predicted speed-up over "
            "today's space (geometric mean, 4 settings)",
            f"x{_knob_gain():.2f}",
            "plan_knobs.json",
        ],
        [
            "that search with its proof, every knob: GPT-3 175B on 1,024 A100s / "
            "the SC'21 1T setting on 3,072 A100s",
            f"{knobs['settings']['gpt3-175b']['spaces']['all']['search_s']:.1f} s / "
            f"{knobs['published']['sc21_table1_1T']['spaces']['all']['search_s']:.1f}"
            " s",
            "plan_knobs.json",
        ],
        [
            "analytical block model vs PyTorch blocks timed on a GPU (H200, "
            "today's constants): bf16 with cuDNN's fused attention, median error",
            pct(
                load("gpu_blocks_cudnn_repriced.json")["summary"]["bf16-flash"][
                    "forward_backward"
                ]["median_abs"]
            ),
            "gpu_blocks_cudnn_repriced.json",
        ],
        [
            "our plan / Sailor's plan (both priced by our predictor)",
            span(
                [s["sailor"]["ours_over_sailor"] for s in sailor], lambda x: f"{x:.3f}"
            ),
            "plan_vs_sailor.json",
        ],
        [
            "choosing the micro-batch size: gain median / mean / max",
            f"{pct(mbs['gain_median'])} / {pct(mbs['gain_mean'])} / "
            f"{pct(mbs['gain_max'])}",
            "mbs_choice.json",
        ],
        [
            "goodput mode over a fixed batch of 1024",
            span(gains, lambda x: f"+{100 * x:.0f}%"),
            "goodput_modes.json",
        ],
    ]
    body = [[a, b, f"`{c}` ({meta(c)[0][:10]})"] for a, b, c in rows]
    return table(["result", "measured", "results file (date)"], body) + (
        "\n\n*Machine: " + "; ".join(sorted({meta(c)[1] for *_, c in rows})) + ".*"
    )


def t_dp_scaling() -> str:
    def finished(r):
        return r.get("alpa_cost_ratio") is not None

    spec = [
        ("L", lambda r: r["L"]),
        ("D", lambda r: r["D"]),
        ("memory", lambda r: r["memory"]),
        ("caps", lambda r: r["candidates"]),
        ("exact DP s", lambda r: f"{r['exact_time_s']:.3f}"),
        (
            "Alpa's scan s",
            lambda r: (
                f"{r['alpa_time_s']:.2f}"
                if finished(r)
                else f">{r['alpa_budget_s']:.0f} (cut off)"
            ),
        ),
        ("caps Alpa evaluated", lambda r: r["alpa_evaluated"]),
        (
            "Alpa / exact",
            lambda r: (
                f"{r['time_ratio']:.0f}x"
                if finished(r)
                else f">{r['alpa_budget_s'] / r['exact_time_s']:.0f}x"
            ),
        ),
        (
            "Alpa cost / optimum",
            lambda r: f"{r['alpa_cost_ratio']:.5f}" if finished(r) else "?",
        ),
    ]
    return columns(load("dp_scaling.json")["rows"], spec) + source("dp_scaling.json")


def t_engine_quality() -> str:
    rows = [r for r in load("search_vs_dp_quality.json")["rows"] if "cost_ratio" in r]

    def group(r):
        return "real" if r["instance"].startswith("gpt") else str(r["L"])

    groups: dict[str, list] = {}
    for r in rows:
        groups.setdefault(group(r), []).append(r)

    def median(rs, field):
        return statistics.median(r[field] for r in rs)

    spec = [
        ("L", lambda rs: group(rs[0])),
        ("instances", len),
        (
            "engine / optimum (max)",
            lambda rs: f"{max(r['cost_ratio'] for r in rs):.5f}",
        ),
        ("exact DP s (median)", lambda rs: f"{median(rs, 'exact_s'):.3f}"),
        ("engine warm s (median)", lambda rs: f"{median(rs, 'engine_warm_s'):.2f}"),
        (
            "engine / exact DP time (median)",
            lambda rs: f"{median(rs, 'time_ratio_warm'):.1f}x",
        ),
        ("certified gap (max)", lambda rs: pct(max(r["gap_to_bound"] for r in rs), 3)),
    ]
    return columns(groups.values(), spec) + source("search_vs_dp_quality.json")


def t_compare_methods() -> str:
    rows = load("compare_methods.json")["rows"]
    sizes = sorted({(r["num_layers"], r["cluster"]) for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))

    def at(size):
        def cell(method):
            rs = [
                r
                for r in rows
                if r["method"] == method and (r["num_layers"], r["cluster"]) == size
            ]
            ratio = statistics.mean(r["cost_ratio"] for r in rs)
            worst = max(r["worst_ratio"] for r in rs)
            t = statistics.mean(r["time_ratio"] for r in rs)
            return f"{ratio:.4f} ({worst:.4f}); {t:.2g}x"

        return cell

    spec = [("method", lambda m: m)]
    spec += [(f"L={n} ({c})", at((n, c))) for n, c in sizes]
    return (
        "Each cell: plan cost / exact optimum, mean over two instances (worst run); "
        "search time / the exact DP's.\n\n"
        + columns(methods, spec)
        + source("compare_methods.json")
    )


def t_hetero() -> str:
    data = load("hetero_vs_alpa.json")
    limit = data["oracle_limit_s"]
    spec = [
        ("instance", lambda r: r["instance"]),
        ("devices", lambda r: r["num_devices"]),
        ("Alpa's way s", lambda r: f"{r['alpa_s']:.2f}"),
        (
            "engine s cold / warm",
            lambda r: f"{r['engine_cold_s']:.1f} / {r['engine_warm_s']:.1f}",
        ),
        (
            "exact search s",
            lambda r: (
                f"{r['oracle_s']:.2f}" if r["oracle_finished"] else f"> {limit:g}"
            ),
        ),
        (
            "Alpa's way / exact search",
            lambda r: f"{r['alpa_cost'] / r['oracle_cost']:.3f}",
        ),
        (
            "engine / exact search",
            lambda r: f"{r['engine_cost'] / r['oracle_cost']:.4f}",
        ),
        # a cut-off exact search: its best plan so far and that plan's gap to
        # the certified bound
        (
            "exact search: proven, gap",
            lambda r: (
                f"{r.get('oracle_proven', 'cut off')}, "
                + pct(r["oracle_cost"] / r["oracle_lower_bound"] - 1, 1)
            ),
        ),
        ("engine: certified gap", lambda r: pct(r["certified_gap"], 1)),
    ]
    return columns(data["rows"], spec) + source("hetero_vs_alpa.json")


def t_hetero_engine_versions() -> str:
    data = load("hetero_engine_versions.json")
    spec = [
        ("engine", lambda r: r["tree"]),
        ("commit", lambda r: f"`{data['trees'][r['tree']][:7]}`"),
        ("L", lambda r: r["layers"]),
        ("round", lambda r: r["round"]),
        ("engine s (cold)", lambda r: f"{r['engine_s']:.1f}"),
        ("bound s", lambda r: f"{r['bound_time_s']:.1f}"),
        ("polish s", lambda r: f"{r['polish_time_s']:.1f}"),
        ("cost (its objective)", lambda r: f"{r['cost']:.6f}"),
        ("certified gap", lambda r: pct(r["certified_gap"], 2)),
        ("load", lambda r: f"{r['load_average'][0]:.1f}"),
    ]
    return (
        columns(data["rows"], spec)
        + f"\n\nInstance: {data['instance']}. The engine of before issue 23 prices "
        "the all-in-flight objective, today's the 1F1B objective (higher); their "
        "costs do not compare." + source("hetero_engine_versions.json")
    )


def t_predict_runs() -> str:
    s = load("predict_real_runs.json")["summary"]
    names = {"gh200-opt350": "GH200, OPT-350M", "rtx-opt350": "RTX cluster, OPT-350M"}

    def median_mean_max(e):
        return f"{pct(e['median'])} / {pct(e['mean'])} / {pct(e['max'])}"

    def errors(field):
        return field_cell(field, median_mean_max, "not fitted")

    spec = [
        ("runs", lambda v: v["runs"]),
        ("n", lambda v: v["time_error"]["n"]),
        ("time", errors("time_error")),
        ("time, leave-one-out", errors("loo_time_error")),
        ("time, Sailor's closed form", errors("anchor_time_error")),
        ("memory", errors("memory_error")),
        ("memory, Sailor's closed form", errors("anchor_memory_error")),
    ]
    records = [dict(v, runs=names.get(k, k)) for k, v in s.items()]
    return (
        "Absolute relative error, median / mean / max.\n\n"
        + columns(records, spec)
        + source("predict_real_runs.json")
    )


def t_plan_vs_sailor() -> str:
    def setting(s):
        gpus = " + ".join(f"{n} {t}" for t, n in s["gpus"].items())
        return f"{s['model']}, {gpus}, gbs {s['gbs']}"

    def sailor(field):
        return lambda s: f"{s['sailor'][field]:.3f}" if s.get("sailor") else ""

    spec = [
        ("setting", setting),
        ("our plan", lambda s: s["ours"]["plan"].split(" (")[0]),
        ("predicted s", lambda s: f"{s['ours']['predicted_s']:.3f}"),
        (
            "proven optimal",
            lambda s: "yes" if s["ours"]["proven_optimal_under_predictor"] else "no",
        ),
        ("Sailor's plan, predicted s", sailor("predicted_by_us_s")),
        ("ours / Sailor's", sailor("ours_over_sailor")),
        (
            "search s (warm)",
            lambda s: (
                f"{s['ours']['search_time_warm_s']:.2f}"
                if "search_time_warm_s" in s["ours"]
                else ""
            ),
        ),
    ]
    settings = load("plan_vs_sailor.json")["settings"]
    return columns(settings, spec) + source("plan_vs_sailor.json")


def t_mbs_choice() -> str:
    spec = [
        ("measured runs", lambda s: s["runs"]),
        ("distinct settings", lambda s: s["settings"]),
        ("settings where the mbs changes", lambda s: s["settings_mbs_changed"]),
        ("gain: median", lambda s: pct(s["gain_median"])),
        ("mean", lambda s: pct(s["gain_mean"])),
        ("max", lambda s: pct(s["gain_max"])),
    ]
    summary = load("mbs_choice.json")["summary"]
    return columns([summary], spec) + source("mbs_choice.json")


def t_goodput_modes() -> str:
    def model(r):
        gpus = " + ".join(f"{n} {t}" for t, n in r["gpus"].items())
        return f"{r['model']}, {gpus}"

    def fixed(r):
        return ", ".join(
            f"{f['batch']}: {f['goodput']:.1f} (+{100 * f['goodput_mode_gain']:.0f}%)"
            for f in r["fixed"]
        )

    spec = [
        ("model, GPUs", model),
        ("loss (nats)", lambda r: r["loss_nats"]),
        ("noise scale", lambda r: f"{r['noise_scale_samples']:.0f}"),
        ("chosen batch", lambda r: r["best_batch"]),
        ("goodput", lambda r: f"{r['goodput']:.1f}"),
        ("batches planned", lambda r: f"{r['planned']} of {r['candidates']}"),
        ("fixed batch: goodput (goodput mode's gain)", fixed),
    ]
    rows = load("goodput_modes.json")["rows"]
    return columns(rows, spec) + source("goodput_modes.json")


def t_elastic_modes() -> str:
    spec = [
        ("model", lambda r: r["model"]),
        ("mode", lambda r: r["mode"]),
        ("common batch", lambda r: r["common_batch"]),
        (
            "valid for every count",
            lambda r: "yes" if r["common_valid_for_all"] else "no",
        ),
        ("price: mean", lambda r: pct(r["price_mean"])),
        ("worst", lambda r: pct(r["price_worst"])),
    ]
    results = load("elastic_modes.json")["results"]
    return columns(results, spec) + source("elastic_modes.json")


def t_pollux() -> str:
    spec = [
        ("experiment", lambda r: r["experiment"]),
        ("plans fitted", lambda r: r["train"]),
        ("plans tested", lambda r: r["test"]),
        ("held-out error: median", lambda r: pct(r["test_median"])),
        ("max", lambda r: pct(r["test_max"])),
    ]
    results = load("pollux_vs_predictor.json")["results"]
    return columns(results, spec) + source("pollux_vs_predictor.json")


def t_init_search() -> str:
    def accuracy(s):
        lo, hi = s["ci95"]["final_test_accuracy"]
        return f"{100 * s['final_test_accuracy']:.2f}% ({100 * lo:.2f}-{100 * hi:.2f})"

    spec = [
        ("model", lambda s: f"`{s['model']}`"),
        ("strategy", lambda s: s["strategy"]),
        ("final val loss", lambda s: f"{s['final_validation_loss']:.3f}"),
        ("final test loss", lambda s: f"{s['final_test_loss']:.3f}"),
        ("test accuracy (95% interval)", accuracy),
        ("gradient evaluations", lambda s: f"{s['gradient_evaluations']:,.0f}"),
    ]
    strategies = [
        dict(s, model=model, strategy=name)
        for model, m in load("init_search.json")["models"].items()
        for name, s in m["strategies"].items()
    ]
    return columns(strategies, spec) + source("init_search.json")


def t_layout() -> str:
    def times(c):
        sums = c.get("row_time_sums", {})
        return ", ".join(f"{k} {v['ratio']:.2f}x" for k, v in sums.items())

    spec = [
        ("run", lambda c: c["run"]),
        ("benchmark", lambda c: c["benchmark"]),
        ("compared", lambda c: f"{c['rows_compared']} rows, {c['rounds']} round(s)"),
        ("plans and costs identical", lambda c: "yes" if c["identical"] else "NO"),
        ("time after / before", times),
        (
            "process wall after / before",
            lambda c: f"{c['subprocess_wall']['ratio']:.2f}x",
        ),
    ]
    names = ("layout_before_after.json", "layout_before_after_final.json")
    comparisons = []
    for name in names:
        data = load(name)
        before, after = data["before"]["commit"][:7], data["after"]["commit"][:7]
        run = f"`{name}` ({before} -> {after})"
        comparisons += [
            dict(c, run=run, benchmark=bench, rounds=data["rounds"])
            for bench, c in data["comparison"].items()
        ]
    return columns(comparisons, spec) + source(*names)


_STARTUP_NAMES = {
    "python": "`python -c pass`",
    "help": "`pipedejavu --help`",
    "solve_generated": "`pipedejavu solve generated-gpt-32layers-2x8`",
    "solve_alpa_profile": "`pipedejavu solve gpt1.3b-6layers-B128`",
    "import_numpy": "`python -c 'import numpy'`",
    "import_scipy_optimize": "`python -c 'import scipy.optimize'`",
    "import_jax": "`python -c 'import jax'`",
}


def _startup(results: str) -> str:
    data = load(results)
    rows = {(r["tree"], r["command"]): r for r in data["rows"]}
    before = data["commits"].get("before")

    def timed(tree, field):
        def cell(name):
            row = rows.get((tree, name))
            return "" if row is None else f"{row[field]:.2f}"

        return cell

    def target(name):
        row = rows[("after", name)]
        if "target_s" not in row:
            return ""
        return f"<= {row['target_s']} s ({'met' if row['met'] else 'missed'})"

    spec = [
        ("process", lambda name: _STARTUP_NAMES[name]),
        ("wall s", timed("after", "wall_s")),
        ("CPU s", timed("after", "cpu_s")),
        ("target", target),
    ]
    if before:
        spec += [
            (f"before ({before}): wall s", timed("before", "wall_s")),
            ("CPU s", timed("before", "cpu_s")),
        ]
    runs = data["in_process"]
    loads = data["load_average"]
    note = (
        f"Median of {data['repeats']} processes each, interleaved, our modules' "
        f"bytecode {data.get('bytecode', 'compiled every time')}; load average "
        f"{min(loads):.1f} to {max(loads):.1f} on the 2 cores. In one process the "
        "exact DP takes "
        f"{runs['generated-gpt-32layers-2x8']['dp_s'] * 1e3:.0f} ms on "
        "generated-gpt-32layers-2x8 and "
        f"{runs['gpt1.3b-6layers-B128']['dp_s'] * 1e3:.1f} ms on "
        "gpt1.3b-6layers-B128, whose profile takes "
        f"{runs['gpt1.3b-6layers-B128']['load_s']:.2f} s to read (the restricted "
        "unpickler's checks)."
    )
    return note + "\n\n" + columns(_STARTUP_NAMES, spec) + source(results)


def t_startup() -> str:
    return _startup("startup.json")


def t_startup_no_bytecode() -> str:
    return _startup("startup_no_bytecode.json")


def t_published_runs() -> str:
    data = load("published_runs.json")["sc21"]
    spec = [
        ("run", lambda r: r["id"].replace("sc21_table1_", "GPT ")),
        ("A100-80 GPUs", lambda r: r["gpus"]),
        (
            "TP / PP / chunks",
            lambda r: f"{r['tp']} / {r['pp']} / {r['virtual_stages']}",
        ),
        ("published TFLOP/s per GPU", lambda r: f"{r['published_tflops_per_gpu']:.0f}"),
        ("predicted", lambda r: f"{r['predicted_tflops_per_gpu']:.1f}"),
        ("error (in-sample)", lambda r: signed(r["in_sample_error"])),
        ("error (leave-one-out)", lambda r: signed(r["leave_one_out_error"])),
        ("prediction (ms)", lambda r: f"{r['prediction_ms']:.0f}"),
    ]
    loo, anchor = data["leave_one_out"], data["constant_mfu_leave_one_out"]
    return (
        columns(data["runs"], spec)
        + f"\n\nLeave-one-out absolute error: median {pct(loo['median'])}, max "
        f"{pct(loo['max'])}; one constant MFU for all runs (leave-one-out): "
        f"median {pct(anchor['median'])}, max {pct(anchor['max'])}. Prediction: "
        "each run's first `predict` in one process (its own cost source, "
        "nothing of it cached before)." + source("published_runs.json")
    )


def t_opt350_no_profile() -> str:
    data = load("published_runs.json")["opt350"]
    names = {"gh200-opt350": "GH200", "rtx-opt350": "RTX cluster"}
    sources = {"no_profile": "no OPT-350M profile", "profiles": "profiles"}

    def errors(field):
        return field_cell(field, median_max, "not trusted")

    spec = [
        ("runs", lambda e: names.get(e["cluster"], e["cluster"])),
        ("costs from", lambda e: sources[e["source"]]),
        ("n", lambda e: e["time"]["count"]),
        ("time, abs. error median / max", errors("time")),
        ("memory", errors("memory")),
    ]
    entries = [
        dict(entry[kind], cluster=cluster, source=kind)
        for cluster, entry in data.items()
        for kind in sources
    ]
    return columns(entries, spec) + source("published_runs.json")


def t_analytical_lomo() -> str:
    data = load("analytical_accuracy.json")["leave_one_model_out"]
    spec = [
        ("held-out model", lambda s: s["model"]),
        ("GPU", lambda s: s["gpu"]),
        ("entries", lambda s: s["count"]),
        ("block fwd+bwd, abs. error median / max", median_max),
    ]
    summaries = [
        dict(summary, model=model, gpu=gpu)
        for model, entry in data.items()
        for gpu, summary in entry["blocks"].items()
    ]
    return columns(summaries, spec) + source("analytical_accuracy.json")


def t_analytical_logo() -> str:
    data = load("analytical_accuracy.json")["leave_one_gpu_out"]

    def blocks(field):
        return lambda gpu: [s[field] for s in data[gpu]["blocks"].values()]

    medians, maxima = blocks("median"), blocks("max")
    spec = [
        ("held-out GPU type", lambda gpu: gpu),
        ("models", lambda gpu: len(medians(gpu))),
        ("median of medians", lambda gpu: pct(statistics.median(medians(gpu)))),
        ("max", lambda gpu: pct(max(maxima(gpu)))),
    ]
    return columns(data, spec) + source("analytical_accuracy.json")


def t_check_exports() -> str:
    data = load("check_exports.json")
    keys = [
        "plans checked",
        "built as planned",
        "refused by us",
        "refusal confirmed by the real code",
        "silent differences",
        "exports the real code rejects",
    ]
    # a row a count, a column a target
    targets = data["targets"]

    def count(target):
        return lambda key: targets[target][key]

    spec = [("", lambda key: key)]
    spec += [(f"`{t}`", count(t)) for t in targets]
    versions = data["versions"]
    names = ("torch", "megatron imported", "deepspeed", "torchtitan")
    used = ", ".join(f"{n.split()[0]} {versions[n]}" for n in names)
    return (
        columns(keys, spec)
        + f"\n\n{data['random_plans']} seeded random plans and "
        + f"{data['planner_plans']} planner plans; {used}."
        + source("check_exports.json")
    )


def _block_table(data: dict, groups) -> str:
    """One row a group of the timed blocks: ``groups`` pairs a name with a
    test of a block's config (None: the bf16 flash blocks measured at 1 ms or
    more)."""
    ok = [r for r in data["rows"] if r["status"] == "ok"]

    def measured_ms(r):
        m = r["measured"]
        return m["forward_ms"]["median"] + m["backward_ms"]["median"]

    def chosen(keep):
        if keep is None:
            return [
                r
                for r in ok
                if r["config"]["precision"] == "bf16"
                and r["config"]["flash_attention"]
                and measured_ms(r) >= 1.0
            ]
        return [r for r in ok if keep(r["config"])]

    spec = [
        ("blocks timed on the GPU", lambda g: g["name"]),
        ("configs", lambda g: len(g["errors"])),
        (
            "fwd+bwd abs. error, median",
            lambda g: pct(statistics.median(abs(e) for e in g["errors"])),
        ),
        ("max", lambda g: pct(max(abs(e) for e in g["errors"]))),
        ("signed median", lambda g: signed(statistics.median(g["errors"]))),
    ]
    records = [
        {"name": name, "errors": [r["error"]["forward_backward"] for r in chosen(keep)]}
        for name, keep in groups
    ]
    return columns(records, spec)


def _block_device(data: dict, measured: str, repriced: str) -> str:
    device = data["environment"]["device_name"]
    entry = data["gpu_sheet_entry"]["name"]
    return (
        f"\n\nDevice: {device} (GPU-sheet entry `{entry}`), torch "
        + f"{data['environment']['torch']}; error = predicted / measured - 1; "
        + "timed by `gpu_blocks.py`, priced with today's constants by "
        + "`gpu_blocks_reprice.py`."
        + source(measured, repriced)
    )


def t_gpu_blocks() -> str:
    data = load("gpu_blocks_repriced.json")
    groups = [
        (
            "bf16, flash attention",
            lambda c: c["precision"] == "bf16" and c["flash_attention"],
        ),
        ("of them, blocks measured at 1 ms or more", None),
        (
            "bf16, unfused attention",
            lambda c: c["precision"] == "bf16" and not c["flash_attention"],
        ),
        ("fp32 (TF32 off), unfused", lambda c: c["precision"] == "fp32"),
        ("Llama-style (GQA, SwiGLU, RMSNorm)", lambda c: c["style"] == "llama"),
        ("all", lambda c: True),
    ]
    return _block_table(data, groups) + _block_device(
        data, "gpu_blocks.json", "gpu_blocks_repriced.json"
    )


def t_gpu_blocks_cudnn() -> str:
    data = load("gpu_blocks_cudnn_repriced.json")
    groups = [
        ("bf16, cuDNN fused attention", lambda c: True),
        ("of them, blocks measured at 1 ms or more", None),
        ("GPT-style", lambda c: c["style"] == "gpt"),
        ("Llama-style (GQA, SwiGLU, RMSNorm)", lambda c: c["style"] == "llama"),
    ]
    return _block_table(data, groups) + _block_device(
        data, "gpu_blocks_cudnn.json", "gpu_blocks_cudnn_repriced.json"
    )


def t_gpu_attention() -> str:
    data = load("gpu_attention.json")
    extended = load("gpu_attention_extended.json")
    names = {"cudnn": "cuDNN fused attention", "flash": "FlashAttention-2"}
    passes = []
    for backend in ("cudnn", "flash"):
        fit = data["fit"][backend]
        c = fit["constants"]
        for kind in ("forward", "backward"):
            field = "_backward" if kind == "backward" else ""
            passes.append(
                {
                    "name": f"{names[backend]}, {kind}",
                    "gemm": data["summary"][backend][kind],
                    "held_out": fit["held_out"][kind],
                    # only the planner's kernel was timed outside the grid
                    "outside": extended["repriced"]["errors"][backend][kind]
                    if backend == "cudnn"
                    else None,
                    "half_s": c[f"attention{field}_half_seconds"],
                    "exponent": c[f"attention{field}_exponent"],
                    "exponentials": c["attention_softmax_exponentials"],
                }
            )

    def median_max_abs(e):
        return f"{pct(e['median_abs'])} / {pct(e['max_abs'])}"

    def errors(field):
        return field_cell(field, median_max_abs, "- (not the planner's kernel)")

    spec = [
        ("kernel (bf16, causal), pass", lambda p: p["name"]),
        ("priced as a GEMM: abs. error median / max (77 shapes)", errors("gemm")),
        (
            "fused-attention rule fitted on half: held-out median / max",
            errors("held_out"),
        ),
        ("32 shapes outside the grid, held out: median / max", errors("outside")),
        (
            "fitted floor h / exponent p",
            lambda p: f"{1e6 * p['half_s']:.1f} us / {p['exponent']:.2f}",
        ),
        (
            "softmax, exponentials per score and product",
            lambda p: f"{p['exponentials']:.2f}",
        ),
    ]
    device = data["environment"]["device_name"]
    return (
        columns(passes, spec)
        + f"\n\nDevice: {device}, torch {data['environment']['torch']}, "
        + f"cuDNN {data['environment'].get('cudnn')}; the planner's constants "
        + "are the cuDNN fit (`MEASURED_ATTENTION`); the shapes outside the "
        + "grid are priced with them."
        + source("gpu_attention.json", "gpu_attention_extended.json")
    )


def t_gpu_h100() -> str:
    attention = load("gpu_attention_h100.json")["repriced"]["errors"]["cudnn"]
    blocks = load("gpu_blocks_cudnn_h100_repriced.json")["summary"]
    spec = [
        ("on an H100 SXM, priced with today's constants", lambda e: e["label"]),
        ("median", lambda e: pct(e["median_abs"])),
        ("max", lambda e: pct(e["max_abs"])),
        ("signed median", lambda e: signed(e["median_signed"])),
    ]
    entries = [
        ("cuDNN fused attention, forward (77 shapes)", attention["forward"]),
        ("cuDNN fused attention, backward", attention["backward"]),
        (
            "bf16 blocks with cuDNN attention, fwd+bwd (41)",
            blocks["bf16-flash"]["forward_backward"],
        ),
        ("of them Llama-style (8)", blocks["style:llama"]["forward_backward"]),
    ]
    return columns([dict(e, label=label) for label, e in entries], spec) + source(
        "gpu_attention_h100.json", "gpu_blocks_cudnn_h100_repriced.json"
    )


def _knobs(entry: dict) -> str:
    schedule = entry["schedule"]
    if schedule in ("interleaved", "interleaved-zb"):
        schedule = f"{schedule} x{entry['chunks']}"
    parts = [schedule]
    blocks = entry.get("recompute_num_layers")
    recompute = entry["recompute"] if blocks is None else f"full (first {blocks})"
    parts.append(f"recompute {recompute}")
    if entry["sequence_parallel"]:
        parts.append("SP")
    if entry["distributed_optimizer"]:
        parts.append("dist-opt")
    if entry.get("rank_order") == "tp-pp-dp":
        parts.append("tp-pp-dp")
    return ", ".join(parts)


def _short_stages(plan: str) -> str:
    """``pp 4 [3+2+2+2+3]`` -> ``pp 4 [3+2x3+3]`` (runs of equal stages)."""
    match = re.search(r"\[([0-9+]+)\]", plan)
    if not match:
        return plan
    runs: list[list[str]] = []
    for count in match.group(1).split("+"):
        if runs and runs[-1][0] == count:
            runs[-1].append(count)
        else:
            runs.append([count])
    text = "+".join(r[0] if len(r) == 1 else f"{r[0]}x{len(r)}" for r in runs)
    return plan[: match.start()] + f"[{text}]" + plan[match.end() :]


def t_plan_knobs() -> str:
    data = load("plan_knobs.json")
    rows = []
    gains = []

    def add(label, spaces, published=None):
        today = spaces["today"]["iteration_time_s"]
        if published is not None:
            rows.append(
                [label, "published configuration", f"{published:.2f} s", "", "", "", ""]
            )
            label = ""
        for name, entry in spaces.items():
            rows.append(
                [
                    label,
                    name,
                    f"{entry['iteration_time_s']:.2f} s",
                    f"x{today / entry['iteration_time_s']:.3f}",
                    f"{_short_stages(entry['plan'].split(' (')[0])}; {_knobs(entry)}",
                    "yes"
                    if entry["proven"]
                    else f"no (bound {entry.get('lower_bound_s', float('nan')):.2f} s)",
                    f"{entry['search_s']:.1f}",
                ]
            )
            label = ""
        gains.append(today / spaces["all"]["iteration_time_s"])

    for entry in data["settings"].values():
        gpus = ", ".join(f"{n} {t}" for t, n in entry["gpus"].items())
        add(
            f"{entry['model']}, {gpus}, gbs {entry['gbs']}, seq {entry['seq']}",
            entry["spaces"],
        )
    for run_id, entry in data["published"].items():
        gpus = ", ".join(f"{n} {t}" for t, n in entry["gpus"].items())
        add(f"{run_id} ({gpus})", entry["spaces"], entry["published_predicted_s"])
    head = [
        "setting",
        "space",
        "predicted",
        "vs today",
        "best plan",
        "proven",
        "search s",
    ]
    mean = _knob_gain()
    assert abs(mean - statistics.geometric_mean(gains)) < 1e-12
    return (
        table(head, rows)
        + "\n\nGeometric mean over the settings, all knobs vs today's space: "
        + f"x{mean:.3f}."
        + source("plan_knobs.json")
    )


def t_zero_bubble_split() -> str:
    data = load("gpu_zero_bubble_split_cudnn.json")
    spec = [
        ("blocks", lambda e: e["label"]),
        ("n", lambda e: e["count"]),
        (
            "W share of the backward: error median / max",
            lambda e: (
                f"{e['share_pp']['median_abs']:.1f} / {e['share_pp']['max_abs']:.1f} pp"
            ),
        ),
        (
            "W, predicted / measured - 1 (median)",
            lambda e: pct(e["weight_gradient"]["median_signed"]),
        ),
        (
            "B, predicted / measured - 1 (median)",
            lambda e: pct(e["input_backward"]["median_signed"]),
        ),
    ]
    groups = [
        ("bf16-flash", "bf16, cuDNN fused attention"),
        ("bf16-unfused", "bf16, unfused attention"),
        ("fp32-unfused", "fp32 (TF32 off), unfused"),
        ("all", "all"),
    ]
    entries = [dict(data["split_summary"][g], label=label) for g, label in groups]
    return (
        columns(entries, spec)
        + "\n\nPriced with the constants of the day it ran (the results file "
        + "names them)."
        + source("gpu_zero_bubble_split_cudnn.json")
    )


def t_fp8_gemms() -> str:
    data = load("gpu_fp8_gemms.json")
    rows = [r for r in data["rows"] if r["measured"]["fp8"].get("status") == "ok"]

    def error(row: dict, precision: str) -> float:
        measured = row["measured"][precision]["median"] * 1e-3
        return row["predicted"][precision]["seconds"] / measured - 1

    def errors(precision):
        def cell(g):
            values = [error(r, precision) for r in g["rows"]]
            return f"{pct(statistics.median(values))} / {pct(max(values, key=abs))}"

        return cell

    def speed_up(g):
        measured = [
            r["measured"]["bf16"]["median"] / r["measured"]["fp8"]["median"]
            for r in g["rows"]
        ]
        model = [
            r["predicted"]["bf16"]["seconds"] / r["predicted"]["fp8"]["seconds"]
            for r in g["rows"]
        ]
        return f"{statistics.median(measured):.2f}x / {statistics.median(model):.2f}x"

    spec = [
        ("GEMMs", lambda g: g["label"]),
        ("n", lambda g: len(g["rows"])),
        ("bf16, predicted / measured - 1: median / largest", errors("bf16")),
        ("fp8, predicted / measured - 1: median / largest", errors("fp8")),
        ("fp8 speed-up over bf16, median: measured / predicted", speed_up),
    ]
    large = [r for r in rows if r["measured"]["bf16"]["median"] >= 0.25]
    groups = [
        {"label": kind, "rows": [r for r in rows if r["kind"] == kind]}
        for kind in ("forward", "dgrad", "wgrad")
    ]
    groups += [
        {"label": "all", "rows": rows},
        {"label": "all, bf16 >= 0.25 ms", "rows": large},
    ]
    return columns(groups, spec) + source("gpu_fp8_gemms.json")


#: The published and predicted tokens/s per GPU of a published run.
PUBLISHED_AND_PREDICTED = [
    ("published tokens/s/GPU", lambda r: f"{r['published_tokens_per_s_per_gpu']:.0f}"),
    ("predicted", lambda r: f"{r['predicted_tokens_per_s_per_gpu']:.0f}"),
]


def t_moe_published() -> str:
    data = load("moe_published.json")
    spec = [
        ("run", lambda r: f"`{r['id']}`"),
        *PUBLISHED_AND_PREDICTED,
        ("error", lambda r: signed(r["error"])),
        ("leave-one-out", lambda r: signed(r["leave_one_out_error"])),
    ]
    c, fit, loo = data["constants"], data["fitted_on_all"], data["leave_one_out"]
    return (
        columns(data["runs"], spec)
        + f"\n\nFitted on all thirteen: `alltoall_efficiency` "
        f"{c['alltoall_efficiency']}, `alltoall_hidden` {c['alltoall_hidden']}, "
        f"`expert_block_overhead_s` {1e3 * c['expert_block_overhead_s']:.2f} ms. "
        + fit_errors(fit, loo)
        + "."
        + source("moe_published.json")
    )


def t_moe_planning() -> str:
    def plan(r):
        p, options = r["plan"], r["plan"]["options"]
        vp = options["virtual_stages"]
        return (
            f"PP {p['pp']}"
            + (f" x VP {vp}" if vp > 1 else "")
            + f", TP {p['tp']}, DP {p['dp']}, EP {p['ep']}, mbs {p['mbs']}, "
            f"recompute {options['recompute']}, "
            f"{p.get('dispatcher', 'alltoall')} dispatcher"
            + (", all-to-all overlapped" if p.get("a2a_overlap") else "")
        )

    def proof(r):
        if r["proven"]:
            return "proven optimal"
        return f"within {pct(r['iteration_time_s'] / r['lower_bound_s'] - 1)}"

    spec = [
        (
            "setting (seq 4096, bf16)",
            lambda r: f"{r['model']} on {r['gpus']} H100, global batch {r['gbs']}",
        ),
        ("planning time", lambda r: f"{r['seconds']:.0f} s"),
        ("best plan", plan),
        (
            "predicted iteration (tokens/s/GPU)",
            lambda r: (
                f"{r['iteration_time_s']:.2f} s ({r['tokens_per_s_per_gpu']:.0f})"
            ),
        ),
        ("proof", proof),
    ]
    settings = load("moe_planning.json")["settings"]
    return columns(settings, spec) + source("moe_planning.json")


def t_moe_vs_published() -> str:
    def shape(p: dict) -> str:
        vp = f" x VP {p['vp']}" if p["vp"] > 1 else ""
        return f"PP {p['pp']}{vp}, TP {p['tp']}, EP {p['ep']}, mbs {p['mbs']}"

    spec = [
        ("published run", lambda r: r["id"]),
        (
            "published tokens/s/GPU",
            lambda r: f"{r['published_tokens_per_s_per_gpu']:.0f}",
        ),
        (
            "launch as predicted",
            lambda r: f"{r['given_tokens_per_s_per_gpu']:.0f} ({shape(r['given'])})",
        ),
        (
            "best plan, same settings and expert layout",
            lambda r: (
                f"{r['planned_tokens_per_s_per_gpu']:.0f} "
                f"({shape(r['planned'])}, recompute {r['planned']['recompute']})"
            ),
        ),
        ("speed-up", lambda r: f"x{r['speedup']:.3f}"),
        ("proof", lambda r: "proven" if r["proven"] else "not proven"),
        ("search", lambda r: f"{r['seconds']:.1f} s"),
    ]
    published = load("moe_planning.json")["published"]
    return columns(published, spec) + source("moe_planning.json")


def t_simulator_speed() -> str:
    data = load("simulator_speed.json")
    spec = [
        ("stages x micro-batches", lambda r: f"{r['stages']} x {r['microbatches']}"),
        ("links", lambda r: "blocking" if r["blocking"] else "buffered"),
        ("program, built and run (ms)", lambda r: f"{r['program_first_ms']:.1f}"),
        ("program, cached (ms)", lambda r: f"{r['program_cached_ms']:.1f}"),
        ("by steps, first (ms)", lambda r: f"{r['steps_first_ms']:.1f}"),
        ("by steps, again (ms)", lambda r: f"{r['steps_cached_ms']:.1f}"),
        ("same grids", lambda r: "yes" if r["same_grids"] else "NO"),
    ]
    orders = ", ".join(
        f"{r['schedule']} {r['build_ms']:.1f} ms" for r in data["orders_530b_shape"]
    )
    return (
        columns(data["deepspeed"], spec)
        + f"\n\nBuilding every rank's command order for SC'21 530B's shape (35 ranks, "
        f"3 chunks, 280 micro-batches): {orders}." + source("simulator_speed.json")
    )


def t_torchtitan_published() -> str:
    data = load("torchtitan_published.json")
    spec = [
        (
            "run (Llama 3.1 8B, 8 H100 96 GB)",
            lambda r: f"`{r['id'].split('_8gpu_')[-1]}`",
        ),
        *PUBLISHED_AND_PREDICTED,
        ("leave-one-out", lambda r: signed(r["leave_one_out_error"])),
        (
            "before the constants",
            lambda r: signed(r["error_before_torchtitan_constants"]),
        ),
        ("published GiB", lambda r: f"{r['published_peak_memory_gib']:.1f}"),
        ("predicted GiB", lambda r: f"{r['predicted_peak_memory_gib']:.1f}"),
    ]
    c, fit, loo = data["constants"], data["fitted_on_all"], data["leave_one_out"]
    mem = data["memory"]
    return (
        columns(data["runs"], spec)
        + f"\n\nFitted on all seven: `attention_efficiency` "
        f"{c['attention_efficiency']}, `tensor_efficiency` {c['tensor_efficiency']}. "
        + fit_errors(fit, loo)
        + f"; peak memory |error| median {pct(mem['median'])}, "
        f"max {pct(mem['max'])}." + source("torchtitan_published.json")
    )


def t_sharded_planning() -> str:
    def setting(r):
        export = "" if r["export"] is None else f", `--export {r['export']}`"
        return (
            f"{r['model']}, {r['seq_length']:,} tokens, {r['gpus']:,} H100, "
            f"batch {r['global_batch']}{export}"
        )

    def recompute(r):
        options = r["options"]
        op = (
            options["recompute_modules"] == ["torchtitan_op"]
            and options["recompute"] == "selective"
        )
        return f"{options['recompute']}" + (" (op)" if op else "")

    spec = [
        ("setting", setting),
        ("best plan", lambda r: f"`{r['plan']}`"),
        ("recompute", recompute),
        ("iteration", lambda r: f"{r['iteration_time_s']:.2f} s"),
        ("tokens/s/GPU", lambda r: f"{r['tokens_per_s_per_gpu']:,.0f}"),
        (
            "optimal under the predictor",
            lambda r: ("proven" if r["proven"] else "not proven") + f" ({r['space']})",
        ),
        ("search", lambda r: f"{r['search_seconds']:.1f} s"),
    ]
    runs = load("sharded_planning.json")["runs"]
    return columns(runs, spec) + source("sharded_planning.json")


def t_cluster_calibration() -> str:
    data = load("cluster_calibration.json")
    names = {"gh200-opt350": "GH200 (15 runs)", "rtx-opt350": "RTX cluster (8 runs)"}
    fits = data["runs_fit"]

    def label(cluster):
        n = len(fits[cluster]["runs"])
        return {
            "gh200-opt350": f"OPT-350 runs on GH200 ({n})",
            "rtx-opt350": f"OPT-350 runs on the RTX cluster ({n})",
        }.get(cluster, cluster)

    # a row a cluster's runs, and one of GPT-Neo's blocks: each pricing's errors
    priced = [
        {
            "label": label(cluster),
            "default": errors["default"],
            "calibrated": errors["calibrated"],
            "and_runs": fits[cluster]["leave_one_run_out"],
        }
        for cluster, errors in data["clusters"].items()
    ]
    neo = data["gpt_neo_blocks_gh96"]
    priced.append(
        {
            "label": "GPT-Neo-2.7 block profiles on GH-96 (every TP)",
            "default": neo["default"],
            "calibrated": neo["calibrated"],
            "and_runs": neo["calibrated_and_runs"],
        }
    )
    spec = [
        ("priced analytically", lambda p: p["label"]),
        ("project's constants", lambda p: median_max(p["default"])),
        ("calibrated on profiles", lambda p: median_max(p["calibrated"])),
        ("and on the other runs", lambda p: median_max(p["and_runs"])),
    ]

    def runs_used(n):
        return lambda cluster: median_max(fits[cluster]["by_runs_used"][n])

    counts = sorted(fits["rtx-opt350"]["by_runs_used"], key=int)
    by_runs = [("cluster", lambda cluster: names.get(cluster, cluster))]
    by_runs += [(f"n = {n}", runs_used(n)) for n in counts]
    gh = data["calibration"]["gpus"]["GH-96"]
    values = ", ".join(f"`{k}` {v:.3g}" for k, v in gh["constants"].items())
    loo = gh["leave_one_out"]
    return (
        columns(priced, spec)
        + "\n\n|error| median / max; the runs were not fitted on in the first "
        "two columns, the run priced was not in the third (leave one run out); "
        "GPT-Neo-2.7's blocks (never fitted on) with the profiles' calibration "
        "refined on the 15 GH200 runs. "
        + f"GH-96 fitted on OPT-350's profiles: {values}; "
        f"on the profiles, leave-one-out median {pct(loo['median'])}, max "
        f"{pct(loo['max'])}; the fit of every GPU type took "
        f"{data['fit_seconds']:.0f} s.\n\nCalibrated on the profiles and "
        "n runs of a cluster, its other runs predicted (8 random draws of the "
        "n runs each):\n\n"
        + columns(fits, by_runs)
        + source("cluster_calibration.json")
    )


def t_capacity_planning() -> str:
    data = load("capacity_planning.json")
    rows = []
    for row in data["candidates"]:
        pool = ", ".join(f"{g}:{n}" for g, n in row["pool"].items())
        mark = "chosen" if row["chosen"] else ("frontier" if row["frontier"] else "")
        if row.get("dominated_by"):
            by = ", ".join(f"{g}:{n}" for g, n in row["dominated_by"].items())
            rows.append([pool, f"dominated by {by}", "", "", "", ""])
            continue
        if row["used"] is None:
            rows.append([pool, "no plan fits", "", "", "", ""])
            continue
        rows.append(
            [
                pool,
                row["shape"],
                f"{row['iteration_s']:.2f}",
                f"{row['days']:.1f}",
                f"{row['cost']:,.0f}",
                mark,
            ]
        )
    head = ["pool", "best plan", "s / iteration", "days", "cost (USD)", ""]
    seconds = data["seconds"]
    return (
        table(head, rows) + f"\n\nAnswered in {seconds['1']:.0f} s with one worker, "
        f"{seconds['2']:.0f} s with two local processes "
        f"(x{data['speed_up_2_workers']:.2f}) and {seconds['dask-local-2']:.0f} s "
        f"on a local Dask cluster of two (x{data['speed_up_dask_local_2']:.2f}, "
        "its start included); the three answers "
        + ("are identical" if data["identical"] else "DIFFER")
        + " (wall-clock fields aside). Prices: the bundled example sheet, not "
        "quotes." + source("capacity_planning.json")
    )


def t_capacity_sheet() -> str:
    data = load("capacity_sheet.json")
    q = data["question"]
    spec = [
        ("rented", lambda r: ", ".join(f"{g}:{n}" for g, n in r["used"].items())),
        ("days", lambda r: f"{r['days']:.1f}"),
        ("cost (USD)", lambda r: f"{r['cost']:,.0f}"),
        ("", lambda r: "chosen" if r["used"] == data["chosen"]["used"] else ""),
    ]
    seconds = data["seconds"]
    slowest = data["slowest_pools"][0]
    pool = ", ".join(f"{g}:{n}" for g, n in slowest["pool"].items())
    engines = ""
    if "dask" in seconds:
        engines = f", {seconds['dask']:.0f} s on a local Dask cluster of two; the " + (
            "answers are identical" if data["identical"] else "answers DIFFER"
        )
    every = ""
    if "every_plan_s" in data:
        every = (
            f" With every pool planned to its optimum (`--every-plan`): "
            f"{data['every_plan_s']:.0f} s, and "
            + (
                "the same choice, frontier and plans of the pools not dominated."
                if data["same_as_every_plan"]
                else "a DIFFERENT answer."
            )
        )
    dominated = data.get("dominated", 0)
    return (
        f"{q['model']}, {q['tokens'] / 1e12:g}T tokens, global batch "
        f"{q['global_batch']}, {len(q['types'])} GPU types x {len(q['counts'])} "
        f"counts ({data['pools']} pools: {data['pools_with_a_plan']} planned to "
        f"their optimum, {data['not_proven']} of them not proven; {dominated} "
        f"dominated), least cost within "
        f"{q['deadline_days']:.0f} days; the Pareto frontier:\n\n"
        + columns(data["frontier"], spec)
        + f"\n\nAnswered in {seconds['2']:.0f} s with two local processes "
        f"(target: {data['target_s']} s){engines}. "
        f"{data['planning_s_summed']:.0f} s of planning summed over the pools; "
        f"the slowest pool, {pool}, {slowest['search_s']:.0f} s.{every} Prices: "
        "the bundled example sheet, not quotes." + source("capacity_sheet.json")
    )


def t_large_pools() -> str:
    data = load("large_pools.json")

    def before(row):
        seconds = row["seconds"]
        return min(seconds["before"]) if "before" in seconds else None

    def after(row):
        return min(row["seconds"]["after"])

    def iteration_cell(row):
        earlier = row.get("iteration_s_before", row["iteration_s"])
        if f"{earlier:.2f}" == f"{row['iteration_s']:.2f}":
            return f"{row['iteration_s']:.2f}"
        return f"{earlier:.2f} → {row['iteration_s']:.2f}"

    def same_cell(row):
        if row.get("identical") is not False:
            return {True: "yes"}.get(row.get("identical"), "")
        faster = row["iteration_s"] < row.get("iteration_s_before", math.inf)
        return "no: faster" if faster else "NO"

    def before_cell(row):
        if before(row) is not None:
            return f"{before(row):.0f}"
        return "refused" if "before_refused" in row else ""

    spec = [
        ("model", lambda r: r["model"]),
        ("H100", lambda r: f"{r['gpus']:,}"),
        ("s before", before_cell),
        ("s after", lambda r: f"{after(r):.0f}"),
        (
            "speed-up",
            lambda r: "" if before(r) is None else f"x{before(r) / after(r):.2f}",
        ),
        ("s / iteration", iteration_cell),
        ("same plan", same_cell),
        ("proven", lambda r: "yes" if r["proven"] else "no"),
    ]
    return (
        columns(data["settings"], spec)
        + "\n\nEach planned in a fresh process, global batch "
        "1,024 (16,384 on 131,072 GPUs), the code before and after the change "
        "side by side on one machine, its plans compared field by field "
        "(wall-clock fields and the per-knob outcomes aside); 'refused': the "
        "code before did not search that many GPUs." + source("large_pools.json")
    )


TABLES: dict[str, Callable[[], str]] = {
    "large_pools": t_large_pools,
    "capacity_planning": t_capacity_planning,
    "capacity_sheet": t_capacity_sheet,
    "cluster_calibration": t_cluster_calibration,
    "torchtitan_published": t_torchtitan_published,
    "sharded_planning": t_sharded_planning,
    "simulator_speed": t_simulator_speed,
    "plan_knobs": t_plan_knobs,
    "fp8_gemms": t_fp8_gemms,
    "moe_published": t_moe_published,
    "moe_planning": t_moe_planning,
    "moe_vs_published": t_moe_vs_published,
    "zero_bubble_split": t_zero_bubble_split,
    "gpu_blocks": t_gpu_blocks,
    "gpu_blocks_cudnn": t_gpu_blocks_cudnn,
    "gpu_attention": t_gpu_attention,
    "gpu_h100": t_gpu_h100,
    "layout": t_layout,
    "published_runs": t_published_runs,
    "opt350_no_profile": t_opt350_no_profile,
    "analytical_lomo": t_analytical_lomo,
    "analytical_logo": t_analytical_logo,
    "headline": t_headline,
    "dp_scaling": t_dp_scaling,
    "engine_quality": t_engine_quality,
    "compare_methods": t_compare_methods,
    "hetero_vs_alpa": t_hetero,
    "hetero_engine_versions": t_hetero_engine_versions,
    "predict_real_runs": t_predict_runs,
    "plan_vs_sailor": t_plan_vs_sailor,
    "mbs_choice": t_mbs_choice,
    "goodput_modes": t_goodput_modes,
    "elastic_modes": t_elastic_modes,
    "pollux_vs_predictor": t_pollux,
    "init_search": t_init_search,
    "check_exports": t_check_exports,
    "startup": t_startup,
    "startup_no_bytecode": t_startup_no_bytecode,
}


# ------------------------------------------------------------ prose numbers


@dataclass(frozen=True)
class Value:
    """A number quoted in prose: results file, path into its JSON, format."""

    file: str
    path: tuple
    fmt: Callable[[Any], str]

    def text(self) -> str:
        meta(self.file)  # refuses files without a date or machine
        x = load(self.file)
        for key in self.path:
            x = x[key]
        return self.fmt(x)


def _pct1(x: float) -> str:
    return pct(x)


def _seconds1(x: float) -> str:
    return f"{x:.1f} s"


def _seconds2(x: float) -> str:
    return f"{x:.2f} s"


def _knob(setting: str, space: str, field: str, fmt) -> Value:
    """A value of one space of one setting in ``plan_knobs.json``."""
    return Value("plan_knobs.json", ("settings", setting, "spaces", space, field), fmt)


VALUES: dict[str, Value] = {
    "mbs_gain_median": Value("mbs_choice.json", ("summary", "gain_median"), _pct1),
    "mbs_gain_mean": Value("mbs_choice.json", ("summary", "gain_mean"), _pct1),
    "mbs_gain_max": Value("mbs_choice.json", ("summary", "gain_max"), _pct1),
    "gh200_time_median": Value(
        "predict_real_runs.json",
        ("summary", "gh200-opt350", "time_error", "median"),
        _pct1,
    ),
    "gh200_time_max": Value(
        "predict_real_runs.json",
        ("summary", "gh200-opt350", "time_error", "max"),
        _pct1,
    ),
    "rtx_time_median": Value(
        "predict_real_runs.json",
        ("summary", "rtx-opt350", "time_error", "median"),
        _pct1,
    ),
    "rtx_time_max": Value(
        "predict_real_runs.json", ("summary", "rtx-opt350", "time_error", "max"), _pct1
    ),
    "knobs_175b_interleaved": _knob(
        "gpt3-175b", "+interleaved", "iteration_time_s", _seconds2
    ),
    "knobs_175b_all": _knob("gpt3-175b", "all", "iteration_time_s", _seconds2),
    "knobs_175b_all_search": _knob("gpt3-175b", "all", "search_s", _seconds1),
    "knobs_175b_today_search": _knob("gpt3-175b", "today", "search_s", _seconds1),
    "knobs_70b_recompute_bound": _knob(
        "llama3-70b", "+recompute", "lower_bound_s", _seconds2
    ),
    "split_same": Value(
        "check_megatron_launch_flags.json",
        ("pipeline_splits", "same counts"),
        str,
    ),
    "split_refused": Value(
        "check_megatron_launch_flags.json",
        ("pipeline_splits", "both refuse"),
        str,
    ),
    "split_negative": Value(
        "check_megatron_launch_flags.json",
        ("pipeline_splits", "megatron: negative layers"),
        str,
    ),
}

# The calibration's numbers quoted in docs/calibration.md's prose.
for _cluster, _short in (("gh200-opt350", "gh200"), ("rtx-opt350", "rtx")):
    for _field in ("median", "max"):
        VALUES[f"calib_{_short}_loo_{_field}"] = Value(
            "cluster_calibration.json",
            ("runs_fit", _cluster, "leave_one_run_out", _field),
            _pct1,
        )
VALUES["prediction_16k_ms"] = Value(
    "prediction_speed.json", ("settings", 0, "median_s"), lambda x: f"{x * 1e3:.0f} ms"
)
VALUES["prediction_131k_ms"] = Value(
    "prediction_speed.json", ("settings", 1, "median_s"), lambda x: f"{x * 1e3:.0f} ms"
)
VALUES["capacity_sheet_s"] = Value(
    "capacity_sheet.json", ("seconds", "2"), lambda x: f"{x:.0f}"
)
VALUES["calib_gh200_profiles_max"] = Value(
    "cluster_calibration.json",
    ("clusters", "gh200-opt350", "calibrated", "max"),
    _pct1,
)
VALUES["calib_gh96_latency"] = Value(
    "cluster_calibration.json",
    ("calibration", "gpus", "GH-96", "constants", "collective_latency_s"),
    lambda x: f"{x * 1e3:.2f} ms",
)

# ZB-H1 around the 16,384-GPU plan (benchmarks/zero_bubble_landscape.py).
for _name, _path, _format in (
    ("plan_s", ("plan_s",), lambda x: f"{x:.3f} s"),
    ("equal_s", ("equal_stages_s",), lambda x: f"{x:.3f} s"),
    ("least_s", ("configuration_least_bound_s",), lambda x: f"{x:.3f} s"),
    ("near_01", ("samples", "near_plan", "within", "0.1%"), lambda x: pct(x, 0)),
    ("near_1", ("samples", "near_plan", "within", "1%"), lambda x: pct(x, 0)),
    ("near_chains", ("samples", "near_plan", "chains"), str),
    (
        "near_bound",
        ("samples", "near_plan", "path_bound_over_prediction", "median"),
        lambda x: pct(1 - x),
    ),
):
    VALUES[f"zb16k_{_name}"] = Value("zero_bubble_landscape.json", _path, _format)

# The per-stage recomputation benchmark's plans, bounds and search seconds.
for _key, _setting in (("175b", "gpt3-175b"), ("70b", "llama3-70b")):
    for _name, _space in (("uniform", "uniform"), ("per_stage", "per stage")):
        for _field, _suffix, _format in (
            ("iteration_time_s", "time", _seconds2),
            ("lower_bound_s", "bound", _seconds2),
            ("search_s", "search", _seconds1),
        ):
            VALUES[f"stage_{_key}_{_name}_{_suffix}"] = Value(
                "stage_recompute.json", ("settings", _setting, _space, _field), _format
            )


# ---------------------------------------------------------------- rewriting

TABLE_RE = re.compile(
    r"(<!-- results:([a-z0-9_]+) -->)(.*?)(<!-- /results:\2 -->)", re.S
)
VALUE_RE = re.compile(r"(<!-- value:([a-z0-9_]+) -->)(.*?)(<!-- /value -->)", re.S)


def render(text: str) -> str:
    """The page with every generated table and value rewritten."""

    def fill_table(m: re.Match) -> str:
        name = m.group(2)
        if name not in TABLES:
            raise KeyError(f"unknown results table {name!r}")
        return m.group(1) + "\n" + TABLES[name]() + "\n" + m.group(4)

    def fill_value(m: re.Match) -> str:
        name = m.group(2)
        if name not in VALUES:
            raise KeyError(f"unknown quoted value {name!r}")
        return m.group(1) + VALUES[name].text() + m.group(4)

    return VALUE_RE.sub(fill_value, TABLE_RE.sub(fill_table, text))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a page is stale")
    args = parser.parse_args(argv)
    stale = []
    for page in pages():
        text = page.read_text()
        new = render(text)
        if new != text:
            stale.append(page.relative_to(ROOT))
            if not args.check:
                page.write_text(new)
    for page in stale:
        print(("stale: " if args.check else "rewrote: ") + str(page))
    return 1 if (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
