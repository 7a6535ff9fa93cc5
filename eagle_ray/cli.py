"""`eagle-ray` command line: parse arguments, build a config, call the package.

No logic lives here. Heavy imports (torch, transformers, vllm, ray) happen inside the
commands so `eagle-ray --help` is instant. User errors (bad input, bad --set, missing
files) print one clear line and exit 2; they never print a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Callable


def _recipe(args):
    from eagle_ray.recipes import load_recipe

    return load_recipe(args.recipe, args.set)


def _add_recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", default="tiny_cpu", help="named recipe (default: tiny_cpu)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a recipe field, e.g. --set storage.dtype=fp8_e4m3 (repeatable)")


@dataclasses.dataclass(frozen=True)
class Command:
    """One `eagle-ray` command: its name, help, whether it takes --recipe/--set, its own
    arguments (argparse's add_argument arguments) and its handler."""

    name: str
    help: str
    recipe: bool
    args: tuple
    fn: Callable[[argparse.Namespace], int]


COMMANDS: list[Command] = []  # in the order `eagle-ray --help` lists them
GROUP_HELP = {"store": "hidden-state store tools"}


def arg(*names, **kwargs) -> tuple:
    """One argument of a command (what `ArgumentParser.add_argument` takes)."""
    return names, kwargs


def command(name: str, help: str, *, recipe: bool = False, args: list[tuple] = ()):
    """Register the decorated handler as `eagle-ray NAME` with these arguments."""
    def register(fn):
        COMMANDS.append(Command(name, help, recipe, tuple(args), fn))
        return fn
    return register


@command("tiny-target", "build the tiny local target model + tokenizer", args=[
    arg("out_dir"),
    arg("--seed", type=int, default=0),
    arg("--arch", choices=("llama", "kimi_k25"), default="llama",
        help="llama: the tiny Llama (recipe tiny_cpu); kimi_k25: the Kimi-K2.5 twin "
             "(multimodal wrapper, DeepSeek-V3 MLA + MoE text model; tiny_kimi_cpu)"),
])
def cmd_tiny_target(args) -> int:
    if args.arch == "kimi_k25":
        from eagle_ray.targets.tiny.kimi import build_tiny_kimi as build
    else:
        from eagle_ray.targets.tiny.target import build_tiny_target as build

    out = Path(args.out_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty; choose a new directory")
    stats = build(out, seed=args.seed)
    print(json.dumps(stats, indent=2))
    return 0


@command("recipes", "list recipes, or print one resolved (with --set)", args=[
    arg("name", nargs="?"),
    arg("--set", action="append", default=[]),
    arg("--check-target", metavar="DIR",
        help="validate a downloaded checkpoint's config, weight index and tokenizer "
             "against the recipe (no weights loaded); exit 1 on any mismatch"),
    arg("--from-target", metavar="DIR",
        help="print the recipe derived from a checkpoint directory (what `--recipe DIR` "
             "runs with), checked against it"),
])
def cmd_recipes(args) -> int:
    from eagle_ray.recipes import RECIPES, load_recipe

    if args.from_target:
        from eagle_ray.targets.check import check_target_dir

        recipe = load_recipe("auto", [f"target.path={args.from_target}", *args.set])
        print(recipe.to_json())
        problems = check_target_dir(recipe, args.from_target)
        for p in problems:
            print(f"MISMATCH {p}")
        print(f"{args.from_target}: derived recipe "
              + ("matches the checkpoint" if not problems else f"has {len(problems)} mismatch(es)")
              + f"; run any command with --recipe {args.from_target}", file=sys.stderr)
        return 1 if problems else 0
    if args.check_target:
        from eagle_ray.targets.check import check_target_dir

        if not args.name:
            raise ValueError("--check-target needs a recipe name: eagle-ray recipes NAME --check-target DIR")
        problems = check_target_dir(load_recipe(args.name, args.set), args.check_target)
        for p in problems:
            print(f"MISMATCH {p}")
        print(f"{args.check_target}: {'matches' if not problems else f'{len(problems)} mismatch(es) with'} "
              f"recipe {args.name}")
        return 1 if problems else 0
    if args.name:
        print(load_recipe(args.name, args.set).to_json())
    else:
        for name, fn in RECIPES.items():
            print(f"{name:<18} {(fn.__doc__ or '').strip().splitlines()[0]}")
    return 0


@command("ingest", "validate, split, dedupe and mix conversation logs", recipe=True, args=[
    arg("--input", action="append", required=True, metavar="PATH[:COUNT_OR_FRACTION][::LABEL]",
        help="JSONL source; repeat to mix (data.jsonl:1000 = 1000 samples, :0.5 = half; "
             "::personal labels it, else its file stem names it in every report)"),
    arg("--out", required=True),
    arg("--seed", type=int, default=0),
    arg("--no-lengths", action="store_true",
        help="skip token counting (stats and plan then need a later stage's table)"),
    arg("--token-workers", type=int, default=None, metavar="N",
        help="count tokens on N Ray tokenizer actors (default: the connected cluster's "
             "CPUs for large inputs, else this process)"),
])
def cmd_ingest(args) -> int:
    from eagle_ray.data.ingest import SourceSpec, ingest, problems, summary_line
    from eagle_ray.data.tokenize import length_annotator

    sources = [SourceSpec.parse(s) for s in args.input]
    annotate = None if args.no_lengths else length_annotator(_recipe(args), workers=args.token_workers)
    res = ingest(sources, args.out, seed=args.seed, annotate=annotate)  # progress: logging
    for src, c in res.per_source.items():
        reasons = res.reject_reasons_per_source.get(src)
        print(f"{src}: " + ", ".join(f"{k} {v:,}" for k, v in c.items())
              + (f" ({', '.join(f'{k} {v:,}' for k, v in reasons.items())})" if reasons else "")
              + (f"; {res.with_tools[src]:,} of the accepted are agent sessions (with tools)"
                 if res.with_tools.get(src) else ""))
    print(summary_line(res.counters()))
    if res.reject_reasons:
        print("rejects by reason: " + ", ".join(f"{k} {v:,}" for k, v in sorted(res.reject_reasons.items())))
    print(f"wrote {res.out_dir}/prompts.parquet (rejects: {res.out_dir}/rejects.jsonl)")
    bad = problems(res.counters(), res.out_dir)
    for p in bad:
        print(f"error: {p}", file=sys.stderr)
    return 1 if bad else 0


@command("stats", "token statistics of an ingested/generated/extracted table", args=[
    arg("path"),
    arg("--json", action="store_true"),
])
def cmd_stats(args) -> int:
    from eagle_ray.data.stats import compute_stats, format_stats

    stats = compute_stats(args.path)
    print(json.dumps(stats, indent=2) if args.json else format_stats(stats))
    return 0


@command("plan", "hidden-state storage and data-scale plan for a recipe", recipe=True, args=[
    arg("--stats", help="a table or directory from ingest (sample count and lengths)"),
    arg("--out", help="where the store will be written (default: storage.out_dir)"),
    arg("--json", action="store_true"),
])
def cmd_plan(args) -> int:
    from eagle_ray.plan.budget import format_plan, plan_for_table, plan_from_recipe

    recipe = _recipe(args)
    if args.stats:
        _, plan = plan_for_table(recipe, args.stats, out_dir=args.out)
    else:
        plan = plan_from_recipe(recipe, out_dir=args.out)
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
    return 0 if plan.fits else 3


@command("generate", "regenerate final assistant turns with the target (vLLM on Ray)", recipe=True, args=[
    arg("--prompts", required=True, help="ingest output directory or prompts.parquet"),
    arg("--out", required=True),
    arg("--keep-logged", action="store_true",
        help="keep the logged responses instead of regenerating (recorded in the manifest)"),
    arg("--limit", type=int, help="only the first N prompts (smoke runs)"),
])
def cmd_generate(args) -> int:
    from eagle_ray.generate.run import run_generate

    if args.keep_logged:  # first, so --set data.train_turns=all (keep-logged only) is valid
        args.set = ["generate.mode=keep_logged", *args.set]
    recipe = _recipe(args)
    print(run_generate(recipe, args.prompts, args.out, limit=args.limit).summary_line())
    return 0


@command("extract", "capture target hidden states into a store (Ray actor pool)", recipe=True, args=[
    arg("--conversations", required=True, help="generate output dir or conversations.parquet"),
    arg("--out", required=True, help="the hidden-state store directory"),
    arg("--limit", type=int, help="only the first N conversations (smoke runs)"),
])
def cmd_extract(args) -> int:
    from eagle_ray.extract.run import run_extract

    print(run_extract(_recipe(args), args.conversations, args.out, limit=args.limit).summary_line())
    return 0


@command("generate-extract", "generate and extract in one streamed Ray Data pipeline (resumable; "
                             "same outputs as generate then extract)", recipe=True, args=[
    arg("--prompts", required=True, help="ingest output directory or prompts.parquet"),
    arg("--generated", required=True,
        help="where the conversations go (the generate output directory)"),
    arg("--out", required=True, help="the hidden-state store directory"),
    arg("--placement", choices=("separate", "colocated"),
        help="override the recipe's extract.placement: separate generation and "
             "extractor pools, or one engine per replica that does both"),
])
def cmd_generate_extract(args) -> int:
    from eagle_ray.config import apply_overrides
    from eagle_ray.stream.run import run_generate_extract

    recipe = _recipe(args)
    if args.placement:
        recipe = apply_overrides(recipe, {"extract.placement": args.placement})
    print(run_generate_extract(recipe, args.prompts, args.generated, args.out).summary_line())
    return 0


@command("scale", "resize a running job's pool (extract or generate) without "
                  "restarting it; no arguments: show the pools", args=[
    arg("stage", nargs="?", choices=("extract", "generate")),
    arg("replicas", nargs="?", type=int, metavar="N"),
    arg("--job", help="submission id (or Ray job id) of the job; default: the only "
                      "eagle_ray job running"),
    arg("--address", help="Ray cluster (GCS) address; default RAY_ADDRESS or the "
                          "cluster this machine runs"),
    arg("--wait", type=float, default=0.0, metavar="S",
        help="wait up to S seconds until the pool has N running replicas"),
])
def cmd_scale(args) -> int:
    import time

    from eagle_ray.ops.cluster import init_ray
    from eagle_ray.ops.control import scale

    if (args.stage is None) != (args.replicas is None):
        raise ValueError("give both STAGE and N (e.g. `eagle-ray scale extract 2`), or neither "
                         "to show the pools")
    import os

    from eagle_ray.ops.cluster import resolve_address

    if args.address:
        os.environ["RAY_ADDRESS"] = args.address
    if resolve_address(None)[0] is None:  # never start a cluster of our own here
        raise ValueError("no running Ray cluster found: pass --address (the GCS address, e.g. "
                         "127.0.0.1:6379) or set RAY_ADDRESS")
    init_ray(namespace="eagle_ray")
    t0 = time.time()
    scale(args.stage, args.replicas, args.job, wait_s=args.wait)
    if args.wait and args.stage:
        print(f"({time.time() - t0:.1f}s)")
    return 0


@command("train", "train the EAGLE-3 drafter with Ray Train DDP (resumes RUN_DIR)", recipe=True, args=[
    arg("--store", help="hidden-state store (offline training)"),
    arg("--conversations", help="generate output dir: train ONLINE, features from "
                                "extractor actors through the object store, no store"),
    arg("--out", required=True, help="run directory (re-run to resume)"),
])
def cmd_train(args) -> int:
    from eagle_ray.train.run import run_train, summary_line

    if (args.store is None) == (args.conversations is None):
        raise ValueError("train needs exactly one of --store STORE (offline) or --conversations "
                         "GEN_DIR (online: features from extractor actors, no store)")
    m = run_train(_recipe(args), args.store, args.out, conversations=args.conversations)
    print(summary_line(m, args.out))
    return 0


@command("export", "write a drafter directory vLLM loads (method eagle3)", args=[
    arg("--run", required=True, help="training run directory"),
    arg("--out", required=True, help="drafter directory"),
    arg("--evaluation", help="an `eagle-ray evaluate` report.json of this drafter: "
                             "serving.json then recommends the draft_sample_method it measured best"),
])
def cmd_export(args) -> int:
    from eagle_ray.export.drafter import export_drafter, summary_line

    print(summary_line(export_drafter(args.run, args.out, evaluation=args.evaluation)))
    return 0


@command("evaluate", "offline + online (vLLM) acceptance vs untrained and n-gram", recipe=True, args=[
    arg("--drafter", required=True),
    arg("--prompts", required=True, help="ingest output dir (held-out prompts are used)"),
    arg("--out", required=True),
    arg("--k", type=int, help="draft tokens per step (default drafter.num_speculative_tokens)"),
    arg("--limit", type=int, help="held-out prompts to run online (default evaluate.prompts)"),
    arg("--seeds", type=int,
        help="seeds at the serving profile (default evaluate.seeds; 0: greedy only)"),
    arg("--baseline-drafter", metavar="DIR",
        help="also measure this drafter (e.g. the published one the run started from)"),
])
def cmd_evaluate(args) -> int:
    from eagle_ray.evaluate.run import problems, run_evaluate, summary_lines

    r = run_evaluate(_recipe(args), args.drafter, args.prompts, args.out, k=args.k, limit=args.limit,
                     seeds=args.seeds, baseline_drafter=args.baseline_drafter)

    print("\n".join(summary_lines(r, args.out)))
    bad = problems(r)
    for p in bad:
        print(f"error: {p}; see {args.out}/report.md", file=sys.stderr)
    return 1 if bad else 0


@command("curve", "would more data help? train on nested fractions, fit acceptance "
                  "against training tokens, extrapolate", recipe=True, args=[
    arg("--run", required=True, help="training run directory (its store and split are used)"),
    arg("--out", required=True),
    arg("--fractions", help="comma-separated, e.g. 0.125,0.25,0.5,1 (default curve.fractions)"),
    arg("--steps", type=int, help="training steps per fraction (default curve.steps or train.max_steps)"),
    arg("--prompts", help="ingest output dir: the largest fraction also runs online as served"),
    arg("--online-prompts", type=int, help="held-out prompts for that (default curve.online_prompts)"),
    arg("--seed", type=int, default=0, help="the prompt order the fractions are cut from"),
])
def cmd_curve(args) -> int:
    from eagle_ray.evaluate.curve import run_curve

    fr = [float(x) for x in args.fractions.split(",")] if args.fractions else None
    r = run_curve(_recipe(args), args.run, args.out, fractions=fr, steps=args.steps,
                  prompts=args.prompts, online_prompts=args.online_prompts, seed=args.seed)
    for p in r["points"]:
        print(f"curve: fraction {p['fraction']:g}: {p['samples']:,} samples, {p['tokens']:,} tokens, "
              + ", ".join(f"{m.replace('_', ' ')} {p[m]:.3f}" for m in r["fits"]))
    print(r["sentence"])
    print(f"-> {args.out}/curve.md, curve.png")
    return 0


@command("check", "verify serving feeds the drafter the features it was trained on", recipe=True, args=[
    arg("--drafter", required=True),
    arg("--store", help="the store it was trained on (omit for a drafter trained "
                        "online: its features are captured again from its run's data)"),
    arg("--target", help="target model directory (default: the recipe's target)"),
    arg("--static-only", action="store_true", help="config checks only (no vLLM)"),
])
def cmd_check(args) -> int:
    from eagle_ray.evaluate.check import run_check

    r = run_check(_recipe(args), args.drafter, args.store, args.target, runtime=not args.static_only)
    for k, v in r.details.items():
        print(f"{k}: {v}")
    for p in r.problems:
        print(f"FAIL {p}")
    print(r.summary_line(args.drafter))
    print("OK: serving feeds the drafter the features it was trained on" if r.ok else "CHECK FAILED")
    return 0 if r.ok else 1


@command("store verify", "check every shard against the index; non-zero exit on problems", args=[
    arg("store"),
    arg("--json", action="store_true"),
    arg("--no-checksums", action="store_true",
        help="structure and segment headers only (seconds for any size)"),
])
def cmd_store_verify(args) -> int:
    from eagle_ray.store.reader import verify_store

    rep = verify_store(args.store, checksums=not args.no_checksums)
    if args.json:
        print(json.dumps(rep, indent=2))
    else:
        print(f"{rep['store']}: {rep['samples']:,} samples, {rep['tokens']:,} tokens in "
              f"{rep['shards']:,} shards")
        how = ("structure and segment headers, no checksums" if args.no_checksums else
               f"checksums of {rep['bytes_hashed'] / 1e9:,.2f} GB at "
               f"{rep['bytes_hashed'] / 1e9 / max(rep['seconds'], 1e-9):,.2f} GB/s")
        print(f"verified in {rep['seconds']:.2f}s ({how})")
        for p in rep["problems"]:
            print(f"PROBLEM {p}")
        for o in rep["orphans"]:
            print(f"ORPHAN  {o} (no index row points to it)")
        for t in rep["interrupted"]:
            print(f"LEFTOVER {t} (an interrupted write: nothing of it is committed; the next "
                  "extract or `store repair` removes it)")
        print("OK" if rep["ok"] else "FAILED")
    return 0 if rep["ok"] else 1


@command("store compact", "merge the committed index parts into one index file "
                          "(atomic; safe while writers run; stores of any age)", args=[
    arg("store"),
])
def cmd_store_compact(args) -> int:
    from eagle_ray.store.compact import compact, live_index_files

    before = len(live_index_files(args.store))
    res = compact(args.store, everything=True)
    after = len(live_index_files(args.store))
    print(f"{args.store}: index files {before:,} -> {after:,}"
          + (f" ({res['rows']:,} rows merged)" if res else " (nothing to merge)"))
    return 0


@command("store repair", "drop duplicate commits (keeping one verified copy), "
                         "damaged samples, orphan shards and temp files", args=[
    arg("store"),
    arg("--dry-run", action="store_true", help="report what would be removed"),
    arg("--json", action="store_true"),
])
def cmd_store_repair(args) -> int:
    from eagle_ray.store.repair import repair_store

    rep = repair_store(args.store, dry_run=args.dry_run)
    if args.json:
        print(json.dumps(rep, indent=2))
        return 0
    verb = "would drop" if args.dry_run else "dropped"
    print(f"{rep['store']}: {rep['samples']:,} samples kept; {verb} {rep['duplicates_dropped']:,} "
          f"duplicate commit(s), {len(rep['damaged_dropped']):,} damaged sample(s), "
          f"{len(rep['parts_dropped']):,} unreadable index part(s), "
          f"{len(rep['shards_removed']):,} shard(s), {len(rep['temp_files_removed']):,} temp file(s), "
          f"{rep['bytes_dropped']:,} shard bytes no committed write owned (lost index parts)")
    for d in rep["damaged_dropped"]:
        print(f"DROPPED {d}")
    if rep["damaged_dropped"] or rep["parts_dropped"] or rep["bytes_dropped"]:
        print("re-run `eagle-ray extract` into this store to redo the dropped samples")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command in COMMANDS (each one's arguments are next to its handler)."""
    parser = argparse.ArgumentParser(prog="eagle-ray", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for c in COMMANDS:
        where = sub
        if " " in c.name:  # a tool group: `eagle-ray store verify`
            group, _, name = c.name.partition(" ")
            if group not in groups:
                groups[group] = sub.add_parser(group, help=GROUP_HELP[group]).add_subparsers(
                    dest=f"{group}_command", required=True)
            where = groups[group]
        p = where.add_parser(c.name.rpartition(" ")[2], help=c.help)
        if c.recipe:
            _add_recipe_args(p)
        for a, kw in c.args:
            p.add_argument(*a, **kw)
        p.set_defaults(fn=c.fn)
    return parser


def kept_after_stop(args) -> str:
    """What a stopped command leaves committed, and how to go on."""
    again = "re-run the same command to resume"
    out = Path(getattr(args, "out", None) or ".")
    try:
        if args.command in ("extract", "generate-extract"):
            from eagle_ray.store.reader import committed_ids

            n = len(committed_ids(out)) if (out / "manifest.json").exists() else 0
            return f"{n:,} samples committed in {out} are kept; {again}"
        if args.command == "generate":
            from eagle_ray.generate.run import PARTS_DIR, done_prompts

            n = len(done_prompts(out / PARTS_DIR)) if (out / PARTS_DIR).exists() else 0
            return f"{n:,} prompts generated in {out} are kept; {again}"
        if args.command == "train":
            from eagle_ray.train.checkpoint import newest_loadable

            ckpt = newest_loadable(out)
            return (f"checkpoint {ckpt.name} in {out} is intact; {again}" if ckpt else
                    f"no checkpoint was written yet; {again} (it starts over)")
    except Exception as e:  # reporting must not hide the stop
        return f"could not count what was kept ({e}); {again}"
    return again


# Commands whose --out is a run output directory: their logs go to OUT/logs.
LOGGED_COMMANDS = {"generate", "extract", "generate-extract", "train", "evaluate", "curve"}


def main(argv: list[str] | None = None) -> int:
    from eagle_ray.common import logs, signals
    from eagle_ray.common.errors import run_for_a_person

    signals.install()  # SIGTERM / Ctrl-C: one line with what is kept (kept_after_stop)
    from_command_line = argv is None
    args = build_parser().parse_args(argv)
    args.verbose = args.verbose or logs.verbose()  # -v or EAGLE_RAY_LOG_LEVEL=DEBUG

    def command() -> int:
        # Quiet console, the run's log file under --out for the commands that run Ray / vLLM.
        log_dir = logs.setup(args.out if args.command in LOGGED_COMMANDS else None,
                             verbose_flag=args.verbose)
        if from_command_line:  # not when a test calls main() in its own process
            logs.filter_native_stderr(log_dir)
        return args.fn(args)

    return run_for_a_person(command, f"eagle-ray {args.command}", verbose=args.verbose,
                            kept=lambda: kept_after_stop(args))


if __name__ == "__main__":
    sys.exit(main())
