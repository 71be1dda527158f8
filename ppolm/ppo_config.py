"""The configuration of a PPO run (``ppolm ppo``): nested dataclasses, one docstring per field.

Defaults are chosen so that the embedded 135M model learns on a laptop CPU within 40 steps of
8 rollouts; the comments give the source of each default.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Literal

from ppolm.config_sections import LoRAOptions, ModelLoading, RunControl
from ppolm.distributed import launched_world_size
from ppolm.errors import FLOAT32_MAX, PPOLMError

GROUP_ESTIMATORS = ("grpo", "dr-grpo", "rloo", "reinforce++-baseline")
"""Estimators whose baseline is the other responses to the same prompt: they need --samples-per-prompt >= 2."""
GROUP_SIZE = 4
"""--samples-per-prompt of the group estimators when it is not given (a batch of 8: 2 prompts x 4)."""
KL_IN_LOSS_ESTIMATORS = ("grpo", "dr-grpo", "rloo", "remax")
"""Score-based estimators whose KL penalty goes into the loss (k3, as GRPO) under --kl-in auto."""
KL_PENALTY_AT_TARGET = 0.48
"""The default ceiling on beta (--kl-coef-max) is this over --kl-target: the KL penalty of a policy at
its target, beta * target, is then at most 0.48 score units, about the widest spread of scores (0.5)
that --score-scale auto leaves as it is (0.04 at the default target of 12 nats)."""


@dataclass
class ModelConfig(ModelLoading, LoRAOptions):
    """The policy and its critic; the model-loading and LoRA options are shared with sft/reward/dpo."""

    model: str = "smollm2-135m-instruct"
    """Policy to train: a Hugging Face model directory, a .gguf file, or an embedded model name. The frozen reference is a copy of it."""
    ref_model: str | None = None
    """Frozen reference of the KL penalty; default: the reference of the run whose policy/ --model is (the original SFT model, as InstructGPT), else --model."""
    critic_model: str | None = None
    """Start the separate critic from this value model (a run's critic/, e.g. last round's), its top --critic-layers trained."""
    critic: Literal["separate", "shared"] = "separate"
    """Value model: a separate model (OpenRLHF, TRL), or a value head on the policy's own trunk (OpenAI's original; saves memory)."""
    critic_init: Literal["reward", "policy"] = "reward"
    """Start a separate critic from the (first) reward model, or from the policy (also when only reward functions are given). why: docs/defaults.md#critic-init"""
    critic_zero_head: bool = False
    """Start the separate critic's value head at zero: its first values are 0, so the first advantages are the whitened returns. why: docs/defaults.md#critic-zero-head"""
    critic_layers: int = 4
    """Train only the separate critic's top N layers and head, sharing the frozen rest; 0 = a full copy (as TRL). why: docs/defaults.md#critic-layers"""
    share_trunk: bool = True
    """Run once the frozen layers the reference shares with a reward model or a LoRA policy (results unchanged). more: docs/defaults.md#share-trunk"""
    share_prefix: bool = True
    """Run the prompts' common beginning once per forward pass, through the KV cache (results unchanged up to rounding). more: docs/defaults.md#share-prefix"""
    lora_r: int = 0
    """LoRA rank for the policy (peft); 0 = full fine-tuning. With LoRA the reference is the policy with its adapter disabled (no second copy)."""
    fsdp: bool = False
    """Under torchrun: shard the policy's and critic's training state over the processes (FSDP2); full fine-tuning only. more: docs/defaults.md#fsdp"""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """bf16: bf16 compute, fp32 master weights and PPO maths; fp32: float32 throughout; auto: bf16 where native, else fp32. more: docs/defaults.md#precision"""


