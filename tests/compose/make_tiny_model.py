"""Write a tiny random-weight Llama with a locally trained BPE tokenizer, for vLLM's CPU build in tests.

Test machines reach no model hub. Run with the vllm-cpu image's Python (it has torch, transformers and
tokenizers): `python make_tiny_model.py OUT_DIR [SEED]` (another seed draws other weights: another model of the
same architecture and tokenizer), `--kv-heads 2` gives it two KV heads (one per rank at tensor-parallel 2,
where one head would be replicated on both). The shapes are the smallest vLLM's CPU attention accepts
(head_dim 64); the output is noise, but prefix caching and KV events behave as with any model. `--size bench`
writes a larger one of the same tokenizer (8 layers, hidden 512, 8 heads over 4 KV heads: about 32M
parameters), whose prefill takes long enough on a CPU for routing to matter.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CORPUS = (
    "the quick brown fox jumps over the lazy dog while a support assistant of a hardware store answers "
    "briefly and cites the aisle for screws nails hinges paint and never invents stock levels "
) * 50
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


SIZES = {  # name: (layers, hidden, intermediate, attention heads); head_dim 64 in both
    "tiny": (2, 128, 256, 2),
    "bench": (8, 512, 2048, 8),
}


def main(out: Path, seed: int | None = None, kv_heads: int = 1, size: str = "tiny") -> None:
    layers, hidden, intermediate, heads = SIZES[size]
    out.mkdir(parents=True, exist_ok=True)
    if seed is not None:
        torch.manual_seed(seed)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        [CORPUS],
        trainers.BpeTrainer(
            vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(out)
    print(json.dumps({"model": str(out), "vocab": tok.get_vocab_size()}))


if __name__ == "__main__":
    args = sys.argv[1:]
    opts = {"--kv-heads": "1", "--size": "tiny"}
    for flag in opts:
        if flag in args:
            i = args.index(flag)
            opts[flag] = args[i + 1]
            del args[i : i + 2]
    main(Path(args[0]), int(args[1]) if len(args) > 1 else None, int(opts["--kv-heads"]), opts["--size"])
