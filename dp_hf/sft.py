"""Private supervised fine-tuning with trl: :class:`DPSFTTrainer` and :class:`DPSFTConfig`.

``DPSFTConfig`` is trl's ``SFTConfig`` plus the privacy fields of :class:`~dp_hf.DPTrainingArguments`
(the same :class:`~dp_hf.training_args.DPArgumentsMixin`: same names, same validation);
``DPSFTTrainer`` is trl's ``SFTTrainer`` with the DP behaviour of :class:`~dp_hf.DPTrainer` (the same
:class:`~dp_hf.trainer.DPTrainerMixin`): Poisson sampling, per-example losses, per-example clipping,
noise, the accountant, the budget stop, epsilon in the logs, exact resume, and the privacy card on
every save and on ``push_to_hub``. trl's dataset preparation is kept as is (conversational,
prompt-completion and language-modeling datasets, chat templates, ``assistant_only_loss``,
``completion_only_loss``, ``max_length`` truncation); what changes is how a batch becomes a gradient:

* each example's loss is computed from its own row alone: the mean (``dp_token_reduction="mean"``,
  the default) or the sum (``"sum"``) of the next-token losses over its own unmasked tokens (labels
  not ``-100``: trl sets the prompt, the non-assistant turns and the padding to ``-100``), never
  normalized by the batch's token count as trl's loss is. Changing another example of the batch
  leaves it (and its clipped gradient) unchanged;
* ``padding_free=True`` is supported with a per-example guarantee: trl's collator concatenates the
  Poisson-sampled examples of a micro-batch into one row, ``position_ids`` restarting at 0 for each,
  and the model attends within each example only (transformers' block-diagonal mask from
  ``position_ids``; checked on the model when the trainer is built). Each example is a *segment* of
  the row: its loss is computed from its own tokens (no next-token label crosses a boundary), the
  fast clipping path records and clips each segment as one example (``Segments`` of
  :mod:`dp_hf.per_example.ghost.segments`), and the step counts segments as examples.
  ``dp_max_physical_batch_size`` splits a packed row between whole segments. It needs the fast
  path (every trainable module supported: LoRA, or full fine-tuning of Llama-style models, RMSNorm
  weights included); a model on Opacus's hooks is refused, as are ``pad_to_multiple_of`` and
  ``per_example_loss_fn`` with it;
* ``packing=True`` (dataset-level packing, every ``packing_strategy``) is refused (before any data
  is prepared): the rows are packed before sampling, so Poisson sampling would sample rows (fixed
  groups of examples), not examples, and ``bfd_split``/``wrapped`` cut one example over several rows.
  ``padding_free=True`` packs each Poisson batch's own examples instead;
* trl's ``mean_token_accuracy`` and ``entropy`` of the training batches are statistics of private
  data without noise, like the training loss: logged only while ``dp_log_train_loss=True`` (and
  listed as not covered on the card), dropped with it otherwise. ``num_tokens`` (the token count of
  the Poisson batches) is not logged.

Needs trl: ``pip install "dp-hf[trl]"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from dp_hf.batches import row_lengths
from dp_hf.losses import shifted_labels
from dp_hf.per_example.ghost.segments import Segments
from dp_hf.per_example.prompts import peft_type_name
from dp_hf.prompt_learning import align_labels, prompt_learning_config
from dp_hf.trainer import DPTrainerMixin
from dp_hf.training_args import DPArgumentsMixin
from dp_hf.versions import check_tested_versions

try:
    from trl import SFTConfig, SFTTrainer
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        'dp_hf.sft needs trl (DPSFTTrainer wraps trl\'s SFTTrainer): pip install "dp-hf[trl]"'
    ) from err

__all__ = [
    "DPSFTConfig",
    "DPSFTTrainer",
    "check_padding_free_rows",
    "check_sft_privacy_options",
    "sft_per_example_losses",
]

check_tested_versions(("trl",))  # SFTTrainer internals are version-sensitive too

TOKEN_REDUCTIONS = ("mean", "sum")


@dataclass(repr=False)
class DPSFTConfig(DPArgumentsMixin, SFTConfig):
    """trl's ``SFTConfig`` plus the privacy fields of :class:`~dp_hf.DPTrainingArguments`.

    The logical batch is ``per_device_train_batch_size * gradient_accumulation_steps * world_size``
    examples in expectation (Poisson sampling); one example is one row of the prepared dataset (one
    conversation, one prompt-completion pair, one text).
    """

    _VALID_DICT_FIELDS = SFTConfig._VALID_DICT_FIELDS + ["dp_optimizer_kwargs"]
    UNNOISED_TRAIN_LOG_KEYS = DPArgumentsMixin.UNNOISED_TRAIN_LOG_KEYS + ("mean_token_accuracy", "entropy")

    # trl turns gradient checkpointing on by default; its recomputed forward would record the per-example
    # activations twice, so DP training needs it off (and refuses it on).
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={
            "help": "Deprecated alias of activation_checkpointing, which DP does not support (per-example "
            "gradient hooks): off by default here, unlike trl's SFTConfig."
        },
    )
    dp_token_reduction: str = field(
        default="mean",
        metadata={
            "help": "How an example's token losses make its loss: 'mean' over its own unmasked tokens (the "
            "default; every example has the same weight before clipping) or 'sum' (longer completions weigh "
            "more, and are clipped more often). Never normalized by the batch's token count.",
            "choices": list(TOKEN_REDUCTIONS),
        },
    )

    def validate_privacy_arguments(self) -> None:
        super().validate_privacy_arguments()
        if self.dp_token_reduction not in TOKEN_REDUCTIONS:
            raise ValueError(
                f"dp_token_reduction={self.dp_token_reduction!r} is unknown; choose one of {list(TOKEN_REDUCTIONS)}."
            )
        check_sft_privacy_options(self)

    def privacy_dict(self) -> dict[str, Any]:
        d = super().privacy_dict()
        d["dp_token_reduction"] = self.dp_token_reduction
        return d


def check_sft_privacy_options(args: Any) -> None:
    """Refuse the ``SFTConfig`` options whose batches or losses mix examples (unless ``disable_dp``)."""
    if args.disable_dp:
        return
    if args.packing:
        raise ValueError(
            f"packing=True (packing_strategy={args.packing_strategy!r}) is not supported by DPSFTTrainer: it packs "
            "the dataset before sampling, so Poisson sampling would draw fixed groups of examples (rows) instead "
            "of examples, and the accountant's sampling rate would not be the examples' ('bfd_split' and "
            "'wrapped' even cut one example over several rows). Set packing=False and padding_free=True in "
            "DPSFTConfig instead: each Poisson batch's own examples are then packed into one row and clipped "
            "one by one."
        )
    if args.padding_free and args.max_length is not None:
        raise ValueError(
            f"padding_free=True with max_length={args.max_length}: trl does not truncate padding-free rows (and "
            "suggests packing, which DP training refuses). Set max_length=None and truncate the examples before "
            "training, or use padding_free=False (padded rows, truncated to max_length)."
        )
    if args.padding_free and args.pad_to_multiple_of:
        raise ValueError(
            f"padding_free=True with pad_to_multiple_of={args.pad_to_multiple_of} is not supported by "
            "DPSFTTrainer: the padding positions (position 0 each) would be taken for extra examples. Set "
            "pad_to_multiple_of=None."
        )
    if args.gradient_checkpointing or getattr(args, "activation_checkpointing", False):
        raise ValueError(
            "gradient_checkpointing=True / activation_checkpointing=True is not supported by DPSFTTrainer: the "
            "recomputed forward would record the per-example activations a second time. Set "
            "gradient_checkpointing=False (activation_checkpointing=False) in DPSFTConfig: its default there, "
            "unlike trl's SFTConfig."
        )
    if args.loss_type not in ("nll", "dft"):
        raise ValueError(
            f"loss_type={args.loss_type!r} is not supported by DPSFTTrainer; use 'nll' or 'dft'."
        )


def sft_per_example_losses(
    logits: torch.Tensor,
    labels: torch.Tensor,
    reduction: str = "mean",
    loss_type: str = "nll",
    segments: Segments | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Next-token losses per example: ``(losses [b], per_token_nll [b, T-1], mask [b, T-1])``.

    Row ``i`` of ``logits`` predicts ``labels[i, t + 1]`` from position ``t`` (the causal-LM shift);
    positions whose label is ``-100`` do not count. ``reduction`` is ``"mean"`` (over the example's own
    unmasked tokens; 0 for an example without any) or ``"sum"``. ``loss_type="dft"`` weights each token
    by its (detached) probability, as trl's DFT loss.

    With ``segments`` (packed rows), the examples are the segments: ``losses`` is ``[S]``, and a
    prediction whose label lies in the next segment (from a segment's last token) does not count.
    """
    if logits.shape[:2] != labels.shape[:2]:  # (PEFT prompt tuning's virtual tokens: see align_labels)
        raise ValueError(
            f"the model returned logits for {tuple(logits.shape[:2])} positions but the labels have "
            f"{tuple(labels.shape[:2])}: each label must be its own position's. Return one logit row per input "
            "token (DPSFTTrainer pads the labels for PEFT prompt tuning's virtual tokens itself)."
        )
    logits = logits.float()
    # The labels are shifted, not the logits (whose slice would be copied: dp_hf.losses.shifted_labels); the last
    # position predicts nothing.
    labels = shifted_labels(labels)
    mask = labels != -100
    if segments is not None:  # the prediction from a segment's last token is of the next segment's first
        ids = segments.ids.to(labels.device)
        mask = mask & F.pad(ids[:, 1:] == ids[:, :-1], (0, 1), value=False)
    nll = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.clamp_min(0).reshape(-1), reduction="none"
    ).view(labels.shape)
    per_token = nll * torch.exp(-nll).detach() if loss_type == "dft" else nll
    weights = mask.to(per_token.dtype)
    if segments is None:
        sums, counts = (per_token * weights).sum(dim=1), weights.sum(dim=1)
    else:  # position t's prediction belongs to the segment of token t
        index = segments.ids.to(labels.device).reshape(-1)
        sums = per_token.new_zeros(segments.num_segments).index_add(
            0, index, (per_token * weights).reshape(-1)
        )
        counts = weights.new_zeros(segments.num_segments).index_add(0, index, weights.reshape(-1))
    if reduction == "sum":
        losses = sums
    elif reduction == "mean":
        losses = sums / counts.clamp_min(1)
    else:
        raise ValueError(f"reduction must be one of {TOKEN_REDUCTIONS}, got {reduction!r}.")
    return losses, nll[:, :-1], mask[:, :-1]


