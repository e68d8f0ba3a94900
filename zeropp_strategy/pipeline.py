"""Layer: commands. ``zeropp pipeline``: SFT -> reward model -> PPO, or SFT -> GRPO (``--rl grpo``), each
stage reading the previous one's output.

    zeropp pipeline --output-dir runs/pipeline                      # the embedded default
    zeropp pipeline --rl grpo --output-dir runs/pipeline-grpo       # GRPO on the task's check
    zeropp pipeline --config recipes/pipeline.yaml --output-dir runs/opt --strategy zeropp_stage_2

The recipe has a ``trainer`` block shared by the stages and one block per stage (``sft``,
``reward``, ``ppo``, ``grpo``), each with ``model`` (the module's ``__init__`` arguments)
and ``trainer`` (overrides of the shared block); ``--rl`` picks which of ``ppo`` (after
``reward``) and ``grpo`` runs after ``sft``. Without ``--config`` the embedded default of
``--rl`` runs (``pipeline.yaml`` or ``pipeline_grpo.yaml``): a tiny Llama from scratch, a
byte-level tokenizer, the addition task; no downloads.

Output, in ``--output-dir``:

    sft/      the SFT policy (Hugging Face folder)
    reward/   the reward model (backbone folder + value_head.safetensors + reward_stats.json; ppo only)
    actor/    the PPO or GRPO actor, the final model (Hugging Face folder)
    summary.json

``summary.json`` holds ``rl``, ``sft_task_accuracy_greedy`` (greedy decoding of the SFT folder on
the held-out prompts), ``rm_pairwise_accuracy`` (held-out pairs; ppo), ``<rl>_reward_before``
/ ``<rl>_reward_after`` and ``<rl>_task_accuracy_sampled_before`` / ``<rl>_task_accuracy_sampled_after``
(the same held-out prompts and sampling draws, before and after the RL stage), the
exported actor's greedy accuracy, the bytes each stage sent, the wall time of each stage
and the final actor's folder.

Lightning starts the other processes by re-running this command, so all of this runs on
every rank; rank 0 writes the summary.
"""

from __future__ import annotations

import copy
import json
import time
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import yaml

from zeropp_strategy.errors import MissingPathError, UsageError, check_arguments
from zeropp_strategy.parsers import pipeline_parser

__all__ = ["DEFAULT_RECIPE", "DEFAULT_RECIPES", "RL_STAGES", "load_recipe", "main", "run_pipeline"]

DEFAULT_RECIPE = "pipeline.yaml"  # shipped in zeropp_strategy/recipes/
DEFAULT_RECIPES = {"ppo": DEFAULT_RECIPE, "grpo": "pipeline_grpo.yaml"}  # the embedded default of each --rl
RL_STAGES = {"ppo": ("sft", "reward", "ppo"), "grpo": ("sft", "grpo")}  # the stages each --rl runs
STAGES = ("sft", "reward", "ppo", "grpo")


def load_recipe(path: str | None, rl: str = "ppo") -> dict[str, Any]:
    """The recipe at ``path``, or the embedded default of ``rl``; checked for unknown blocks
    and keys (``UsageError``) before anything starts."""
    if rl not in RL_STAGES:
        raise UsageError(f"zeropp pipeline --rl {rl!r} is unknown", f"use one of {', '.join(RL_STAGES)}")
    if path is None:
        name = DEFAULT_RECIPES[rl]
        text = resources.files("zeropp_strategy.recipes").joinpath(name).read_text("utf-8")
        where = f"<embedded {name}>"
    else:
        if not Path(path).is_file():
            raise MissingPathError(f"zeropp pipeline --config {path!r}: no such file",
                                   "pass a recipe path, or omit --config for the embedded default")
        text, where = Path(path).read_text("utf-8"), path
    try:
        recipe = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        raise UsageError(f"{where} is not valid YAML: {err}", "correct the line it names") from None
    if not isinstance(recipe, dict):
        raise UsageError(f"{where} is not a mapping", "give it the blocks trainer, sft, reward and ppo (or grpo)")
    unknown = sorted(set(recipe) - {"trainer", *STAGES})
    if unknown:
        raise UsageError(f"{where}: unknown block(s) {unknown}", "use only trainer, sft, reward, ppo and grpo")
    for stage in STAGES:
        extra = sorted(set(_mapping(recipe.get(stage), f"{where}: {stage}")) - {"model", "trainer"})
        if extra:
            raise UsageError(f"{where}: {stage} has unknown key(s) {extra}", f"put module arguments under "
                             f"{stage}.model and Trainer arguments under {stage}.trainer")
    _check_keys(recipe, where)
    return recipe


