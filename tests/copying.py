"""A random model made to copy a text: a bigram table of that text planted in its embeddings and head.

Random weights never copy their prompt, so prompt lookup's drafts would all fall. Here each token of
the text gets an embedding orthogonal to the others' (norm sqrt(hidden)), and the head's row for y
is built so that, after token x, y scores ``BASE + log(count(x -> y))`` where x was followed by y in
the text and about 0 elsewhere. The decoder layers keep their random weights (and their cost): their
outputs are small beside such embeddings, so after x the model draws the text's successors of x in
proportion to how often each followed it, and its greedy reply walks the text by the most frequent
successor, as a model returning a file would copy runs of it.
"""

from __future__ import annotations

import math
from collections import Counter

import torch

BASE = 10.0  # a successor's logit over the others': e^-10 of the mass per other token


@torch.no_grad()
def plant_bigrams(model, text: list[int], seed: int = 0) -> None:
    """Make ``model`` (an untied HF causal LM) continue each token of ``text`` as the text does."""
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    if embed.data_ptr() == head.data_ptr():
        raise ValueError("the bigram table needs a head of its own (an untied model)")
    hidden = embed.shape[1]
    tokens = sorted(set(text))
    if len(tokens) > hidden:
        raise ValueError(f"{len(tokens)} distinct tokens do not fit orthogonally in hidden size {hidden}")
    generator = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(hidden, hidden, generator=generator))
    for row, token in enumerate(tokens):
        embed[token] = basis[:, row] * math.sqrt(hidden)
    counts = Counter(zip(text, text[1:]))
    table = torch.zeros(head.shape[0], hidden)
    for (x, y), count in counts.items():
        table[y] += (BASE + math.log(count)) * embed[x] / hidden  # embed[x] . embed[x] = hidden
    head.copy_(table.to(head.dtype))
