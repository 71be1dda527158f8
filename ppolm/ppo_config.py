"""The configuration of a PPO run (``ppolm ppo``): nested dataclasses, one docstring per field.

Defaults are chosen so that the embedded 135M model learns on a laptop CPU within 40 steps of
8 rollouts; the comments give the source of each default.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Literal

from ppolm.config_sections import LoRAOptions, ModelLoading
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
    critic: Literal["separate", "shared"] = "separate"
    """Value model: a separate model (OpenRLHF, TRL), or a value head on the policy's own trunk (OpenAI's original; saves memory)."""
    critic_init: Literal["reward", "policy"] = "reward"
    """Initialise a separate critic from the (first) reward model (Huang et al. 2024) or from the policy. Falls back to the policy when only reward functions are given. A critic that keeps the reward model's head predicts its scores as they come; its output v counts as the value (v - center) / unit, with the center and unit the scores get (--score-center, --score-scale), so that it starts as close to the returns whatever they do to the scores."""
    critic_zero_head: bool = False
    """Start the separate critic's value head at zero, whatever it is initialised from: its first values are 0, so the first advantages are the whitened returns. (A head kept from a reward model scores partial responses far from their returns at first: value explained variance -10 .. -2 on the demo, whose PPO then gained no gold reward in 8 steps; with a zero head it gained +0.29 ± 0.05.)"""
    critic_layers: int = 4
    """Train only the separate critic's top N layers (and its head). Its lower layers stay frozen and are shared with the frozen model it starts from (reward model or reference): no extra memory, no extra forward pass. 0 = train every layer of a full copy (as TRL)."""
    share_trunk: bool = True
    """Store and run once the frozen layers that the reference has in common with a reward model (one trained from the same base with `ppolm reward --train-layers N`) or with a LoRA policy's adapter-free lower layers; found by comparing weights, results unchanged (ppolm/trunk.py). false = run every model in full."""
    share_prefix: bool = True
    """Run the prompts' common beginning (a chat template's system prompt, a shared instruction) once per forward pass, at batch size 1, the rest of each row attending to it through the key/value cache; results unchanged up to float rounding (ppolm/prefix.py). false = every row in full."""
    lora_r: int = 0
    """LoRA rank for the policy (peft); 0 = full fine-tuning. With LoRA the reference is the policy with its adapter disabled (no second copy)."""
    fsdp: bool = False
    """Under torchrun: shard the trained models (policy and critic: weights, gradients, Adam states) over the processes with FSDP2 (fully_shard per decoder layer, then the rest), for models whose training state does not fit one device; they are gathered whole for sampling. The frozen reference and reward models stay whole on every process. Full fine-tuning only (a LoRA policy's trained state is small: DDP suffices)."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """bf16: every model computes in bf16, trained weights keep fp32 master copies, logits, values and the PPO maths in fp32 (faster on GPUs and CPUs with AMX/AVX512-BF16; 3-5x slower where bf16 is emulated). fp32: everything in float32. auto: bf16 where native, else fp32 (printed with the reason)."""


@dataclass
class RewardConfig:
    reward_model: list[str] = field(default_factory=list)
    """Reward model directory (from `ppolm reward`, or any sequence-classification model with one label). Repeat for an ensemble."""
    reward_fn: list[str] = field(default_factory=list)
    """Reward function 'path/to/file.py:function' or 'package.module:function', TRL GRPO convention f(prompts, completions, **kwargs) -> list[float]. Repeatable. At least one --reward-fn or --reward-model is required; ppolm.builtin_rewards:positive_sentiment is a built-in one (VADER sentiment)."""
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
    """Whiten the per-token rewards over the batch (scale only, mean kept; OpenAI detail 11). Needs batch >= 8."""
    score_scale: Literal["auto", "std", "none"] = "auto"
    """PPO (--advantage gae): what the score is divided by before the KL penalty is added, from the spread of the scores around their own batch's mean, pooled over every batch so far (ppolm.core.RunningScale.spread, ppolm.core.score_unit; objective/score_scale logs the divisor, the logged scores stay raw): the std of every score together also counts the policy's progress: on a reward climbed from -110 to -10 it grew fivefold, to twice the spread within the batches, shrinking what PPO learns from towards the size of the KL penalty (docs/learning.md, "The score unit from the spread within batches"). auto: nothing while that spread lies in [0.05, 0.5], the spread of the [0, 1] rewards the default --kl-coef was measured on, else the factor that brings it to the nearer edge; without it, in bench/learning.py, a reward 10x smaller learnt a third as much (the KL penalty outweighed it) and one 10x larger ran at 2.5-3x the KL target for its last 10 steps. std: the spread itself (reward scaling, Engstrom et al. 2020; beta is then per std, e.g. --kl-coef 0.05). none: raw scores."""
    score_center: Literal["auto", "running", "none"] = "auto"
    """PPO (--advantage gae): what is subtracted from each score before it is divided (--score-scale) and the KL penalty is added, from the running mean and std of every score so far (ppolm.core.score_center; objective/score_center logs it). Until the zero-initialised value head has learnt a reward's offset, GAE with lambda < 1 hands every response's late tokens more of it than its early ones: a positive offset rewards ending the answer, a negative one penalises it (in bench/learning.py exclaim + 3 learnt a third as much within twice the KL target). auto (default): the running mean's part beyond two running stds from 0, so a reward far from 0 (one that is never positive, one that starts at 3) is brought to the edge of that band, and one within it, as the [0, 1] rewards the defaults were measured on are while their mean is under 0.8, is left as it is (a critic that keeps the reward model's head is moved alike: --critic-init). running: the whole running mean, so a reward r and r + c train the same policy (reward centering, Naik et al. 2024, arXiv:2405.09999; InstructGPT shifts its reward model to mean 0 on the reference's samples for the same reason; on the benchmark's [0, 1] rewards it learnt no more than leaving them). none: the scores as they are. Critic-free estimators (--advantage grpo, rloo, ...) are offset-free by construction."""


@dataclass
class GenerationConfig:
    response_length: int = 48
    """Maximum number of new tokens per response."""
    temperature: float = 1.0
    """Sampling temperature; log-probs are recomputed from logits divided by it (OpenAI detail 5). 1 (as TRL's GRPO): PPO then optimises the policy itself, the one a user samples from, and explores more than at 0.7 (Huang et al. 2024's TL;DR choice); on a rare rule-based reward (bench/learning.py) 0.7 learnt a third as much."""
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
    """PPO epochs over each rollout batch, freshly shuffled each epoch (OpenAI detail 14). 2 (with --actor-lr 2e-5): at 8 rollouts per batch, 4 epochs at 5e-5 moved the policy so far per batch that the KL ran away and the reward barely rose (bench/learning.py)."""
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
    """GAE lambda of the critic's value targets (returns = GAE(this) + values); None = --lam. 1 gives the critic the plain return still to come, whatever it predicts now (decoupled GAE, Yuan et al. 2025, arXiv:2503.01491): with --lam below 1 its targets lean on its own, still untrained values, so a reward that arrives only at the last token reaches the values of early tokens slowly."""
    actor_lr: float = 2e-5
    """Policy learning rate (full fine-tuning of a ~100M model at 8 rollouts per batch; LoRA wants ~10x more)."""
    critic_lr: float = 1e-4
    """Critic learning rate (separate from the actor's; the seeds suggest ~5x the actor's)."""
    adam_eps: float = 1e-5
    """Adam epsilon (1e-5, the TF default of OpenAI's code; detail 16)."""
    critic_adam_eps: float | None = 1e-8
    """Adam epsilon of the separate critic's optimiser (None = --adam-eps). 1e-8 (PyTorch's default): on rewards in [0, 1] the critic's gradients are small (the median sqrt(v) of its Adam states was 2e-8 after 40 updates), so --adam-eps 1e-5 shrank its steps ~500x and its explained variance stayed below 0 (-1.6 over the last 10 of 40 updates on bench/learning.py's exclaim); at 1e-8 it learns (+0.2 to +0.9 in the updates with a signal) and, with --tied-scores zero, the dense rewards there learnt more per nat of KL (exclaim 0.61, 0.66 and 0.65 at KL <= 12 over 3 seeds, against 0.53, 0.53 and 0.48). The policy keeps 1e-5: 1e-8 on both lost reward on exclaim."""
    actor_adam_beta1: float = 0.9
    """Adam's beta1 (first-moment decay) of the policy's optimiser; beta2 stays 0.999. A gradient keeps moving the weights along Adam's momentum for ~1/(1 - beta1) steps after the batch it came from: at 0.9 and 2 epochs, about 85 % of the displacement a batch causes comes on the following batches' steps, where the ratio clip does not see it (docs/learning.md, "Four PPO epochs a batch"). 0 keeps each batch's movement to its own clipped epochs (RMSProp-like), but on bench/learning.py it learnt far less of every reward (exclaim 0.245 against 0.667 at KL <= 12; keyword and question 0.010-0.078 against 0.094-0.680): the momentum carries much of what these small batches teach. The critic keeps 0.9."""
    actor_lr_warmup: int = 0
    """Updates over which the policy's learning rate rises linearly to --actor-lr (update i of the first N takes (i + 1) / N of it; 0 = off). The first batches that earn a rare reward hold one rewarded answer among noise, and a full step on them, carried on by Adam's momentum over the unrewarded batches after it, spends KL before the reward is found again. The critic's lr does not warm up. Off by default: on bench/learning.py, 10 updates of warmup to 3e-5 kept a format found in the first batches (question) but lost a vocabulary that rare (keyword), whose first rewarded answers then moved the policy too little to be found again (docs/learning.md, "A warmup of the policy's step")."""
    actor_lr_warmup_from: float = 0.0
    """Share of --actor-lr the warmup starts from: update i of the first --actor-lr-warmup N takes F + (1 - F)(i + 1) / N of it (F = 0: (i + 1) / N). A start at the share of a smaller lr keeps the first steps that size and enlarges only the later ones."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping (global norm) per model."""
    lr_schedule: Literal["constant", "linear"] = "constant"
    """Learning-rate schedule: constant, or linear decay to 0 over --steps (OpenAI detail 15; --resume then needs the same --steps, while a constant schedule lets --resume extend a run)."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (0 = off)."""
    whiten_advantages: bool = True
    """Whiten advantages per batch over real tokens (OpenAI detail 12)."""
    tied_scores: Literal["zero", "keep", "skip"] = "zero"
    """--advantage gae, a batch whose scores are all equal over every process and no higher than the run's mean score (a rule-based reward that no response in it earned), which says nothing about the reward: zero = its advantages are set to 0, so it adds no gradient to the policy (Adam's momentum from earlier batches still moves it; the critic still learns), as GRPO's per-prompt normalisation treats such a group; skip = as zero, and the policy's optimiser does not step at all on that batch, so momentum from an earlier rewarded batch is held until the next batch with a signal (the critic still steps; with a critic sharing the policy's trunk, the trunk waits too; on bench/learning.py's keyword and digit it learnt less than zero on both, over 9 and 5 seeds: stepping on the empty batches also lowers Adam's bias-corrected second moment, which makes the rarer rewarded batches' steps larger, docs/learning.md); keep = PPO's usual advantages, which are then only the critic's error and the KL penalty, whitened to full size, so such batches spend the KL budget on noise (bench/learning.py: on a reward earned once in 200 samples, zero alone learnt about twice as much over 3 seeds; with the critic's --critic-adam-eps 1e-8 the runs in which a rare reward came late no longer fell below GRPO's within the KL target). A batch that all earned alike above the mean (a reward the policy has mastered) keeps its advantages under both: its KL penalty is then its one signal and pulls the policy back (zeroed, a word-budget reward earned by every response held the KL at twice its target for 10 updates and lost its reward when beta caught up). A zeroed batch leaves the adaptive KL coefficient unchanged (its penalty had no gradient to act through). adv/tied logs 1 for a tied batch, adv/unearned 1 for a tied one at or below the mean (the batches zero acts on)."""
    target_kl: float | None = None
    """Stop the PPO epochs of a batch early once the approximate KL to the rollout policy exceeds this. None = off."""
    update_kl_max: float | None = None
    """A trust region on each update: after the PPO epochs, the policy's mean per-token KL to the rollout policy on the batch (k2, 0.5 (log ratio)^2, one extra forward pass) is measured, and if it exceeds this the step is shrunk towards the rollout policy by sqrt(max / KL) (the KL grows as the square of a small step; TRPO's bound, Schulman et al. 2015, arXiv:1502.05477, applied to the step Adam took). policy/update_kl logs the measured KL, policy/update_scale the factor. None = off."""
    ptx_coef: float = 0.0
    """PPO-ptx: weight of a language-modelling loss on --ptx-data mixed into the policy loss (InstructGPT)."""
    ptx_data: str | None = None
    """Plain-text corpus for PPO-ptx (.txt, one document per line, or .jsonl with a 'text' column)."""
    advantage: Literal["gae", "grpo", "dr-grpo", "rloo", "reinforce++", "reinforce++-baseline", "remax"] = "gae"
    """Advantage estimator: gae (PPO with a critic) or a critic-free one: grpo, dr-grpo, rloo, reinforce++-baseline (groups of --samples-per-prompt > 1), reinforce++, remax (a greedy response per prompt as baseline). Only gae builds, trains and saves a critic. See README, "PPO and its alternatives"."""
    samples_per_prompt: int | None = None
    """Responses sampled per prompt (G): a step takes --batch-size / G prompts, each sampled G times, the G responses of a prompt adjacent and forming one group. Minibatches may split a group (the advantages are computed on the whole batch first). Default: 4 for the group estimators (grpo, dr-grpo, rloo, reinforce++-baseline), 1 otherwise."""
    loss_agg: Literal["auto", "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "auto"
    """How the per-token policy loss is reduced: token-mean (each token weighs the same), seq-mean-token-sum, seq-mean-token-mean (GRPO as published), seq-mean-token-sum-norm (token sum / (rows * --response-length), Dr. GRPO). auto: seq-mean-token-sum-norm for dr-grpo, token-mean otherwise."""
    clip_eps_high: float | None = 0.28
    """Upper clip range of the ratio, 1 + this, above the lower 1 - --clip-eps (clip-higher, Yu et al. 2025, DAPO, arXiv:2503.14476); None = --clip-eps (symmetric, PPO as published). 0.28 (DAPO's): the upper clip bounds a token's rise per batch to about p * eps, tiny for a rewarded token the policy rarely samples (small p), while the lower clip still bounds how far a penalised token falls; in bench/learning.py (2 epochs a batch) it learnt more of a rarely earned keyword reward and of a question format within the KL target, and as much of two dense rewards (README, "Learning benchmark")."""
    dual_clip: float | None = None
    """Dual-clip constant C > 1: where the advantage is negative the policy loss is capped at -C * A (Ye et al. 2020; 3 is common). None = off."""


@dataclass
class KLConfig:
    kl_coef: float = 0.01
    """Initial KL coefficient beta, and by default the adaptive controller's floor (--kl-coef-min), per nat of KL in units of the (--score-scale) score. 0.01: in 40 updates of 8 rollouts a policy held at beta 0.05 (Huang et al. 2024's value for 1B TL;DR at 512 rollouts a batch) learnt a rare rule-based reward a third as much (bench/learning.py); the controller raises beta as soon as the KL passes --kl-target."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """Per-token KL estimator of the reward penalty and the reported KL: k1 = logp - logp_ref (OpenAI), k2 = squared/2, k3 = exp(-x)-1+x (non-negative). With --kl-in loss the loss term uses k3 whatever this is."""
    kl_in: Literal["auto", "reward", "loss"] = "auto"
    """auto: in the reward for gae, reinforce++ and reinforce++-baseline, in the loss for grpo, dr-grpo, rloo and remax (as GRPO); config.yaml records the choice. reward: fold the KL penalty into the per-token reward (InstructGPT; for the score-based estimators the score becomes score - beta * sequence KL); loss: add beta*KL to the policy loss. In the loss the KL is always the k3 estimator (as GRPO; Schulman, "Approximating KL divergence"): k1's gradient does not depend on the reference, so it would pull toward nothing. --kl-estimator then sets only the reported KL (objective/kl) and the adaptive controller's input."""
    adaptive_kl: bool = True
    """Adapt beta to keep KL near --kl-target (Ziegler et al. 2019); off = fixed beta."""
    kl_target: float = 12.0
    """Target KL (nats per response, summed over tokens) for the adaptive controller. 12: with Ziegler et al.'s 6 (for 24-token continuations) the policy passed the target while it learnt a reward and beta then pulled it back from what it had learnt; on 10 rule-based rewards (bench/learning.py, 40 updates of 8, 32 tokens) 12 learnt about as much within 12 nats and kept far more of it at the end (docs/learning.md, "The target of 12 as the default"). For a learned reward model, whose score a policy can over-optimise (Gao et al. 2022), a smaller target is the safer budget."""
    kl_coef_min: float | None = None
    """Floor of the adaptive coefficient: beta never falls below it. None = --kl-coef: beta starts at its floor, rises while the KL is above --kl-target and falls back, never below, while it is under. Without a floor (0, Ziegler et al.'s controller) beta winds down while the KL is still small, as it is for the many updates a rare reward takes to be found, and the KL then ran to 3x its target before beta had climbed back (bench/learning.py)."""
    kl_coef_max: float | None = None
    """Ceiling of the adaptive coefficient: beta never rises above it (>= --kl-coef and --kl-coef-min; inf = no ceiling, as Ziegler et al.). None (default) = KL_PENALTY_AT_TARGET / --kl-target, 0.04 at the default target, where PPO (--advantage gae) runs with --score-scale auto and that value is at least --kl-coef and the floor; no ceiling otherwise (raw or hand-scaled scores, a hand-set beta above it, the critic-free estimators). config.yaml records the value used. Past it the penalty of a KL at its target outweighs most of a score in [0, 1] (--score-scale auto leaves a spread of at most 0.5), so a beta that climbed there threw the policy back below its target instead of holding it there: without a ceiling, runs of 100 updates swung between twice the target and a collapsed reward for 20-30 updates at a time; with it they held their reward (docs/learning.md, "A ceiling on beta" and "Runs longer than 40 updates")."""
    kl_error_clip: float = 0.2
    """The adaptive controller's largest relative step per horizon: beta *= 1 + clip(KL/target - 1, +-this) / --kl-horizon (0.2, Ziegler et al. 2019's; in (0, 1))."""
    kl_horizon: int = 1
    """Horizon of the adaptive controller, in PPO updates: each update moves beta by at most --kl-error-clip (20%)/horizon (beta *= 1 + clip(KL/target - 1, +-0.2) / horizon). Ziegler et al. count it in samples (10000, with batches of 512: 1% per update); counted in samples it would barely move at the small batches of a laptop (8 rollouts: 0.02% per update), so ppolm counts updates. 1 (20% per update): in a run of 40 updates a slower controller (10: 2%) let the KL reach 3x its target before beta caught up (bench/learning.py)."""
    kl_lr_boost: float = 1.0
    """Largest factor on the actor's learning rate while the KL is under --kl-target: each update's lr is --actor-lr (and its schedule) times clip(--kl-target / KL, 1, this), KL the mean over the previous batch (core.kl_lr_scale). A policy still far inside its KL budget, as while a rare reward is being found, then takes larger steps, and one at or past its target takes the plain --actor-lr. 1 = off. The lr logged is the one used."""

    @property
    def floor(self) -> float:
        """The adaptive coefficient's floor: --kl-coef-min, by default --kl-coef (beta starts at its floor)."""
        return self.kl_coef if self.kl_coef_min is None else self.kl_coef_min


@dataclass
class RunConfig:
    prompts: str | None = None
    """Prompts: .jsonl/.json ('prompt' text or 'messages' chat list), .txt (one per line), .parquet, or a saved datasets directory. Default: a built-in prompt set."""
    chat_template: bool = True
    """Apply the tokenizer's chat template to text prompts (messages prompts always use it)."""
    output_dir: str = "runs/ppo"
    """Where the policy, critic, config, metrics, samples, TensorBoard events and checkpoints go."""
    seed: int = 0
    """Random seed (of the models' sampling, the prompt order and the minibatch shuffles)."""
    sample_every: int = 5
    """Write samples (prompt, response, score, KL) to samples.jsonl every N steps."""
    save_every: int = 10
    """Write a resumable checkpoint every N steps (and at the end, and on Ctrl-C)."""
    keep_last: int = 2
    """Keep only the newest K checkpoints."""
    resume: bool = False
    """Continue from the newest valid checkpoint in --output-dir."""
    overwrite: bool = False
    """Allow writing into an --output-dir that holds a different run (its files are replaced)."""
    max_skipped_updates: int = 3
    """Abort after this many consecutive updates skipped for non-finite rewards, losses or gradients (or at the end of a run that skipped every update). A skipped update leaves the adaptive KL coefficient unchanged."""
    quiet: bool = False
    """No progress bar; one log line per step instead."""
    eval_prompts: str | None = None
    """Held-out prompts scored before training and every --eval-every steps (same formats as --prompts); results in eval.jsonl (one row per evaluation, step = updates done, eval/score the trained-on score with the missing-EOS and length penalties as objective/scores, eval/<source> each source's raw mean and eval/<source>_se its standard error, eval/kl) and eval_samples.jsonl."""
    eval_every: int = 5
    """Evaluate on --eval-prompts every N PPO steps (and before the first and after the last)."""
    eval_batch_size: int = 32
    """Held-out prompts generated and scored together. Large batches are cheap: decoding reads every weight once per token whatever the batch, so 32 prompts take little longer than 8 on a CPU."""
    eval_reward_fn: list[str] = field(default_factory=list)
    """Extra scorers used only for evaluation, never for training (e.g. a gold judge): 'file.py:fn' or 'module:fn'."""
    best_metric: str | None = None
    """Keep the policy that maximises this eval metric (e.g. eval/gold_judge) in best/ with best.json."""
    dist_timeout: float = 600.0
    """Under torchrun: seconds a process waits in a collective for the others before failing (a process that died or hangs then stops the job instead of blocking it forever)."""


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
        need(self.model.lora_r >= 0, f"--lora-r must be >= 0; got {self.model.lora_r}")
        need(a.target_kl is None or a.target_kl > 0, "--target-kl must be > 0 (or none)")
        need(a.update_kl_max is None or a.update_kl_max > 0,
             f"--update-kl-max must be > 0 (or none); got {a.update_kl_max}")
        need(a.ptx_coef >= 0, "--ptx-coef must be >= 0")
        need(a.ptx_coef == 0 or a.ptx_data is not None, "--ptx-coef > 0 needs --ptx-data FILE (a text corpus)")
        need(bool(r.reward_fn or r.reward_model),
             "no reward given: pass --reward-fn FILE.py:fn (TRL GRPO convention) or --reward-model DIR; for the "
             "built-in sentiment reward use --reward-fn ppolm.builtin_rewards:positive_sentiment")
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
        need(not (g.ignore_eos and r.missing_eos_penalty is not None),
             "--missing-eos-penalty with --ignore-eos would penalise every response; drop one of them")

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
