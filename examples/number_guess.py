"""Multi-turn RL: guess a number from 1 to 20 -- the seed tutorial, on your own machine.

    python examples/number_guess.py            # the full CPU recipe (several minutes)
    python examples/number_guess.py --quick    # a smoke run (about a minute or two)
    python examples/number_guess.py train.num_steps=10 warmup.steps=200   # Hydra overrides

This is the hosted-gym notebook with homegym's API. Edits from the seed:
  * imports: ``from trainer.api import ...`` and ``from rollout import ...`` (not slime);
    the seed's generate function is imported from examples/number_guess_seed.py;
    the model/recipe are the CPU ones (``TinyQwen3``, ``NumberGuessCPURecipe``); on a GPU
    node use ``Qwen3_4B()`` / ``Qwen3_4B_Recipe(...)`` and the seed's arguments verbatim;
  * ``number_guess_rm`` also reads the built-in env driver's flat metadata (one line);
  * the offline evaluator sends the game as a chat (user prompt, assistant guess, user
    feedback, ...), which is how the built-in driver plays it during training;
  * endpoints are shut down when done (``with``), so a 2-core box is not oversubscribed.

About ``number_guess_generate``: the seed's function posts raw text and re-tokenizes each
segment. It works here unchanged (pass ``--seed-generate``), but the ~1M-parameter CPU model
is taught the chat format by the recipe's warm-up, so the CPU recipe lets homegym's built-in
environment driver (envs/number_guess.py, token-in/token-out) play the game instead;
``number_guess_rm`` -- a function defined in this script, i.e. in ``__main__`` -- is still the
reward: homegym ships it to the Ray workers by value.
"""

import json
import sys

from trainer.api import (
    DatasetConfig,
    Endpoint,
    NumberGuessCPURecipe,
    TinyQwen3,
    TrainJob,
)
from examples.number_guess_seed import (
    _MAX_TURNS,
    _extract_answer,
    _trajectory_reward,
    number_guess_generate,
)

# Build a deterministic guessing dataset: train on odd targets, evaluate on even targets.

_MAX_VALUE = 20
_PROMPT = (
    "You are playing a number guessing game.\n"
    "The hidden integer is between 1 and 20.\n"
    "Return only guesses in this exact format: <answer>N</answer> "
    "where N is an integer between 1 and 20.\n"
    "After each guess, you will receive <feedback>higher</feedback> or "
    "<feedback>lower</feedback>, and must update your next guess accordingly."
)

TRAIN_TARGETS = list(range(1, _MAX_VALUE + 1, 2))
TEST_TARGETS = list(range(2, _MAX_VALUE + 1, 2))


class NumberGuessDataset(DatasetConfig):
    input_key = "messages"
    label_key = "label"
    apply_chat_template = True
    input_column = "prompt"
    always_prepare = True  # prepare the dataset every time, in case of stale data

    def load(self, split="all"):
        targets = TRAIN_TARGETS if split == "train" else TEST_TARGETS
        return [{"prompt": _PROMPT, "target": target} for target in targets]

    def prepare(self, path: str, eval_paths: dict[str, str] | None = None):
        import os

        from datasets import Dataset

        os.makedirs(os.path.dirname(path), exist_ok=True)

        def _row(target: int) -> dict:
            return {
                "messages": [{"role": "user", "content": _PROMPT}],
                "label": json.dumps({"answer": target}),
            }

        train_rows = [_row(target) for target in TRAIN_TARGETS for _ in range(20)]
        eval_rows = [_row(target) for target in TEST_TARGETS]

        Dataset.from_list(train_rows).to_parquet(path)
        if eval_paths:
            for eval_path in eval_paths.values():
                os.makedirs(os.path.dirname(eval_path), exist_ok=True)
                Dataset.from_list(eval_rows).to_parquet(eval_path)


train_dataset = NumberGuessDataset()

eval_dataset = NumberGuessDataset()

# Multi-turn environment and reward (PipelineRL-style shaping):
#   success: 2.0 - 0.1 * (turns - 1); malformed output: -2.0; otherwise: -1.0
# The seed's generate function and parsing helpers come from examples/number_guess_seed.py
# (verbatim there); the reward stays in this script, shipped by value as a notebook's is.

async def number_guess_rm(args, sample, **kwargs) -> float:
    sample_metadata = getattr(sample, "metadata", None)
    # homegym edit: the built-in env driver keeps the same keys at the top level.
    guessing_meta = (sample_metadata.get("guessing", sample_metadata)
                     if isinstance(sample_metadata, dict) else {})

    success = bool(guessing_meta.get("success", False))
    format_error = bool(guessing_meta.get("format_error", False))
    turns_taken = int(guessing_meta.get("turns_taken", getattr(args, "max_turns", _MAX_TURNS)))
    return _trajectory_reward(
        success=success,
        format_error=format_error,
        turns_taken=turns_taken,
    )


# Offline multi-turn trajectory evaluator (through the OpenAI-compatible endpoint).


