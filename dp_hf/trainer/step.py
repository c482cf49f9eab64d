"""The private training step of a :class:`~dp_hf.trainer.DPTrainer`: the DP optimizer built from the plan,
per-example losses, backward and clipping per bounded micro-batch.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any

import torch

from dp_hf.batches import split_microbatch
from dp_hf.distributed import unwrap_ddp
from dp_hf.losses import per_example_loss
from dp_hf.optim import DPOptimizer, get_optimizer_class, optimizer_keywords
from dp_hf.per_example.batch import batch_size_of_call, note_broadcast_expansions
from dp_hf.prompt_learning import align_labels, prepended_virtual_tokens
from dp_hf.trainer.buffers import check_buffers_ignore_the_data
from dp_hf.trainer.probe import (
    backward_explained,
    check_gradients_follow_the_examples,
    check_layers_follow_the_batch,
    check_losses_are_per_example,
)

logger = logging.getLogger(__name__)


def variable_batch_attention(device: torch.device) -> contextlib.AbstractContextManager:
    """Scaled-dot-product attention without the cuDNN backend, on CUDA.

    Poisson batches change size every step, and cuDNN attention builds an execution plan for each
    new shape (measured ~5 ms of CPU per attention call on an H100, BERT-base: a third of the step);
    the flash and memory-efficient kernels need none. Elsewhere, nothing changes.
    """
    if getattr(device, "type", device) != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


class PrivateStepMixin:
    """The optimizer and the training step (per-example loss sum, backward, clip and accumulate)."""

    #: Whether each micro-batch is packed rows whose segments are the examples (padding-free SFT): then
    #: the examples are the segments of ``position_ids`` everywhere (the step tag's count, the clipping,
    #: the losses), and ``dp_max_physical_batch_size`` splits a packed row between whole segments.
    packed_examples: bool = False

    def micro_batch_segments(self, inputs: dict[str, Any]):
        """The ``Segments`` (:mod:`dp_hf.per_example.ghost.segments`) of a packed micro-batch, or None."""
        if not self.packed_examples:
            return None
        from dp_hf.per_example.ghost.segments import find_segments

        return find_segments(inputs["position_ids"])

    def packed_context(self, segments) -> contextlib.AbstractContextManager:
        """Record the segments of a packed micro-batch as its examples (the fast path only)."""
        if segments is None:
            return contextlib.nullcontext()
        if self.fast_clipping is None:
            raise RuntimeError(
                "packed micro-batches need dp_hf's fast clipping hooks (per-segment clipping); the model runs on "
                "Opacus's hooks, which clip per row. This is a dp_hf bug: the trainer should have refused it."
            )
        return self.fast_clipping.packed(segments)

    def physical_pieces(self, inputs: dict[str, Any]) -> list[dict[str, Any]]:
        """The micro-batch in pieces of at most ``physical_batch_size`` examples (rows, or whole segments)."""
        if self.packed_examples:
            from dp_hf.per_example.ghost.segments import split_segments

            return split_segments(inputs, self.args.physical_batch_size)
        return split_microbatch(inputs, self.args.physical_batch_size)

    def create_optimizer(self, model=None):
        # Why: the optimizer must be the DP optimizer, built with the planned noise and expected batch.
        if self.optimizer is None:
            model = model if model is not None else self.model
            optimizer_cls = get_optimizer_class(self.args.dp_optimizer)
            decay = set(self.get_decay_parameter_names(model))
            trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            groups = [
                {"params": [p for n, p in trainable if n in decay], "weight_decay": self.args.weight_decay},
                {"params": [p for n, p in trainable if n not in decay], "weight_decay": 0.0},
            ]
            groups = [g for g in groups if g["params"]]
            self.optimizer = optimizer_cls(groups, **self._optimizer_kwargs(optimizer_cls))
        # A second train() finds the optimizer that accelerate wrapped during the first one.
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        if not isinstance(optimizer, DPOptimizer):
            raise TypeError(f"the optimizer must be a dp_hf DP optimizer, got {type(optimizer).__name__}.")
        self._check_optimizer_matches_plan(optimizer)
        self.dp_optimizer = optimizer
        self._check_optimizer_matches_accountant()
        if self._hooked_optimizer is not optimizer:  # once per optimizer (a second train() reuses it)
            if hasattr(optimizer, "check_horizon") and self.planned_steps:
                optimizer.check_horizon(self.planned_steps)  # e.g. MicroAdam too sparse for the run's length
            optimizer.register_step_post_hook(self._on_optimizer_step)
            optimizer.budget_guard = self._budget_allows_step
            self._hooked_optimizer = optimizer
        return self.optimizer

    def _check_optimizer_matches_plan(self, optimizer: DPOptimizer) -> None:
        # The accountant uses the trainer's plan; an optimizer built by hand must add exactly that noise.
        if self.args.disable_dp:
            return
        mismatches = []
        if not math.isclose(optimizer.noise_multiplier, self.noise_multiplier, rel_tol=1e-9):
            mismatches.append(
                f"noise_multiplier {optimizer.noise_multiplier!r} (plan: {self.noise_multiplier!r})"
            )
        if not math.isclose(optimizer.expected_batch_size, self.args.expected_batch_size, rel_tol=1e-9):
            mismatches.append(
                f"expected_batch_size {optimizer.expected_batch_size!r} (plan: {self.args.expected_batch_size!r} "
                "= per_device_train_batch_size * gradient_accumulation_steps * world_size)"
            )
        clip = self.plan.max_grad_norm if self.plan is not None else None  # None: adaptive, C fixed
        if clip is not None and not math.isclose(optimizer.max_grad_norm, clip, rel_tol=1e-9):
            mismatches.append(f"max_grad_norm {optimizer.max_grad_norm!r} (plan: {clip!r})")
        if self.args.world_size > 1 and not optimizer.privatizer.distributed:
            mismatches.append(
                f"distributed=False on {self.args.world_size} processes (each rank would release its own share "
                "with its own noise, never summed over the ranks): leave distributed out"
            )
        if mismatches:
            raise ValueError(
                "the optimizer passed to DPTrainer disagrees with the privacy plan: "
                + "; ".join(mismatches)
                + ". Build it with the same values or let DPTrainer build it from args.dp_optimizer."
            )

    def _optimizer_kwargs(self, optimizer_cls) -> dict[str, Any]:
        args = self.args
        # Through **kwargs too: scale-then-privatize takes DP-Adam's betas and eps that way.
        accepted = optimizer_keywords(optimizer_cls)
        kwargs: dict[str, Any] = {"lr": args.learning_rate}
        candidates = {
            "betas": (args.adam_beta1, args.adam_beta2),
            "eps": args.adam_epsilon,
        }
        kwargs.update({k: v for k, v in candidates.items() if accepted is None or k in accepted})
        if getattr(optimizer_cls, "adaptive_clipping", False):
            # DP-MacAdam fixes C = 1 in its own adaptive geometry; per_sample_max_grad_norm does not apply.
            if args.per_sample_max_grad_norm != 1.0 and not args.disable_dp:
                logger.warning(
                    "%s clips to norm 1 in its adaptive geometry; per_sample_max_grad_norm=%s is not used.",
                    args.dp_optimizer,
                    args.per_sample_max_grad_norm,
                )
        else:
            kwargs["max_grad_norm"] = math.inf if args.disable_dp else args.per_sample_max_grad_norm
        kwargs.update(
            noise_multiplier=0.0 if args.disable_dp else self.noise_multiplier,
            expected_batch_size=args.expected_batch_size,
            noise_seed=args.secret_seed("noise_seed"),
            secure_mode=args.secure_mode,
            disable_dp=args.disable_dp,
        )
        kwargs.update(args.dp_optimizer_kwargs)
        return kwargs

    def _get_grad_norm(self, model, grad_norm=None):
        # Why: before the optimizer step the Trainer would take the norm of p.grad, which is empty (consumed
        # by clipping) under DP: it logged 0. log() reports the released gradient's norm instead.
        if self.args.disable_dp:
            return super()._get_grad_norm(model, grad_norm)
        return None

    def floating_point_ops(self, inputs) -> int:
        # Why: the Trainer's count walks every module to count the non-embedding parameters on every
        # step (~4 ms per step for BERT-base on a CPU); that count does not change while training. And
        # the total (state.total_flos, trainer_state.json) counts each private batch's size and padded
        # length without noise: with dp_log_train_loss=False (logs free of such statistics) it stays 0.
        main_input = getattr(self.model, "main_input_name", "input_ids")
        if main_input not in inputs or not hasattr(self.model, "num_parameters"):
            return 0
        if not self.args.disable_dp and not self.args.dp_log_train_loss:
            return 0
        cached = getattr(self, "_flos_parameters", None)
        if cached is None or cached[0] is not self.model:
            cached = self._flos_parameters = (self.model, self.model.num_parameters(exclude_embeddings=True))
        return 6 * inputs[main_input].numel() * cached[1]

    def _get_num_items_in_batch(self, batch_samples, device):
        # Why: our loss is a sum of per-example losses, never normalized by the realized token count
        # (which would couple examples); empty Poisson micro-batches also have no "labels".
        if self.args.disable_dp:
            return super()._get_num_items_in_batch(batch_samples, device)
        return None

    def training_step(self, model, inputs, num_items_in_batch=None):
        # Why: per-example loss sum, backward and clip-and-accumulate for each bounded micro-batch.
        if self.args.disable_dp:
            return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        self._check_step_tag(inputs)
        local_expected = self.args.expected_batch_size / self.args.world_size
        if not inputs:  # empty Poisson micro-batch: nothing to clip; the step still adds noise
            return torch.zeros((), device=self.args.device)
        # Under data parallelism, bypass the DDP wrapper: DDP would all-reduce the unclipped gradients
        # (the privatizer reduces the clipped sums in step()) and runs collectives in forward that a rank
        # with an empty micro-batch never enters. Its gradient hooks stay inert without its forward.
        module = unwrap_ddp(model)
        inputs = self._prepare_inputs(inputs)
        total = torch.zeros((), device=self.args.device)
        for piece in self.physical_pieces(inputs):
            segments = self.micro_batch_segments(piece)
            # Once per run (the batch dimensions on the first micro-batch, the losses on the first of two
            # or more examples). Packed rows are not probed: each is one row of segments, checked on every
            # pass, and their losses are dp_hf's own (a per_example_loss_fn is refused with padding_free).
            probed = self._losses_checked and self._batch_dimensions_checked and self._gradients_checked
            if not probed and segments is None:
                self._probing_losses = True  # side statistics (trl's token metrics) skip the probe's forwards
                try:
                    checked = (self._batch_dimensions_checked, self._losses_checked, self._gradients_checked)
                    clipping = self.fast_clipping or self.grad_sample_handle
                    hooks = (self._discard_records, self.dp_optimizer.trainable_params, clipping)
                    checked = _probe_micro_batch(
                        checked,
                        self.compute_per_example_losses,
                        module,
                        piece,
                        self._loss_forward_context,
                        hooks,
                    )
                    self._batch_dimensions_checked, self._losses_checked, self._gradients_checked = checked
                finally:
                    self._probing_losses = False
            with self._loss_forward_context(), self.packed_context(segments):
                losses = self.compute_per_example_losses(module, piece)
            if segments is not None and tuple(losses.shape) != (segments.num_segments,):
                raise ValueError(
                    f"a packed micro-batch holds {segments.num_segments} examples (segments) but the per-example "
                    f"losses have shape {tuple(losses.shape)}: one loss per segment is needed."
                )
            loss = losses.sum()
            # Not accelerator.backward: it divides by gradient_accumulation_steps, and the per-example
            # gradients must be those of each example's own loss, unscaled.
            backward_explained(loss, module, opacus=self.fast_clipping is None)
            if self.fast_clipping is not None:
                self.fast_clipping.accumulate(self.dp_optimizer)
            else:
                self.dp_optimizer.clip_and_accumulate()
            total = total + loss.detach()
        return total / local_expected

    def _discard_records(self) -> None:
        # After the batch-dimension probe's forwards (never back-propagated): Opacus keeps their inputs.
        if self.grad_sample_handle is not None:
            self.grad_sample_handle.clear()

    def _loss_forward_context(self) -> contextlib.AbstractContextManager:
        """The context of every per-example loss forward (the training step's and the loss check's)."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.compute_loss_context_manager())
        stack.enter_context(variable_batch_attention(self.args.device))
        return stack

    def compute_per_example_losses(self, model, inputs: dict[str, Any]) -> torch.Tensor:
        """One loss per example, ``[b]``; their sum is what is differentiated."""
        inputs = dict(inputs)
        labels = inputs.pop("labels", None)
        if labels is None and self.per_example_loss_fn is None:  # (which may read QA's start/end positions)
            raise ValueError(
                f"the training batch has no 'labels' (keys: {sorted(inputs)}; label_names={self.args.label_names!r}); "
                "DPTrainer computes one loss per example from the logits and the batch's 'labels' (use a collator "
                "that sets them, e.g. DataCollatorForLanguageModeling for masked/causal LM, or name the label "
                "column 'labels'). Heads with other label keys (question answering's start_positions and "
                "end_positions) need per_example_loss_fn=fn(outputs, labels, inputs), which then gets labels=None "
                "and reads them from inputs."
            )
        try:
            outputs = model(**inputs)
        except RuntimeError as error:
            if (
                self.fast_clipping is None
                and "BackwardHookFunction is a view and is being modified inplace" in str(error)
            ):
                raise RuntimeError(_in_place_edit_message(model)) from error
            hooks = self.fast_clipping or self.grad_sample_handle
            note_broadcast_expansions(error, hooks.batch_recorder if hooks is not None else None)
            raise
        losses = _losses_of(model, outputs, labels, inputs, self.per_example_loss_fn, self.task)
        examples = (
            batch_size_of_call({}, (), inputs, positional_fallback=True) if labels is None else len(labels)
        )
        if losses.dim() != 1 or losses.shape[0] != examples:
            raise ValueError(
                f"per-example losses must have shape [{examples}] (one per example), got "
                f"{tuple(losses.shape)}: compute them with reduction='none' and reduce over each example's own "
                "tokens only."
            )
        return losses