@dataclass
class RewardConfig:
    reward_model: list[str] = field(default_factory=list)
    """Reward model directory (from `ppolm reward`, or any sequence-classification model with one label). Repeat for an ensemble."""
    reward_fn: list[str] = field(default_factory=list)
    """Reward function 'file.py:fn' or 'module:fn', f(prompts, completions, **kwargs) -> list[float] as TRL's GRPO; this or --reward-model is required."""
    reward_fn_weights: list[float] = field(default_factory=list)
    """One weight per --reward-fn, in order (default 1 each)."""
    reward_model_weight: float = 1.0
    """Weight of the (ensembled) reward-model score in the total score."""
    reward_ensemble: Literal["mean", "min", "mean-minus-std"] = "mean"
    """How several reward models combine: mean, min (pessimistic), or mean minus std (penalise disagreement)."""
    missing_eos_penalty: float | None = None
    """Score given to responses that never emit EOS, replacing the reward (OpenAI detail 4; e.g. -1). None = off."""
    length_penalty: float = 0.0
    """Subtracted from the score per response token beyond --length-budget (counters length drift)."""
    length_budget: int = 0
    """Response tokens free of --length-penalty: score -= length_penalty * max(0, length - budget). A budget keeps the penalty from favouring empty or clipped answers."""
    whiten_rewards: bool = False
    """Whiten the per-token rewards over the batch (scale only, mean kept; OpenAI detail 11). Meant for batches of 8 or more."""
    score_scale: Literal["auto", "std", "none"] = "auto"
    """Score divisor before the KL penalty: auto brings the within-batch spread into [0.05, 0.5]; std: that spread; none: 1. why: docs/defaults.md#score-scale"""
    score_center: Literal["auto", "running", "none"] = "auto"
    """Subtracted from each score: auto = the running mean's part beyond two running stds from 0; running = all of it; none = 0. why: docs/defaults.md#score-center"""
    reward_url: list[str] = field(default_factory=list)
    """Reward service URL (OpenRLHF's /get_reward protocol, e.g. `ppolm serve-rm`); repeatable.
    Comma-separated URLs: replicas sharing a batch (docs/rewards.md)."""
    reward_url_weights: list[float] = field(default_factory=list)
    """One weight per --reward-url, in order (default 1 each)."""
    reward_url_batch_size: int = 64
    """Most prompt+response texts per request to a reward service; larger batches are split into several requests."""
    reward_url_timeout: float = 60.0
    """Seconds a reward service may take to answer one request before the request counts as failed."""
    reward_url_retries: int = 2
    """Further tries of a failed request (unreachable, timed out, HTTP 408/429/5xx), after 0.5 s, 1 s, 2 s, ..."""
    reward_url_label_column: str = "label"
    """Prompts-file column sent as the request's 'labels' (null where a row has none)."""
    reward_judge: list[str] = field(default_factory=list)
    """LLM judge 'openai:MODEL@BASE_URL[,option=value...]' rating each answer 1-10, mapped to [0, 1]; repeatable.
    API key, template, options: docs/rewards.md."""
    reward_judge_weights: list[float] = field(default_factory=list)
    """One weight per --reward-judge, in order (default 1 each)."""
    judge: str | None = None
    """Judge of answers for --rm-check-* and --rm-refresh-*: 'file.py:fn', 'module:fn' or 'openai:MODEL@URL'. more: docs/overoptimisation.md"""
    judge_temperature: float = 0.0
    """Bradley-Terry noise of a scoring judge's labels, P(a) = sigmoid((s_a - s_b) / T); 0 = the higher score wins."""
    rm_check_every: int = 0
    """With --judge: check the reward model against the judge on the policy's answers every N steps; 0 = at each held-out evaluation."""
    rm_check_pairs: int = 64
    """Answer pairs per on-policy check (rm/onpolicy_accuracy and its SE); 0 = no check."""
    rm_refresh_every: int = 0
    """With --judge: every K steps, train the reward model further on judge-labelled pairs of the policy's answers; 0 = never."""
    rm_refresh_pairs: int = 64
    """Pairs of the policy's answers to training prompts that the judge labels per refresh (up to N judge calls)."""
    rm_refresh_steps: int = 32
    """Reward-model optimiser steps per refresh, each batch half fresh and half replayed pairs; then it is re-normalised."""
    rm_refresh_start_share: float = 0.5
    """Share of a refresh's pairs setting the policy's answer against the starting policy's; 0 = both current.
    why: docs/overoptimisation.md#results"""


