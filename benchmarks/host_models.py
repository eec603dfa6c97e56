"""Models for benchmarks/bench_host.py: ``model_specs`` (what each row trains: torchvision's
ResNet-50 / ResNet-18 where installed, the UNet, GPT-2, the examples' MLP, many params; their batches, losses and
AMP dtypes), and the stand-ins built from plain torch modules (no torchvision needed):

* ``SmallResNet``: a ResNet-like conv net (conv-bn-relu stem, basic blocks with BatchNorm and
  strided shortcuts, pooled linear head), the CPU stand-in for torchvision's resnet50/resnet18;
* ``UNet``: a diffusion-style UNet: residual conv blocks (GroupNorm, SiLU, 3x3 convs) fed a
  timestep embedding, self-attention blocks at the low resolutions, skip connections;
* ``ManyParams``: ``count`` separate 1-d params of ``numel`` elements whose backward is one
  stack node, so backward's host time is almost only the per-param grad accumulation (and the
  optimizer's hooks on it).
"""
from __future__ import annotations

import math
from typing import Dict, List, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from host_iteration import LOOPS


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = None
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.short is None else self.short(x)))


class SmallResNet(nn.Module):
    def __init__(self, widths: Sequence[int] = (16, 32, 64), blocks: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
        layers: List[nn.Module] = []
        cin = widths[0]
        for i, w in enumerate(widths):
            for j in range(blocks):
                layers.append(BasicBlock(cin, w, 2 if (j == 0 and i > 0) else 1))
                cin = w
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def _norm(ch: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(32, ch // 4), ch)


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, temb: int) -> None:
        super().__init__()
        self.norm1, self.conv1 = _norm(cin), nn.Conv2d(cin, cout, 3, 1, 1)
        self.temb = nn.Linear(temb, cout)
        self.norm2, self.conv2 = _norm(cout), nn.Conv2d(cout, cout, 3, 1, 1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.temb(t)[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return h + self.skip(x)


class AttnBlock(nn.Module):
    def __init__(self, ch: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm = _norm(ch)
        self.qkv = nn.Conv2d(ch, 3 * ch, 1)
        self.proj = nn.Conv2d(ch, ch, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, 3, self.heads, c // self.heads, h * w).transpose(-1, -2).unbind(1)
        y = F.scaled_dot_product_attention(q, k, v)  # (b, heads, hw, c/heads)
        y = y.transpose(-1, -2).reshape(b, c, h, w)
        return x + self.proj(y)


class UNet(nn.Module):
    """Diffusion-style UNet: ``levels`` resolutions of ``ch * mult`` channels, two residual
    blocks per level going down and up, attention at the levels in ``attn_levels``."""

    def __init__(self, in_ch: int = 4, ch: int = 128, mults: Sequence[int] = (1, 2, 2, 4),
                 attn_levels: Sequence[int] = (2, 3), temb: int = 512) -> None:
        super().__init__()
        self.ch = ch
        self.temb = nn.Sequential(nn.Linear(ch, temb), nn.SiLU(), nn.Linear(temb, temb))
        self.inp = nn.Conv2d(in_ch, ch, 3, 1, 1)
        self.down = nn.ModuleList()
        skips, cur = [ch], ch
        for lvl, m in enumerate(mults):
            for _ in range(2):
                block = nn.ModuleList([ResBlock(cur, ch * m, temb)])
                cur = ch * m
                if lvl in attn_levels:
                    block.append(AttnBlock(cur))
                self.down.append(block)
                skips.append(cur)
            if lvl != len(mults) - 1:
                self.down.append(nn.ModuleList([nn.Conv2d(cur, cur, 3, 2, 1)]))
                skips.append(cur)
        self.mid = nn.ModuleList([ResBlock(cur, cur, temb), AttnBlock(cur), ResBlock(cur, cur, temb)])
        self.up = nn.ModuleList()
        for lvl, m in reversed(list(enumerate(mults))):
            for _ in range(3):
                block = nn.ModuleList([ResBlock(cur + skips.pop(), ch * m, temb)])
                cur = ch * m
                if lvl in attn_levels:
                    block.append(AttnBlock(cur))
                self.up.append(block)
            if lvl != 0:
                self.up.append(nn.ModuleList([nn.Upsample(scale_factor=2.0, mode="nearest"), nn.Conv2d(cur, cur, 3, 1, 1)]))
        self.out = nn.Sequential(_norm(cur), nn.SiLU(), nn.Conv2d(cur, in_ch, 3, 1, 1))

    def _embed(self, t: torch.Tensor) -> torch.Tensor:
        half = self.ch // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
        args = t.float()[:, None] * freqs[None]
        return self.temb(torch.cat([args.sin(), args.cos()], dim=1))

    @staticmethod
    def _run(block: nn.ModuleList, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        for layer in block:
            x = layer(x, t) if isinstance(layer, ResBlock) else layer(x)
        return x

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        temb = self._embed(t)
        h = self.inp(x)
        hs = [h]
        for block in self.down:
            h = self._run(block, h, temb)
            hs.append(h)
        for layer in self.mid:
            h = layer(h, temb) if isinstance(layer, ResBlock) else layer(h)
        for block in self.up:
            if isinstance(block[0], ResBlock):
                h = torch.cat([h, hs.pop()], dim=1)
            h = self._run(block, h, temb)
        return self.out(h)


class ManyParams(nn.Module):
    def __init__(self, count: int, numel: int) -> None:
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.randn(numel) * 0.02) for _ in range(count)])
        self.register_buffer("w", torch.randn(count, numel))

    def forward(self, scale: torch.Tensor) -> torch.Tensor:
        # one StackBackward node hands every param its grad: backward's host time is the
        # per-param accumulation, which is what the optimizer's hooks add to. (``scale``: DDP
        # needs an input to forward.)
        return (torch.stack(list(self.ps)).float() * self.w).sum() * scale


# ------------------------------------------------------------------------------ the rows' models
def model_specs(device: torch.device, small: bool) -> Dict[str, dict]:
    """name -> how to build the model, its batch and loss, and its dtype."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    specs: Dict[str, dict] = {}

    def images(b: int, px: int, classes: int):
        x = torch.randn(b, 3, px, px, generator=gen).to(device).contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, classes, (b,), generator=gen).to(device)
        return lambda: ((x,), y)

    cls_loss = F.cross_entropy
    fp16 = torch.float16 if device.type == "cuda" else None
    bf16 = torch.bfloat16 if device.type == "cuda" else None
    tv = None
    if not small:
        try:
            import torchvision.models as tv  # noqa: F811
        except ImportError:
            tv = None
    if tv is not None:
        specs["resnet50"] = dict(make=lambda: tv.resnet50(), batch=images(64, 160, 1000), loss=cls_loss,
                                 amp=fp16, cl=True, loops=list(LOOPS))
    else:
        specs["small resnet"] = dict(make=lambda: SmallResNet(), batch=images(8 if small else 64, 32, 10),
                                     loss=cls_loss, amp=fp16, cl=True, loops=list(LOOPS))
    unet = (lambda: UNet(ch=16, mults=(1, 2), attn_levels=(1,), temb=32)) if small else (lambda: UNet())
    b, px = (2, 16) if small else (16, 64)
    lat = torch.randn(b, 4, px, px, generator=gen).to(device).contiguous(memory_format=torch.channels_last)
    steps = torch.randint(0, 1000, (b,), generator=gen).to(device)
    noise = torch.randn(b, 4, px, px, generator=gen).to(device)
    mse = lambda out, target: F.mse_loss(out.float(), target)  # noqa: E731
    for name, amp in (("unet fp16", fp16), ("unet bf16", bf16)):
        if name == "unet bf16" and small:
            continue  # the CPU runs fp32 compute: one UNet row is enough for a smoke test
        specs[name] = dict(make=unet, batch=lambda: ((lat, steps), noise), loss=mse, amp=amp, cl=True,
                           loops=["scaler+unscale_+clip"])
    from gpt import GPT, GPTConfig, loss_fn as gpt_loss

    cfg = GPTConfig(vocab_size=256, seq_len=32, dim=32, layers=2, heads=2) if small else \
        GPTConfig(vocab_size=50257, seq_len=1024, dim=768, layers=12, heads=12)
    gb = 2 if small else 8
    idx = torch.randint(0, cfg.vocab_size, (gb, cfg.seq_len + 1), generator=gen).to(device)
    specs["gpt2 bf16"] = dict(make=lambda: GPT(cfg), batch=lambda: ((idx[:, :-1],), idx[:, 1:]), loss=gpt_loss,
                              amp=bf16, cl=False, loops=["max_grad_norm in step", "max_grad_norm in step, two groups"])
    if not small:  # GPT-2 large (774M), 4 x 1024 tokens: a GPU-bound iteration whose step moves 6x the bytes
        big = GPTConfig(vocab_size=50257, seq_len=1024, dim=1280, layers=36, heads=20)
        lidx = idx[:4]
        specs["gpt2 large bf16"] = dict(make=lambda: GPT(big), batch=lambda: ((lidx[:, :-1],), lidx[:, 1:]),
                                        loss=gpt_loss, amp=bf16, cl=False, loops=["max_grad_norm in step"])
    # the examples' MLP (33.6M params in 20 tensors, batch 64): the GPU finishes an iteration in
    # well under a millisecond, so the loop measures the host's fixed cost per step
    from framework_common import Net, loss_fn as mlp_loss

    dim, depth, mb = (32, 2, 8) if small else (2048, 8, 64)
    mx = torch.randn(mb, 16, generator=gen).to(device)
    my = (torch.tanh(mx[:, :4] * 2) + 0.1 * torch.randn(mb, 4, generator=gen).to(device))
    specs["mlp bf16"] = dict(make=lambda: Net(dim, depth), batch=lambda: ((mx,), my), loss=mlp_loss, amp=bf16,
                             cl=False, loops=["scaler+unscale_+clip", "plain step"])
    count, numel = (64, 256) if small else (1024, 4096)
    one = torch.ones((), device=device)
    specs[f"many params {count}x{numel}"] = dict(make=lambda: ManyParams(count, numel), batch=lambda: ((one,), None),
                                                 loss=lambda out, _t: out, amp=None, cl=False, loops=["plain step"])
    if tv is not None:  # last: compiling takes a while
        specs["compiled resnet18"] = dict(make=lambda: tv.resnet18(), batch=images(32, 128, 1000), loss=cls_loss,
                                          amp=fp16, cl=True, loops=["scaler+unscale_+clip"], compile=True)
    return specs


def build_model(spec: dict, device: torch.device, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = spec["make"]().to(device)
    if spec.get("cl"):
        model = model.to(memory_format=torch.channels_last)
    return model


class Compiled(torch.nn.Module):
    """Owns ``model`` (so ``.parameters()`` are its params, which the optimizer makes views of)
    and forwards through ``torch.compile(model)``."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.__dict__["compiled"] = torch.compile(model)  # not a submodule

    def forward(self, *inputs):
        return self.compiled(*inputs)