def _losses_of(model, outputs: Any, labels: Any, inputs: dict, loss_fn: Any, task: Any) -> torch.Tensor:
    """Each example's loss: ``loss_fn(outputs, labels, inputs)``, else :func:`~dp_hf.losses.per_example_loss`.

    PEFT prompt tuning's virtual tokens have logits too: their labels are -100, as PEFT's own forward pads
    them, also for a ``loss_fn`` (which would otherwise get labels one virtual prompt out of line).
    """
    if labels is not None and prepended_virtual_tokens(model):
        labels = align_labels(model, _logits_of(outputs), labels)
    if loss_fn is not None:
        return loss_fn(outputs, labels, inputs)
    return per_example_loss(_logits_of(outputs), labels, task, model)


def _logits_of(outputs: Any) -> torch.Tensor:
    return outputs["logits"] if isinstance(outputs, dict) else outputs[0]


def _in_place_edit_message(model) -> str:
    from dp_hf.per_example import ghost

    names = ", ".join(f"{path} ({kind})" for path, kind, _ in ghost.unsupported_modules(model)) or "none"
    return (
        "the model edits a layer's output in place (the line above in the traceback: `x += y`, `x[mask] = 0`), "
        "and this run takes per-example gradients from Opacus's hooks, whose backward hooks cannot follow an "
        "in-place edit of an output they wrap. This step was not taken. Opacus's hooks are used because these "
        f"trainable modules have no fast per-example rule: {names}. Freeze them (for wav2vec2, "
        "model.freeze_feature_encoder() and the positional convolution) so that the fast path takes the "
        "model, or make that edit out of place (`x = x + y`)."
    )