def _check_keys(recipe: dict[str, Any], where: str) -> None:
    """Each ``model`` block against its module's ``__init__``, each ``trainer`` block against ``Trainer``'s."""
    from lightning.pytorch import Trainer

    from zeropp_strategy.recipes.grpo import GRPOModule
    from zeropp_strategy.recipes.ppo import PPOModule
    from zeropp_strategy.recipes.reward import RewardModule
    from zeropp_strategy.recipes.sft import SFTModule

    modules = {"sft": SFTModule, "reward": RewardModule, "ppo": PPOModule, "grpo": GRPOModule}
    check_arguments(Trainer, _mapping(recipe.get("trainer"), f"{where}: trainer"), f"{where}: trainer")
    for stage in STAGES:
        block = recipe.get(stage) or {}
        for key, func in (("model", modules[stage]), ("trainer", Trainer)):
            name = f"{where}: {stage}.{key}"
            check_arguments(func, _mapping(block.get(key), name), name)


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise UsageError(f"{where} is {value!r}, not a mapping", "write it as `key: value` lines indented under it")
    return value


def _trainer(recipe: dict[str, Any], stage: str, overrides: dict[str, Any], root: Path) -> Any:
    from lightning.pytorch import Trainer

    kwargs = {"logger": False, "enable_checkpointing": False, "enable_model_summary": False,
              "enable_progress_bar": False, "num_sanity_val_steps": 0}
    kwargs.update(recipe.get("trainer") or {})
    kwargs.update((recipe.get(stage) or {}).get("trainer") or {})
    kwargs.update({k: v for k, v in overrides.items() if v is not None})
    kwargs.setdefault("default_root_dir", str(root / stage))
    return Trainer(**kwargs)


def _ledger_bytes(trainer: Any) -> int | None:
    ledger = getattr(trainer.strategy, "comm_ledger", None)
    return ledger.totals().total_bytes if ledger is not None else None


def _metric(trainer: Any, name: str) -> float:
    value = trainer.callback_metrics.get(name)
    if value is None:
        raise RuntimeError(f"zeropp pipeline: the run logged no {name!r}; the stage's validation did not run. Fix: "
                           "give the stage validation data (limit_val_batches > 0).")
    return float(value)


@torch.no_grad()
def task_accuracy(folder: str | Path, tokenizer: Any, records: list[dict[str, str]], *, greedy: bool = True,
                  max_new_tokens: int = 8, batch_size: int = 64, seed: int = 0) -> tuple[float, str]:
    """Task accuracy of the model in ``folder`` (one process), greedy or sampled at
    temperature 1, and one example completion: this also checks that the folder loads
    with ``from_pretrained`` and generates."""
    from transformers import AutoModelForCausalLM

    from zeropp_strategy.rlhf.data import PromptCollator
    from zeropp_strategy.rlhf.generation import decode_responses, sample
    from zeropp_strategy.rlhf.task import AdditionTask

    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    collate = PromptCollator(tokenizer)
    right, example = 0, ""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    generator = torch.Generator().manual_seed(seed)
    for start in range(0, len(records), batch_size):
        batch = collate(records[start : start + batch_size])
        # top_k=1 is greedy decoding
        out = sample(model, batch["input_ids"], batch["attention_mask"], max_new_tokens=max_new_tokens, eos_id=eos,
                     pad_id=pad, top_k=1 if greedy else 0, generator=generator)
        for prompt, text in zip(batch["prompts"], decode_responses(tokenizer, out, eos)):
            right += AdditionTask.score(prompt, text) == 1.0
            example = example or f"{prompt}{text}"
    return right / max(len(records), 1), example


