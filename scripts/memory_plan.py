"""Print the per-GPU memory plan of a recipe and layout; no GPU or model needed.

    python scripts/memory_plan.py +recipe=qwen_4b
    python scripts/memory_plan.py +recipe=qwen_8b cluster.colocate=false rollout.num_gpus=4 train.ranks_per_node=4
    python scripts/memory_plan.py +recipe=qwen_8b --gpu H200        # or --gpu-memory-gib 141
    python scripts/memory_plan.py +recipe=qwen_4b --te no           # Megatron without TE

Arguments are Hydra overrides, composed exactly as ``python -m trainer.main`` composes them
(``config.compose.compose_config``). ``--gpu`` / ``--gpu-memory-gib`` set the GPU for this plan
(the same as ``cluster.gpu_type`` / ``cluster.gpu_memory_gib`` where the config has them).
``--te``: whether the training ranks have Transformer Engine (yes / no; auto, the default:
whether it imports here, as the start-up check decides). Without it Megatron's attention
materialises the score matrix.
Exit status: 0 when the layout fits, 1 when it does not (the start-up check would refuse
it, with the message printed last), 2 for a config error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from config import ConfigError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", help="GPU type: H100, H200, A100, A100-40GB")
    parser.add_argument("--gpu-memory-gib", type=float, help="GiB per GPU (overrides --gpu's table value)")
    parser.add_argument("--te", choices=("auto", "yes", "no"), default="auto",
                        help="Transformer Engine on the training ranks (auto: importable here)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. +recipe=qwen_4b")
    args = parser.parse_intermixed_args(argv)

    from config import compose_config
    from trainer.driver.memory_plan import plan_memory

    try:
        config = compose_config(args.overrides)
        if config.cluster.device != "cuda":
            print(f"{config.derived.label}: cluster.device={config.cluster.device}: no GPU memory "
                  "to plan (GPU recipes: qwen_0_6b, qwen_4b, qwen_8b)")
            return 0
        te = {"auto": None, "yes": True, "no": False}[args.te]
        plan = plan_memory(config, gpu=args.gpu, gpu_memory_gib=args.gpu_memory_gib,
                           transformer_engine=te)
    except ConfigError as err:
        print(f"homegym: invalid config: {err}", file=sys.stderr)
        return 2
    print(plan.table())
    message = plan.error_message()
    if message:
        print("\nthe start-up check would refuse it:\n" + message)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
