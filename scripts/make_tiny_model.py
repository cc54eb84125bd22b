"""Build the tiny Llama that the real-engine tier serves: made here, seeded, nothing downloaded.

Real engines need a real model directory (config, weights, tokenizer), and this machine may
fetch none. So ``scripts/real_engine_setup.sh`` runs this once, in the engine virtualenv
(torch, transformers, tokenizers), and caches the result (default ``~/.cache/kvroute/tiny-llama``):

- a byte-level BPE tokenizer (vocabulary ~1,000) trained with ``tokenizers`` on a few thousand
  sentences drawn from a fixed word list, special tokens ``<unk> <s> </s> <pad>``, ``<s>``
  added in front of every text, and a small chat template;
- a ``LlamaForCausalLM`` with random weights from a fixed seed, in bfloat16: 2 layers, hidden
  size 256, 4 attention heads (head dim 64: vLLM's CPU attention needs at least 32), 2 KV heads.

Its outputs are gibberish, but deterministic: greedy decoding gives the same tokens for the
same prompt on every worker, which is what routing tests compare. It is a few MB: never commit it.

    python scripts/make_tiny_model.py --out ~/.cache/kvroute/tiny-llama
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

_WORD_TEXT = (
    "the a one every some this that river cache token worker router model request prefix "
    "system user answer question document page block tree leaf node memory queue batch "
    "prompt reply story code table list fast slow small large new old first last next "
    "is are was were has have makes takes keeps sends reads writes finds moves serves "
    "and or but so because while when where which who with from into over under after "
    "red green blue black white north south east west morning evening night day week "
    "cat dog bird fish tree stone water fire wind light sound city road house garden"
)
WORDS = _WORD_TEXT.split()

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}</s>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _sentences(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 16))]
        number = str(rng.randint(0, 9999))
        out.append(" ".join(words).capitalize() + f" {number}.")
    return out


def build_tokenizer(out: Path, vocab_size: int, seed: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_sentences(5000, seed), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def build_model(out: Path, vocab_size: int, seed: int, bos: int, eos: int, pad: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=4096,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--vocab-size", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(args.out, args.vocab_size, args.seed)
    ids = {name: tok.convert_tokens_to_ids(name) for name in ("<s>", "</s>", "<pad>")}
    build_model(args.out, len(tok), args.seed, ids["<s>"], ids["</s>"], ids["<pad>"])
    print(f"tiny model in {args.out}: vocabulary {len(tok)}")


if __name__ == "__main__":
    main()
