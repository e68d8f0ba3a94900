"""Layer: recipes (rlhf). Sampling responses for PPO, and ZeRO-3's gather-once rule for generation.

Under stage 3 each transformer block's parameters live as shards and are all-gathered
before the block runs and freed after it. ``generate`` runs the model once per new token,
so a naive loop all-gathers every block ``max_new_tokens`` times (DeepSpeed-Chat's
"hybrid engine" exists for this reason). ``gathered(model)`` keeps each block of
``model`` unsharded from its first use until the context exits: one all-gather per block
per ``generate`` call. It costs one whole copy of the model's gathered blocks in memory
for the duration, which is what generation at full speed needs anyway.

``sample`` is a small sampling loop with a KV cache. It uses ``ops.sampling_logits``, the
function PPO recomputes log-probs with, so sampling and scoring cannot disagree on
temperature or top-k; positions count only real tokens (left padding), as every later
forward does; the random draws come from an explicit generator, so a run is reproducible
and the same under every strategy.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from zeropp_strategy.engine.fsdp_groups import fsdp_modules
from zeropp_strategy.fsdp_private import keep_unsharded_after_forward
from zeropp_strategy.rlhf.models import positions
from zeropp_strategy.rlhf.ops import sampling_logits

__all__ = ["cache_name", "decode_responses", "gathered", "sample"]


@contextmanager
def gathered(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Within the context, the FSDP blocks inside ``model`` stay unsharded after their
    forward; on exit they are resharded and their reshard-after-forward setting restored.
    A model with no FSDP block (stages 1/2, DDP, one process) is left as it is."""
    with ExitStack() as stack:
        for block in fsdp_modules(model) if enabled else []:
            stack.enter_context(keep_unsharded_after_forward(block))
        yield


@torch.no_grad()
def sample(
    model: Callable[..., Any],
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    stop_when_done: bool = True,
) -> Tensor:
    """Sample up to ``max_new_tokens`` after left-padded prompts; returns the new tokens
    ``[batch, n]`` (``n <= max_new_tokens``), ``pad_id`` after each row's EOS.

    ``model`` is a Hugging Face causal LM (or anything called the same way:
    ``input_ids, attention_mask, position_ids, use_cache`` and the KV cache in, ``.logits``
    and the KV cache out; the cache's name, ``cache`` or ``past_key_values``, is the one
    the installed transformers uses: see ``cache_name``).

    ``stop_when_done`` stops as soon as every row has its EOS. Pass False when each
    forward is a collective (stage 3 outside ``gathered``): ranks would stop after
    different numbers of steps and wait for each other forever.
    """
    mask = attention_mask.long()
    pos = positions(mask)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=pos, use_cache=True)
    name = cache_name(model, out)
    cache, logits = getattr(out, name), out.logits[:, -1]
    next_pos = pos[:, -1] + 1
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    tokens: list[Tensor] = []
    for step in range(max_new_tokens):
        probs = torch.softmax(sampling_logits(logits, temperature=temperature, top_k=top_k), dim=-1)
        token = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        token = torch.where(done, torch.full_like(token, pad_id), token)
        tokens.append(token)
        real = (~done).long()  # this step's token counts (the EOS included)
        done = done | (token == eos_id)
        if (stop_when_done and bool(done.all())) or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, real.unsqueeze(1)], dim=1)
        out = model(input_ids=token.unsqueeze(1), attention_mask=mask, position_ids=next_pos.unsqueeze(1),
                    use_cache=True, **{name: cache})
        cache, logits = getattr(out, name), out.logits[:, -1]
        next_pos = next_pos + 1
    return torch.stack(tokens, dim=1)


def cache_name(model: Callable[..., Any], out: Any) -> str:
    """The name a causal LM takes and returns its KV cache by: ``cache`` from transformers
    5.x on, ``past_key_values`` in 4.x. transformers 5.x still accepts the old name but
    warns (a ``FutureWarning``) on every forward, so the name is read from the model, never
    guessed by passing one (a model's ``**kwargs`` would swallow a name it does not know).

    From the signature of ``model.forward`` (through peft's wrapper, whose forward takes
    ``*args, **kwargs``, to the base model's); for a callable whose signature names neither
    (a wrapper taking ``**kwargs``), from the fields of ``out``, its first output.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = inspect.signature(getattr(base, "forward", base)).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    fields = getattr(out, "__dataclass_fields__", None) or vars(out)
    return "cache" if "cache" in fields else "past_key_values"


def decode_responses(tokenizer: Any, response: Tensor, eos_id: int) -> list[str]:
    """The texts of sampled responses (``sample``'s output): each row up to its first EOS,
    without the EOS and the padding after it."""
    from zeropp_strategy.rlhf.ops import response_mask

    out = []
    for row, keep in zip(response.tolist(), response_mask(response, eos_id).tolist()):
        out.append(tokenizer.decode([t for t, k in zip(row, keep) if k and t != eos_id], skip_special_tokens=True))
    return out
