"""Build a tiny random Llama and a byte-level BPE tokenizer for the vLLM CPU e2e tests.

    <vllm venv>/bin/python e2e/make_model.py TARGET_DIR

No model hub: the weights are random (fixed seed) and the tokenizer is trained on a
made-up corpus generated here.  Output text is nonsense, but greedy decoding is
deterministic and `ignore_eos: true` gives exact token counts.  Running it twice gives
byte-identical files.

Shape constraint: vLLM's CPU attention needs head_dim >= 32 (32, 64, 80, ...).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

SEED = 1234
VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<unk>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_SYLLABLES = (  # noqa: SIM905
    "ka lo mi ra te su no pe di vo an el is or un ba ce fi gu ho ju ke li mo "
    "nu pa qui ro sa ti ul ve wa xi yo ze tra ple sto gri bla cro dre fla"
).split()
_COMMON = (  # noqa: SIM905
    "the a of to and in is it that for on with as was by at from this be or are "
    "router engine request token rank data parallel worker cache queue stream "
    "hello world yes no one two three four five six seven eight nine ten "
    "user assistant system please thank you what why how when where"
).split()


def corpus(lines: int = 6000) -> list[str]:
    """A deterministic made-up corpus: pseudo-words, common words, digits, punctuation."""
    rng = random.Random(SEED)
    words = sorted({"".join(rng.choices(_SYLLABLES, k=rng.randint(1, 4))) for _ in range(2500)})
    out = []
    for _ in range(lines):
        n = rng.randint(4, 16)
        parts = [rng.choice(_COMMON) if rng.random() < 0.5 else rng.choice(words) for _ in range(n)]
        if rng.random() < 0.2:
            parts.insert(rng.randrange(len(parts)), str(rng.randint(0, 9999)))
        sentence = " ".join(parts).capitalize() + rng.choice([".", "?", "!", ",", ";", ":"])
        out.append(sentence)
    return out


def build_tokenizer(target: Path) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    if len(fast) != VOCAB_SIZE:  # the model's vocab must cover every id it can emit
        raise SystemExit(f"tokenizer has {len(fast)} tokens, expected {VOCAB_SIZE}")
    fast.save_pretrained(str(target))
    return fast


def build_model(target: Path, bos: int, eos: int, pad: int) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        torch_dtype="bfloat16",  # what vLLM on CPU runs; float32 weights get cast
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, do_sample=False
    )
    model.save_pretrained(str(target), safe_serialization=True)


def main(argv: list[str]) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if len(argv) != 2:
        print(f"usage: {argv[0]} TARGET_DIR", file=sys.stderr)
        return 2
    target = Path(argv[1])
    target.mkdir(parents=True, exist_ok=True)
    fast = build_tokenizer(target)
    ids = [fast.convert_tokens_to_ids(t) for t in ("<s>", "</s>", "<pad>")]
    build_model(target, *ids)
    n = len(fast)
    print(f"tiny model written to {target} (tokenizer {n} tokens, model vocab {VOCAB_SIZE})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