def run_pipeline(recipe: dict[str, Any], output_dir: str | Path, *, strategy: str | None = None,
                 devices: int | None = None, rl: str = "ppo") -> dict[str, Any]:
    """Run the stages of ``rl`` (``RL_STAGES``); returns the summary (written to
    ``output_dir/summary.json``)."""
    from lightning.pytorch import seed_everything

    import zeropp_strategy  # noqa: F401 - registers the strategy names
    from zeropp_strategy.recipes.reward import RewardModule
    from zeropp_strategy.recipes.sft import SFTModule
    from zeropp_strategy.rlhf.data import load_records

    if rl not in RL_STAGES:
        raise UsageError(f"zeropp pipeline --rl {rl!r} is unknown", f"use one of {', '.join(RL_STAGES)}")
    root = Path(output_dir)
    overrides = {"strategy": strategy, "devices": devices}
    block = {s: copy.deepcopy((recipe.get(s) or {}).get("model") or {}) for s in STAGES}
    summary: dict[str, Any] = {"rl": rl, "bytes_sent_rank0": {}, "seconds": {}}

    # 1. SFT
    start = time.perf_counter()
    seed_everything(int(block["sft"].get("seed", 0)), workers=True, verbose=False)
    sft = SFTModule(**{**block["sft"], "export_dir": str(root / "sft")})
    trainer = _trainer(recipe, "sft", overrides, root)
    trainer.fit(sft)
    summary["bytes_sent_rank0"]["sft"] = _ledger_bytes(trainer)
    summary["seconds"]["sft"] = round(time.perf_counter() - start, 1)
    rank0 = trainer.is_global_zero
    if rank0 and block["sft"].get("data", "embedded:addition") == "embedded:addition":
        accuracy, example = task_accuracy(root / "sft", sft.tokenizer, load_records("embedded:addition", kind="eval"))
        summary["sft_task_accuracy_greedy"], summary["sft_example"] = round(accuracy, 4), example

    if rl == "ppo":
        # 2. reward model, from the SFT model's body
        start = time.perf_counter()
        seed_everything(int(block["reward"].get("seed", 0)), workers=True, verbose=False)
        reward = RewardModule(**{"model": str(root / "sft"), **block["reward"], "export_dir": str(root / "reward")})
        trainer = _trainer(recipe, "reward", overrides, root)
        trainer.fit(reward)
        trainer.validate(reward, verbose=False)
        summary["rm_pairwise_accuracy"] = round(_metric(trainer, "val_accuracy"), 4)
        summary["bytes_sent_rank0"]["reward"] = _ledger_bytes(trainer)
        summary["seconds"]["reward"] = round(time.perf_counter() - start, 1)

    # 3. RL: the actor (and a reference) from SFT; PPO's critic and reward model from step 2
    start = time.perf_counter()
    seed_everything(int(block[rl].get("seed", 0)), workers=True, verbose=False)
    actor = _rl_module(rl, block[rl], root)
    trainer = _trainer(recipe, rl, overrides, root)
    trainer.validate(actor, verbose=False)
    before = {k: _metric(trainer, f"val_{k}") for k in ("reward", "task_accuracy")}
    trainer.fit(actor)
    trainer.validate(actor, verbose=False)
    after = {k: _metric(trainer, f"val_{k}") for k in ("reward", "task_accuracy")}
    summary.update({
        f"{rl}_reward_before": round(before["reward"], 4), f"{rl}_reward_after": round(after["reward"], 4),
        f"{rl}_task_accuracy_sampled_before": round(before["task_accuracy"], 4),
        f"{rl}_task_accuracy_sampled_after": round(after["task_accuracy"], 4),
    })
    summary["bytes_sent_rank0"][rl] = _ledger_bytes(trainer)
    summary["seconds"][rl] = round(time.perf_counter() - start, 1)
    summary["final_actor"] = str(root / "actor")
    summary["strategy"] = str(trainer.strategy.__class__.__name__)
    summary["world_size"] = trainer.world_size
    if rank0:
        accuracy, example = task_accuracy(root / "actor", actor.tokenizer, load_records("embedded:addition",
                                                                                         kind="eval"))
        summary["actor_greedy_task_accuracy"], summary["actor_example"] = round(accuracy, 4), example
        (root / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _rl_module(rl: str, block: dict[str, Any], root: Path) -> Any:
    """The RL stage's module: PPO reads the SFT and reward folders, GRPO the SFT folder
    (its reward is the task's check unless the recipe names reward functions)."""
    if rl == "ppo":
        from zeropp_strategy.recipes.ppo import PPOModule

        return PPOModule(**{"actor": str(root / "sft"), "reward_model": str(root / "reward"), **block,
                            "export_dir": str(root / "actor")})
    from zeropp_strategy.recipes.grpo import GRPOModule

    return GRPOModule(**{"actor": str(root / "sft"), **block, "export_dir": str(root / "actor")})


def main(argv: list[str] | None = None, prog: str = "zeropp pipeline") -> int:
    parser = pipeline_parser(prog)
    args = parser.parse_args(argv)
    recipe = load_recipe(args.config, rl=args.rl)
    summary = run_pipeline(recipe, args.output_dir, strategy=args.strategy, devices=args.devices, rl=args.rl)
    if "sft_task_accuracy_greedy" in summary or "actor_example" in summary:  # rank 0
        print(json.dumps(summary, indent=2))
    return 0
