"""Benchmark models, defined here so that the benchmarks need nothing beyond torch.

Each model comes with a batch maker that returns synthetic ``(inputs,
targets)`` and a default batch size. The models are chosen for their
communication profile, not for accuracy:

* ``vgg``: VGG-style convolutions followed by two 4096-wide fully connected
  layers. About 34M parameters, 3/4 of them in the last layers, whose
  gradients are ready first in backward but needed last in forward: the case
  where priority scheduling pays most.
* ``resnet18``: the CIFAR variant of ResNet-18 (11M parameters, many small
  tensors, compute-heavy).
* ``gpt``: a 6-layer decoder-only transformer with an untied output head
  (27M parameters, embeddings at both ends).
* ``tiny``: a two-layer MLP for smoke tests.

Default batch sizes (``DEFAULT_BATCH``) were picked so that one forward and
backward pass takes 0.3 to 1.5 s per rank on the 2-core development machine
with ``torch.set_num_threads(1)``; the timings measured with
``python -m benchmarks.models`` are recorded beside them. Compute in that
range makes the 1 Gbit/s links and the compute comparable, which is where
scheduling decides the iteration time.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# Measured with `python -m benchmarks.models --threads 1` on the 2-core
# development machine (Intel Xeon, torch 2.13 CPU; other jobs running, load
# average about 3.5), median of 5 fwd+bwd passes after 2 warm-up passes:
#   vgg       batch 16:             0.45 s  (34.4M params, 131 MiB of gradients)
#   resnet18  batch 8:              0.48 s  (11.2M params,  43 MiB)
#   gpt       batch 4 x 128 tokens: 0.95 s  (27.4M params, 104 MiB)
#   tiny      batch 32:             < 1 ms
# At 1 Gbit/s and 2 ranks one all-reduce of all gradients takes about 1.15 s
# (vgg) and 0.9 s (gpt): vgg is communication-bound, as VGG is on slow
# links, and gpt is balanced, where overlapping decides the iteration time.
DEFAULT_BATCH = {"vgg": 16, "resnet18": 8, "gpt": 4, "tiny": 32}

IMAGE_SIZE = 32  # CIFAR-sized inputs keep the convolutions affordable on CPU.
NUM_CLASSES = 10
GPT_VOCAB = 8192
GPT_CONTEXT = 128
GPT_WIDTH = 512
GPT_LAYERS = 6
GPT_HEADS = 8


# --------------------------------------------------------------------------
# VGG-like
# --------------------------------------------------------------------------

# VGG-11's convolution stack, but with only four pools so that a 2x2x512 map
# reaches the classifier: its first FC layer then has 2048 inputs, which puts
# the parameter count (and the gradient bytes) where we want it.
_VGG_CFG = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512)


class VGGLike(nn.Module):
    def __init__(self, num_classes: int = NUM_CLASSES, fc_width: int = 4096):
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for item in _VGG_CFG:
            if item == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [
                    nn.Conv2d(channels, item, 3, padding=1),
                    nn.ReLU(inplace=True),
                ]
                channels = item
        self.features = nn.Sequential(*layers)
        side = IMAGE_SIZE // 16
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(channels * side * side, fc_width),
            nn.ReLU(inplace=True),
            nn.Linear(fc_width, fc_width),
            nn.ReLU(inplace=True),
            nn.Linear(fc_width, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


# --------------------------------------------------------------------------
# ResNet-18-like
# --------------------------------------------------------------------------


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18Like(nn.Module):
    """ResNet-18 for 32x32 inputs (3x3 stem, no initial pooling)."""

    def __init__(self, num_classes: int = NUM_CLASSES):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU()
        )
        blocks: list[nn.Module] = []
        cin = 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            blocks += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.blocks(self.stem(x))
        return self.head(F.adaptive_avg_pool2d(out, 1).flatten(1))


class Bottleneck(nn.Module):
    """ResNet-50's block: 1x1 down, 3x3, 1x1 up (4x), each with batch norm; a projection where the shape changes."""

    def __init__(self, cin: int, mid: int, stride: int):
        super().__init__()
        cout = 4 * mid
        self.conv1 = nn.Conv2d(cin, mid, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(mid)
        self.conv2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(mid)
        self.conv3 = nn.Conv2d(mid, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + self.shortcut(x))


class ResNet50Shaped(nn.Module):
    """ResNet-50's structure (stages of 3, 4, 6, 3 bottlenecks: 161 parameter tensors) at a chosen base
    width, for 32x32 inputs; ``width=64`` is ResNet-50's own."""

    def __init__(self, width: int = 64, num_classes: int = NUM_CLASSES):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        blocks: list[nn.Module] = []
        cin = width
        for k, (depth, stride) in enumerate(((3, 1), (4, 2), (6, 2), (3, 2))):
            mid = width * 2**k
            for j in range(depth):
                blocks.append(Bottleneck(cin, mid, stride if j == 0 else 1))
                cin = 4 * mid
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.blocks(self.stem(x))
        return self.head(F.adaptive_avg_pool2d(out, 1).flatten(1))


# --------------------------------------------------------------------------
# GPT-like
# --------------------------------------------------------------------------


class DecoderBlock(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        # (b, t, c) -> (b, heads, t, c / heads)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPTLike(nn.Module):
    def __init__(
        self,
        vocab: int = GPT_VOCAB,
        context: int = GPT_CONTEXT,
        width: int = GPT_WIDTH,
        layers: int = GPT_LAYERS,
        heads: int = GPT_HEADS,
    ):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*(DecoderBlock(width, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(width)
        # Untied on purpose: a second vocab x width gradient at the output end
        # is part of the communication profile we want to exercise.
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        return self.head(self.ln(self.blocks(x)))


# --------------------------------------------------------------------------
# Residual MLP (many small tensors, LayerNorm in every block)
# --------------------------------------------------------------------------


class ResidualBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.fc(self.norm(x)))


class ResidualMLP(nn.Module):
    """A stem, ``blocks`` pre-norm residual blocks (LayerNorm, Linear, ReLU) and a head: 4 tensors a block."""

    def __init__(self, features: int = 64, width: int = 64, blocks: int = 24):
        super().__init__()
        self.stem = nn.Linear(features, width)
        self.blocks = nn.Sequential(*(ResidualBlock(width) for _ in range(blocks)))
        self.head = nn.Linear(width, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


# --------------------------------------------------------------------------
# LSTM language model (few, large tensors; the embedding read first)
# --------------------------------------------------------------------------


class LSTMLanguageModel(nn.Module):
    """An embedding, a stacked LSTM and an output layer: 11 tensors, 2.9 M parameters at the defaults, the
    embedding's update needed by the forward's first operation."""

    def __init__(self, vocab: int = 5000, width: int = 128, hidden: int = 256, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.lstm = nn.LSTM(width, hidden, layers, batch_first=True)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(self.lstm(self.embed(idx))[0])


# --------------------------------------------------------------------------
# Tiny
# --------------------------------------------------------------------------


class TiedLM(nn.Module):
    """An embedding tied to the output layer (one tensor read at both ends), with ``blocks`` Linear-ReLU blocks
    between (``benchmarks.host_patterns``)."""

    def __init__(self, vocab: int = 512, width: int = 64, blocks: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(blocks)])
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(x))).flatten(0, 1)


class RootReadsAll(nn.Module):
    """Every weight in a ParameterList of ``n`` blocks that the root's own forward reads with ``F.linear``: one
    module reads them all (its apply point owns every tensor), as functional and hypernetwork-style code has it
    (``benchmarks.host_patterns``)."""

    def __init__(self, n: int = 150, width: int = 32, classes: int = 10):
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(torch.randn(width, width) / width ** 0.5) for _ in range(n)])
        self.biases = nn.ParameterList([nn.Parameter(torch.zeros(width)) for _ in range(n)])
        self.head = nn.Parameter(torch.randn(classes, width) / width ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w, b in zip(self.weights, self.biases):
            x = x + torch.tanh(F.linear(x, w, b))
        return F.linear(x, self.head)


class SharedBlock(nn.Module):
    """One block applied ``times`` times (ALBERT-style weight sharing): each of its tensors read at every pass,
    its gradient the sum of them all (``benchmarks.host_patterns``)."""

    def __init__(self, width: int = 64, times: int = 12, classes: int = 10):
        super().__init__()
        self.times = times
        self.block = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.times):
            x = x + self.block(x)
        return self.head(x)


