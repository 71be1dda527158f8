"""ppolm: RLHF with Proximal Policy Optimisation for language models.

The pipeline of InstructGPT (SFT -> reward model -> PPO) with the implementation details
that decide whether PPO works, on a laptop CPU or a GPU.

Heavy imports (transformers, datasets) happen in submodules; ``import ppolm.core`` needs only torch.
"""

__version__ = "0.1.0"
