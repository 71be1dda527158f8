"""Option groups that several commands share, each field and its ``--help`` line written once.

A command's config inherits the groups it needs (``class RewardTrainConfig(TrainRunControl,
ModelLoading, LoRAOptions, ...)``; sft and dpo through :class:`PolicyTrainOptions`), so its fields
stay flat: ``cfg.lora_r`` in Python, ``--lora-r`` on the command line, ``lora_r:`` in the
saved YAML. A field whose meaning differs per command (``model``, ``data``, ``output_dir``,
``lr``, ``epochs``, ``batch_size``) is declared in the command's own class; a command that needs a
shared field with another default or a more specific help line redeclares it there (the
redeclaration wins, in the dataclass and in :func:`ppolm.config.field_docs`).

``--help`` lists a command's own fields first, then the inherited ones (see
:func:`ppolm.config.ordered_fields`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class DeviceOptions:
    """Where models run, and in which precision."""

    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """bf16: fp32 master weights with bf16 autocast; fp32: everything in float32."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device: auto picks cuda when available."""


@dataclass
class ModelLoading(DeviceOptions):
    """Device and precision, and which model files may run code when loaded."""

    trust_remote_code: bool = False
    """Allow model code shipped inside a model directory to run (off: only transformers' own code runs)."""
    allow_pickle: bool = False
    """Accept pickle-based weights (.bin/.pt), which can run arbitrary code when loaded. Off: safetensors only."""


@dataclass
class LoRAOptions:
    """Low-rank adapters (peft) instead of full fine-tuning."""

    lora_r: int = 0
    """LoRA rank (peft); 0 = full fine-tuning."""
    lora_alpha: float = 32.0
    """LoRA scaling alpha."""
    lora_target: str = "all-linear"
    """LoRA target modules (peft syntax: 'all-linear' or comma-separated module names)."""


@dataclass
class PolicyLoRAOptions(LoRAOptions):
    """LoRA for a command whose output is a policy (a causal LM that `ppolm ppo` can start from)."""

    merge_lora: bool = True
    """With LoRA, save the merged full model (loadable by `ppolm ppo --model`); off: save only the adapter."""


@dataclass
class TextEncoding:
    """How a prompt and its response become tokens."""

    max_length: int = 512
    """Longest prompt+response in tokens; longer responses are cut."""
    chat_template: bool = True
    """Apply the tokenizer's chat template to text prompts (messages always use it), as `ppolm ppo` does."""


@dataclass
class OptimiserOptions:
    """AdamW settings besides the learning rate, whose default each command sets."""

    lr_schedule: Literal["constant", "linear"] = "linear"
    """Constant, or linear decay to 0 over the run (--resume then needs the same --epochs; a constant schedule lets --resume add epochs)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping (global norm)."""


@dataclass
class HeldOutSplit:
    """The held-out part of --data when no --eval-data is given."""

    eval_fraction: float = 0.1
    """Fraction of --data held out when --eval-data is not given (0 = no eval)."""


@dataclass
class RunControl:
    """Seeding, --resume/--overwrite, the non-finite guard and the torchrun timeout: the run options
    of every training command, ppo included (:mod:`ppolm.scaffold`)."""

    seed: int = 0
    """Random seed (data order and shuffles, sampling, LoRA init)."""
    keep_last: int = 2
    """Keep only the newest K checkpoints."""
    resume: bool = False
    """Continue from the newest valid checkpoint in --output-dir (same options as the run it continues)."""
    overwrite: bool = False
    """Allow writing into an --output-dir that already holds files (they are replaced once the data and model have loaded)."""
    max_skipped_updates: int = 3
    """Abort after this many consecutive updates skipped for a non-finite (NaN/inf) reward, loss or gradient."""
    quiet: bool = False
    """No progress bar; one log line per epoch (ppo: per step) instead."""
    dist_timeout: float = 600.0
    """Under torchrun: seconds a process waits for the others in a collective before the job fails instead of hanging."""


@dataclass
class TrainRunControl(RunControl):
    """The run options of sft, reward and dpo (:class:`ppolm.trainloop.TrainLoop`): the shared ones
    and their checkpoint interval, and FSDP for the one trained model."""

    save_every: int = 50
    """Write a resumable checkpoint every N optimiser steps (and at the end, and on Ctrl-C/SIGTERM)."""
    fsdp: bool = False
    """Under torchrun: shard the trained model's weights, gradients and Adam states over the processes (FSDP2); off: DDP. more: docs/distributed.md"""


@dataclass
class PolicyTrainOptions(TrainRunControl, ModelLoading, PolicyLoRAOptions, TextEncoding, OptimiserOptions,
                         HeldOutSplit):
    """Every shared option of a command that trains a policy (sft, dpo). The bases' order sets the
    order of these options in ``--help`` (the last base's first)."""
