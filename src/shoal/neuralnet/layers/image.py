"""kImagePreprocess: mean subtraction, crop, mirror and scale of images from an input layer."""
from __future__ import annotations

import torch

from shoal.config import job_pb2
from shoal.neuralnet.layers.base import Layer
from shoal.neuralnet.layers.common import config_error, uniform
from shoal.neuralnet.layers.registry import register


@register("kImagePreprocess")
class ImagePreprocess(Layer):
    """y = scale · mirror(crop(x − mean)), per image; rgbimage_conf {scale, cropsize, mirror, meanfile}.

    kTrain: each image gets its own random crop position and, with `mirror`, a
    coin flip for a horizontal flip (both from ctx.generator, drawn per sample of the
    group's batch, see layers.common.draw). Other phases:
    the centred crop, never mirrored (SINGA took the top-left crop at test
    time; the centre is the usual choice and what Caffe does).
    `self.mean` is the image of rgbimage_conf.meanfile (full size, before the crop),
    set by the runtime.
    """

    category = "input"
    draws_random = True

    def __init__(self, conf, src_shapes):
        super().__init__(conf, src_shapes)
        if len(self.src_shapes) != 1 or len(self.src_shapes[0]) != 3:
            raise config_error(conf, f"needs one srclayer of C×H×W images, got shapes {self.src_shapes}")
        channels, h, w = self.src_shapes[0]
        self.crop = conf.rgbimage_conf.cropsize
        if self.crop < 0 or self.crop > min(h, w):
            raise config_error(conf, f"rgbimage_conf.cropsize {self.crop} does not fit the {h}×{w} images")
        self.shape = (channels, self.crop, self.crop) if self.crop else (channels, h, w)
        self.mean: torch.Tensor | None = None

    def forward(self, xs, params, labels, ctx):
        c = self.conf.rgbimage_conf
        x = xs[0]
        if self.mean is not None:
            x = x - self.mean.reshape(x.shape[1:])
        batch, _, h, w = x.shape
        out_h, out_w = self.shape[1:]
        training = ctx.phase == job_pb2.kTrain
        if training:
            # one row of draws per image, made for the group's whole batch and sliced to this
            # worker's rows (per_sample): a synchronous group crops as one worker would
            draws = uniform((batch, 3), ctx, x.device, per_sample=True)
            top = (draws[:, 0] * (h - out_h + 1)).long().clamp(max=h - out_h)
            left = (draws[:, 1] * (w - out_w + 1)).long().clamp(max=w - out_w)
            flip = (draws[:, 2] < 0.5) if c.mirror else torch.zeros(batch, dtype=torch.bool, device=x.device)
        else:
            top = torch.full((batch,), (h - out_h) // 2, device=x.device)
            left = torch.full((batch,), (w - out_w) // 2, device=x.device)
            flip = torch.zeros(batch, dtype=torch.bool, device=x.device)
        rows = top[:, None] + torch.arange(out_h, device=x.device)  # (B, out_h)
        offsets = torch.arange(out_w, device=x.device)
        cols = left[:, None] + torch.where(flip[:, None], out_w - 1 - offsets, offsets)  # a flip reads the crop's columns backwards
        b = torch.arange(batch, device=x.device)[:, None, None, None]
        ch = torch.arange(x.shape[1], device=x.device)[None, :, None, None]
        y = x[b, ch, rows[:, None, :, None], cols[:, None, None, :]]
        return y * c.scale if c.scale != 1 else y
