"""Synthetic long-context tasks of the tiny KDSA checkpoint: vocabulary, tokenizer, and example generators.

One module serves both sides so that training data (`scripts/train_tiny.py`, training seed) and the held-out lm-eval
data (`python -m modeling_kdsa.eval.make_data`, a different seed) come from the same generators.

Sequences are whitespace-separated words from a fixed vocabulary (one word = one token):

- **key-value** (`pairs k5 v12 k90 v3 ... ? k90 v3 + k5 v13 ...`): `P` pairs with distinct keys (128 possible) and
  random values (64 possible), then queries. `? k` asks for the value stored with `k` (associative recall); `+ k`
  asks for the *successor* of that value, `v(j+1 mod 64)` — the compositional task: an in-context lookup composed
  with a fixed function the model must hold in its weights. With 64 pairs the context holds twice as many pairs as
  the KDA state has key dimensions (32 per head), so exact recall needs the DSA layers.
- **copy** (`copy k7 k100 ... | k7 k100 ...`): `L` distinct keys, then the same keys again after `|`.
"""

import random

PAD, BOS, EOS, UNK = "[PAD]", "[BOS]", "[EOS]", "[UNK]"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]
PAIRS, COPY, COPY_SEP, RECALL_Q, COMPOSE_Q = "pairs", "copy", "|", "?", "+"
NUM_KEYS, NUM_VALUES = 128, 64
KEYS = [f"k{i}" for i in range(NUM_KEYS)]
VALUES = [f"v{i}" for i in range(NUM_VALUES)]
VOCAB = SPECIAL_TOKENS + [PAIRS, COPY, COPY_SEP, RECALL_Q, COMPOSE_Q] + KEYS + VALUES

# Held-out evaluation shape: 64 pairs (130 tokens up to the query; the farthest needle sits 129 tokens back), copies
# of 64 keys (the source starts 65 tokens back). Training grows to these sizes.
EVAL_NUM_PAIRS = 64
EVAL_COPY_LENGTH = 64


def build_tokenizer():
    """Word-level tokenizer over `VOCAB`, wrapped for transformers (`save_pretrained` → `AutoTokenizer` works offline).

    No BOS is added: every sequence starts with its task word, so the tokenizer output is exactly the words."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(VOCAB)}, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Every word decodes with its leading space, as a continuation (what `pipeline("text-generation")` appends to the
    # prompt, what the lm-eval targets " {{target}}" carry). With one token per word the first word of a text cannot
    # also decode unspaced, so `decode` of a whole sequence starts with a space; encoding ignores it (round trip).
    backend.decoder = decoders.Replace(Regex("^"), " ")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK, model_max_length=1024
    )
    # Left padding, saved into tokenizer_config.json: a decoder-only batch must end in its real tokens for generate()
    # to continue each row. (The constructor's `padding_side=` is neither applied nor saved with tokenizer_object.)
    tokenizer.padding_side = tokenizer.init_kwargs["padding_side"] = "left"
    return tokenizer


def successor(value: int) -> int:
    return (value + 1) % NUM_VALUES


def key_value_example(rng: random.Random, num_pairs: int, num_queries: int, compose_fraction: float = 0.5):
    """A multi-query key-value sequence. Returns `(words, is_answer)`: `is_answer[i]` marks the answer words (the
    training loss is taken only on them). Queries ask distinct keys in random order."""
    keys = rng.sample(range(NUM_KEYS), num_pairs)
    values = [rng.randrange(NUM_VALUES) for _ in range(num_pairs)]
    words = [PAIRS]
    for key, value in zip(keys, values, strict=True):
        words += [KEYS[key], VALUES[value]]
    is_answer = [False] * len(words)
    for pair in rng.sample(range(num_pairs), num_queries):
        if rng.random() < compose_fraction:
            words += [COMPOSE_Q, KEYS[keys[pair]], VALUES[successor(values[pair])]]
        else:
            words += [RECALL_Q, KEYS[keys[pair]], VALUES[values[pair]]]
        is_answer += [False, False, True]
    return words, is_answer


def copy_example(rng: random.Random, length: int):
    """`copy s_1 .. s_L | s_1 .. s_L` with distinct keys; the answer words are the second copy."""
    source = [KEYS[i] for i in rng.sample(range(NUM_KEYS), length)]
    words = [COPY, *source, COPY_SEP, *source]
    return words, [False] * (length + 2) + [True] * length


def key_value_doc(rng: random.Random, compose: bool, min_distance: int, max_distance: int) -> dict:
    """A held-out doc: `EVAL_NUM_PAIRS` pairs, then one query whose key sits `distance` tokens after the needle's key
    (`min_distance <= distance <= max_distance`, odd: `2·(pairs after the needle) + 1`). `context` ends with the
    queried key, `target` is the answer word."""
    num_pairs = EVAL_NUM_PAIRS
    keys = rng.sample(range(NUM_KEYS), num_pairs)
    values = [rng.randrange(NUM_VALUES) for _ in range(num_pairs)]
    # The query key sits at position 2P + 2, the key of pair i at 2i + 1: distance = 2 (P - i) + 1.
    candidates = [i for i in range(num_pairs) if min_distance <= 2 * (num_pairs - i) + 1 <= max_distance]
    needle = rng.choice(candidates)
    words = [PAIRS]
    for key, value in zip(keys, values, strict=True):
        words += [KEYS[key], VALUES[value]]
    words += [COMPOSE_Q if compose else RECALL_Q, KEYS[keys[needle]]]
    answer = successor(values[needle]) if compose else values[needle]
    return {"context": " ".join(words), "target": VALUES[answer], "distance": 2 * (num_pairs - needle) + 1}


def copy_doc(rng: random.Random) -> dict:
    words, _ = copy_example(rng, EVAL_COPY_LENGTH)
    split = EVAL_COPY_LENGTH + 2
    return {"context": " ".join(words[:split]), "target": " ".join(words[split:]), "distance": EVAL_COPY_LENGTH + 1}


def context_signature(words: list[str]) -> str:
    """What makes two examples 'the same' for the held-out check: the context up to the first query (the pairs, or
    the copy source with its separator)."""
    for i, word in enumerate(words):
        if word in (RECALL_Q, COMPOSE_Q):
            return " ".join(words[:i])
        if word == COPY_SEP:
            return " ".join(words[: i + 1])
    return " ".join(words)
