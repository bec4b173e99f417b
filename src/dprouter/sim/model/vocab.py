"""A real tokenizer for the simulated engines, built here: no model hub.

``write_tokenizer(directory)`` trains a small byte-level BPE (the kind Llama-3 and Qwen
ship) on a made-up corpus and writes the files an engine loads: ``tokenizer.json`` and
``tokenizer_config.json`` with a chat template. The simulator, the router and tests
then tokenise with the same real files, as a real engine and a router would. Training
is deterministic: the same files every time (about 0.3 s).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from dprouter.sim.model.tokens import WORDS

SEED = 4321
VOCAB_SIZE = 4096
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>", "<unk>")
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
    """Pseudo-words, common words, the simulator's output words, digits, punctuation."""
    rng = random.Random(SEED)
    made = sorted({"".join(rng.choices(_SYLLABLES, k=rng.randint(1, 4))) for _ in range(2500)})
    pools = (_COMMON, made, WORDS)
    out = []
    for _ in range(lines):
        parts = [rng.choice(rng.choice(pools)) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.2:
            parts.insert(rng.randrange(len(parts)), str(rng.randint(0, 9999)))
        out.append(" ".join(parts).capitalize() + rng.choice(".?!,;:"))
    return out


def write_tokenizer(directory: Path) -> Path:
    """Write the tokenizer files into ``directory`` (created); returns it."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "model_max_length": 32768,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


def ensure_tokenizer(directory: Path) -> bool:
    """Use the files in ``directory``; write the simulator's own there when it has no
    ``tokenizer.json``. True when they were written now."""
    if (directory / "tokenizer.json").is_file():
        return False
    write_tokenizer(directory)
    return True