class SparseEmbeddingMLP(nn.Module):
    """An embedding with sparse gradients (``sparse=True``), mean-pooled, under ``blocks`` Linear-ReLU blocks
    (``benchmarks.host_patterns``)."""

    def __init__(self, vocab: int = 5000, width: int = 64, blocks: int = 16, classes: int = 10):
        super().__init__()
        self.emb = nn.Embedding(vocab, width, sparse=True)
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(blocks)])
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(x).mean(1)))


class ReadBackwards(nn.Module):
    """The layers of ``layers`` (a Sequential) read in the reverse of their registration order, but for the last,
    which stays last: the order of first reads is not the order of the parameters (``benchmarks.host_patterns``)."""

    def __init__(self, layers: nn.Sequential):
        super().__init__()
        self.layers = layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        *body, head = self.layers
        for layer in reversed(body):
            x = layer(x)
        return head(x)


class TinyMLP(nn.Module):
    def __init__(self, width: int = 64):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(32, width), nn.ReLU(), nn.Linear(width, NUM_CLASSES)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


# --------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[], nn.Module]
    make_batch: Callable[[int, torch.Generator], Batch]
    default_batch: int


def _image_batch(batch: int, gen: torch.Generator) -> Batch:
    x = torch.randn(batch, 3, IMAGE_SIZE, IMAGE_SIZE, generator=gen)
    y = torch.randint(0, NUM_CLASSES, (batch,), generator=gen)
    return x, y


