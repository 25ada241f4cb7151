"""Models for the experiments; all return logits ([B, classes], or [B, T, vocab] for the LM).

None uses BatchNorm: simulated workers share buffers, so normalisation is GroupNorm/LayerNorm.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from adasum.sim import KeyedDropout

MODELS = ("cnn", "mlp", "resnet", "transformer", "skipgram", "skipgram-neg")


class HorovodCNN(nn.Module):
    """The 2-layer CNN of Horovod's MNIST example: conv(10, 5x5) - pool - conv(20, 5x5) - dropout -
    pool - fc(50) - dropout - fc(classes). For 1-D signals ([C, L] inputs, e.g. MNIST-1D) the same
    layers are 1-D convolutions.

    >>> HorovodCNN((1, 28, 28), 10)(torch.zeros(4, 1, 28, 28)).shape
    torch.Size([4, 10])
    """

    def __init__(self, input_shape: tuple[int, ...], classes: int, dropout: float = 0.5) -> None:
        super().__init__()
        if len(input_shape) not in (2, 3):
            raise ValueError(
                f"the CNN needs [C, L] or [C, H, W] inputs, got {input_shape}; leave --model out to use the task's "
                "default model, or choose one that fits its inputs"
            )
        one_d = len(input_shape) == 2
        conv = nn.Conv1d if one_d else nn.Conv2d
        self.pool = F.max_pool1d if one_d else F.max_pool2d
        self.conv1 = conv(input_shape[0], 10, kernel_size=5)
        self.conv2 = conv(10, 20, kernel_size=5)
        # keyed dropout: simulated workers and torchrun ranks draw the same masks (adasum.sim)
        self.conv2_drop = KeyedDropout(dropout, channels=True)
        self.fc1_drop = KeyedDropout(dropout)
        with torch.no_grad():
            features = self._features(torch.zeros(1, *input_shape)).shape[1]
        self.fc1 = nn.Linear(features, 50)
        self.fc2 = nn.Linear(50, classes)

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.pool(self.conv1(x), 2))
        x = F.relu(self.pool(self.conv2_drop(self.conv2(x)), 2))
        return x.flatten(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits of a batch of images."""
        x = F.relu(self.fc1(self._features(x)))
        return self.fc2(self.fc1_drop(x))