def run_guessing_trajectory(
    deployment: Endpoint,
    *,
    target: int,
    max_turns: int = _MAX_TURNS,
) -> dict:
    messages = [{"role": "user", "content": _PROMPT}]
    trace = ""
    for turn in range(max_turns):
        msg = deployment.chat(
            messages,
            chat_template_kwargs={"enable_thinking": False},
        )
        response = msg.get("content") or msg.get("reasoning_content") or ""
        guess = _extract_answer(response)
        if guess is None:
            return {
                "success": False,
                "format_error": True,
                "turns_taken": turn + 1,
                "response": trace + response,
            }
        if guess == target:
            return {
                "success": True,
                "format_error": False,
                "turns_taken": turn + 1,
                "response": trace + response,
            }
        feedback = "higher" if guess < target else "lower"
        trace += f"{response}\n<feedback>{feedback}</feedback>\n"
        messages += [
            {"role": "assistant", "content": response},
            {"role": "user", "content": f"<feedback>{feedback}</feedback>"},
        ]
    return {
        "success": False,
        "format_error": False,
        "turns_taken": max_turns,
        "response": trace,
    }


def guessing_eval_fn(
    deployment: Endpoint,
    example: dict,
) -> dict:
    target = int(example["target"])
    trajectory = run_guessing_trajectory(
        deployment,
        target=target,
        max_turns=_MAX_TURNS,
    )
    reward = _trajectory_reward(
        success=trajectory["success"],
        format_error=trajectory["format_error"],
        turns_taken=trajectory["turns_taken"],
    )
    return {
        "score": reward,
        "response": trajectory["response"],
        "metadata": {
            "success": trajectory["success"],
            "format_error": trajectory["format_error"],
            "turns_taken": trajectory["turns_taken"],
            "target": target,
        },
    }


def summarize_eval(rows: list[dict]) -> dict:
    n = max(len(rows), 1)
    return {
        "success_rate": sum(1 for row in rows if row["metadata"].get("success")) / n,
        "mean_turns": sum(int(row["metadata"].get("turns_taken", _MAX_TURNS)) for row in rows) / n,
        "format_error_rate": sum(1 for row in rows if row["metadata"].get("format_error")) / n,
    }


def run_eval(
    deployment, *, max_concurrency: int = 2
) -> tuple[float, list[dict]]:
    from concurrent.futures import ThreadPoolExecutor

    deployment.wait_until_ready(timeout=15 * 60)

    def _score_one(example):
        return guessing_eval_fn(deployment, example)

    with ThreadPoolExecutor(max_workers=max_concurrency) as executor:
        rows = list(executor.map(_score_one, eval_dataset.load()))
    mean = sum(r["score"] for r in rows) / len(rows) if rows else float("nan")
    return mean, rows


QUICK = [  # a smoke run: few steps, a small batch, a short warm-up
    "train.num_steps=2", "train.save_interval=2", "warmup.steps=5", "warmup.batch_size=8",
    "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=4", "rollout.num_engines=1",
    "train.ranks_per_node=1", "eval.n_samples_per_prompt=1", "eval.before_and_after=false",
]


def main(argv: list[str]) -> dict:
    quick = "--quick" in argv
    seed_generate = "--seed-generate" in argv
    overrides = [a for a in argv if not a.startswith("--")]
    overrides = (QUICK if quick else []) + overrides
    if not any(o.startswith("logging.wandb_mode=") for o in overrides):
        overrides.append("logging.wandb_mode=offline")

    # Serve and evaluate the base model
    model = TinyQwen3()
    with Endpoint.launch(model, unauthenticated=True, recreate_if_existing=True,
                         overrides=overrides) as base_deployment:
        print(f"Base model URL: {base_deployment.url}")
        base_mean, base_rows = run_eval(base_deployment)
    base_summary = summarize_eval(base_rows)
    print(f"Base success rate: {base_summary['success_rate']:.2%}")
    print(f"Base mean reward: {base_mean:.3f}")
    print(f"Base mean turns:  {base_summary['mean_turns']:.2f}")

    # Train with the multi-turn environment and our reward function
    config = TrainJob(
        model=model,
        dataset=train_dataset,
        recipe=NumberGuessCPURecipe(
            eval_interval=None,
            custom_rm_function=number_guess_rm,
            **({"custom_generate_function": number_guess_generate} if seed_generate else {}),
            extra_config={
                "max_turns": _MAX_TURNS,
                "log_multi_turn": True,
            },
            colocate=True,
            rollout_temperature=1.0,
            apply_chat_template_kwargs='{"enable_thinking": false}',
            overrides=overrides,
        ),
    )
    print("Starting training...")
    run = config.launch()
    print(f"run id: {run.training_run_id}")

    # Evaluate the trained checkpoint
    result = run.result()
    checkpoint = result.checkpoints()[-1]
    with Endpoint.launch(model, checkpoint, unauthenticated=True, recreate_if_existing=True,
                         overrides=overrides) as trained_deployment:
        print(f"Trained model URL: {trained_deployment.url}")
        trained_mean, trained_rows = run_eval(trained_deployment)
    trained_summary = summarize_eval(trained_rows)

    table = "\n".join([
        "| model | success | mean reward | mean turns | format errors |",
        "|---|---|---|---|---|",
        *(f"| {name} | {s['success_rate']:.1%} | {mean:+.3f} | {s['mean_turns']:.2f} | "
          f"{s['format_error_rate']:.1%} |"
          for name, s, mean in (("base", base_summary, base_mean),
                                ("trained", trained_summary, trained_mean))),
    ])
    print("\n" + table)
    (result.run_dir / "example_eval_table.md").write_text(table + "\n")
    return {"run_dir": str(result.run_dir), "checkpoint": str(checkpoint),
            "base": {"mean_reward": base_mean, **base_summary},
            "trained": {"mean_reward": trained_mean, **trained_summary}}


if __name__ == "__main__":
    summary = main(sys.argv[1:])
    print("RESULT " + json.dumps(summary))
