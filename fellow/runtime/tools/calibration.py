"""Calibration text and the hidden states that cross each stage boundary, for fitting codecs."""

from __future__ import annotations

import torch


def default_texts() -> list[str]:
    """The stdlib's help topics: real English prose about code, on every machine, offline."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def calibration_sequences(tokenizer, texts: list[str] | None, seq_len: int, sequences: int) -> list[list[int]]:
    """One token sequence per text (cut to ``seq_len``), at most ``sequences`` of them, in order.

    Callers hold out the last quarter, so a test can rebuild exactly the held-out set.
    """
    texts = default_texts() if texts is None else texts
    seqs = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:seq_len]
        if ids:
            seqs.append(ids)
        if len(seqs) == sequences:
            break
    if len(seqs) < 2:
        raise ValueError("calibration needs at least two non-empty texts (one to fit, one held out)")
    return seqs


@torch.no_grad()
def boundary_activations(model, seqs: list[list[int]], cuts: list[int]) -> dict[int, torch.Tensor]:
    """For each cut layer L, the input of layer L for every token: {L: [tokens, hidden]}.

    hidden_states[L] is what leaves layer L - 1, i.e. what a stage ending at L sends.
    """
    acts: dict[int, list[torch.Tensor]] = {cut: [] for cut in cuts}
    for ids in seqs:
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        for cut in cuts:
            acts[cut].append(out.hidden_states[cut][0].float())
    return {cut: torch.cat(parts) for cut, parts in acts.items()}
