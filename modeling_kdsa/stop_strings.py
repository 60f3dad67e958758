"""`generate(stop_strings=..., tokenizer=...)` for tokenizers whose vocabulary cannot spell transformers' probe text.

transformers' `StopStringCriteria` learns the text each token adds after earlier text by decoding a fixed probe
("abcdef") followed by the token, then cutting the probe off. A word-level vocabulary (the shipped checkpoints' one
word, one token tokenizer) encodes the probe as `[UNK]`, the decoded text never contains it, and the criterion fails
with a bare `ValueError: substring not found` (transformers/generation/stopping_criteria.py,
`StopStringCriteria.clean_tokenizer_vocab`). The probe cannot be added to such a vocabulary without a new token id
the trained embedding does not have. So the same criterion is built with a probe the vocabulary does spell: one of
its own words. Everything else (matching, byte modes) is transformers' code.
"""

from transformers.generation.stopping_criteria import StopStringCriteria

# StopStringCriteria.clean_tokenizer_vocab's default `static_prefix`.
TRANSFORMERS_PROBE = "abcdef"


def _spells(tokenizer, text: str) -> bool:
    """Whether encoding `text` and turning the tokens back into a string keeps `text` (what the probe needs)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return text in tokenizer.convert_tokens_to_string(tokenizer.convert_ids_to_tokens(ids))


def stop_string_probe(tokenizer) -> str | None:
    """The probe for `StopStringCriteria`: None when transformers' own works, else the first non-special word of the
    vocabulary (by id) that the tokenizer spells. A ValueError when neither exists."""
    if _spells(tokenizer, TRANSFORMERS_PROBE):
        return None
    vocab = tokenizer.get_vocab()
    special = set(tokenizer.all_special_tokens)
    for word in sorted(vocab, key=vocab.get):
        if word not in special and word.strip() and _spells(tokenizer, word):
            return word
    raise ValueError(
        f"stop_strings: the tokenizer ({type(tokenizer).__name__}) spells neither transformers' probe "
        f"{TRANSFORMERS_PROBE!r} nor any word of its own vocabulary, so the text of its tokens cannot be recovered"
    )


class VocabularyProbeStopStringCriteria(StopStringCriteria):
    """transformers' `StopStringCriteria`, recovering token texts with `probe` instead of its fixed "abcdef".

    Skips transformers' module-level embedding cache (keyed by vocabulary and stop strings, not by probe); the
    vocabularies that need this class are word-level and small."""

    def __init__(self, tokenizer, stop_strings: str | list[str], probe: str):
        self.probe = probe
        super().__init__(tokenizer=tokenizer, stop_strings=stop_strings)

    def clean_and_embed_tokens_with_cache(self, token_list, token_indices, tokenizer):
        clean_tokens, clean_indices = self.clean_tokenizer_vocab(
            tokenizer, static_prefix=self.probe, stop_string_matching_mode=self._stop_string_matching_mode
        )
        return self._stop_string_create_embedding_vec(clean_tokens, clean_indices, self._stop_strings_for_matching)
