"""DeiT fine-tuning on CIFAR-10 / CIFAR-100, privately: the fine-tuning experiment of DP-MicroAdam.

Hudisteanu et al., "DP-MicroAdam: Private and Frugal Algorithm for Training and Fine-tuning",
Section 5 ("Fine-tuning on CIFAR-10 and CIFAR-100"), Appendix C.4 and the fine-tuning table of
Appendix E:

* ``facebook/deit-{tiny,small,base}-patch16-224`` pretrained (non-privately) on ImageNet, the
  classification head replaced by a new linear layer (``ignore_mismatched_sizes``), all weights trained;
* images resized to 224, normalised with ImageNet statistics, random crops and horizontal flips;
* expected batch 4096 (Poisson), lr 1e-3, cosine schedule with 2% warm-up, betas (0.9, 0.999),
  clip norm C = 1, DP-MicroAdam;
* CIFAR-10: noise multiplier 1.56, 50 epochs; CIFAR-100: noise multiplier 2, 90 epochs;
* the official 50K training images split 45K train / 5K validation (Appendix C.2), test on the 10K.

The expected batch is ``per_device_train_batch_size * gradient_accumulation_steps * num_processes``;
``per_device_train_batch_size`` only bounds memory (per-example gradients of DeiT-Base take
86M * 4 bytes per example: keep it at 32-64 there, 128 is fine for Tiny).

Commands (from the repository root; accelerate configs are in ``recipes/accelerate_configs/``)::

    accelerate launch --config_file recipes/accelerate_configs/single_gpu.yaml \\
        -m recipes.deit_cifar recipes/configs/deit_cifar10.yaml
    accelerate launch --config_file recipes/accelerate_configs/single_gpu.yaml \\
        -m recipes.deit_cifar recipes/configs/deit_cifar100.yaml --model_name_or_path facebook/deit-small-patch16-224

    # 8 GPUs: 128 per device x 4 accumulation x 8 processes = 4096
    accelerate launch --config_file recipes/accelerate_configs/multi_gpu.yaml --num_processes 8 \\
        -m recipes.deit_cifar recipes/configs/deit_cifar10.yaml --gradient_accumulation_steps 4

    # another optimizer at the same noise (the paper's baselines are DP-BiTFiT and SPARTA, not in dp_hf)
    python -m recipes.deit_cifar recipes/configs/deit_cifar10.yaml --dp_optimizer dp-adamw

    # offline pipeline check (tiny random ViT, synthetic 32x32 images; seconds on a CPU)
    python -m recipes.deit_cifar recipes/configs/deit_cifar_smoke.yaml

Reading CIFAR from the Hub decodes PNG images with Pillow (``pip install pillow``).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import datasets
from transformers import (
    AutoModelForImageClassification,
    ViTConfig,
    ViTForImageClassification,
    default_data_collator,
    set_seed,
)

from dp_hf import DPTrainer
from recipes import smoke
from recipes.common import (
    SmokeArguments,
    accuracy_metric,
    apply_cpu_threads,
    finish_run,
    held_out_split,
    parameter_counts,
    parse_recipe_args,
    setup_logging,
)
from recipes.image_transforms import IMAGENET_MEAN, IMAGENET_STD, ImageBatchTransform

logger = logging.getLogger(__name__)


@dataclass
class CifarArguments(SmokeArguments):
    """Model, data and augmentation (the privacy and optimiser knobs are DPTrainingArguments)."""

    model_name_or_path: str = field(
        default="facebook/deit-tiny-patch16-224",
        metadata={"help": "ImageNet-pretrained checkpoint: facebook/deit-{tiny,small,base}-patch16-224."},
    )
    dataset_name: str = field(
        default="uoft-cs/cifar10", metadata={"help": "uoft-cs/cifar10 or uoft-cs/cifar100."}
    )
    image_column: str = field(default="img", metadata={"help": "Column holding the images."})
    label_column: str = field(
        default="label", metadata={"help": "'label' (CIFAR-10) or 'fine_label' (CIFAR-100)."}
    )
    train_split: str = field(
        default="train", metadata={"help": "Split to train on (minus the validation images)."}
    )
    test_split: str = field(default="test", metadata={"help": "Split to report accuracy on."})
    validation_size: int = field(
        default=5000,
        metadata={"help": "Training images held out for validation (the paper: 45K/5K); 0 for none."},
    )
    image_size: int | None = field(
        default=None, metadata={"help": "Model input size (default: the model's, 224)."}
    )
    crop_padding: int = field(
        default=4, metadata={"help": "Zero padding of the random crop, at source resolution."}
    )
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Truncate the training set (debugging)."}
    )
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Truncate the test set (debugging)."}
    )
    use_evaluate: bool = field(
        default=True,
        metadata={
            "help": "Accuracy via evaluate.load('accuracy') (needs the Hub once); numpy if unavailable."
        },
    )
    smoke_train_size: int = field(default=256, metadata={"help": "Synthetic training images in smoke mode."})
    smoke_eval_size: int = field(default=64, metadata={"help": "Synthetic test images in smoke mode."})
    smoke_num_classes: int = field(default=10, metadata={"help": "Classes of the synthetic images."})


def load_raw_data(args: CifarArguments, seed: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    """``(train, test)`` with the image and label columns."""
    if args.smoke:
        train = smoke.images_like(args.smoke_train_size, args.smoke_num_classes, 32, seed, args.label_column)
        test = smoke.images_like(
            args.smoke_eval_size, args.smoke_num_classes, 32, seed + 1, args.label_column
        )
        return train, test
    raw = datasets.load_dataset(args.dataset_name)
    return raw[args.train_split], raw[args.test_split]


def split_validation(
    train: datasets.Dataset, args: CifarArguments, seed: int
) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """Hold ``validation_size`` images out of the training split, ranked by a keyed hash of their content
    (:func:`recipes.common.held_out_split`: one raw image more or less changes the training set by one
    row). The held-out images are private data that the guarantee does not cover: their metrics are
    logged and put in the card unnoised."""
    if args.validation_size <= 0:
        return train, None
    if args.validation_size >= len(train):
        raise ValueError(
            f"validation_size={args.validation_size} leaves no training images (of {len(train)})."
        )
    rest, validation = held_out_split(train, [args.validation_size], seed)
    return rest, validation


def load_model(args: CifarArguments, label_names: list[str]):
    """``(model, image_processor or None)``: the pretrained DeiT with a new head, or a tiny random ViT."""
    id2label = dict(enumerate(label_names))
    label2id = {name: i for i, name in id2label.items()}
    if args.smoke:
        config = ViTConfig(
            image_size=args.image_size or 16,
            patch_size=4,
            num_channels=3,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=37,
            num_labels=len(label_names),
            id2label=id2label,
            label2id=label2id,
        )
        return ViTForImageClassification(config), None
    # The DeiT checkpoints without distillation are ViT-architecture models; the 1000-class ImageNet
    # head is dropped and a fresh one sized for CIFAR is initialised.
    model = AutoModelForImageClassification.from_pretrained(
        args.model_name_or_path,
        num_labels=len(label_names),
        id2label=id2label,
        label2id=label2id,
        ignore_mismatched_sizes=True,
    )
    return model, _image_processor(args, model.config.image_size)


def _image_processor(args: CifarArguments, image_size: int):
    """The checkpoint's processor, set to what the recipe does at test time (plain resize to
    ``image_size``, no 256-then-center-crop), so the saved model predicts on CIFAR-size inputs
    as it was evaluated. None if it cannot be loaded (it is only saved alongside the weights)."""
    try:
        from transformers import AutoImageProcessor

        processor = AutoImageProcessor.from_pretrained(args.model_name_or_path)
    except Exception as err:  # optional: normalisation uses ImageNet statistics anyway
        logger.warning("no image processor saved with the model (%s: %s)", type(err).__name__, err)
        return None
    processor.size = {"height": image_size, "width": image_size}
    if hasattr(processor, "do_center_crop"):
        processor.do_center_crop = False
    return processor


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train, evaluate on the test split, save; returns the run summary."""
    args, training_args = parse_recipe_args(CifarArguments, argv)
    setup_logging(training_args)
    apply_cpu_threads(args)
    set_seed(training_args.seed)
    if training_args.remove_unused_columns:
        # The transform reads the raw image column, which is not a model input; the Trainer must keep it.
        training_args.remove_unused_columns = False

    train, test = load_raw_data(args, training_args.seed)
    label_names = train.features[args.label_column].names
    train, validation = split_validation(train, args, training_args.seed)
    if args.max_train_samples is not None:
        train = train.select(range(min(args.max_train_samples, len(train))))
    if args.max_eval_samples is not None:
        test = test.select(range(min(args.max_eval_samples, len(test))))

    model, processor = load_model(args, label_names)
    image_size = args.image_size or model.config.image_size
    mean = getattr(processor, "image_mean", None) or IMAGENET_MEAN
    std = getattr(processor, "image_std", None) or IMAGENET_STD
    common = dict(
        image_size=image_size,
        image_column=args.image_column,
        label_column=args.label_column,
        mean=mean,
        std=std,
    )
    train.set_transform(ImageBatchTransform(train=True, crop_padding=args.crop_padding, **common))
    for split in (test, validation):
        if split is not None:
            split.set_transform(ImageBatchTransform(train=False, **common))
    trainable, total = parameter_counts(model)
    logger.info(
        "%d training / %d validation / %d test images, %d classes, %dx%d input; %d trainable parameters of %d",
        len(train),
        0 if validation is None else len(validation),
        len(test),
        len(label_names),
        image_size,
        image_size,
        trainable,
        total,
    )

    trainer = DPTrainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=validation,
        processing_class=processor,
        data_collator=default_data_collator,
        compute_metrics=accuracy_metric(use_evaluate=args.use_evaluate and not args.smoke),
    )
    trainer.train(
        resume_from_checkpoint=training_args.resume_from_checkpoint
    )  # (train() itself never reads it)
    metrics = trainer.evaluate(test, metric_key_prefix="test")
    card = {"dataset_name": "synthetic images (smoke)" if args.smoke else args.dataset_name}
    if not args.smoke:
        card["base_model"] = args.model_name_or_path
    return finish_run(trainer, "deit_cifar", args, metrics, card_metadata=card)


if __name__ == "__main__":
    main(sys.argv[1:])
