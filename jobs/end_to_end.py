"""End-to-end job: `ray job submit --working-dir . -- python -m jobs.end_to_end [--recipe R] [--data F ...]`.

Thin entrypoint: parse arguments, set up logging (console quiet, OUT/logs/ everything; -v
for all of it on the console), build the recipe, call eagle_ray.job.pipeline. A fault the
user can fix ends the job in one line naming it (its traceback with -v); a bug keeps its
traceback.
"""

import argparse
import sys

from eagle_ray.common import logs
from eagle_ray.recipes import load_recipe
from eagle_ray.job.pipeline import SAMPLE_DATA, run_end_to_end


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="tiny_cpu")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    p.add_argument("--data", action="append", metavar="PATH[:COUNT_OR_FRACTION][::LABEL]",
                   help="conversation logs to mix (default: the bundled sample data set)")
    p.add_argument("--out", default="out/run")
    p.add_argument("--online", action="store_true",
                   help="train online: features from extractor actors, no hidden-state store")
    p.add_argument("--init-from", metavar="DRAFTER_DIR",
                   help="fine-tune a published EAGLE-3 drafter (vLLM/SpecForge or speculators "
                        "layout) instead of training from scratch (= --set train.init_from=DIR)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="everything on the console: vLLM, Ray Data and Ray Train INFO, tracebacks")
    args = p.parse_args(argv)
    if args.init_from:
        args.set.append(f"train.init_from={args.init_from}")
    from eagle_ray.common import signals
    from eagle_ray.common.errors import run_for_a_person
    from eagle_ray.common.threads import take_driver_threads

    signals.install()  # `ray job stop` sends SIGTERM: one line, not an abort
    args.verbose = args.verbose or logs.verbose()

    def job() -> int:
        log_dir = logs.setup(args.out, verbose_flag=args.verbose)
        if argv is None:  # the job's own process, not a test calling main()
            logs.filter_native_stderr(log_dir)
        take_driver_threads()  # Ray's job supervisor leaves its entrypoint one CPU thread
        run_end_to_end(load_recipe(args.recipe, args.set), args.data or SAMPLE_DATA, args.out,
                       online=args.online)
        return 0

    return run_for_a_person(job, "end_to_end", verbose=args.verbose, kept=lambda: (
        f"every finished step and every committed sample in {args.out} is kept; submit the "
        "same job (same --out) again to resume"))


if __name__ == "__main__":
    sys.exit(main())
