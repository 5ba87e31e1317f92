"""A small byte-level BPE tokenizer for the tiny checkpoints, with DeepSeek-V4's special tokens.

vLLM 0.32 forces ``tokenizer_mode="deepseek_v4"`` for ``DeepseekV4ForCausalLM``: it loads the directory with
transformers' ``TokenizersBackend.from_pretrained`` (so ``tokenizer.json`` + ``tokenizer_config.json`` are what
it needs) and renders chat prompts with DeepSeek-V4's own encoder, which writes the literal strings
``<｜begin▁of▁sentence｜>``, ``<｜User｜>``, ``<｜Assistant｜>``, ``<think>``, ``</think>`` and
``<｜end▁of▁sentence｜>``. They are added here as special tokens so that a chat prompt becomes single
special-token ids, as with the real tokenizer. ids: BOS 0, EOS 1 (the released configs' ``bos/eos_token_id``).

The BPE merges are learnt from a fixed text generated in this module, so the tokenizer depends only on
``vocab_size``.
"""

from __future__ import annotations

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
            lines.append(f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now? "
                         f"{a} + {b} = {a + b}. #### {a + b}\n")
            if a > b:
                lines.append(f"{name} gives away {b} of {a} {item}: {a} - {b} = {a - b} left. #### {a - b}\n")
            lines.append(f"{a} times {b} is {a * b}.\n")
    return "".join(lines)


def train_tokenizer(vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` with exactly ``vocab_size`` tokens (specials first)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    n_min = 256 + len(SPECIAL_TOKENS)
    if vocab_size < n_min:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level BPE: need >= {n_min} "
                         f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(builtin_text().splitlines(keepends=True), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is too large for the tiny tokenizer: its built-in text yields "
                         f"only {tok.get_vocab_size()} BPE tokens (choose vocab_size <= {tok.get_vocab_size()})")
    # BOS is prepended to every encoded prompt, as DeepSeek's own tokenizer does.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)])
    return tok


def save_tokenizer(out_dir: str | Path, vocab_size: int, model_max_length: int = 4096, tokenizer=None) -> list[Path]:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` (+ special tokens map) into ``out_dir``.

    ``tokenizer``: the result of :func:`train_tokenizer` for ``vocab_size`` when the caller already has it."""
    from transformers import PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    tok = tokenizer if tokenizer is not None else train_tokenizer(vocab_size)
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        model_max_length=model_max_length, clean_up_tokenization_spaces=False,
    )
    files = fast.save_pretrained(str(out_dir))
    return [Path(f) for f in files if Path(f).is_file()]