@torch.no_grad()
def check_model_separates_segments(model: torch.nn.Module) -> None:
    """Refuse a model whose tokens attend across the segments of a packed row (padding-free batches).

    Two packed rows that differ only in their first segment must give the second segment the same
    logits: transformers builds a block-diagonal causal mask from ``position_ids`` for the sdpa and
    eager attentions (flash attention uses ``cu_seq_lens``). A model that ignores them would mix
    examples, and their per-example gradients would not be bounded.
    """
    vocab = int(model.get_input_embeddings().num_embeddings)
    device = next(model.parameters()).device
    first, second = torch.arange(3) % vocab, (torch.arange(4) + 3) % vocab
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3]], device=device)
    was_training = model.training
    model.eval()
    try:
        logits = []
        for head in (first, (first + 1) % vocab):
            ids = torch.cat([head, second]).unsqueeze(0).to(device)
            out = model(input_ids=ids, position_ids=position_ids, use_cache=False)
            logits.append((out["logits"] if isinstance(out, dict) else out[0])[0, 3:].float())
    finally:
        model.train(was_training)
    scale = float(logits[0].abs().max()) + 1e-12
    if not torch.allclose(logits[0], logits[1], rtol=0, atol=1e-4 * scale):
        raise ValueError(
            f"{type(model).__name__} lets the tokens of one packed example attend to the previous example's (its "
            "logits change when only the previous segment changes), so padding_free=True would mix examples. "
            "Use an attention implementation that honours position_ids restarts (sdpa, eager, flash attention), "
            "and no PEFT prompt or prefix tuning (their virtual tokens are shared by the row's segments), or set "
            "padding_free=False."
        )