def _token_batch(batch: int, gen: torch.Generator) -> Batch:
    # Targets are the inputs shifted by one, as in language-model training.
    seq = torch.randint(0, GPT_VOCAB, (batch, GPT_CONTEXT + 1), generator=gen)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def _tiny_batch(batch: int, gen: torch.Generator) -> Batch:
    x = torch.randn(batch, 32, generator=gen)
    y = torch.randint(0, NUM_CLASSES, (batch,), generator=gen)
    return x, y


MODELS: dict[str, ModelSpec] = {
    "vgg": ModelSpec("vgg", VGGLike, _image_batch, DEFAULT_BATCH["vgg"]),
    "resnet18": ModelSpec("resnet18", ResNet18Like, _image_batch, DEFAULT_BATCH["resnet18"]),
    "gpt": ModelSpec("gpt", GPTLike, _token_batch, DEFAULT_BATCH["gpt"]),
    "tiny": ModelSpec("tiny", TinyMLP, _tiny_batch, DEFAULT_BATCH["tiny"]),
}


def get_model(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(MODELS)}") from None


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for both classifiers (b, C) and language models (b, t, V)."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def time_compute(spec: ModelSpec, batch: int, reps: int, warmup: int) -> list[float]:
    """Seconds per forward+backward pass, one process, no communication."""
    torch.manual_seed(0)
    model = spec.build()
    x, y = spec.make_batch(batch, torch.Generator().manual_seed(0))
    times = []
    for i in range(warmup + reps):
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Print model sizes and compute times.")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batch", type=int, default=None, help="override the default batch")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    for name in args.models.split(","):
        spec = get_model(name)
        batch = args.batch or spec.default_batch
        n = param_count(spec.build())
        times = sorted(time_compute(spec, batch, args.reps, args.warmup))
        median = times[len(times) // 2]
        print(
            f"{name:9s} batch {batch:3d}  params {n / 1e6:6.2f}M "
            f"({n * 4 / 2**20:6.1f} MiB fp32)  fwd+bwd median {median:.3f} s "
            f"min {times[0]:.3f} max {times[-1]:.3f}"
        )


if __name__ == "__main__":
    main()
