"""Image preprocessing and augmentation in plain torch (no torchvision, whose CPU build is not installed).

The DeiT fine-tuning recipe needs what ``torchvision.transforms`` usually provides: resize to the
model's resolution, random crop with padding, horizontal flip, per-channel normalisation. Each is a
small function on a ``[C, H, W]`` float tensor; :class:`ImageBatchTransform` chains them for
``datasets.Dataset.set_transform``, which calls it on a *batch* (a dict of lists) every time
examples are read, so each epoch sees fresh random crops and flips.

Augmentation randomness does not touch privacy: it is applied per example, before clipping.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

# ImageNet statistics, as the DeiT/ViT checkpoints were trained with (timm's IMAGENET_DEFAULT_*).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def to_tensor(image: Any, num_channels: int = 3) -> torch.Tensor:
    """``[C, H, W]`` float32 in [0, 1] from a PIL image, a ``[H, W(, C)]`` array/list or a tensor.

    Integer inputs are taken as 0..255 pixel values; float inputs as already in [0, 1]. Grey
    images are repeated to ``num_channels`` (CIFAR has a few images that decode as "L" or "RGBA").
    """
    if hasattr(image, "convert"):  # PIL image: decode to the channel layout we want
        image = image.convert("RGB" if num_channels == 3 else "L")
    array = image.numpy() if isinstance(image, torch.Tensor) else np.asarray(image)
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if tensor.dtype == torch.uint8 or not tensor.is_floating_point():
        tensor = tensor.float() / 255.0
    else:
        tensor = tensor.float()
    if tensor.dim() == 2:
        tensor = tensor.unsqueeze(-1)
    if tensor.dim() != 3:
        raise ValueError(f"expected an image of shape [H, W] or [H, W, C], got {tuple(tensor.shape)}.")
    tensor = tensor.permute(2, 0, 1)  # HWC -> CHW
    if tensor.shape[0] == 4:  # RGBA: drop alpha
        tensor = tensor[:3]
    if tensor.shape[0] == 1 and num_channels > 1:
        tensor = tensor.expand(num_channels, -1, -1)
    if tensor.shape[0] != num_channels:
        raise ValueError(f"image has {tensor.shape[0]} channels, the model expects {num_channels}.")
    return tensor.contiguous()


def resize(image: torch.Tensor, size: int | tuple[int, int]) -> torch.Tensor:
    """Bilinear resize of ``[C, H, W]`` to ``size`` (antialiased when shrinking)."""
    size = (size, size) if isinstance(size, int) else tuple(size)
    if tuple(image.shape[-2:]) == size:
        return image
    shrinking = size[0] < image.shape[-2] or size[1] < image.shape[-1]
    return F.interpolate(
        image.unsqueeze(0), size=size, mode="bilinear", align_corners=False, antialias=shrinking
    ).squeeze(0)


def random_crop(
    image: torch.Tensor, size: int, padding: int = 0, generator: torch.Generator | None = None
) -> torch.Tensor:
    """A random ``size x size`` window of ``image`` zero-padded by ``padding`` on each side.

    CIFAR's standard augmentation is ``random_crop(x, 32, padding=4)``: shifts of up to 4 pixels.
    """
    if padding > 0:
        image = F.pad(image, (padding, padding, padding, padding))
    height, width = image.shape[-2:]
    if height < size or width < size:
        raise ValueError(f"crop size {size} is larger than the (padded) image {height}x{width}.")
    top = int(torch.randint(0, height - size + 1, (1,), generator=generator))
    left = int(torch.randint(0, width - size + 1, (1,), generator=generator))
    return image[..., top : top + size, left : left + size]


def random_horizontal_flip(
    image: torch.Tensor, probability: float = 0.5, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Mirror left-right with ``probability``."""
    if float(torch.rand((), generator=generator)) < probability:
        return image.flip(-1)
    return image


def normalize(image: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """``(image - mean) / std`` per channel."""
    mean_t = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
    std_t = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
    return (image - mean_t) / std_t


class ImageBatchTransform:
    """``set_transform`` callable: a batch of raw images and labels -> ``pixel_values`` and ``labels``.

    Training: random crop (at the source resolution, padding ``crop_padding``), resize to
    ``image_size``, random horizontal flip, normalise. Evaluation (``train=False``): resize and
    normalise only. Cropping before resizing is the cheap order (32x32 rather than 224x224) and
    equals cropping the upsampled image up to interpolation.

    A plain class (not a closure) so that ``DataLoader`` workers can pickle it.
    """

    def __init__(
        self,
        image_size: int,
        train: bool,
        image_column: str = "img",
        label_column: str = "label",
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        crop_padding: int = 4,
        flip_probability: float = 0.5,
        num_channels: int = 3,
    ) -> None:
        self.image_size = image_size
        self.train = train
        self.image_column = image_column
        self.label_column = label_column
        self.mean = tuple(mean)
        self.std = tuple(std)
        self.crop_padding = crop_padding
        self.flip_probability = flip_probability
        self.num_channels = num_channels

    def transform_image(self, image: Any) -> torch.Tensor:
        tensor = to_tensor(image, self.num_channels)
        if self.train:
            tensor = random_crop(tensor, min(tensor.shape[-2:]), padding=self.crop_padding)
        tensor = resize(tensor, self.image_size)
        if self.train:
            tensor = random_horizontal_flip(tensor, self.flip_probability)
        return normalize(tensor, self.mean, self.std)

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        if self.image_column not in batch:
            raise KeyError(
                f"image column {self.image_column!r} not in the dataset (columns: {sorted(batch)}); "
                "set image_column to the column holding the images."
            )
        out = {"pixel_values": [self.transform_image(image) for image in batch[self.image_column]]}
        if self.label_column in batch:
            out["labels"] = [int(label) for label in batch[self.label_column]]
        return out
