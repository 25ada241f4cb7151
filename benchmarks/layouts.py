"""Parameter layouts of well-known models as shape lists, so benchmarks need no model package."""

from __future__ import annotations


def resnet50() -> list[tuple[int, ...]]:
    """torchvision's ResNet-50 parameters: 161 tensors, 25,557,032 values."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for planes, blocks in [(64, 3), (128, 4), (256, 6), (512, 3)]:
        for block in range(blocks):
            width, out = planes, planes * 4
            shapes += [(width, inplanes, 1, 1), (width,), (width,)]
            shapes += [(width, width, 3, 3), (width,), (width,)]
            shapes += [(out, width, 1, 1), (out,), (out,)]
            if block == 0:
                shapes += [(out, inplanes, 1, 1), (out,), (out,)]
            inplanes = out
    shapes += [(1000, 2048), (1000,)]
    return shapes


def bert_large() -> list[tuple[int, ...]]:
    """BERT-Large (uncased, with pooler) parameters: 391 tensors, about 335M values."""
    hidden, inter, vocab = 1024, 4096, 30522
    shapes: list[tuple[int, ...]] = [(vocab, hidden), (512, hidden), (2, hidden), (hidden,), (hidden,)]
    for _ in range(24):
        for _qkv in range(3):
            shapes += [(hidden, hidden), (hidden,)]
        shapes += [(hidden, hidden), (hidden,), (hidden,), (hidden,)]
        shapes += [(inter, hidden), (inter,), (hidden, inter), (hidden,), (hidden,), (hidden,)]
    shapes += [(hidden, hidden), (hidden,)]
    return shapes


LAYOUTS = {"resnet50": resnet50, "bert-large": bert_large}


if __name__ == "__main__":
    import math

    for name, fn in LAYOUTS.items():
        shapes = fn()
        print(name, len(shapes), sum(math.prod(s) for s in shapes))