class MLP(nn.Module):
    """Flatten, then fully connected layers with ReLU.

    >>> MLP((1, 8, 8), 10)(torch.zeros(4, 1, 8, 8)).shape
    torch.Size([4, 10])
    """

    def __init__(self, input_shape: tuple[int, ...], classes: int, hidden: tuple[int, ...] = (128, 128)) -> None:
        super().__init__()
        sizes = [math.prod(input_shape), *hidden]
        layers: list[nn.Module] = [nn.Flatten()]
        for a, b in zip(sizes, sizes[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        layers.append(nn.Linear(sizes[-1], classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits of a batch of inputs."""
        return self.net(x)


class BasicBlock(nn.Module):
    """A residual block of two 3x3 convolutions with group norm."""
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.norm1 = nn.GroupNorm(8, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.norm2 = nn.GroupNorm(8, cout)
        self.shortcut = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.GroupNorm(8, cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output."""
        out = F.relu(self.norm1(self.conv1(x)))
        return F.relu(self.norm2(self.conv2(out)) + self.shortcut(x))


class SmallResNet(nn.Module):
    """A small ResNet (3 stages of basic blocks, 16/32/64 channels, GroupNorm) for images.

    >>> SmallResNet((3, 32, 32), 10)(torch.zeros(2, 3, 32, 32)).shape
    torch.Size([2, 10])
    """

    def __init__(self, input_shape: tuple[int, ...], classes: int, width: int = 16, blocks: int = 1) -> None:
        super().__init__()
        if len(input_shape) != 3:
            raise ValueError(
                f"the ResNet needs [C, H, W] inputs, got {input_shape}; leave --model out to use the task's "
                "default model, or choose one that fits its inputs"
            )
        self.stem = nn.Sequential(
            nn.Conv2d(input_shape[0], width, 3, 1, 1, bias=False), nn.GroupNorm(8, width), nn.ReLU()
        )
        layers, cin = [], width
        for stage in range(3):
            cout = width * 2**stage
            for b in range(blocks):
                layers.append(BasicBlock(cin, cout, 2 if stage > 0 and b == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits of a batch of images."""
        return self.fc(self.layers(self.stem(x)).mean(dim=(2, 3)))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention."""
    # written out (no fused kernels) so that it runs under torch.func.vmap
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attention output, the input's shape."""
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        out = scores.softmax(-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then an MLP."""
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output."""
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TransformerLM(nn.Module):
    """A small causal transformer language model over token ids [B, T] -> logits [B, T, vocab].

    >>> TransformerLM(256, context=64)(torch.zeros(2, 64, dtype=torch.long)).shape
    torch.Size([2, 64, 256])
    """

    def __init__(self, vocab: int, context: int = 64, dim: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.randn(context, dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits for every position."""
        x = self.embed(tokens) + self.position[: tokens.shape[-1]]
        return self.head(self.norm(self.blocks(x)))


class SkipGram(nn.Module):
    """word2vec skip-gram with a full softmax: center word id [B] -> context-word logits [B, vocab].

    >>> SkipGram(2000)(torch.zeros(3, dtype=torch.long)).shape
    torch.Size([3, 2000])
    """

    def __init__(self, vocab: int, dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, words: torch.Tensor) -> torch.Tensor:
        """Context-word logits of each center word."""
        return self.out(self.embed(words))


class SkipGramNegative(nn.Module):
    """word2vec's skip-gram with negative sampling (Mikolov et al. 2013), the candidates scored together.

    Input [B, 2 + k] word ids: the center word, then 1 + k candidates (its context word among k noise words).
    Output [B, 1 + k]: the dot product of the center's input vector with each candidate's output vector, so
    that cross-entropy against the context's place is the softmax over the candidates (InfoNCE). The input
    vectors start uniform in +-0.5 / dim and the output vectors at zero, as in word2vec.

    >>> model = SkipGramNegative(10, dim=4)
    >>> out = model(torch.tensor([[1, 2, 3, 4]]))
    >>> out.shape, out.abs().max().item()
    (torch.Size([1, 3]), 0.0)
    """

    def __init__(self, vocab: int, dim: int = 100) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.context = nn.Embedding(vocab, dim)
        with torch.no_grad():
            self.embed.weight.uniform_(-0.5 / dim, 0.5 / dim)
            self.context.weight.zero_()

    def forward(self, words: torch.Tensor) -> torch.Tensor:
        """The score of each candidate of each example."""
        center = self.embed(words[..., 0])  # [B, dim]
        candidates = self.context(words[..., 1:])  # [B, 1 + k, dim]
        return (candidates * center.unsqueeze(-2)).sum(-1)

    def embeddings(self) -> torch.Tensor:
        """The word vectors: the input embedding table [vocab, dim]."""
        return self.embed.weight


def build_model(name: str, input_shape: tuple[int, ...], classes: int) -> nn.Module:
    """A model by name for inputs of `input_shape` (one example) and `classes` outputs.

    >>> model = build_model("cnn", (1, 28, 28), 10)
    >>> type(model).__name__, sum(p.numel() for p in model.parameters())
    ('HorovodCNN', 21840)
    """
    if name == "cnn":
        return HorovodCNN(input_shape, classes)
    if name == "mlp":
        return MLP(input_shape, classes)
    if name == "resnet":
        return SmallResNet(input_shape, classes)
    if name == "transformer":
        return TransformerLM(classes, context=input_shape[0] if input_shape else 64)
    if name == "skipgram":
        return SkipGram(classes)
    if name == "skipgram-neg":
        return SkipGramNegative(classes)
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
