"""A deterministic word-level tokenizer built from the training text, with hash buckets.

The real workloads use pretrained sub-word tokenizers (DistilBERT's WordPiece, Llama's
and Mistral's BPE), which cannot be downloaded here.  sakura-bench therefore tokenizes
real text files with this tokenizer instead: lower-cased words and punctuation marks; the
most frequent training words (ties broken alphabetically) get their own ids, every other
word one of ``hash_buckets`` ids chosen by a CRC-32 of the word.  It is deterministic
(the same files give the same ids on every machine and in every process) and fills the
model's vocabulary, so sequence lengths and the model's compute are those of the real
workload.  Accuracy figures are therefore not comparable with published ones; speed is.
"""

from __future__ import annotations

import re
import zlib
from collections import Counter
from collections.abc import Iterable, Sequence

import torch

__all__ = ["CLS", "PAD", "SEP", "SPECIALS", "UNK", "WordTokenizer", "words"]

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]")
PAD, UNK, CLS, SEP = range(len(SPECIALS))
_WORD = re.compile(r"\w+|[^\w\s]")


def words(text: str) -> list[str]:
    """Lower-cased words and punctuation marks of ``text``."""
    return _WORD.findall(text.lower())


class WordTokenizer:
    """Word ids for the most frequent training words, hash buckets for the rest."""

    def __init__(self, vocab: Sequence[str], vocab_size: int, hash_buckets: int) -> None:
        if vocab_size < len(SPECIALS) + hash_buckets + len(vocab):
            raise ValueError(
                f"vocab_size={vocab_size} is too small for {len(SPECIALS)} special tokens, "
                f"{len(vocab)} words and {hash_buckets} hash buckets"
            )
        if hash_buckets < 1:
            raise ValueError(f"hash_buckets must be >= 1, got {hash_buckets}")
        self.vocab_size = vocab_size
        self.hash_buckets = hash_buckets
        self.words = list(vocab)
        self.ids = {w: len(SPECIALS) + i for i, w in enumerate(self.words)}
        self._bucket0 = len(SPECIALS) + len(self.words)

    @classmethod
    def build(
        cls, texts: Iterable[str], vocab_size: int, hash_buckets: int | None = None
    ) -> WordTokenizer:
        """A tokenizer over ``vocab_size`` ids from the words of ``texts``."""
        if hash_buckets is None:
            hash_buckets = max(1, min(4096, (vocab_size - len(SPECIALS)) // 8))
        room = vocab_size - len(SPECIALS) - hash_buckets
        if room < 0:
            raise ValueError(f"vocab_size={vocab_size} is too small for {hash_buckets} buckets")
        counts = Counter(w for text in texts for w in words(text))
        ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
        return cls([w for w, _ in ranked[:room]], vocab_size, hash_buckets)

    def token_id(self, word: str) -> int:
        found = self.ids.get(word)
        if found is not None:
            return found
        return self._bucket0 + zlib.crc32(word.encode("utf-8")) % self.hash_buckets

    def encode_words(self, text: str) -> list[int]:
        return [self.token_id(w) for w in words(text)]

    def encode_pairs(
        self, first: Sequence[str], second: Sequence[str] | None, max_length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[CLS] a [SEP] (b [SEP])`` per sample, truncated (longest part first) and
        padded to ``max_length``: ``(input_ids, attention_mask)``, both N x max_length."""
        if max_length < 4:
            raise ValueError(f"max_length must be >= 4, got {max_length}")
        n = len(first)
        input_ids = torch.full((n, max_length), PAD, dtype=torch.long)
        mask = torch.zeros((n, max_length), dtype=torch.long)
        for i in range(n):
            a = self.encode_words(first[i])
            b = self.encode_words(second[i]) if second is not None else None
            budget = max_length - (3 if b is not None else 2)
            if b is None:
                a = a[:budget]
                ids = [CLS, *a, SEP]
            else:
                while len(a) + len(b) > budget:
                    if len(a) >= len(b):
                        a.pop()
                    else:
                        b.pop()
                ids = [CLS, *a, SEP, *b, SEP]
            input_ids[i, : len(ids)] = torch.tensor(ids)
            mask[i, : len(ids)] = 1
        return input_ids, mask
