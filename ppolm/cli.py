"""The ``ppolm`` command line. Each subcommand's options come from its typed config dataclass."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ppolm import __version__, config, distributed, runtime
from ppolm.errors import PPOLMError
from ppolm.ppo import train_ppo

COMMANDS: dict[str, tuple[str, str, str]] = {
    # name: ("config.module:ConfigClass", "runner.module:function(cfg) -> exit code", help)
    "ppo": ("ppolm.ppo_config:PPOConfig", "ppolm.cli:run_ppo",
            "train a policy with PPO against reward models and/or reward functions"),
    "sft": ("ppolm.sft:SFTConfig", "ppolm.sft:run", "supervised fine-tuning on demonstrations (loss on responses only)"),
    "reward": ("ppolm.reward_train:RewardTrainConfig", "ppolm.reward_train:run", "train a reward model on preference pairs"),
    "dpo": ("ppolm.dpo:DPOConfig", "ppolm.dpo:run",
            "direct preference optimisation: train a policy on preference pairs, no reward model (DPO, IPO)"),
    "reward-eval": ("ppolm.evaluate:RewardEvalConfig", "ppolm.evaluate:run_reward_eval", "held-out pairwise accuracy of a reward model"),
    "eval": ("ppolm.evaluate:EvalConfig", "ppolm.evaluate:run_eval", "compare policies: rewards, KL, length, diversity, EOS rate"),
    "serve-rm": ("ppolm.serve_rm:ServeRMConfig", "ppolm.serve_rm:run",
                 "serve a reward model over HTTP (POST /get_reward, as OpenRLHF) for ppo --reward-url"),
    "report": ("ppolm.report:ReportConfig", "ppolm.report:run_report", "write report.html and plots for a PPO run"),
    "label": ("ppolm.label:LabelConfig", "ppolm.label:run",
              "rank a policy's answers on a local web page (or with --judge); writes pairs for ppolm reward"),
    "demo": ("ppolm.demo:DemoConfig", "ppolm.demo_long:run", "the whole RLHF pipeline on the embedded model, showing over-optimisation"),
}


def run_ppo(cfg: Any) -> int:
    result = train_ppo(cfg)
    if result.interrupted:
        return 130
    last = result.metrics[-1] if result.metrics else {}

    def num(key: str, spec: str) -> str:  # a skipped step's score is null in metrics.jsonl
        v = last.get(key)
        return format(v, spec) if isinstance(v, (int, float)) else "n/a (update skipped)"

    print(f"done: {len(result.metrics)} steps, final score {num('objective/scores', '+.4f')}, "
          f"KL {num('objective/kl', '.3f')}; policy saved to {result.output_dir / 'policy'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    import importlib


    parser = argparse.ArgumentParser(prog="ppolm", description="RLHF with PPO for language models, on a CPU or GPU.",
                                     epilog="`ppolm COMMAND --help` lists a command's options by section "
                                            "(all of them: docs/options.md).")
    parser.add_argument("--version", action="version", version=f"ppolm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (cls_spec, _runner, help_text) in COMMANDS.items():
        module, _, cls_name = cls_spec.partition(":")
        cls = getattr(importlib.import_module(module), cls_name)
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=config.HelpFormatter,
                           usage="%(prog)s [-h] [--config FILE.yaml] [OPTION ...]")
        p.add_argument("--config", metavar="FILE.yaml", help="YAML file of options (flat or by section); "
                       "command-line options override it")
        config.add_arguments(p, cls)
        p.set_defaults(_cfg_cls=cls)
    return parser


SINGLE_PROCESS = ("demo", "report", "reward-eval", "serve-rm", "label")
"""Commands that run as one process only (the others run under torchrun: docs/distributed.md)."""


SHARED_ERROR_WAIT_S = 30.0
"""How long a torchrun process other than a machine's first waits to be stopped after an error every
process finds alike (see ``main``)."""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2

    streams = sys.stdout, sys.stderr  # processes other than 0 of a torchrun job silence them
    try:
        import importlib


        world = distributed.launched_world_size()  # before anything is read or written
        if world > 1 and args.command in SINGLE_PROCESS:
            raise distributed.RankError(f"ppolm {args.command} runs as one process; launch it without torchrun "
                                        f"(WORLD_SIZE={world} is set)")
        cfg = config.from_cli(args._cfg_cls, args, args.command)
        runtime.quiet_libraries()
        module, _, fn = COMMANDS[args.command][1].partition(":")
        rc = getattr(importlib.import_module(module), fn)(cfg)
        distributed.shutdown()
        return rc
    except PPOLMError as e:
        # Several processes (torchrun): an error every process finds alike (bad options or files,
        # found before they join) is printed once per machine, by its first process; one found by a
        # single process after they joined, by that process. The others wait for torchrun to stop
        # them when the first exits: exiting first would let torchrun stop the first process before
        # it has printed. One that is not stopped within the wait says the error itself.
        shared = isinstance(e, distributed.RankError) or not distributed.active()
        if shared and distributed.local_rank() != 0 and distributed.launched_world_size() > 1:
            time.sleep(SHARED_ERROR_WAIT_S)
        where = "" if distributed.is_main() else f"[rank {distributed.rank()}] "
        print(f"error: {where}{e}", file=streams[1], flush=True)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted; nothing was saved in this step (earlier checkpoints are intact)", file=sys.stderr)
        return 130
    except RuntimeError as e:
        if not (distributed.active() and distributed.peer_failure(e)):
            raise
        print(f"error: [rank {distributed.rank()}] another process of this job stopped or stopped answering "
              f"({type(e).__name__}: {str(e).splitlines()[0][:160]}); the last checkpoint is intact: rerun the same "
              "command with --resume", file=streams[1], flush=True)
        return 1
    finally:
        sys.stdout, sys.stderr = streams


if __name__ == "__main__":
    sys.exit(main())
