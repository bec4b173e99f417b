"""A local word-level tokenizer for inference-perf (no model hub).

It splits text as the simulated engines do (``\\w+|[^\\w\\s]``: one token per word
or punctuation mark), so inference-perf's token counts agree with the
engines'. Run with inference-perf's environment: ``python make_tokenizer.py OUT``.
"""

import json
import random
import sys
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

# the engines' answers are made of these (dprouter.sim.tokens.WORDS)
SIM_WORDS = (
    "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel",
    "india", "juliet", "kilo", "lima", "mike", "november", "oscar", "papa",
    "quebec", "romeo", "sierra", "tango", "uniform", "victor", "whiskey", "xray",
    "yankee", "zulu", "amber", "basil", "cedar", "dune", "ember", "fern",
)  # fmt: skip


def made_up_text(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "zo", "pe", "da", "fu"]
    words = {"".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(2000)}
    vocab = sorted(words) + list(SIM_WORDS)
    lines = [
        " ".join(rng.choice(vocab) for _ in range(20)) + " " + rng.choice(".,;:!?")
        for _ in range(500)
    ]
    return [*lines, " ".join(vocab) + " . , ; : ! ?"]


def main(out: Path) -> None:
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Split(Regex(r"\w+|[^\w\s]"), behavior="isolated"),
        ]
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # tokens joined by spaces
    tok.train_from_iterator(made_up_text(), trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "[UNK]",
                "model_max_length": 32768,
                "clean_up_tokenization_spaces": False,
            }
        )
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