@dataclass
class GenerationConfig:
    response_length: int = 48
    """Maximum number of new tokens per response."""
    temperature: float = 1.0
    """Sampling temperature; log-probs are recomputed from logits divided by it (OpenAI detail 5). why: docs/defaults.md#temperature"""
    top_p: float = 1.0
    """Nucleus sampling threshold (1.0 = off). Anything but 1.0 makes sampling differ from the policy PPO optimises."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    ignore_eos: bool = False
    """Always generate exactly --response-length tokens, ignoring EOS (as TRL's PPO trainer by default; for comparable benchmarks)."""
    max_prompt_length: int = 512
    """Prompts longer than this many tokens are an error."""


@dataclass
class AlgoConfig:
    steps: int = 40
    """Number of PPO iterations (rollout batch + update)."""
    batch_size: int = 8
    """Rollouts (prompts) per PPO iteration."""
    minibatches: int = 1
    """Minibatches per PPO epoch; must divide --batch-size (1, as TRL: the first epoch then reuses the rollout's forward pass)."""
    grad_accum: int = 1
    """Gradient-accumulation steps per minibatch; must divide the minibatch size."""
    ppo_epochs: int = 2
    """PPO epochs over each rollout batch, freshly shuffled each epoch (OpenAI detail 14). why: docs/defaults.md#ppo-epochs"""
    clip_eps: float = 0.2
    """Clip range of the probability ratio in the policy loss."""
    vf_clip: float = 0.2
    """Clip range of the value prediction around its old value (OpenAI detail 13)."""
    vf_coef: float = 0.1
    """Weight of the value loss when the critic shares the policy's trunk."""
    gamma: float = 1.0
    """GAE discount."""
    lam: float = 0.95
    """GAE lambda of the policy's advantages."""
    critic_lam: float | None = None
    """GAE lambda of the critic's value targets; none = --lam; 1 = the plain return still to come (decoupled GAE). more: docs/defaults.md#critic-lam"""
    actor_lr: float = 2e-5
    """Policy learning rate (full fine-tuning of a ~100M model at 8 rollouts per batch; LoRA wants ~10x more)."""
    critic_lr: float = 1e-4
    """Critic learning rate (separate from the actor's; the seeds suggest ~5x the actor's)."""
    adam_eps: float = 1e-5
    """Adam epsilon (1e-5, the TF default of OpenAI's code; detail 16)."""
    critic_adam_eps: float | None = 1e-8
    """Adam epsilon of the separate critic's optimiser (none = --adam-eps): its gradients on [0, 1] rewards are tiny. why: docs/defaults.md#critic-adam-eps"""
    actor_adam_beta1: float = 0.9
    """Adam's beta1 of the policy's optimiser (beta2 stays 0.999; the critic keeps 0.9). why: docs/defaults.md#actor-adam-beta1"""
    actor_lr_warmup: int = 0
    """Updates over which the policy's lr rises linearly to --actor-lr (0 = off; the critic's lr does not warm up). why: docs/defaults.md#actor-lr-warmup"""
    actor_lr_warmup_from: float = 0.0
    """Share F of --actor-lr the warmup starts from: update i of the first N takes F + (1 - F)(i + 1) / N of it."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping (global norm) per model."""
    lr_schedule: Literal["constant", "linear"] = "constant"
    """Learning-rate schedule: constant, or linear decay to 0 over --steps (OpenAI detail 15; --resume then cannot extend the run)."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (0 = off)."""
    whiten_advantages: bool = True
    """Whiten advantages per batch over real tokens (OpenAI detail 12)."""
    tied_scores: Literal["zero", "keep", "skip"] = "zero"
    """A batch whose scores tie at or below the run's mean (nobody earned it): zero its advantages, skip its step, or keep. why: docs/defaults.md#tied-scores"""
    target_kl: float | None = None
    """Stop the PPO epochs of a batch early once the approximate KL to the rollout policy exceeds this. None = off."""
    update_kl_max: float | None = None
    """Trust region: shrink an update by sqrt(max / KL) where its per-token KL to the rollout policy exceeds this. none = off. more: docs/defaults.md#update-kl-max"""
    ptx_coef: float = 0.0
    """PPO-ptx: weight of a language-modelling loss on --ptx-data mixed into the policy loss (InstructGPT)."""
    ptx_data: str | None = None
    """Plain-text corpus for PPO-ptx (.txt, one document per line, or .jsonl with a 'text' column)."""
    advantage: Literal["gae", "grpo", "dr-grpo", "rloo", "reinforce++", "reinforce++-baseline", "remax"] = "gae"
    """Advantage estimator: gae (PPO with a critic) or a critic-free one (grpo, dr-grpo, rloo, reinforce++, ...). more: docs/algorithms.md"""
    samples_per_prompt: int | None = None
    """Responses per prompt, one group (a step takes --batch-size / G prompts); none = 4 for the group estimators, else 1. more: docs/algorithms.md"""
    loss_agg: Literal["auto", "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "auto"
    """Reduction of the per-token policy loss; auto = seq-mean-token-sum-norm for dr-grpo, else token-mean. more: docs/algorithms.md#loss-aggregation"""
    clip_eps_high: float | None = 0.28
    """Upper ratio clip 1 + this, above 1 - --clip-eps (clip-higher, DAPO); none = --clip-eps (symmetric). why: docs/defaults.md#clip-eps-high"""
    dual_clip: float | None = None
    """Dual-clip constant C > 1: where the advantage is negative the policy loss is capped at -C * A (Ye et al. 2020; 3 is common). None = off."""


@dataclass
class KLConfig:
    kl_coef: float = 0.01
    """Starting KL coefficient beta, and by default its floor, per nat of KL in (--score-scale) score units. why: docs/defaults.md#kl-coef"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """Per-token KL of the reward penalty and of objective/kl: k1 = logp - logp_ref, k2 = k1^2 / 2, k3 = exp(-k1) - 1 + k1."""
    kl_in: Literal["auto", "reward", "loss"] = "auto"
    """KL penalty in the per-token reward (InstructGPT) or in the loss (beta * k3, GRPO); auto = loss for grpo, dr-grpo, rloo, remax. more: docs/defaults.md#kl-in"""
    adaptive_kl: bool = True
    """Adapt beta to keep KL near --kl-target (Ziegler et al. 2019); off = fixed beta."""
    kl_target: float = 12.0
    """Target KL of the adaptive controller, in nats per response (summed over tokens). why: docs/defaults.md#kl-target"""
    kl_coef_min: float | None = None
    """Floor of the adaptive beta; none = --kl-coef (beta starts at its floor and never falls below it). why: docs/defaults.md#kl-coef-min"""
    kl_coef_max: float | None = None
    """Ceiling of the adaptive beta; none = 0.48 / --kl-target under gae with --score-scale auto, else inf. why: docs/defaults.md#kl-coef-max"""
    kl_error_clip: float = 0.2
    """The adaptive controller's largest relative step per horizon: beta *= 1 + clip(KL/target - 1, +-this) / --kl-horizon (0.2, Ziegler et al. 2019's; in (0, 1))."""
    kl_horizon: int = 1
    """Horizon of the adaptive controller in PPO updates: beta moves by at most --kl-error-clip / horizon per update. why: docs/defaults.md#kl-horizon"""
    kl_lr_boost: float = 1.0
    """Largest factor on --actor-lr while the KL is under target: lr x clip(--kl-target / KL, 1, this); 1 = off. more: docs/defaults.md#kl-lr-boost"""

    @property
    def floor(self) -> float:
        """The adaptive coefficient's floor: --kl-coef-min, by default --kl-coef (beta starts at its floor)."""
        return self.kl_coef if self.kl_coef_min is None else self.kl_coef_min


@dataclass
class RunConfig(RunControl):
    """Data, outputs, checkpoints and held-out evaluation of a PPO run; seeding, --resume/--overwrite and
    the non-finite guard are the options every training command shares (:class:`RunControl`)."""

    prompts: str | None = None
    """Prompts: .jsonl/.json ('prompt' text or 'messages' chat list), .txt (one per line), .parquet, or a saved datasets directory. Default: a built-in prompt set."""
    chat_template: bool = True
    """Apply the tokenizer's chat template to text prompts (messages prompts always use it)."""
    output_dir: str = "runs/ppo"
    """Where the policy, critic, config, metrics, samples, TensorBoard events and checkpoints go."""
    sample_every: int = 5
    """Write samples (prompt, response, score, KL) to samples.jsonl every N steps."""
    save_every: int = 10
    """Write a resumable checkpoint every N steps (and at the end, and on Ctrl-C)."""
    eval_prompts: str | None = None
    """Held-out prompts (formats as --prompts) scored before training and every --eval-every steps: eval.jsonl. more: docs/metrics.md#held-out-evaluation"""
    eval_every: int = 5
    """Evaluate on --eval-prompts every N PPO steps (and before the first and after the last)."""
    eval_batch_size: int = 32
    """Held-out prompts generated and scored together (decoding reads every weight once per token, so 32 cost little more than 8)."""
    eval_reward_fn: list[str] = field(default_factory=list)
    """Extra scorers used only for evaluation, never for training (e.g. a gold judge): 'file.py:fn' or 'module:fn'."""
    best_metric: str | None = None
    """Keep the policy that maximises this eval metric (e.g. eval/gold_judge) in best/ with best.json."""


@dataclass
class PPOConfig:
    """Everything a PPO run needs. Build one in Python and pass it to :func:`ppolm.train_ppo`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def validate(self, world_size: int | None = None) -> None:
        """Reject impossible combinations with one line each; derived sizes are properties.
        ``world_size``: the number of processes (torchrun) that will share each batch; default: what
        the environment says (WORLD_SIZE)."""

        a, g, k, r = self.algo, self.generation, self.kl, self.reward
        world_size = launched_world_size() if world_size is None else world_size

        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise PPOLMError(msg)

        for name, v in [("steps", a.steps), ("batch-size", a.batch_size), ("minibatches", a.minibatches),
                        ("grad-accum", a.grad_accum), ("ppo-epochs", a.ppo_epochs),
                        ("response-length", g.response_length), ("max-prompt-length", g.max_prompt_length),
                        ("sample-every", self.run.sample_every), ("save-every", self.run.save_every),
                        ("keep-last", self.run.keep_last), ("max-skipped-updates", self.run.max_skipped_updates),
                        ("eval-every", self.run.eval_every),
                        ("eval-batch-size", self.run.eval_batch_size)]:
            need(v >= 1, f"--{name} must be at least 1; got {v}")
        need(a.batch_size % a.minibatches == 0,
             f"--batch-size {a.batch_size} is not divisible by --minibatches {a.minibatches}; "
             f"choose a divisor such as {max(d for d in range(1, a.minibatches + 1) if a.batch_size % d == 0)}")
        need(self.minibatch_size % a.grad_accum == 0,
             f"the minibatch size {self.minibatch_size} is not divisible by --grad-accum {a.grad_accum}")
        need(g.temperature > 0, f"--temperature must be > 0; got {g.temperature}")
        need(0 < g.top_p <= 1, f"--top-p must be in (0, 1]; got {g.top_p}")
        need(g.top_k >= 0, f"--top-k must be >= 0; got {g.top_k}")
        need(0 < a.clip_eps < 1, f"--clip-eps must be in (0, 1); got {a.clip_eps}")
        need(a.vf_clip > 0, f"--vf-clip must be > 0; got {a.vf_clip}")
        need(0 <= a.gamma <= 1 and 0 <= a.lam <= 1, "--gamma and --lam must be in [0, 1]")
        need(a.critic_lam is None or 0 <= a.critic_lam <= 1, f"--critic-lam must be in [0, 1] (or none: --lam); got {a.critic_lam}")
        need(a.actor_lr > 0 and a.critic_lr > 0, "--actor-lr and --critic-lr must be > 0")
        for name, lr in (("actor-lr", a.actor_lr), ("critic-lr", a.critic_lr)):
            need(lr <= FLOAT32_MAX, f"--{name} {lr:g} is too large for float32 (the optimiser's type); use a value "
                 f"<= {FLOAT32_MAX:.3g} (typical: 1e-6 .. 1e-3)")
        need(a.adam_eps > 0 and a.max_grad_norm > 0, "--adam-eps and --max-grad-norm must be > 0")
        need(a.critic_adam_eps is None or a.critic_adam_eps > 0, f"--critic-adam-eps must be > 0; got {a.critic_adam_eps}")
        need(0.0 <= a.actor_adam_beta1 < 1.0, f"--actor-adam-beta1 must be in [0, 1); got {a.actor_adam_beta1}")
        need(a.actor_lr_warmup >= 0, f"--actor-lr-warmup must be >= 0 updates (0 = off); got {a.actor_lr_warmup}")
        need(0.0 <= a.actor_lr_warmup_from <= 1.0,
             f"--actor-lr-warmup-from must be in [0, 1] (a share of --actor-lr); got {a.actor_lr_warmup_from}")
        need(k.kl_coef >= 0, f"--kl-coef must be >= 0; got {k.kl_coef}")
        need(k.kl_target > 0 and k.kl_horizon > 0, "--kl-target and --kl-horizon must be > 0")
        need(0 < k.kl_error_clip < 1, f"--kl-error-clip must be in (0, 1); got {k.kl_error_clip}")
        need(1 <= k.kl_lr_boost <= 100, f"--kl-lr-boost must be in [1, 100] (1 = off); got {k.kl_lr_boost}")
        need(k.kl_coef_min is None or k.kl_coef_min >= 0, f"--kl-coef-min must be >= 0; got {k.kl_coef_min}")
        need(k.kl_coef_max is None or k.kl_coef_max >= max(k.kl_coef, k.kl_coef_min or 0.0),
             f"--kl-coef-max must be >= --kl-coef and --kl-coef-min (or inf: no ceiling); got {k.kl_coef_max}")
        need(self.model.critic_layers >= 0, f"--critic-layers must be >= 0; got {self.model.critic_layers}")
        need(self.model.critic_model is None or self.model.critic == "separate",
             "--critic-model starts a separate critic; drop it or use --critic separate")
        need(self.model.lora_r >= 0, f"--lora-r must be >= 0; got {self.model.lora_r}")
        need(a.target_kl is None or a.target_kl > 0, "--target-kl must be > 0 (or none)")
        need(a.update_kl_max is None or a.update_kl_max > 0,
             f"--update-kl-max must be > 0 (or none); got {a.update_kl_max}")
        need(a.ptx_coef >= 0, "--ptx-coef must be >= 0")
        need(a.ptx_coef == 0 or a.ptx_data is not None, "--ptx-coef > 0 needs --ptx-data FILE (a text corpus)")
        need(bool(r.reward_fn or r.reward_model or r.reward_url or r.reward_judge),
             "no reward given: pass --reward-fn FILE.py:fn (TRL GRPO convention) or --reward-model DIR; for the "
             "built-in sentiment reward use --reward-fn ppolm.builtin_rewards:positive_sentiment")
        for opt, weights, sources in (("url", r.reward_url_weights, r.reward_url),
                                      ("judge", r.reward_judge_weights, r.reward_judge)):
            need(not weights or len(weights) == len(sources), f"--reward-{opt}-weights has {len(weights)} values for "
                 f"{len(sources)} --reward-{opt}; give one per source")
        need(r.reward_url_batch_size >= 1, f"--reward-url-batch-size must be >= 1; got {r.reward_url_batch_size}")
        need(math.isfinite(r.reward_url_timeout) and r.reward_url_timeout > 0,
             f"--reward-url-timeout must be > 0 seconds; got {r.reward_url_timeout}")
        need(r.reward_url_retries >= 0, f"--reward-url-retries must be >= 0; got {r.reward_url_retries}")
        for opt, weights in (("fn", r.reward_fn_weights), ("url", r.reward_url_weights),
                             ("judge", r.reward_judge_weights)):
            bad = [w for w in weights if not math.isfinite(w)]
            need(not bad, f"--reward-{opt}-weights must be finite numbers; got {bad[0] if bad else ''}")
        need(math.isfinite(r.reward_model_weight),
             f"--reward-model-weight must be a finite number; got {r.reward_model_weight}")
        need(not r.reward_fn_weights or len(r.reward_fn_weights) == len(r.reward_fn),
             f"--reward-fn-weights has {len(r.reward_fn_weights)} values for {len(r.reward_fn)} --reward-fn; give one per function")
        need(r.length_penalty >= 0, "--length-penalty must be >= 0")
        need(r.length_budget >= 0, f"--length-budget must be >= 0; got {r.length_budget}")
        need(not self.model.fsdp or world_size > 1,
             "--fsdp shards the models over the processes of a torchrun job: launch with torchrun --nproc-per-node N "
             "(N >= 2) -m ppolm ppo ..., or drop --fsdp")
        need(not (self.model.fsdp and self.model.lora_r > 0),
             "--fsdp with --lora-r > 0 is not supported: LoRA's trained state is small, so drop --fsdp (each process "
             "then holds the model and its adapter whole)")
        need(not (self.model.critic == "shared" and self.model.lora_r > 0),
             "--critic shared with --lora-r > 0 is not supported; use --critic separate")
        need(not (self.run.resume and self.run.overwrite), "--resume and --overwrite exclude each other; pick one")
        spp = self.group_size
        need(spp >= 1, f"--samples-per-prompt must be at least 1; got {spp}")
        need(a.batch_size % spp == 0, f"--batch-size {a.batch_size} is not divisible by --samples-per-prompt {spp}; "
             f"use a multiple of {spp} such as {spp * max(1, a.batch_size // spp)}")
        need(spp > 1 or a.advantage not in GROUP_ESTIMATORS,
             f"--advantage {a.advantage} compares the responses to one prompt: give --samples-per-prompt 2 or more "
             "(e.g. 4)")
        need(a.advantage != "remax" or g.top_k != 1,
             "--advantage remax with --top-k 1 samples the greedy response itself (advantage 0); use --top-k 0 "
             "or > 1")
        need(a.clip_eps_high is None or a.clip_eps_high > 0, f"--clip-eps-high must be > 0; got {a.clip_eps_high}")
        need(a.dual_clip is None or a.dual_clip > 1, f"--dual-clip must be > 1; got {a.dual_clip}")
        need(self.run.dist_timeout > 0, f"--dist-timeout must be > 0 seconds; got {self.run.dist_timeout}")
        if world_size > 1:  # each process takes an equal share of the prompts, whole groups, whole minibatches
            prompts = a.batch_size // spp
            need(prompts % world_size == 0,
                 f"{world_size} processes (WORLD_SIZE) cannot share the {prompts} prompts of a step (--batch-size "
                 f"{a.batch_size} / --samples-per-prompt {spp}) equally; use a --batch-size that is a multiple of "
                 f"{world_size * spp}, or another --nproc-per-node")
            rows = a.batch_size // world_size
            need(rows % (a.minibatches * a.grad_accum) == 0,
                 f"each of the {world_size} processes holds {rows} rows of a batch, which --minibatches "
                 f"{a.minibatches} x --grad-accum {a.grad_accum} must divide; use a --batch-size that is a multiple "
                 f"of {world_size * a.minibatches * a.grad_accum}")
        need(self.run.eval_prompts is not None or not (self.run.eval_reward_fn or self.run.best_metric),
             "--eval-reward-fn and --best-metric need --eval-prompts FILE")
        self.validate_judge()
        need(not (g.ignore_eos and r.missing_eos_penalty is not None),
             "--missing-eos-penalty with --ignore-eos would penalise every response; drop one of them")

    def validate_judge(self) -> None:
        """--judge and the reward-model check and refresh it drives (docs/overoptimisation.md)."""
        r = self.reward
        if r.judge is None:
            for name, v in (("rm-check-every", r.rm_check_every), ("rm-refresh-every", r.rm_refresh_every)):
                if v:
                    raise PPOLMError(f"--{name} needs --judge SPEC (whose preferences the reward model is checked "
                                     "against)")
            return
        if not r.reward_model:
            raise PPOLMError("--judge checks and refreshes a reward model: give --reward-model DIR")
        if not (math.isfinite(r.judge_temperature) and r.judge_temperature >= 0):
            raise PPOLMError(f"--judge-temperature must be >= 0 (0 = the higher score wins); got {r.judge_temperature}")
        for name in ("rm_check_every", "rm_check_pairs", "rm_refresh_every"):
            if getattr(r, name) < 0:
                raise PPOLMError(f"--{name.replace('_', '-')} must be >= 0; got {getattr(r, name)}")
        if r.rm_refresh_every and (r.rm_refresh_pairs < 1 or r.rm_refresh_steps < 1):
            raise PPOLMError("--rm-refresh-every needs --rm-refresh-pairs >= 1 and --rm-refresh-steps >= 1")
        if not (math.isfinite(r.rm_refresh_start_share) and 0.0 <= r.rm_refresh_start_share <= 1.0):
            raise PPOLMError(f"--rm-refresh-start-share must be in [0, 1] (the share of a refresh's pairs against the "
                             f"starting policy); got {r.rm_refresh_start_share}")
        if not r.rm_refresh_every and not (r.rm_check_pairs and (r.rm_check_every or self.run.eval_prompts)):
            raise PPOLMError("--judge is never used: give --rm-check-every N, --eval-prompts FILE (a check at each "
                             "evaluation) or --rm-refresh-every K")

    def resolve(self) -> PPOConfig:
        """A copy with the "auto" choices replaced by what they mean for this estimator (what the run
        saves in its config.yaml): --samples-per-prompt, --kl-in, --loss-agg and --kl-coef-max."""
        resolved = copy.deepcopy(self)
        a, k = resolved.algo, resolved.kl
        a.samples_per_prompt = self.group_size
        if k.kl_in == "auto":
            k.kl_in = "loss" if a.advantage in KL_IN_LOSS_ESTIMATORS else "reward"
        if a.loss_agg == "auto":
            a.loss_agg = "seq-mean-token-sum-norm" if a.advantage == "dr-grpo" else "token-mean"
        if k.kl_coef_max is None:
            k.kl_coef_max = default_kl_coef_max(resolved)
        return resolved

    @property
    def group_size(self) -> int:
        """--samples-per-prompt, or its default for this --advantage."""
        if self.algo.samples_per_prompt is not None:
            return self.algo.samples_per_prompt
        return GROUP_SIZE if self.algo.advantage in GROUP_ESTIMATORS else 1

    @property
    def needs_critic(self) -> bool:
        """Only GAE learns a value function; the other estimators build no critic at all."""
        return self.algo.advantage == "gae"

    @property
    def minibatch_size(self) -> int:
        return self.algo.batch_size // self.algo.minibatches


def default_kl_coef_max(cfg: PPOConfig) -> float:
    """What --kl-coef-max none means for this run: KL_PENALTY_AT_TARGET / --kl-target where beta is
    in the units that ceiling was measured in (GAE's per-token reward on scores under --score-scale
    auto) and lies above the start and the floor of beta; inf (no ceiling) otherwise."""
    k = cfg.kl
    ceiling = KL_PENALTY_AT_TARGET / k.kl_target
    in_units = cfg.algo.advantage == "gae" and cfg.reward.score_scale == "auto" and k.kl_in in ("auto", "reward")
    return ceiling if in_units and k.adaptive_kl and ceiling >= max(k.kl_coef, k.floor) else math.inf
