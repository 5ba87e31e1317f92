"""The byte-level BPE tokenizers of the tiny checkpoints and the embedded model, with DeepSeek-V4's special tokens.

vLLM 0.32 forces ``tokenizer_mode="deepseek_v4"`` for ``DeepseekV4ForCausalLM``: it loads the directory with
transformers' ``TokenizersBackend.from_pretrained`` (so ``tokenizer.json`` + ``tokenizer_config.json`` are what
it needs) and renders chat prompts with DeepSeek-V4's own encoder, which writes the literal strings
``<｜begin▁of▁sentence｜>``, ``<｜User｜>``, ``<｜Assistant｜>``, ``<think>``, ``</think>`` and
``<｜end▁of▁sentence｜>``. They are added here as special tokens so that a chat prompt becomes single
special-token ids, as with the real tokenizer. ids: BOS 0, EOS 1 (the released configs' ``bos/eos_token_id``).

A tiny checkpoint's merges are learnt from a fixed text generated in this module, so its tokenizer depends only
on ``vocab_size``; the embedded model's are learnt from its training problems (``embedded/data.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
CHAT_TOKENS = ("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>")
SPECIAL_TOKENS = (BOS, EOS, PAD, *CHAT_TOKENS)  # ids 0, 1, 2, ...

_NAMES = ("Ada", "Ben", "Cleo", "Dan", "Eve", "Finn", "Gus", "Hana", "Ivy", "Jon", "Kim", "Lea")
_ITEMS = ("apples", "books", "coins", "pencils", "marbles", "cookies", "stamps", "shells", "cards", "eggs")
_PROSE = (
    "The quick brown fox jumps over the lazy dog. A tiny model still has every part of the real one: "
    "hyper-connections with four residual streams, sliding-window attention, compressed attention with a "
    "lightning indexer, heavily compressed attention, hash-routed and score-routed mixture of experts, and a "
    "multi-token prediction layer that drafts the token after next. Question: what is the answer? Answer: "
    "let us think step by step. def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i * i)\n"
)


def builtin_text() -> str:
    """The fixed training text: prose, code and GSM8K-style arithmetic lines (about 200 kB)."""
    lines = [_PROSE] * 3
    k = 0
    for a in range(2, 60):
        for b in range(1, 40, 3):
            name, item = _NAMES[k % len(_NAMES)], _ITEMS[(k // 3) % len(_ITEMS)]
            k += 1
            lines.append(
                f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now? "
                f"{a} + {b} = {a + b}. #### {a + b}\n"
            )
            if a > b:
                lines.append(f"{name} gives away {b} of {a} {item}: {a} - {b} = {a - b} left. #### {a - b}\n")
            lines.append(f"{a} times {b} is {a * b}.\n")
    return "".join(lines)


def train_bpe(texts, vocab_size: int, *, split_digits: bool = False):
    """A byte-level BPE ``tokenizers.Tokenizer`` learnt from ``texts`` (an iterable of strings), the special
    tokens first at ids 0, 1, 2, ...; BOS is prepended to every encoded prompt, as DeepSeek's tokenizer does.

    ``split_digits``: every digit is its own token (with an optional leading space), so numbers are spelled
    digit by digit, which is what lets the embedded tiny model learn its arithmetic.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r" ?[0-9]"), behavior="isolated"), byte_level])
        if split_digits
        else byte_level
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
    )
    return tok


def train_tokenizer(vocab_size: int):
    """The tiny checkpoints' tokenizer: :func:`train_bpe` on :func:`builtin_text`, exactly ``vocab_size`` tokens."""
    n_min = 256 + len(SPECIAL_TOKENS)
    if vocab_size < n_min:
        raise ValueError(
            f"vocab_size {vocab_size} is too small for a byte-level BPE: need >= {n_min} "
            f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens)"
        )
    tok = train_bpe(builtin_text().splitlines(keepends=True), vocab_size)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(
            f"vocab_size {vocab_size} is too large for the tiny tokenizer: its built-in text yields "
            f"only {tok.get_vocab_size()} BPE tokens (choose vocab_size <= {tok.get_vocab_size()})"
        )
    return tok


def save_tokenizer(tok, out_dir: str | Path, model_max_length: int = 4096) -> list[Path]:
    """``tokenizer.json`` + ``tokenizer_config.json`` into ``out_dir``: what transformers' TokenizersBackend (used
    by vLLM's ``deepseek_v4`` tokenizer mode) and AutoTokenizer load from a model directory. Returns the files."""
    out_dir = Path(out_dir)
    for i, s in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(s) != i:
            raise ValueError(f"special token {s!r} has id {tok.token_to_id(s)}, expected {i}")
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "legacy": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    return [out_dir / "tokenizer.json", out_dir / "tokenizer_config.json"]
