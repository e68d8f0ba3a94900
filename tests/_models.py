"""Small LightningModules shared by the distributed tests.

Dimensions are odd on purpose (37, 13, 5 rows...) so that every shard layout is
uneven: some ranks own fewer rows, and at 4 ranks a 3-row tensor leaves a rank empty.
"""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

WIDTH = 37


class Block(nn.Module):
    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width + 1)
        self.fc2 = nn.Linear(2 * width + 1, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, width: int = WIDTH, depth: int = 3, vocab: int = 13) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 5)
        self.scale = nn.Parameter(torch.tensor(1.0))  # a 0-dim parameter

    def reset_parameters(self) -> None:  # its own 0-dim param, for meta-device init
        with torch.no_grad():
            self.scale.fill_(1.0)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # idx: (B, T) -> (B, 5)
        x = self.embed(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean(dim=1)) * self.scale


def dataset(n: int = 160, seq: int = 6, vocab: int = 13, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (n, seq), generator=g)
    y = torch.randint(0, 5, (n,), generator=g)
    return TensorDataset(x, y)


class ParityModule(LightningModule):
    """Built in configure_model (so stage 2/3 shard it); AdamW with weight decay."""

    def __init__(self, freeze_first_block: bool = False, lr: float = 1e-2, meta_init: bool = False) -> None:
        super().__init__()
        self.freeze_first_block = freeze_first_block
        self.lr = lr
        self.meta_init = meta_init
        self.net: Net | None = None

    def configure_model(self) -> None:
        if self.net is not None:
            return
        torch.manual_seed(1234)  # same init on every rank and under every strategy
        self.net = Net()  # on the meta device at stages 2/3 (ZeroConfig.meta_init), real otherwise
        self.built_on_meta = all(p.is_meta for p in self.net.parameters())
        if self.freeze_first_block:
            self.net.blocks[0].requires_grad_(False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.net(idx)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=0.1)

    def train_dataloader(self):
        return DataLoader(dataset(), batch_size=4, shuffle=False)

    def val_dataloader(self):
        return DataLoader(dataset(n=24, seed=1), batch_size=4)

    def test_dataloader(self):
        return DataLoader(dataset(n=24, seed=2), batch_size=4)

    def predict_dataloader(self):
        return DataLoader(dataset(n=16, seed=3), batch_size=4)


def trainer_kwargs(devices: int, **overrides):
    kw = dict(
        accelerator="cpu",
        devices=devices,
        max_steps=10,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        deterministic=True,
    )
    kw.update(overrides)
    return kw


class MetaInitModule(ParityModule):
    """Builds the net on the meta device; the strategy materializes each rank's shard."""

    def configure_model(self) -> None:
        if self.net is not None:
            return
        with torch.device("meta"):
            self.net = Net()


class CompiledModule(ParityModule):
    def configure_model(self) -> None:
        if self.net is not None:
            return
        super().configure_model()
        # aot_eager: exercises dynamo + autograd tracing through the strategy's hooks
        # without spending the suite's time in inductor's C++ compile.
        self.net.blocks = nn.ModuleList(torch.compile(b, backend="aot_eager") for b in self.net.blocks)


class ManualTwoOptimizers(ParityModule):
    """Manual optimization with two optimizers (GAN-style alternating updates)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_body, opt_head = self.optimizers()
        loss = nn.functional.cross_entropy(self(x), y)
        opt_body.zero_grad()
        opt_head.zero_grad()
        self.manual_backward(loss)
        opt_body.step()
        opt_head.step()
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        head = list(self.net.head.parameters())
        head_ids = {id(p) for p in head}
        body = [p for p in self.parameters() if id(p) not in head_ids]
        return torch.optim.AdamW(body, lr=1e-2), torch.optim.SGD(head, lr=5e-2, momentum=0.9)


def tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=64, vocab_size=61, max_position_embeddings=32, tie_word_embeddings=False,
    )


class LoraLlama(LightningModule):
    """A tiny transformers Llama with peft LoRA adapters on q/v projections."""

    def __init__(self, meta_init: bool = False) -> None:
        super().__init__()
        self.meta_init = meta_init
        self.model = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaForCausalLM

        torch.manual_seed(99)
        base = LlamaForCausalLM(tiny_llama_config())
        self.model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(5)
        return DataLoader(TensorDataset(torch.randint(0, 61, (64, 12), generator=g)), batch_size=4)


class LoraBlock(nn.Module):
    """A frozen MLP block with trainable low-rank adapters (LoRA by hand: no peft, so the
    reference can be rebuilt exactly). Rows 64 and 32 divide by 2 and 4 shards."""

    def __init__(self, width: int = 32, rank: int = 4) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.lora_a = nn.Linear(width, rank, bias=False)
        self.lora_b = nn.Linear(rank, 2 * width, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.02)  # nonzero: the adapters matter from step 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.down(torch.nn.functional.gelu(self.up(h) + self.lora_b(self.lora_a(h))))


class FrozenBaseModule(LightningModule):
    """Frozen base weights (embedding, blocks' up/down/norm) + trainable adapters and head:
    the LoRA / RLHF shape that ``quantize_frozen_weights`` is for."""

    def __init__(self, meta_init: bool = False, lr: float = 1e-2, seed: int = 7) -> None:
        super().__init__()
        self.meta_init, self.lr, self.seed = meta_init, lr, seed
        self.net: nn.Module | None = None

    def configure_model(self) -> None:
        if self.net is not None:
            return
        torch.manual_seed(self.seed)
        with torch.device("meta") if self.meta_init else torch.device("cpu"):
            self.net = nn.ModuleDict(
                {"embed": nn.Embedding(16, 32), "blocks": nn.ModuleList(LoraBlock() for _ in range(2)),
                 "head": nn.Linear(32, 6)}  # 6 rows: even shards on 2 ranks
            )
        for name, p in self.net.named_parameters():
            p.requires_grad_("lora_" in name or name.startswith("head"))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.net["embed"](idx)
        for b in self.net["blocks"]:
            x = b(x)
        return self.net["head"](x.mean(dim=1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)

    def train_dataloader(self):
        return DataLoader(dataset(vocab=16), batch_size=4, shuffle=False)
