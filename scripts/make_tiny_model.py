"""Build (or find) a built-in offline model and print its directory.

    python scripts/make_tiny_model.py                 # tiny-qwen3
    python scripts/make_tiny_model.py smollm2-135m    # SmolLM2-135M-Instruct from its GGUF
"""

import argparse

from rollout.models import BUILTIN_MODELS, resolve_model_path

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", nargs="?", default="tiny-qwen3", choices=BUILTIN_MODELS)
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args()
    print(resolve_model_path(args.name, args.cache_dir))