def check_padding_free_rows(dataset: Any) -> None:
    """Refuse, before training, a prepared dataset with a row that would not be one segment of a packed row.

    Every padding-free micro-batch is checked to hold one segment per sampled example, but a failure
    there stops the run at the first step whose Poisson batch holds the row: whether and when the run
    stops then depends on that example. So every row is checked here: ``input_ids`` not empty (an
    empty row packs to no segment), and ``seq_lengths``, where present, exactly ``[len(input_ids)]``
    (the collator would cut the row into its pieces). A ``datasets.Dataset`` is checked on its Arrow
    columns; another map-style dataset row by row.
    """
    if dataset is None:
        return
    lengths = row_lengths(dataset)
    if lengths is not None:
        has_pieces = "seq_lengths" in dataset.column_names
        pieces = dataset.with_format("arrow")["seq_lengths"].to_pylist() if has_pieces else None
    else:
        rows = [dataset[i] for i in range(len(dataset))]
        lengths = [len(row["input_ids"]) for row in rows]
        pieces = [row.get("seq_lengths") for row in rows] if rows and "seq_lengths" in rows[0] else None
    for index, length in enumerate(lengths):
        if not length:
            raise ValueError(
                f"row {index} of the training dataset has no tokens (empty input_ids): with padding_free=True it "
                "would pack to no segment, and the run would stop at the first step that samples it (a stop "
                "that depends on that example). Remove empty rows before training, or set padding_free=False."
            )
        if pieces is not None and list(pieces[index] or []) != [length]:
            raise ValueError(
                f"row {index} of the training dataset has seq_lengths={pieces[index]!r} for {length} tokens: "
                "with padding_free=True each row must be one example, seq_lengths=[len(input_ids)] (or no "
                "seq_lengths column). Fix or remove the column before training."
            )


