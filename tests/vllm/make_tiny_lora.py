"""Write a random LoRA adapter (PEFT's on-disk format) for the tiny Llama of tests/compose/make_tiny_model.py.

Run with the vLLM venv's Python (torch and safetensors): `python make_tiny_lora.py MODEL_DIR OUT_DIR [SEED]`.
Rank 8 on every layer's q_proj and v_proj, lora_B non-zero so the adapter really changes the output.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

RANK = 8


def main(model: Path, out: Path, seed: int) -> None:
    config = json.loads((model / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    head_dim = hidden // config["num_attention_heads"]
    kv_out = config["num_key_value_heads"] * head_dim
    torch.manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for proj, out_dim in (("q_proj", hidden), ("v_proj", kv_out)):
            prefix = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, hidden) * 0.1
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_dim, RANK) * 0.1
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model),
        "r": RANK,
        "lora_alpha": 2 * RANK,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": ["q_proj", "v_proj"],
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter))
    print(json.dumps({"adapter": str(out), "tensors": len(tensors)}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 0)
