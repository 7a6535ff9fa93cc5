"""End-to-end job: `ray job submit --working-dir . -- python -m jobs.end_to_end [--recipe R] [--data F ...]`.

Thin entrypoint: parse arguments, build the recipe, call eagle_ray.job.pipeline.
"""

import argparse
import logging
import sys

from eagle_ray.recipes import load_recipe
from eagle_ray.job.pipeline import SAMPLE_DATA, run_end_to_end


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="tiny_cpu")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    p.add_argument("--data", action="append", metavar="PATH[:COUNT_OR_FRACTION]",
                   help="conversation logs to mix (default: the bundled sample data set)")
    p.add_argument("--out", default="out/run")
    p.add_argument("--online", action="store_true",
                   help="train online: features from extractor actors, no hidden-state store")
    p.add_argument("--init-from", metavar="DRAFTER_DIR",
                   help="fine-tune a published EAGLE-3 drafter (vLLM/SpecForge or speculators "
                        "layout) instead of training from scratch (= --set train.init_from=DIR)")
    args = p.parse_args(argv)
    if args.init_from:
        args.set.append(f"train.init_from={args.init_from}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run_end_to_end(load_recipe(args.recipe, args.set), args.data or SAMPLE_DATA, args.out,
                       online=args.online)
    except (ValueError, FileNotFoundError) as e:
        print(f"end_to_end: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