def no_accelerator() -> bool:
    """Whether torch sees no accelerator (trl's activation offloading then fails with an AttributeError)."""
    accelerator = getattr(torch, "accelerator", None)
    return accelerator is not None and accelerator.current_accelerator() is None


class DPSFTTrainer(DPTrainerMixin, SFTTrainer):
    """trl's ``SFTTrainer`` with differential privacy; takes a :class:`DPSFTConfig`.

    Everything ``SFTTrainer`` accepts (``peft_config``, ``processing_class``, ``formatting_func``...)
    works as there, except the options that mix examples (see :func:`check_sft_privacy_options`) and
    ``compute_loss_func`` (a batch-level loss): pass ``per_example_loss_fn=fn(outputs, labels, inputs)
    -> [b]`` instead. ``trainer.privacy_spent()`` returns ``(epsilon, delta)``.
    """

    dp_args_class = DPSFTConfig

    def __init__(
        self, model, args: DPSFTConfig | None = None, *trainer_args, per_example_loss_fn=None, **kwargs
    ):
        if isinstance(args, DPSFTConfig) and not args.disable_dp:
            # Again here: the options may have been changed after the config was built.
            check_sft_privacy_options(args)
            if args.padding_free and per_example_loss_fn is not None:
                raise TypeError(
                    "per_example_loss_fn is not supported with padding_free=True: the examples are segments of "
                    "one packed row, and DPSFTTrainer computes their losses itself. Set padding_free=False."
                )
            if args.activation_offloading and no_accelerator():
                raise ValueError(
                    "activation_offloading=True needs a GPU (trl offloads activations from the accelerator to the "
                    "CPU), and none is available. Set activation_offloading=False."
                )
            if kwargs.get("compute_loss_func") is not None:
                raise TypeError(
                    "compute_loss_func is not supported by DPSFTTrainer: its loss is normalized over the batch, "
                    "which couples examples. Pass per_example_loss_fn=fn(outputs, labels, inputs) -> one loss "
                    "per example instead."
                )
        super().__init__(model, args, *trainer_args, per_example_loss_fn=per_example_loss_fn, **kwargs)
        if not self.args.disable_dp and getattr(self, "aux_loss_enabled", False):
            raise ValueError(
                "the MoE router auxiliary loss (router_aux_loss_coef) balances experts over the whole batch, "
                "which couples examples; set router_aux_loss_coef=0.0 in DPSFTConfig for DP training."
            )
        if not self.args.disable_dp and self.args.padding_free:
            self.check_padding_free_support()
            check_padding_free_rows(self.train_dataset)
            self.packed_examples = True

    def check_padding_free_support(self) -> None:
        """Refuse ``padding_free=True`` unless each packed example can be clipped (and attended) alone."""
        config = prompt_learning_config(self.model)
        # One prompt per packed row would be shared by its segments (and PEFT drops the position_ids).
        if config is not None:
            raise ValueError(
                f"padding_free=True with PEFT {peft_type_name(config)}: its virtual "
                "tokens are added once per packed row, and every example (segment) of the row would share them. "
                "Set padding_free=False (padded rows), or use LoRA with padding_free=True."
            )
        if self.fast_clipping is None:
            from dp_hf.per_example.ghost import unsupported_modules

            listed = "; ".join(
                f"{path} ({kind}): {reason}" for path, kind, reason in unsupported_modules(self.model)
            )
            raise ValueError(
                "padding_free=True needs dp_hf's fast clipping path, which clips each example (segment) of a "
                "packed row; this model falls back to Opacus's per-row hooks because of its trainable modules "
                f"without a fast rule ({listed or 'none listed'}). Freeze them (e.g. LoRA, or requires_grad=False "
                "on their parameters), or set padding_free=False."
            )
        check_model_separates_segments(self.model)

    def training_step(self, model, inputs, num_items_in_batch=None):
        # Why: SFTTrainer.training_step only adds the activation-offloading context; DPTrainerMixin's
        # training step (per-example losses, clipping) replaces the rest.
        if self.args.disable_dp:
            return super().training_step(model, inputs, num_items_in_batch)
        with self.maybe_activation_offload_context:
            return super().training_step(model, inputs, num_items_in_batch)

    def compute_per_example_losses(self, model, inputs: dict[str, Any]) -> torch.Tensor:
        """One loss per example from the model's logits and trl's labels (see :func:`sft_per_example_losses`)."""
        if self.per_example_loss_fn is not None:
            return super().compute_per_example_losses(model, inputs)
        inputs = dict(inputs)
        labels = inputs.pop("labels", None)
        if labels is None:
            raise ValueError(
                f"the training batch has no 'labels' (keys: {sorted(inputs)}); trl's dataset preparation builds "
                "them, so a dataset passed with skip_prepare_dataset=True must carry its own."
            )
        # Not trl's fused LM head: it reads lm_head.weight directly, bypassing the per-example gradient
        # hooks on the LM head; the plain forward (with the logits) keeps every trainable module visible.
        inputs["use_cache"] = False
        outputs = model(**inputs)
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        labels = align_labels(model, logits, labels)  # PEFT prompt tuning's virtual tokens come first
        segments = self.micro_batch_segments(inputs)  # the step's own, found once
        losses, nll, mask = sft_per_example_losses(
            logits,
            labels,
            reduction=self.args.dp_token_reduction,
            loss_type=self.args.loss_type,
            segments=segments,
        )
        if self.args.dp_log_train_loss and not self._probing_losses:
            self._record_token_metrics(logits, labels, mask)
        return losses

    @torch.no_grad()
    def _record_token_metrics(self, logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> None:
        # trl's training metrics, on this micro-batch (unnoised statistics of private data: only while
        # dp_log_train_loss=True, and the card says so).
        valid = int(mask.sum())
        if valid == 0:
            return
        # One example at a time: its [T, V] float32 transients, not three [b, T, V] ones at the forward's peak.
        entropy = torch.zeros(len(logits), device=logits.device)
        correct = torch.zeros(len(logits), device=logits.device)
        for i, (row_logits, row_labels, row_mask) in enumerate(zip(logits, labels, mask)):
            row_logits = row_logits[:-1].float()
            log_probs = torch.log_softmax(row_logits, dim=-1)
            entropy[i] = -((log_probs.exp() * log_probs).sum(dim=-1) * row_mask).sum()
            correct[i] = ((row_logits.argmax(dim=-1) == row_labels[1:]) & row_mask).sum()
        metrics = self._metrics["train"]
        metrics["entropy"].append(float(entropy.sum()) / valid)
        metrics["mean_token_accuracy"].append(float(correct.sum()) / valid)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # Why: SFTTrainer.log adds the averaged training metrics after DPTrainerMixin.log has filtered the
        # logs; without dp_log_train_loss they must not be added at all.
        if not self.args.disable_dp and not self.args.dp_log_train_loss:
            for key in self.args.UNNOISED_TRAIN_LOG_KEYS:
                self._metrics["train"].pop(key, None)
        if not self.args.disable_dp:  # trl counts tokens in compute_loss, which DP training does not call
            self._metrics["train"].pop("num_tokens", None)
            self._metrics["eval"].pop("num_tokens", None)
        super().log(logs, start_time)
