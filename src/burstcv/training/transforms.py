"""Crop, resize and flip whole batches of stored uint8 images on the training device.

Random numbers come from a CPU generator, so a batch is the same on any device and after any
resume.
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F
from torchvision.ops import roi_align

from burstcv.training.job import AugmentSpec

# Candidate boxes drawn per image before falling back to the whole image (torchvision's 10).
RRC_ATTEMPTS = 10


def center_crop(batch: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Return the centre height x width of NCHW images (offsets round down, as in the spec)."""
    full_h, full_w = batch.shape[-2], batch.shape[-1]
    if height > full_h or width > full_w:
        raise ValueError(f"cannot crop {height}x{width} from {full_h}x{full_w} images")
    top, left = (full_h - height) // 2, (full_w - width) // 2
    return batch[..., top : top + height, left : left + width]


def shift(batch_u8: torch.Tensor, padding: int, gen: torch.Generator) -> torch.Tensor:
    """Randomly shift each image by up to ``padding`` px, filling with zeros."""
    n, _, h, w = batch_u8.shape
    if padding <= 0:
        return batch_u8
    device = batch_u8.device
    padded = F.pad(batch_u8, (padding, padding, padding, padding))
    dy = torch.randint(0, 2 * padding + 1, (n,), generator=gen, device="cpu").to(device)
    dx = torch.randint(0, 2 * padding + 1, (n,), generator=gen, device="cpu").to(device)
    rows = (torch.arange(h, device=device)[None, :] + dy[:, None])[:, :, None]  # n,h,1
    cols = (torch.arange(w, device=device)[None, :] + dx[:, None])[:, None, :]  # n,1,w
    idx = torch.arange(n, device=device)[:, None, None]
    return padded.permute(0, 2, 3, 1)[idx, rows, cols].permute(0, 3, 1, 2)


def random_flip(batch: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Mirror each image left-right with probability 1/2."""
    flip = torch.rand(batch.shape[0], generator=gen, device="cpu").to(batch.device) < 0.5
    return torch.where(flip[:, None, None, None], batch.flip(3), batch)


def rrc_boxes(
    n: int,
    height: int,
    width: int,
    scale: tuple[float, float],
    ratio: tuple[float, float],
    gen: torch.Generator,
) -> torch.Tensor:
    """Draw one crop box per image as torchvision's RandomResizedCrop does: (n, 4) x0 y0 x1 y1."""
    area = float(height * width)
    shares = torch.empty(n, RRC_ATTEMPTS).uniform_(scale[0], scale[1], generator=gen)
    log_ratio = torch.empty(n, RRC_ATTEMPTS).uniform_(
        math.log(ratio[0]), math.log(ratio[1]), generator=gen
    )
    aspect = torch.exp(log_ratio)
    crop_w = torch.round(torch.sqrt(area * shares * aspect))
    crop_h = torch.round(torch.sqrt(area * shares / aspect))
    fits = (crop_w > 0) & (crop_w <= width) & (crop_h > 0) & (crop_h <= height)
    u_top = torch.rand(n, RRC_ATTEMPTS, generator=gen)
    u_left = torch.rand(n, RRC_ATTEMPTS, generator=gen)
    top = torch.floor(u_top * (height - crop_h + 1)).clamp(min=0)
    left = torch.floor(u_left * (width - crop_w + 1)).clamp(min=0)

    # The fallback box: the whole image, narrowed to the allowed aspect range.
    in_ratio = width / height
    if in_ratio < ratio[0]:
        fb_w, fb_h = float(width), float(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        fb_w, fb_h = float(round(height * ratio[1])), float(height)
    else:
        fb_w, fb_h = float(width), float(height)
    fb_top, fb_left = float((height - fb_h) // 2), float((width - fb_w) // 2)

    first = torch.argmax(fits.to(torch.int8), dim=1)  # index of the first fitting candidate
    rows = torch.arange(n)
    any_fits = fits.any(dim=1)

    def pick(values: torch.Tensor, fallback: float) -> torch.Tensor:
        return torch.where(any_fits, values[rows, first], torch.full((n,), fallback))

    x0, y0 = pick(left, fb_left), pick(top, fb_top)
    x1, y1 = x0 + pick(crop_w, fb_w), y0 + pick(crop_h, fb_h)
    return torch.stack([x0, y0, x1, y1], dim=1)


def random_resized_crop(
    batch_u8: torch.Tensor,
    size: tuple[int, int],
    scale: tuple[float, float],
    ratio: tuple[float, float],
    gen: torch.Generator,
) -> torch.Tensor:
    """Crop a random box of each image and resize it to ``size`` (uint8 NCHW in, float out);
    roi_align's adaptive sampling anti-aliases a downscale as Pillow's resize does at eval."""
    n, _, height, width = batch_u8.shape
    boxes = rrc_boxes(n, height, width, scale, ratio, gen).to(batch_u8.device)
    index = torch.arange(n, device=batch_u8.device, dtype=boxes.dtype)[:, None]
    crops: torch.Tensor = roi_align(
        batch_u8.float(),
        torch.cat([index, boxes], dim=1),
        output_size=size,
        spatial_scale=1.0,
        sampling_ratio=-1,  # adaptive: ceil(box side / output side) samples per bin and axis
        aligned=True,  # pixel centres at +0.5: a box of the whole image maps pixel to pixel
    )
    return crops


def train_transform(
    batch_u8: torch.Tensor, aug: AugmentSpec, size: tuple[int, int], gen: torch.Generator
) -> torch.Tensor:
    """Turn stored uint8 NCHW images into augmented training inputs of ``size`` (0..255)."""
    mode = aug.mode
    if mode == "auto":  # random_resized_crop on margin shards
        mode = "random_resized_crop" if batch_u8.shape[-2:] != size else "shift"
    if mode == "random_resized_crop":
        out = random_resized_crop(batch_u8, size, aug.rrc_scale, aug.rrc_ratio, gen)
        hflip = True if aug.hflip is None else aug.hflip
    else:
        out = shift(center_crop(batch_u8, *size), aug.crop_padding_px, gen)
        hflip = bool(aug.hflip)
    return random_flip(out, gen) if hflip else out
