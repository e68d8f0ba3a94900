"""The Llama shapes the benchmarks train (infinity.py, gpu/parts.py): one table, one builder.

    from llama import SIZES, llama_config, llama_params
    cfg = llama_config("1.3B", seq=2048)      # a transformers LlamaConfig, untied embeddings

Heads of 128 (at least one), as many KV heads as heads, vocabulary 32000 (the ``tiny``
shapes, for dry runs on a CPU: 256). ``llama3-8B`` is Llama-3-8B's shape: 8 KV heads,
vocabulary 128256.
"""

from __future__ import annotations

SIZES = {  # name -> (hidden, layers, MLP width)
    "tiny": (64, 2, 128),
    "tiny2": (96, 2, 192),
    "0.1B": (768, 4, 2048),
    "1B": (2048, 16, 5632),
    "1.3B": (2048, 22, 5632),
    "2.1B": (2560, 24, 6912),
    "2.7B": (2560, 32, 6912),
    "4.3B": (3072, 36, 8192),
    "6.7B": (4096, 32, 11008),
    "13B": (5120, 40, 13824),
    "llama3-8B": (4096, 32, 14336),
}
# shapes whose KV heads and vocabulary are not the defaults: name -> (KV heads, vocabulary)
PUBLISHED = {"llama3-8B": (8, 128256)}


def vocab_size(size: str) -> int:
    if size in PUBLISHED:
        return PUBLISHED[size][1]
    return 256 if size.startswith("tiny") else 32000


def kv_heads(size: str) -> int:
    hidden = SIZES[size][0]
    return PUBLISHED[size][0] if size in PUBLISHED else max(1, hidden // 128)


def llama_params(size: str) -> int:
    """Parameters of ``llama_config(size)``'s model: blocks, two untied embeddings, the final norm."""
    hidden, layers, mlp = SIZES[size]
    kv = kv_heads(size) * hidden // max(1, hidden // 128)  # the width of K and V
    attention = 2 * hidden * hidden + 2 * hidden * kv
    return layers * (attention + 3 * hidden * mlp + 2 * hidden) + 2 * vocab_size(size) * hidden + hidden


def llama_config(size: str, seq: int):
    from transformers import LlamaConfig

    hidden, layers, mlp = SIZES[size]
    heads = max(1, hidden // 128)
    return LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=mlp, num_attention_heads=heads,
                       num_key_value_heads=kv_heads(size), vocab_size=vocab_size(size), max_position_embeddings=seq,
                       tie_word_embeddings=False)