def _probe_micro_batch(
    checked: tuple[bool, bool, bool],
    compute_losses: Any,
    module: torch.nn.Module,
    piece: dict[str, Any],
    context: Any,
    hooks: tuple[Any, Any, Any],
) -> tuple[bool, bool, bool]:
    """The once-per-run checks of :mod:`dp_hf.trainer.probe` on a micro-batch of padded rows.

    ``checked``: whether the batch dimensions, the losses and the gradients' attribution were checked;
    returned updated. In order, each until it has checked: the batch dimensions (first micro-batch), the
    buffers and the losses (first micro-batch of two or more examples: :mod:`dp_hf.trainer.buffers` and
    :mod:`dp_hf.trainer.probe`), then, once the losses are per example, the
    clipping's attribution of gradients to examples. ``hooks``: ``(discard the hooks' records, the
    trainable parameters (a callable), the FastClipping or Opacus handle)``.
    """
    dimensions, losses, gradients = checked
    discard, trainable_params, clipping = hooks
    if not dimensions:
        check_layers_follow_the_batch(compute_losses, module, piece, context, discard)
        dimensions = True
    if not losses:  # (buffers first: the loss probe's train-mode forwards would update a data-dependent one)
        check_buffers_ignore_the_data(compute_losses, module, piece, context)
        losses = check_losses_are_per_example(compute_losses, module, piece, context)
    if losses and not gradients:
        gradients = check_gradients_follow_the_examples(
            compute_losses, module, piece, context, trainable_params(), clipping
        )
    return dimensions, losses, gradients
