"""Rewards and evaluation read each completion from its own generated tokens, never from the padded matrix.

The bug this guards against: with vocabularies where id 0 (or the pad id) is an ordinary token, as in Qwen2.5,
Llama-3 and GPT-2, decoding `completion_ids * completion_mask` turned the padding after every shorter completion
into text (`...!!!!`), and a strict format check then failed every row but the longest one.
"""

from __future__ import annotations

import torch

from gpo.generation import completion_tokens, decode_completions, generate
from gpo.types import Sampling

EOS, PAD = 7, 8  # pad != eos, and id 0 is an ordinary token
VOCAB = {0: "!", 1: "<answer>", 2: "4", 3: "</answer>", 4: "so", 5: " ", EOS: "<eos>", PAD: "<pad>"}
SPECIAL = {EOS, PAD}


class BangTokenizer:
    """Id 0 decodes to `!`, as in Qwen's BPE vocabulary; eos and pad are special tokens that decoding skips."""

    eos_token_id, pad_token_id = EOS, PAD

    def decode(self, ids, skip_special_tokens=False):
        return "".join(VOCAB[i] for i in ids if not (skip_special_tokens and i in SPECIAL))


class FixedBackend:
    def __init__(self, rows):
        self.rows = rows

    def generate(self, prompts, n, sampling, seed):
        return [list(r) for r in self.rows]

    def generator_logprobs(self):
        return None


def test_each_completion_decodes_from_its_own_tokens_only():
    rows = [
        [1, 2, 3, EOS],  # short answer, then EOS
        [4, 5, 1, 2, 3, EOS],  # longer
        [0, 1, 2, 3],  # a real `!` first, truncated (no EOS)
    ]
    batch = generate(FixedBackend(rows), [[2]], n=3, sampling=Sampling(max_new_tokens=6), seed=0,
                     eos_token_id=EOS, pad_token_id=PAD)
    assert batch.completion_ids.shape == (3, 6)  # padded to the longest row
    assert completion_tokens(batch) == rows
    texts = decode_completions(BangTokenizer(), completion_tokens(batch))
    assert texts == ["<answer>4</answer>", "so <answer>4</answer>", "!<answer>4</answer>"]
    # What the old decoding of the mask-multiplied matrix produced: the padding became `!` after short rows.
    old = [BangTokenizer().decode(r, skip_special_tokens=True)
           for r in (batch.completion_ids * batch.completion_mask).tolist()]
    assert old[0] == "<answer>4</answer>!!" and old[0] != texts[0]


def test_completion_tokens_stop_at_the_first_eos_of_the_mask():
    ids = torch.tensor([[1, EOS, PAD, PAD], [2, 2, 2, 2]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])

    class Rows:
        completion_ids, completion_mask = ids, mask
        lengths = mask.sum(dim=1)

    assert completion_tokens(Rows()) == [[1, EOS], [2, 2, 2, 2]]
