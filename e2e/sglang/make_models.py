"""Build the two tiny random models for the SGLang CPU e2e tests.

    <sglang venv>/bin/python e2e/sglang/make_models.py TARGET_ROOT

writes TARGET_ROOT/model-llama (LlamaForCausalLM) and TARGET_ROOT/model-qwen3
(Qwen3ForCausalLM).  Both share one locally trained WordLevel tokenizer and a
small chat template.

No model hub: the weights are random (fixed seed) and the tokenizer is trained
here on a made-up corpus.  Output is nonsense made of real-looking words (a
byte-level BPE gives unreadable bytes from random weights), greedy decoding is
deterministic, and `ignore_eos: true` gives exact token counts.  Running it
twice gives byte-identical files.

Why two models: attention DP (`--tp-size 2 --attn-dp-size 2`) needs a model
whose attention heads are split by the attention-TP size.  SGLang's Llama
splits them by the full TP size and fails there ("The expanded size of the
tensor (1) must match the existing size (2)"); its Qwen3 works.  Plain
`--dp-size N` works with either.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

SEED = 1234
VOCAB_SIZE = 1024  # tokenizer words + specials; the model's vocab is the same
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<unk>"]
# Plain words only: the WordLevel tokenizer knows "user", "assistant", "system"
# and ":" from the corpus, so the template never produces <unk>.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }} : {{ message['content'] }} {{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)
SHAPE = {  # shared by both models
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}

_SYLLABLES = (  # noqa: SIM905
    "ka lo mi ra te su no pe di vo an el is or un ba ce fi gu ho ju ke li mo "
    "nu pa qui ro sa ti ul ve wa xi yo ze tra ple sto gri bla cro dre fla"
).split()
_COMMON = (  # noqa: SIM905
    "the a of to and in is it that for on with as was by at from this be or are "
    "router engine request token rank data parallel worker cache queue stream "
    "hello world hi yes no one two three four five six seven eight nine ten "
    "user assistant system please thank you what why how when where count say "
    "tell me story about write short word"
).split()
_PUNCT = [".", "?", "!", ",", ";", ":"]


def corpus(lines: int = 6000) -> list[str]:
    """A deterministic made-up corpus: pseudo-words, common words, digits, punctuation."""
    rng = random.Random(SEED)
    words = sorted({"".join(rng.choices(_SYLLABLES, k=rng.randint(1, 3))) for _ in range(1500)})
    out = []
    for _ in range(lines):
        n = rng.randint(4, 16)
        parts = [rng.choice(_COMMON) if rng.random() < 0.5 else rng.choice(words) for _ in range(n)]
        if rng.random() < 0.3:
            parts.insert(rng.randrange(len(parts)), str(rng.randint(0, 9)))
        parts.insert(rng.randrange(len(parts) + 1), rng.choice(_PUNCT))
        out.append(" ".join([*parts, rng.choice(_PUNCT)]))
    # Every common word, digit and punctuation mark gets its own token for sure.
    out.extend([" ".join(_COMMON + _PUNCT + [str(d) for d in range(10)])] * 50)
    return out


def build_tokenizer(target: Path) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    # Split on whitespace and punctuation; with no decoder, decode() joins the
    # tokens with single spaces, which reads as words.
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=1, special_tokens=SPECIAL_TOKENS, show_progress=False
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=SHAPE["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    if len(fast) != VOCAB_SIZE:  # the model's vocab must cover every id, and no more
        raise SystemExit(f"tokenizer has {len(fast)} tokens, expected {VOCAB_SIZE}")
    unk = fast.convert_tokens_to_ids("<unk>")
    probe = fast("user : hello world , tell me a story . assistant :")["input_ids"]
    if unk in probe:
        raise SystemExit(f"tokenizer maps common words to <unk>: {probe}")
    fast.save_pretrained(str(target))
    return fast


def build_model(kind: str, target: Path, bos: int, eos: int, pad: int) -> None:
    import torch
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(SEED)
    ids = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}
    model: Any
    if kind == "llama":
        config = LlamaConfig(
            vocab_size=VOCAB_SIZE, rms_norm_eps=1e-5, dtype="bfloat16", **SHAPE, **ids
        )
        model = LlamaForCausalLM(config)
    elif kind == "qwen3":
        config = Qwen3Config(
            vocab_size=VOCAB_SIZE, rms_norm_eps=1e-6, dtype="bfloat16", **SHAPE, **ids
        )
        model = Qwen3ForCausalLM(config)
    else:
        raise ValueError(kind)
    model = model.to(torch.bfloat16).eval()
    model.generation_config = GenerationConfig(do_sample=False, **ids)
    model.save_pretrained(str(target), safe_serialization=True)


def main(argv: list[str]) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if len(argv) != 2:
        print(f"usage: {argv[0]} TARGET_ROOT", file=sys.stderr)
        return 2
    root = Path(argv[1])
    for kind in ("llama", "qwen3"):
        target = root / f"model-{kind}"
        target.mkdir(parents=True, exist_ok=True)
        fast = build_tokenizer(target)
        ids = [fast.convert_tokens_to_ids(t) for t in ("<s>", "</s>", "<pad>")]
        build_model(kind, target, *ids)
        size = sum(f.stat().st_size for f in target.iterdir())
        print(f"{kind}: {target} (vocab {len(fast)}, {size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
