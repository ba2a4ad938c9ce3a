"""Layer pricing memoised across cost sources (price_cache): exact (the same
rows, plans, predictions and bounds as pricing every source alone), fewer
pricing calls, read-only results, bounded."""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path

import numpy as np
import pytest
from test_moe_predict import SPEC

from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.costmodel.analytical import source as source_module
from pipedejavu.costmodel.analytical.layers import analytical_layer_times
from pipedejavu.costmodel.analytical.moe_layers import (
    ExpertLayers,
    dense_view,
    expert_layer_times,
)
from pipedejavu.costmodel.analytical.moe_tokens import ExpertPass
from pipedejavu.costmodel.analytical.ops import PassOptions
from pipedejavu.costmodel.analytical.price_cache import PriceCache
from pipedejavu.costmodel.analytical.recompute import recompute_of
from pipedejavu.costmodel.analytical.source import AnalyticalSource
from pipedejavu.io.gpu_sheet import load_gpu_sheet
from pipedejavu.planning.plan_model import plan_model

SHEET = load_gpu_sheet()
H100 = SHEET["H100-SXM"]
TINY_MOE = str(Path(__file__).parent / "tiny_moe.json")
#: What the sources call to price their rows (source.py's names).
PRICING = (
    "analytical_layer_times",
    "selective_forward_seconds",
    "weight_gradient_seconds",
    "expert_rerun_seconds",
    "expert_layer_times",
)
#: Knob choices whose rows differ (recompute, SP, Megatron's block method).
CHOICES = [
    TrainingOptions("bf16", recompute=recompute, sequence_parallel=sp)
    for recompute in ("none", "selective", "full")
    for sp in (False, True)
] + [
    TrainingOptions("bf16", recompute="full", recompute_num_layers=1),
    TrainingOptions(
        "bf16", recompute="selective", recompute_modules=("core_attn", "moe_act")
    ),
]


