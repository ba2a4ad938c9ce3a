"""Any model on any GPU: layer costs for the Megatron predictor without profiles.

:class:`AnalyticalSource` answers what
:func:`~pipedejavu.costmodel.megatron.predictor.predict_plan`, the planning
tables and the proof ask of their data (the interface of
:class:`~pipedejavu.costmodel.megatron.sailor_data.SailorData`: ``models``,
``gpu_types``, ``profile``, ``layer_times``, ``model_info``, ``network``,
``gpu_spec``, ``options``) for one
:class:`~pipedejavu.core.transformer.TransformerSpec` trained with one
:class:`~pipedejavu.core.training_options.TrainingOptions`:

* **Layer times** from the profile where one exists for the exact (model, GPU
  type, mbs, TP) and the training the profiles measured (fp32, no
  recomputation, no sequence parallelism); otherwise from the analytical model
  (:func:`~pipedejavu.costmodel.analytical.layers.analytical_layer_times`), with
  the recomputed forward (:func:`~pipedejavu.costmodel.megatron.options.
  recompute_time`: the block's, or what the selective modules rerun,
  :mod:`~pipedejavu.costmodel.analytical.recompute`) added to each block's
  backward. :meth:`source_of` says which
  priced an entry.
* **GEMM precision**: ``fp16``/``bf16``/``fp8`` training multiplies in that
  precision; ``fp32`` training in TF32 where the GPU has it (NVIDIA's PyTorch
  containers allow TF32 by default, and the bundled A100/GH200 profiles run at
  TF32 speed), else fp32.
* **Sizes**: parameters per layer from the spec (the tied embedding's copy
  counted in the last layer, as Sailor's ``llm_info`` does), activations per
  Korthikanti et al. (:func:`~pipedejavu.costmodel.analytical.layers.
  activation_bytes`), element sizes and model-state bytes per parameter from
  :mod:`pipedejavu.costmodel.megatron.options`.
* **GPUs and links** from the GPU sheet (:class:`~pipedejavu.costmodel.megatron.
  sheet_network.SheetNetwork`), or the profiles' measured links where asked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from pipedejavu.core.gpu_sheet import GpuSheetEntry, Precision
from pipedejavu.core.memory_headroom import MemoryHeadroom
from pipedejavu.core.plan3d import Plan3D
from pipedejavu.core.problem import ProblemError
from pipedejavu.core.replica import kinds_of
from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.costmodel.analytical.layers import (
    activation_bytes,
    analytical_layer_times,
    layer_output_bytes,
    selective_forward_seconds,
    weight_gradient_seconds,
)
from pipedejavu.costmodel.analytical.moe_layers import (
    ExpertLayers,
    dense_view,
    expert_layer_activations,
    expert_layer_times,
    expert_rerun_seconds,
)
from pipedejavu.costmodel.analytical.moe_tokens import ExpertPass, expert_shape
from pipedejavu.costmodel.analytical.ops import PassOptions
from pipedejavu.costmodel.analytical.price_cache import SHARED_PRICES, PriceCache
from pipedejavu.costmodel.analytical.recompute import Recompute, recompute_of
from pipedejavu.costmodel.analytical.roofline import (
    FITTED_ANALYTICAL,
    HALF_PRECISION_ANALYTICAL,
    AnalyticalConstants,
)
from pipedejavu.costmodel.megatron.options import (
    activation_element_bytes,
    grad_reduce_bytes_per_param,
    param_gather_bytes_per_param,
    param_state_bytes,
    recompute_time,
)
from pipedejavu.costmodel.megatron.profile_types import with_memory_headroom
from pipedejavu.costmodel.megatron.rules import profiling_params
from pipedejavu.costmodel.megatron.sailor_data import (
    GpuSpec,
    LayerTimes,
    ModelInfo,
    NetworkTables,
    SailorData,
)
from pipedejavu.costmodel.megatron.sheet_network import (
    SheetNetwork,
    sheet_entry,
    tp_bandwidth,
)

__all__ = ["DEFAULT_MBS_VALUES", "AnalyticalSource", "gemm_precision"]

#: Micro-batch sizes the planner may choose among for an analytical model.
DEFAULT_MBS_VALUES = (1, 2, 4, 8, 16)


def gemm_precision(options: TrainingOptions, gpu: GpuSheetEntry) -> Precision:
    """The precision the GEMMs of ``options`` run in on ``gpu`` (module doc)."""
    if options.precision != "fp32":
        return options.precision
    has_tf32 = any(name == "tf32" for name, _ in gpu.peak_flops)
    return "tf32" if has_tf32 else "fp32"


class AnalyticalSource:
    """One model's costs from profiles where they exist, else analytical.

    Args:
        spec: the model.
        sheet: GPU types by name (``load_gpu_sheet()``).
        options: how it is trained (fp32, no recomputation by default).
        profiles: profiles to use where they cover an entry exactly (only for
            fp32 training without recomputation or sequence parallelism, what
            they measured); ``None``: analytical everywhere.
        profile_model: the model's name in ``profiles`` (default ``spec.name``).
        measured_links: measured link fits to price links with where they
            have one (e.g. ``SailorData().network``: the clusters Sailor's
            runs come from); ``None``: the GPU sheet's links only.
        constants: the analytical model's constants (``None``: those fitted on
            the profiles for fp32 training, on the published 16-bit runs for
            fp16/bf16/fp8: :data:`~pipedejavu.costmodel.analytical.roofline.
            HALF_PRECISION_ANALYTICAL`).
        mbs_values: micro-batch sizes offered to the planner.
        link_efficiency: share of the sheet's link bandwidth reached.
        query_key_layer_scaling: the model's code scales the attention scores
            in a kernel of its own (Megatron's ``apply_query_key_layer_scaling``;
            the bundled Sailor models but GPT-Neo-2.7 do).
        eager: price a block's element-wise kernels as eager PyTorch runs
            them (a torchtitan job without ``torch.compile``), not fused.
        context_parallel: Megatron's context parallelism ``c``: ``spec`` holds
            a GPU's share of each sequence (``seq_length = s / c``), whose
            attention reads the whole sequence's keys and values
            (:class:`~pipedejavu.costmodel.analytical.ops.PassOptions`).
        experts: how a mixture of experts' expert blocks run (their EP and
            expert-TP, kernels, all-to-all overlap:
            :class:`~pipedejavu.costmodel.analytical.moe_layers.ExpertLayers`);
            ``None``: EP 1 for a mixture of experts, nothing for a dense model.
            The expert blocks are priced by
            :func:`~pipedejavu.costmodel.analytical.moe_layers.expert_layer_times`,
            their parameters counted with
            :meth:`~pipedejavu.core.transformer.TransformerSpec.layer_param_split`
            (``ModelInfo.expert_params``).
        prices: the memo of the pricing functions
            (:class:`~pipedejavu.costmodel.analytical.price_cache.PriceCache`;
            ``None``: the one every source shares,
            :data:`~pipedejavu.costmodel.analytical.price_cache.SHARED_PRICES`,
            so the choices of a search price each layer row once).
        calibrated: per GPU type, constants that replace the source's for
            the layers priced on it (a calibration to the user's cluster:
            :mod:`~pipedejavu.costmodel.analytical.cluster_fit`).
    """

    def __init__(
        self,
        spec: TransformerSpec,
        sheet: Mapping[str, GpuSheetEntry],
        options: TrainingOptions | None = None,
        *,
        profiles: SailorData | None = None,
        profile_model: str | None = None,
        measured_links: NetworkTables | None = None,
        constants: AnalyticalConstants | None = None,
        mbs_values: Sequence[int] = DEFAULT_MBS_VALUES,
        link_efficiency: float = 1.0,
        query_key_layer_scaling: bool = False,
        context_parallel: int = 1,
        experts: ExpertLayers | None = None,
        prices: PriceCache | None = None,
        eager: bool = False,
        calibrated: Mapping[str, Mapping[str, float]] | None = None,
    ) -> None:
        self.spec = spec
        self.prices = SHARED_PRICES if prices is None else prices
        self.context_parallel = int(context_parallel)
        self.eager = bool(eager)
        if experts is None and spec.moe is not None:
            experts = ExpertLayers(ExpertPass())
        self.experts = experts if spec.moe is not None else None
        self.link_efficiency = float(link_efficiency)
        self.sheet = dict(sheet)
        self._options = TrainingOptions() if options is None else options
        self.profiles = profiles
        self.profile_model = spec.name if profile_model is None else profile_model
        if constants is None:
            half = self._options.precision in ("fp16", "bf16", "fp8")
            constants = HALF_PRECISION_ANALYTICAL if half else FITTED_ANALYTICAL
        self.constants = constants
        self._calibrated = {
            gpu: dataclasses.replace(constants, **dict(fields))
            for gpu, fields in (calibrated or {}).items()
        }
        self.mbs_values = tuple(int(m) for m in mbs_values)
        self.query_key_layer_scaling = bool(query_key_layer_scaling)
        self._network = SheetNetwork(
            self.sheet, measured=measured_links, efficiency=link_efficiency
        )
        self._measured = measured_links
        self._info: ModelInfo | None = None
        self._tables: dict[str, dict[tuple[int, int], LayerTimes]] = {}
        self._sources: dict[tuple[str, int, int], str] = {}
        self._entries: dict[tuple[str, int, int], LayerTimes] = {}
        self.memory_headroom: MemoryHeadroom | None = None

    def with_memory_headroom(self, headroom: MemoryHeadroom | None) -> AnalyticalSource:
        """This source with ``headroom`` kept free on every GPU
        (:meth:`gpu_spec`; the priced layers are shared)."""
        return with_memory_headroom(self, headroom)

    # ------------------------------------------------------------ interface
    @property
    def options(self) -> TrainingOptions:
        return self._options

    @property
    def network(self) -> SheetNetwork:
        return self._network

    def models(self) -> tuple[str, ...]:
        return (self.spec.name,)

    def _check_model(self, model: str) -> None:
        if model != self.spec.name:
            raise ProblemError(
                f"this cost source describes model {self.spec.name!r}, not {model!r}"
            )

    def gpu_types(self, model: str) -> tuple[str, ...]:
        self._check_model(model)
        return tuple(sorted(self.sheet))

    def _entry(self, gpu: str) -> GpuSheetEntry:
        return sheet_entry(self.sheet, gpu, "; add it with a --gpu-sheet file")

    def gpu_spec(self, gpu: str) -> GpuSpec:
        entry = self._entry(gpu)
        spec = GpuSpec(gpu, entry.gpus_per_node, entry.memory_bytes)
        return spec.with_headroom(self.memory_headroom)

    def tp_values(self, gpu: str) -> tuple[int, ...]:
        """TP degrees that split the model and fit in a node of ``gpu``."""
        per_node = self._entry(gpu).gpus_per_node
        out = []
        for tp in range(1, per_node + 1):
            if per_node % tp:
                continue
            try:
                self.spec.check_tp(tp)
                if self.experts is not None:  # Megatron-Core's rules for experts
                    precision = gemm_precision(self._options, self._entry(gpu))
                    opts = self._pass_options(1, tp, precision)
                    expert_shape(self.spec, opts, self.experts.experts)
            except ValueError:
                continue
            out.append(tp)
        return tuple(out)

    def profile(self, model: str, gpu: str) -> dict[tuple[int, int], LayerTimes]:
        """``{(mbs, tp): LayerTimes}`` for every offered mbs and usable TP."""
        self._check_model(model)
        if gpu not in self._tables:
            self._tables[gpu] = {
                (mbs, tp): self._priced(gpu, mbs, tp)
                for mbs in self.mbs_values
                for tp in self.tp_values(gpu)
            }
        return self._tables[gpu]

    def layer_times(
        self, model: str, gpu: str, mbs: int, tp: int, *, smooth: bool = False
    ) -> LayerTimes:
        """One entry, priced alone (a prediction needs one: pricing the whole
        :meth:`profile` took most of a small model's prediction)."""
        self._check_model(model)
        if (gpu, mbs, tp) not in self._entries:
            self._entry(gpu)
            if mbs not in self.mbs_values or tp not in self.tp_values(gpu):
                self.model_info(model).check_tp(tp)
        return self._priced(gpu, mbs, tp)

    def source_of(self, gpu: str, mbs: int, tp: int) -> str:
        """``"profiles"`` or ``"analytical"``: what priced an entry."""
        self._priced(gpu, mbs, tp)
        return self._sources[(gpu, mbs, tp)]

    def cost_source(self, plan: Plan3D) -> str:
        """``"profiles"``, ``"analytical"`` or ``"mixed"``: what priced the
        entries ``plan`` uses (:meth:`source_of` of each replica's)."""
        sources = {
            self.source_of(replica.gpu_type, plan.mbs, replica.tp)
            for stage in plan.stages
            for replica in kinds_of(stage.replicas)
        }
        return sources.pop() if len(sources) == 1 else "mixed"

    # -------------------------------------------------------------- pricing
    def _priced(self, gpu: str, mbs: int, tp: int) -> LayerTimes:
        key = (gpu, mbs, tp)
        if key not in self._entries:
            self._entries[key] = self._layer_times(gpu, mbs, tp)
        return self._entries[key]

    def _profiled(self, gpu: str, mbs: int, tp: int) -> LayerTimes | None:
        options = self._options
        plain = (
            options.precision == "fp32"
            and options.recompute == "none"
            and (not options.sequence_parallel or tp == 1)  # (none at TP 1)
            and self.context_parallel == 1
        )
        if self.profiles is None or not plain:
            return None
        try:
            if gpu not in self.profiles.gpu_types(self.profile_model):
                return None
            table = self.profiles.profile(self.profile_model, gpu)
        except ProblemError:
            return None
        if (mbs, tp) not in table:
            return None
        return self.profiles.layer_times(self.profile_model, gpu, mbs, tp, smooth=True)

    def _layer_times(self, gpu: str, mbs: int, tp: int) -> LayerTimes:
        profiled = self._profiled(gpu, mbs, tp)
        if profiled is not None:
            self._sources[(gpu, mbs, tp)] = "profiles"
            return profiled
        entry = self._entry(gpu)
        spec, options = self.padded(tp), self._options
        precision = gemm_precision(options, entry)
        measured = self._measured
        if tp > 1 and measured is not None and measured.intra_sizes(gpu):
            # the profiled machine's TP link, as the calibration prices it
            act = activation_element_bytes(options.precision)
            message = mbs * spec.seq_length * spec.hidden_size * act
            per_gpu = tp_bandwidth(measured, gpu, tp, message)
            entry = dataclasses.replace(entry, intra_node_bytes_per_s=per_gpu)
        kwargs = dict(
            flash_attention=options.flash_attention,
            attention_dropout=options.attention_dropout,
            query_key_layer_scaling=self.query_key_layer_scaling,
            context_parallel=self.context_parallel,
            constants=self.constants_of(gpu),
        )
        args = (spec, entry, mbs, tp, precision)
        split = dict(
            sequence_parallel=options.sequence_parallel,
            tp_comm_overlap=options.tp_comm_overlap,
            eager=self.eager,
        )
        dense = (dense_view(spec), *args[1:])
        recomputed = recompute_of(options)
        # Megatron-Core's block method skips the MTP depths' recomputation (a
        # model without depths reruns none: one price for every recompute)
        mtp = recomputed if spec.mtp_layers and not options.block_recompute else "none"
        call = self.prices.call  # (read-only rows, shared by the sources)
        try:
            rows = call(
                analytical_layer_times, *dense, **split, **kwargs, mtp_recompute=mtp
            )
            # what selective recomputation reruns of each block
            selective = np.full(len(rows[0]), 0.0)
            if options.recompute == "selective":
                selective[:] = call(
                    selective_forward_seconds,
                    *dense,
                    recompute=recomputed,
                    **split,
                    **kwargs,
                )
            weight = call(weight_gradient_seconds, *dense, **split, **kwargs)
            if self.experts is not None:
                opts = self._pass_options(mbs, tp, precision)
                efficiency = dict(
                    constants=self.constants_of(gpu),
                    link_efficiency=self.link_efficiency,
                )
                selective = call(
                    expert_rerun_seconds,
                    spec,
                    entry,
                    opts,
                    self.experts,
                    recomputed,
                    selective,
                    **efficiency,
                )
                rows = call(
                    expert_layer_times,
                    spec,
                    entry,
                    opts,
                    self.experts,
                    rows,
                    precision,
                    **efficiency,
                    mtp_recompute=mtp,
                )
        except (ValueError, KeyError) as err:
            raise ProblemError(f"{spec.name} on {gpu}: {err}") from None
        forward, backward, update = rows
        backward = backward.copy()
        # Full recomputation reruns each block's forward; with Megatron's
        # block method only some blocks of a stage do, which the predictor
        # adds (rules.span_backward).
        rerun = recompute_time(options.recompute, forward[1:-1], selective[1:-1])
        recompute = None
        if not options.block_recompute:
            backward[1:-1] += rerun
        else:
            recompute = np.zeros(len(backward))
            recompute[1:-1] = rerun
            recompute = self._split_head(recompute)
        # The Adam step is memory-bound: seconds per parameter of a block, for
        # the profiling model's parameters (what LayerTimes.update holds).
        info = self.model_info(self.spec.name)
        per_param = float(update[1]) / max(float(info.params[tp][1]), 1.0)
        profiling = profiling_params(info, tp)
        forward, backward = self._split_head(forward), self._split_head(backward)
        weight = self._split_head(weight)
        update_s = np.full(len(forward), per_param * profiling)
        self._sources[(gpu, mbs, tp)] = "analytical"
        return LayerTimes(
            forward, backward, update_s, weight_grad=weight, recompute=recompute
        )

    def _expert_axes(self) -> tuple[int, int | None]:
        """``(ep, etp)`` of the expert layers (``(1, None)`` for a dense model)."""
        if self.experts is None:
            return 1, None
        return self.experts.experts.ep, self.experts.experts.etp

    @property
    def measured_links(self) -> NetworkTables | None:
        """The measured links that price where they hold a fit (``None``:
        the sheet's alone)."""
        return self._measured

    def constants_of(self, gpu: str) -> AnalyticalConstants:
        """The constants that price layers on ``gpu``: its calibrated ones,
        else the source's."""
        return self._calibrated.get(gpu, self.constants)

    def _pass_options(self, mbs: int, tp: int, precision: Precision) -> PassOptions:
        options = self._options
        return PassOptions(
            mbs=mbs,
            tp=tp,
            precision=precision,
            flash_attention=options.flash_attention,
            sequence_parallel=options.sequence_parallel,
            attention_dropout=options.attention_dropout,
            query_key_layer_scaling=self.query_key_layer_scaling,
            context_parallel=self.context_parallel,
            tp_comm_overlap=options.tp_comm_overlap,
            eager=self.eager,
        )

    def _split_head(self, row: np.ndarray, norm: float = 0.0) -> np.ndarray:
        """A profile whose final norm and LM head are two layers: the head's
        value on the LM head layer, ``norm`` on the norm."""
        if not self.spec.split_head_layer:
            return row
        return np.insert(row, len(row) - 1, norm)

    def padded(self, tp: int) -> TransformerSpec:
        """The spec with its vocabulary padded as Megatron-LM pads it at ``tp``
        (what the analytical model prices)."""
        try:
            vocab = self.spec.padded_vocab_size(tp)
        except ValueError as err:
            raise ProblemError(f"{self.spec.name}: {err}") from None
        return dataclasses.replace(self.spec, vocab_size=vocab)

    # ---------------------------------------------------------------- sizes
    def model_info(self, model: str) -> ModelInfo:
        self._check_model(model)
        if self._info is None:
            try:
                self._info = self._build_info()
            except ValueError as err:
                raise ProblemError(f"{self.spec.name}: {err}") from None
        return self._info

    def _build_info(self) -> ModelInfo:
        spec, options = self.spec, self._options
        element = activation_element_bytes(options.precision)
        params, outputs, memories, tied = {}, {}, {}, {}
        recomputed: dict[int, np.ndarray] = {}
        # Megatron's block method: a block keeps its activations unless it is
        # among the first recompute_num_layers of its stage (rules.span_act_mem)
        block = options.block_recompute
        degrees = sorted({tp for gpu in self.sheet for tp in self.tp_values(gpu)})
        ep, etp = self._expert_axes()
        experts = {}
        for tp in degrees or [1]:
            split = TransformerSpec.layer_param_split
            pairs = self.prices.call(split, spec, tp, ep, etp, tied_copy=True)
            params[tp] = np.asarray([d + e for d, e in pairs], float)
            experts[tp] = np.asarray([e for _, e in pairs], float)
            tied[tp] = float(spec.tied_params(tp))

            def kept(recompute: Recompute, tp: int = tp) -> np.ndarray:
                stash = activation_bytes(
                    dense_view(self.padded(tp)),
                    1,
                    tp,
                    options.precision,
                    recompute=recompute,
                    sequence_parallel=options.sequence_parallel,
                    flash_attention=options.flash_attention,
                    attention_dropout=options.attention_dropout,
                )
                # the loss's working copies of the logits at its peak
                padded = self.padded(tp)
                logits = padded.seq_length * padded.vocab_size / tp
                stash[-1] += self.constants.loss_logit_bytes * logits
                if self.experts is not None:
                    stash = expert_layer_activations(
                        self.padded(tp),
                        self._pass_options(1, tp, options.precision),
                        self.experts.experts,
                        recompute,
                        stash,
                    )
                return self._split_head(stash / element)

            memories[tp] = kept("none" if block else recompute_of(options))
            if block:
                recomputed[tp] = kept(options.recompute)
            output = layer_output_bytes(
                dense_view(self.padded(tp)), 1, options.precision
            )
            output = output / element
            outputs[tp] = self._split_head(output, float(output[-2]))
        bf16_grads = options.grad_reduce_in_bf16
        parts = param_state_bytes(
            options.precision, bf16_grads=bf16_grads, zero_stage=options.zero_stage
        )
        sharded = parts.shardable if options.distributed_optimizer else 0
        return ModelInfo(
            name=spec.name,
            params=params,
            act_output=outputs,
            act_mem=memories,
            activation_bytes=float(element),
            gradient_bytes=float(
                grad_reduce_bytes_per_param(options.precision, bf16_grads=bf16_grads)
            ),
            state_bytes_per_param=float(parts.replicated + parts.shardable - sharded),
            sharded_state_bytes_per_param=float(sharded),
            distributed_optimizer=options.distributed_optimizer,
            tied=tied,
            recompute_layers=options.recompute_num_layers,
            recomputed_mem=recomputed if block else None,
            blocks=(1, 1 + spec.num_layers) if block else None,
            expert_params=None if self.experts is None else experts,
            expert_axes=(ep, etp),
            zero_stage=options.zero_stage,
            reshard_after_forward=options.reshard_after_forward,
            weight_bytes=float(param_gather_bytes_per_param(options.precision, True)),
        )
