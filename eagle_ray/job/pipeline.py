"""The end-to-end pipeline, step by step (the job in jobs/end_to_end.py calls this).

    target -> ingest -> stats/plan -> generate+extract -> train -> export -> check -> evaluate
    OUT/    ingest/              generate/   store/    train/  drafter/ check.json evaluate/

Each step writes under OUT/ with the same code as its CLI command, and is skipped when its
output is already complete, so a failed or stopped job resumes when it is submitted again:

  step      complete when                                          when not complete
  ingest    ingest/report.json (written last)                      re-run (deterministic ids)
  generate  generate/manifest.json: no prompt pending              resume: skip done samples
  extract   every conversation committed in store/index            resume: skip committed samples
            (generate and extract stream in one Ray Data pipeline, eagle_ray/stream/run.py:
            separate pools, or one colocated engine per replica for whole-node targets)
  train     newest loadable checkpoint at train.max_steps          resume from that checkpoint
  export    drafter/ exported from that checkpoint                 export (atomic swap)
  check     check.json (ok) for that drafter                       check
  evaluate  evaluate/report.json for that drafter                  evaluate
  serving   drafter/serving.json holds evaluate's measured choice  export it again with it
  (stats and plan are recomputed every time: seconds.)

The table is OFFLINE_STEPS below (ONLINE_STEPS: generate alone, no store); one loop in
run_end_to_end times each step, skips it when it is complete and no earlier step did work
this time, prints its one-line summary (the same function its CLI command prints) and its
problems, and records what ran.

A different recipe or data set needs a new --out: generate and the store refuse mixing.
OUT/summary.json (status "finished") is written last.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from eagle_ray.config import Recipe
from eagle_ray.targets.resolve import resolve_target_path
from eagle_ray.common.atomic import atomic_write_json

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
SAMPLE_DATA = [str(REPO_ROOT / "examples" / "data" / "personal.jsonl"),
               str(REPO_ROOT / "examples" / "data" / "general_sharegpt.jsonl") + ":600::general"]
SUMMARY_FILE = "summary.json"
# Per step, the wall time of the submission that did its work, kept across resubmissions: a
# resumed job skips finished steps, so its own timings say nothing of what they cost.
STEP_WALL_FILE = "step_wall.json"
CHECK_FILE = "check.json"


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def train_complete(run_dir: Path, max_steps: int) -> Path | None:
    """The final checkpoint when training reached max_steps, else None."""
    from eagle_ray.train.checkpoint import newest_loadable

    if not (run_dir / "run.json").exists():
        return None
    ckpt = newest_loadable(run_dir)
    if ckpt is None or json.loads((ckpt / "state.json").read_text())["step"] < max_steps:
        return None
    return ckpt


def _last_metrics(run_dir: Path) -> dict:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
    return json.loads(lines[-1]) if lines else {}


@dataclass
class Job:
    """What the steps share: the recipe, OUT/, the mode, and what each step found or made."""

    recipe: Recipe
    inputs: list[str]
    out: Path
    online: bool
    found: dict[str, Any] = field(default_factory=dict)  # step name -> its result

    def path(self, name: str) -> Path:
        return self.out / name


@dataclass(frozen=True)
class Step:
    """One step of the job. `done(job)`: its output is complete (asked only when no earlier
    step ran this time, since new upstream output makes everything downstream stale; a step
    that resumes by itself says False and lets `run` find nothing to do); `run(job)` does the
    work and says whether there was any; `line(job)` is its one-line summary, printed whether
    it ran or was skipped; `problems(job)`: what is wrong with its result, which stops the
    job when `fatal` and is printed to stderr otherwise; `where`: its outputs under OUT/."""

    name: str
    where: tuple[str, ...]
    done: Callable[[Job], bool]
    run: Callable[[Job], bool]
    line: Callable[[Job], str]
    problems: Callable[[Job], list[str]] = lambda job: []
    fatal: bool = True


# -- ingest -----------------------------------------------------------------------------------

def _ingest_done(job: Job) -> bool:
    job.found["ingest"] = _json(job.path("ingest") / "report.json")
    return job.found["ingest"] is not None


def _ingest_run(job: Job) -> bool:
    from eagle_ray.data.ingest import SourceSpec, ingest
    from eagle_ray.data.tokenize import length_annotator

    res = ingest([SourceSpec.parse(s) for s in job.inputs], job.path("ingest"), seed=job.recipe.data.seed,
                 annotate=length_annotator(job.recipe))
    job.found["ingest"] = res.counters()
    return True


def _ingest_line(job: Job) -> str:
    from eagle_ray.data.ingest import summary_line

    return summary_line(job.found["ingest"])


def _ingest_problems(job: Job) -> list[str]:
    from eagle_ray.data.ingest import problems

    return problems(job.found["ingest"], job.path("ingest"))


def _plan_run(job: Job) -> bool:
    from eagle_ray.plan.budget import plan_for_table

    job.found["stats"], job.found["plan"] = plan_for_table(job.recipe, job.path("ingest"),
                                                           out_dir=job.path("store"))
    return False  # seconds, every time; nothing downstream depends on it having run


def _plan_line(job: Job) -> str:
    from eagle_ray.data.stats import format_stats
    from eagle_ray.plan.budget import format_plan

    return format_stats(job.found["stats"]) + "\n" + format_plan(job.found["plan"])


# -- generate + extract (streamed), or generate alone (online) --------------------------------

def _stream_run(job: Job) -> bool:
    from eagle_ray.store.reader import verify_store
    from eagle_ray.stream.run import run_generate_extract

    # One Ray Data pipeline: separate generation and extractor pools, or one colocated engine
    # per replica for a target that takes the whole node (the recipe's extract.placement).
    # It resumes per sample and starts no Ray work when nothing is left.
    res = run_generate_extract(job.recipe, job.path("ingest"), job.path("generate"), job.path("store"))
    job.found["generate+extract"] = res
    job.found["store_verify"] = verify_store(job.path("store"))
    return bool(res.generated or res.extracted)


def _stream_line(job: Job) -> str:
    return job.found["generate+extract"].summary_line(job.found["store_verify"])


def _generate_run(job: Job) -> bool:
    from eagle_ray.generate.run import run_generate

    if job.path("store").exists():
        raise ValueError(f"{job.out} holds a store from an offline run; use a new --out for --online")
    res = run_generate(job.recipe, job.path("ingest"), job.path("generate"))
    job.found["generate"] = res
    return res.prompts - res.skipped_done > 0  # this run's work (none on a resubmitted job)


def _generate_line(job: Job) -> str:
    return (job.found["generate"].summary_line()
            + "; no store: online training extracts as it trains")


# -- train, export, check, evaluate, serving --------------------------------------------------

def _train_done(job: Job) -> bool:
    if train_complete(job.path("train"), job.recipe.train.max_steps) is None:
        return False
    job.found["train"] = _last_metrics(job.path("train"))
    return True


def _train_run(job: Job) -> bool:
    from eagle_ray.train.run import run_train

    job.found["train"] = (run_train(job.recipe, None, job.path("train"), conversations=job.path("generate"))
                          if job.online else run_train(job.recipe, job.path("store"), job.path("train")))
    return True


def _train_line(job: Job) -> str:
    from eagle_ray.train.run import summary_line

    return summary_line(job.found["train"], job.path("train"))


def _export_run(job: Job) -> bool:
    from eagle_ray.export.drafter import export_drafter

    export_drafter(job.path("train"), job.path("drafter"))
    return True


def _export_line(job: Job) -> str:
    from eagle_ray.export.drafter import summary_line

    return summary_line(job.path("drafter"))


def _check_done(job: Job) -> bool:
    from eagle_ray.evaluate.check import CheckResult

    details = _json(job.path(CHECK_FILE)) or {}
    job.found["check"] = CheckResult(ok=True, details={k: v for k, v in details.items() if k != "ok"})
    return bool(details.get("ok"))


def _check_run(job: Job) -> bool:
    from eagle_ray.evaluate.check import run_check

    chk = run_check(job.recipe, job.path("drafter"), None if job.online else job.path("store"))
    job.found["check"] = chk
    if chk.ok:  # a failed check is done again on the next submission
        atomic_write_json(job.path(CHECK_FILE), {"ok": True, **chk.details})
    return True


def _check_line(job: Job) -> str:
    return job.found["check"].summary_line(job.path("drafter"))


def _evaluate_done(job: Job) -> bool:
    job.found["evaluate"] = _json(job.path("evaluate") / "report.json")
    return job.found["evaluate"] is not None


def _evaluate_run(job: Job) -> bool:
    from eagle_ray.evaluate.run import run_evaluate

    # A run started from a published drafter is judged against it too.
    job.found["evaluate"] = run_evaluate(job.recipe, job.path("drafter"), job.path("ingest"), job.path("evaluate"),
                                         baseline_drafter=job.recipe.train.init_from or None)
    return True


def _evaluate_line(job: Job) -> str:
    from eagle_ray.evaluate.run import summary_lines

    return "\n".join(summary_lines(job.found["evaluate"], job.path("evaluate")))


def _evaluate_problems(job: Job) -> list[str]:
    from eagle_ray.evaluate.run import problems

    # The same judgement `eagle-ray evaluate` exits 1 on; the job finishes and says it.
    return [f"{p}; see {job.path('evaluate') / 'report.md'}" for p in problems(job.found["evaluate"])]


def _serving_done(job: Job) -> bool:
    return "measured" in (_json(job.path("drafter") / "serving.json") or {})


def _serving_run(job: Job) -> bool:
    from eagle_ray.export.drafter import export_drafter

    # serving.json recommends what evaluate measured best at the serving profile.
    export_drafter(job.path("train"), job.path("drafter"), evaluation=job.path("evaluate") / "report.json")
    return True


def _never(job: Job) -> bool:
    return False


OFFLINE_STEPS = [
    Step("ingest", ("ingest",), _ingest_done, _ingest_run, _ingest_line, _ingest_problems),
    Step("plan", (), _never, _plan_run, _plan_line),
    Step("generate+extract", ("generate", "store"), _never, _stream_run, _stream_line),
    Step("train", ("train",), _train_done, _train_run, _train_line),
    Step("export", ("drafter",), lambda job: (job.path("drafter") / "config.json").exists(), _export_run,
         _export_line),
    Step("check", (CHECK_FILE,), _check_done, _check_run, _check_line, lambda job: job.found["check"].problems),
    Step("evaluate", ("evaluate",), _evaluate_done, _evaluate_run, _evaluate_line, _evaluate_problems,
         fatal=False),
    Step("serving", ("drafter/serving.json",), _serving_done, _serving_run, _export_line),
]
ONLINE_STEPS = [Step("generate", ("generate",), _never, _generate_run, _generate_line)
                if s.name == "generate+extract" else s for s in OFFLINE_STEPS]


def run_end_to_end(recipe: Recipe, inputs: list[str], out_dir: str | Path, *,
                   online: bool = False) -> dict:
    """The steps above, in one loop that times, skips and records them. `online`: no store:
    generate, then train with features streamed from extractor actors (train/online.py);
    check captures its reference features again."""
    job = Job(recipe, list(inputs), Path(out_dir).resolve(), online)
    job.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    target_dir = resolve_target_path(recipe.target)
    timings = {"target": time.time() - t0}
    logger.info("target: %s", target_dir)
    ran = run_steps(job, ONLINE_STEPS if online else OFFLINE_STEPS, timings)
    # The summary's timing groups (the streamed steps share one wall time).
    timings["generate"] = timings["extract"] = timings["generate_extract"] = timings.get(
        "generate+extract", timings.get("generate", 0.0))
    timings["export_check_evaluate"] = sum(timings[k] for k in ("export", "check", "evaluate", "serving"))
    summary = _summary(job, target_dir, ran, timings)
    atomic_write_json(job.out / SUMMARY_FILE, json.loads(json.dumps(summary, default=str)))
    print(summary_text(job.out, timings, ran))
    return summary


def run_steps(job: Job, steps: list[Step], timings: dict[str, float]) -> list[str]:
    """The loop: each step skipped (complete, nothing upstream ran) or run, timed into
    `timings`, its line printed, its problems raised (fatal) or printed; the names of the
    steps that did work are returned in order."""
    ran: list[str] = []
    for step in steps:
        t0 = time.time()
        where = " and ".join(str(job.out / w) for w in step.where)
        if not ran and step.done(job):
            print(f"{step.name}: complete in {where}, skipped")
        elif step.run(job):
            ran.append(step.name)
            _record_step_wall(job.out, step.name, time.time() - t0)
        elif where:
            print(f"{step.name}: complete in {where}, nothing left to do")
        timings[step.name] = time.time() - t0
        print(step.line(job))
        bad = step.problems(job)
        if bad and step.fatal:
            raise ValueError(f"{step.name} failed: " + "; ".join(bad))
        for p in bad:
            print(f"{step.name}: problem: {p}", file=sys.stderr)
    return ran


def _record_step_wall(out: Path, name: str, seconds: float) -> None:
    walls = _json(out / STEP_WALL_FILE) or {}
    walls[name] = {"wall_s": seconds, "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    atomic_write_json(out / STEP_WALL_FILE, walls)


def _summary(job: Job, target_dir: Path, ran: list[str], timings: dict[str, float]) -> dict:
    from eagle_ray.data.stats import compute_stats

    f, out = job.found, job.out
    gen_counts = (_json(out / "generate" / "manifest.json") or {}).get("counts", {})
    st = f.get("generate+extract")
    check = f.get("store_verify") or {"ok": True, "samples": 0, "shards": 0, "problems": [], "online": True}
    ev = f["evaluate"]
    return {"status": "finished", "steps_run": ran,
            "recipe": job.recipe.to_dict(), "target_dir": str(target_dir),
            "ingest": {k: f["ingest"][k] for k in ("lines_read", "accepted", "duplicates", "rejected",
                                                   "sampled_out")},
            "stats": f["stats"], "plan": f["plan"].to_dict(),
            "generate": {"generated": gen_counts.get("ok"), "rejected": gen_counts.get("rejected"),
                         "pending": gen_counts.get("pending")},
            "generate_stats": compute_stats(out / "generate"),
            # this run's work (0 when the store was already complete) and the store's size
            "extract": {"extracted": st.extracted if st else 0, "tokens": st.tokens if st else 0,
                        "samples": check["samples"]},
            "store_verify": check, "train": f["train"], "check": {"ok": True, **f["check"].details},
            "evaluate": {k: ev.get(k) for k in ("headline", "offline", "online", "untrained", "ngram",
                                                "baseline_drafter", "outputs_identical", "as_served")},
            "timings_s": timings,
            # what each step cost when it did its work (this submission or an earlier one)
            "step_wall_s": {k: v["wall_s"] for k, v in (_json(out / STEP_WALL_FILE) or {}).items()}}


def summary_text(out: Path, timings: dict[str, float], ran: list[str]) -> str:
    """The job's last lines: wall time per step, the headline, where every output is."""
    from eagle_ray.common.progress import hms

    steps = [("ingest", "ingest"), ("generate+extract", "generate_extract"), ("train", "train"),
             ("export+check+evaluate", "export_check_evaluate")]
    ev = _json(out / "evaluate" / "report.json") or {}
    lines = ["", "summary",
             "  wall time: " + ", ".join(f"{name} {hms(timings[k])}" for name, k in steps if k in timings)
             + f" (steps run this time: {', '.join(ran) or 'none'})"]
    if ev.get("headline"):
        lines.append(f"  headline: {_headline_text(ev)}")
    outputs = [("ingested prompts", out / "ingest"), ("conversations", out / "generate"),
               ("hidden-state store", out / "store"), ("training run", out / "train"),
               ("drafter (vLLM loads it; serving.json: the serve command)", out / "drafter"),
               ("evaluation", out / "evaluate" / "report.md"), ("logs (everything)", out / "logs"),
               ("summary", out / SUMMARY_FILE)]
    lines += [f"  {what}: {where}" for what, where in outputs if where.exists()]
    return "\n".join(lines)


def _headline_text(ev: dict) -> str:
    from eagle_ray.evaluate.run import speedup_text

    h = ev["headline"]
    return (f"expected speedup {h['setting']} {speedup_text(h)} with {h['draft_sample_method']} "
            f"drafting, mean acceptance length {h['mean_acceptance_length']:.2f}")