def _counted(monkeypatch) -> collections.Counter:
    """Count the calls of each pricing function the sources make (a call
    answered by the cache does not reach it)."""
    calls: collections.Counter = collections.Counter()
    for name in PRICING:
        real = getattr(source_module, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(source_module, name, counted)
    return calls


def _rows(data: AnalyticalSource, gpu: str = "H100-SXM") -> dict:
    """Every entry of ``data``'s profile, and its sizes, as plain arrays."""
    out = {}
    for key, times in data.profile(data.spec.name, gpu).items():
        for field in dataclasses.fields(times):
            value = getattr(times, field.name)
            out[(key, field.name)] = None if value is None else np.array(value)
    info = data.model_info(data.spec.name)
    for tp, params in info.params.items():
        out[("params", tp)] = np.array(params)
        out[("experts", tp)] = np.array(info.expert_params[tp])
    return out


def _same(left: dict, right: dict) -> None:
    assert left.keys() == right.keys()
    for key, value in left.items():
        if value is None:
            assert right[key] is None, key
        else:  # bit for bit
            assert value.dtype == right[key].dtype, key
            assert np.array_equal(value, right[key]), key


@pytest.mark.parametrize("mtp", [0, 1])
def test_shared_pricing_gives_every_source_its_own_rows(monkeypatch, mtp):
    """The sources of a search's choices (each knob choice at each EP) price
    through one cache: each gets the rows, the weight-gradient split, the
    block method's reruns and the parameter counts it gets alone, bit for bit,
    with fewer pricing calls (the dense rows shared by the EPs and the
    recompute choices, the expert rows by the recompute choices)."""
    spec = dataclasses.replace(SPEC, mtp_layers=mtp)
    layouts = [ExpertLayers(ExpertPass(ep=ep, etp=1)) for ep in (1, 4)]
    calls = _counted(monkeypatch)
    alone = {}
    for layers in layouts:
        kw = {"experts": layers, "mbs_values": (1, 4)}
        for options in CHOICES:
            data = AnalyticalSource(spec, SHEET, options, **kw, prices=PriceCache(0))
            alone[(layers, options)] = _rows(data)
    alone_calls = sum(calls.values())
    calls.clear()
    prices = PriceCache()
    for layers in layouts:
        kw = {"experts": layers, "mbs_values": (1, 4)}
        for options in CHOICES:
            data = AnalyticalSource(spec, SHEET, options, **kw, prices=prices)
            _same(_rows(data), alone[(layers, options)])
            # read-only rows: a caller cannot change another source's
            times = data.layer_times(spec.name, "H100-SXM", 1, 1)
            with pytest.raises(ValueError):
                times.forward[0] = 0.0
    shared_calls = sum(calls.values())
    # the dense rows once per (SP, mbs, TP) and what the depths rerun (the
    # block method: nothing), for every layout and recompute choice; the
    # expert rows once per layout too
    priced = [
        (options, key)
        for (layers, options), rows in alone.items()
        for (key, field) in rows
        if field == "forward" and layers == layouts[0]
    ]
    entries = {(options.sequence_parallel, key) for options, key in priced}
    reruns = {
        (
            options.sequence_parallel,
            key,
            recompute_of(options) if mtp and not options.block_recompute else "none",
        )
        for options, key in priced
    }
    assert len(entries) == 2 * (1 + 4)  # mbs x (TP 1; with SP, TP 1, 2, 4, 8)
    assert calls["weight_gradient_seconds"] == len(entries)
    assert calls["analytical_layer_times"] == len(reruns)
    assert calls["expert_layer_times"] == len(layouts) * len(reruns)
    assert shared_calls < alone_calls


def test_a_model_without_depths_prices_one_row_for_every_recompute():
    """The sources price a model without multi-token-prediction depths with
    ``mtp_recompute="none"`` whatever they recompute (one cache entry): the
    rows do not depend on it there."""
    spec = dense_view(SPEC)
    for recompute in ("full", ("core_attn", "mlp")):
        for options in ({}, {"sequence_parallel": True}):
            args = (spec, H100, 2, 2, "bf16")
            plain = analytical_layer_times(*args, **options)
            other = analytical_layer_times(*args, **options, mtp_recompute=recompute)
            for a, b in zip(plain, other, strict=True):
                assert np.array_equal(a, b)
    opts = PassOptions(2, 1, "bf16")
    layers = ExpertLayers(ExpertPass(ep=4, etp=1))
    rows = analytical_layer_times(spec, H100, 2, 1, "bf16")
    plain = expert_layer_times(SPEC, H100, opts, layers, rows, "bf16")
    for recompute in ("full", ("core_attn", "moe"), ("moe_act",)):
        other = expert_layer_times(
            SPEC, H100, opts, layers, rows, "bf16", mtp_recompute=recompute
        )
        for a, b in zip(plain, other, strict=True):
            assert np.array_equal(a, b)


def _searched(path: str) -> dict:
    """plan --model's result, all but the seconds the search took."""
    found = plan_model(path, {"H100": 8}, 16)
    out = found.to_json()
    out.pop("search_time_s")
    for choice in out["knobs"]["choices"]:
        choice.pop("time_s")
    out["notes"] = found.choice.notes
    return out


def test_plan_model_is_the_same_with_shared_pricing(monkeypatch):
    """plan --model of a mixture of experts (every EP, every knob choice)
    finds the same plan, prediction, bound and knob outcomes with the pricing
    shared as with each source pricing alone, with far fewer pricing calls."""
    calls = _counted(monkeypatch)
    monkeypatch.setattr(source_module, "SHARED_PRICES", PriceCache(0), raising=False)
    alone = _searched(TINY_MOE)
    alone_calls = sum(calls.values())
    calls.clear()
    shared = PriceCache()
    monkeypatch.setattr(source_module, "SHARED_PRICES", shared, raising=False)
    assert _searched(TINY_MOE) == alone
    # (each layout's expert rows differ by dispatcher and overlap: measured
    # 3,625 calls alone, 1,225 shared, when both dispatchers and the overlap
    # joined the search; 3 x fewer before)
    assert shared.hits > 0 and sum(calls.values()) < alone_calls / 2.5
    assert alone["proven_optimal"] and alone["predicted_lower_bound_s"] > 0


def test_the_cache_is_exact_and_bounded():
    """A call is answered from the cache only for arguments equal in type and
    value; arrays come back read-only copies; the least recently used entry
    goes first; errors and mutable results are not kept."""
    runs = []

    def priced(x, scale=1.0):
        runs.append((x, scale))
        if isinstance(x, np.ndarray):
            return x * scale, float(x.sum())
        if x < 0:
            raise ValueError("negative")
        return np.full(3, x * scale)

    cache = PriceCache(maxsize=2)
    first = cache.call(priced, 2)
    assert not first.flags.writeable and first.tolist() == [2.0, 2.0, 2.0]
    assert cache.call(priced, 2) is first and len(runs) == 1
    assert cache.call(priced, 2.0) is not first  # another type: run again
    assert cache.call(priced, 2, scale=3.0).tolist() == [6.0] * 3
    assert len(runs) == 3 and len(cache) == 2  # (2) went first
    cache.call(priced, 2)
    assert len(runs) == 4 and (cache.hits, cache.misses) == (1, 4)
    given = np.arange(3.0)
    row, total = cache.call(priced, given)
    assert not row.flags.writeable and total == 3.0
    given[0] = 5.0  # another array's bytes: another call
    assert cache.call(priced, given)[1] == 8.0 and len(runs) == 6
    with pytest.raises(ValueError):
        cache.call(priced, -1)
    with pytest.raises(ValueError):
        cache.call(priced, -1)
    assert len(runs) == 8
    with pytest.raises(TypeError):
        cache.call(lambda: [1.0])
    never = PriceCache(maxsize=0)
    never.call(priced, 1)
    never.call(priced, 1)
    assert len(never) == 0 and never.misses == 2 and len(runs) == 10
