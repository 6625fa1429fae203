"""What people read of a study: the record's trial from Tune's (`tune_trial`; `launch.record.table_row` adds the
columns every table and the summary's trial rows share), the replicate groups, the verdict and the compute line, printed by
`a2 study status` and at the end of `run`/`resume` (`launch.driver`), and the live trial table."""
from __future__ import annotations

import copy
import json

from a2core.config import format_value, get_dotted
from a2core.errors import StudyError
from a2core.selection import finite
from dashboards.stats import MIN_SEEDS, Interval, short_hash, stopped_early_text
from dashboards.runs import Trial
from dashboards.tables import text_table
from launch.layout import end_text, outage_line
from launch.location import SUMMARY_FILE
from launch.spec import SEED_PATH


# -- the record's trial from Tune's, and its table columns ---------------------------------------------------------
def tune_trial(trial) -> Trial:
    """What Tune knows of a trial (a Tune `Trial`: the driver's live ones, or `ExperimentAnalysis.trials`) as the
    record's `Trial`: id, name, sampled config, state, retries, last error line and last result."""
    try:
        lines = str(trial.get_error() or "").strip().splitlines()
    except Exception:  # noqa: BLE001 - the error file may be gone with its node
        lines = ["the trial failed"] if trial.status == "ERROR" else []
    return Trial(str(trial.trial_id), name=str(trial), state=str(trial.status), sampled=dict(trial.config or {}),
                 retries=int(getattr(trial, "num_failures", 0) or 0), error=lines[-1][:500] if lines else None,
                 last_result=dict(getattr(trial, "last_result", None) or {}))


def test_metric(metric: str) -> str:
    """The test-split counterpart of a val metric ("val/CIDEr" and "best/val/CIDEr" -> "test/CIDEr")."""
    return "test/" + metric.removeprefix("best/").split("/", 1)[-1]


def best_value(values, mode: str) -> float | None:
    """The best of the finite values, or None."""
    return (max if mode == "max" else min)((v for v in map(finite, values) if v is not None), default=None)


def compute_line(totals: dict) -> str:
    """One line for people: `compute: 812 s wall, 1570 CPU-s; on early-stopped trials ...; early stopping saved ...`."""
    if not totals:
        return "compute: not recorded"
    forms = {"wall_s": "{:.0f} s wall", "gpu_s": "{:.0f} GPU-s", "cpu_s": "{:.0f} CPU-s", "cost": "cost {:.2f}"}

    def part(kind: str) -> str:
        shown = [(form, totals.get(f"{kind}_{key}")) for key, form in forms.items()]
        return ", ".join(form.format(value) for form, value in shown if value is not None)

    return f"compute: {part('total')}; on early-stopped trials {part('stopped')}; early stopping saved {part('saved')}"


def verdict(summary: dict) -> str:
    """The best trial against its baseline (fusion none, same seed) and, for a study with replicates, the best
    configuration's mean with its interval against the best fusion-none configuration's."""
    best, metric = summary.get("best"), summary["metric"]
    if best is None:
        return f"study {summary['study']}: no trial reported {metric}"
    line = (f"best trial {best['trial_id']}: {metric} {best['value']:.2f} at epoch {best['epoch']} "
            f"({config_text(best, varying_keys(summary))}, seed {best['seed']})")
    base = summary.get("baseline")
    if best["fusion"] == "none":
        line += "; it is itself the baseline (fusion none)"
    elif base is None:
        line += f"; no baseline (fusion none) trial with seed {best['seed']} in the study"
    else:
        # one run against one run: a difference, never a verdict (that needs seed noise: `group_verdict`)
        line += (f"; the baseline's run with that seed (fusion none, trial {base['trial_id']}): {base['value']:.2f}, "
                 f"{best['value'] - base['value']:+.2f} (one seed each: no verdict)")
    group = group_verdict(summary)
    return line + (f"\n{group}" if group else "")


def group_verdict(summary: dict) -> str | None:
    """For replicated studies: "best configuration (fusion gate, lambda 0.035): 112.3 [110.1, 114.5] over 3 seeds;
    gate beats none by ..." (the summary's `verdicts`: `a2 study compare --by fusion`'s rule and family, Holm over
    every fusion against the baseline, `dashboards.compare.study_verdicts`)."""
    best, metric = summary.get("best_group"), summary["metric"]
    if not best or best["n"] < 2:
        return None
    iv = Interval(best["mean"], best["low"], best["high"], best["n"], bool(best.get("identical")))
    line = (f"best configuration ({config_text(best, varying_keys(summary))}): {metric} {iv.text()} "
            f"over {best['n']} seeds")
    if best["fusion"] == "none" or summary.get("baseline_group") is None:
        return line
    family = summary.get("verdicts") or {}
    entry = next((c for c in family.get("comparisons", []) if c["arm"] == str(best["fusion"])), None)
    why = entry["verdict"] if entry else family.get("note")  # the note: no verdict yet (confirmation seeds to come)
    if not why and family.get("error"):  # no comparison could be made (`study_verdicts`): say why, not nothing
        why = f"no verdict: {family['error']}"
    return f"{line}; {why}" if why else line


def varying_keys(summary: dict) -> list[str]:
    """The search keys besides fusion and lambda (always named) whose value differs between configurations."""
    groups = summary.get("groups") or []
    keys = sorted({k for g in groups for k in g.get("sampled") or {}
                   if k.split(".")[-1] not in ("fusion", "lambda")})
    return [k for k in keys if len({value_text(g["sampled"].get(k)) for g in groups}) > 1]


def config_text(item: dict, keys: list[str]) -> str:
    """"fusion gate, lambda 0.035" and the value of each of `keys`, named by its last part ("mask_net linear")."""
    sampled = item.get("sampled") or {}
    named = [f"fusion {item['fusion']}", f"lambda {value_text(item['lambda'])}"]
    return ", ".join(named + [f"{k.split('.')[-1]} {value_text(sampled.get(k))}" for k in keys])


def value_text(value) -> str:
    """A value as the tables and run names show it: a float to 4 significant digits, None as "-"."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def state_text(row: dict) -> str:
    """A trial's or group's state: Tune's, "stopped early (rung r, cutoff c)" when the scheduler stopped it, or
    "diverged at epoch e step s (train/loss nan)" when it ended itself (`launch.layout.end_record`)."""
    if row.get("ended"):
        return end_text(row["ended"])
    return stopped_early_text(row["stopped_early"]) if row.get("stopped_early") else row.get("state", "")


def format_table(rows: list[dict], spec) -> str:
    """The trial table: a column for each searched key of `spec` (the keys that tell a study's cells apart:
    `fusion`, `lambda`, `temperature`, `model.renormalize`, ...; "-" where a key does not apply to the trial), its
    seed, state, epochs, and the study metric's last and best values."""
    short = spec.metric.split("/")[-1]
    searched = [p for p in spec.params.values() if p.path != SEED_PATH]
    header = ["trial", *(p.key.split(".")[-1] for p in searched), "seed", "state", "epochs", f"last {short}",
              f"best {short}"]
    body = [[r["trial_id"], *(_searched_value(r, p) for p in searched), value_text(r["seed"]), state_text(r),
             epochs_text(r), value_text(r["last"]), value_text(r["best"])] for r in rows]
    return text_table(header, body)


def epochs_text(row) -> str:
    """`3/8`: a trial's epochs reported of planned; `3/8 +41%` with 41% of its next epoch's steps done (a running
    trial's `under_way`, `launch.layout.progress_record`)."""
    text = f"{row['epochs_done']}/{row['epochs_planned']}"
    under = row.get("under_way") if row.get("state") == "RUNNING" else None
    return text + (f" +{min(under['done'] / under['total'], 0.99):.0%}" if under and under.get("total") else "")


def _searched_value(row, param) -> str:
    """A searched key's value in a trial: from its resolved config, else (an old study whose keys moved on) as Tune
    sampled it; "-" where the key does not apply (its `when` excludes the trial)."""
    config = row["config"] or {}
    value = get_dotted(config, param.path, None) if config else (row["sampled"] or {}).get(param.key)
    return "-" if value is None else format_value(value)  # as a study file writes it: 12000, not 1.2e+04


def format_groups(groups: list[dict], metric: str) -> str:
    """One row per replicate group: its seeds, the mean of the best metric with its 95% interval, its state."""
    header = ["config", "fusion", "lambda", "seeds", f"best {metric.split('/')[-1]} [95% CI]", "state"]
    body = [[short_hash(g["config_hash"]), str(g["fusion"]), value_text(g["lambda"]), str(g["n"]),
             "-" if g["mean"] is None else Interval(g["mean"], g["low"], g["high"], g["n"],
                                                    bool(g.get("identical"))).text(),
             state_text(g) if g.get("stopped_early") else "-"] for g in groups]
    return text_table(header, body)


def print_conclusions(spec, summary: dict, rows: list[dict]) -> None:
    """The trial table (of `rows`), the replicate groups, the verdict, the compute and any tracking outage."""
    lines = [format_table(rows, spec)] if rows else []
    if any(g["n"] > 1 for g in summary["groups"]):
        lines.append(f"replicate groups (mean over seeds, 95% interval; below {MIN_SEEDS} seeds: none):\n"
                     f"{format_groups(summary['groups'], spec.metric)}")
    lines += [verdict(summary), compute_line(summary["compute"]), outage_line(summary.get("tracking"))]
    lines += [f"trial {r['trial_id']}: best checkpoint {r['best_checkpoint_problem'].split(': ', 1)[-1]}: "
              f"{r['best_checkpoint']}; `a2 package` refuses it (restore it from a copy)"
              for r in rows if r.get("best_checkpoint_problem")]
    print("\n".join(line for line in lines if line), flush=True)


# -- summary.json: the study's own files relative to its folder ----------------------------------------------------
# A copied (`cp -a`) or moved study reads and packages its own checkpoints: the summary's paths of files inside the
# study's folder are written relative to it (`portable_summary`) and placed below wherever the study is read
# (`placed_summary`). `path` (the study's folder) is written ".".
_ROW_PATHS = ("best_checkpoint", "train_run")  # a trial row's paths (`dashboards.runs.ROW_KEYS`)


def _absolute(value: str) -> bool:
    return value.startswith("/") or "://" in value


def _summary_paths(summary: dict, change) -> dict:
    """A copy of `summary` with `change` applied to each path it holds of the study's own files."""
    out = copy.deepcopy(summary)
    for part in (out.get("best"), out.get("baseline")):
        if isinstance(part, dict) and isinstance(part.get("checkpoint"), str):
            part["checkpoint"] = change(part["checkpoint"])
    for row in out.get("trials") or []:
        for key in _ROW_PATHS:
            if isinstance(row, dict) and isinstance(row.get(key), str):
                row[key] = change(row[key])
    return out


def portable_summary(summary: dict, study_uri: str) -> dict:
    """`summary` as `summary.json` holds it: every path below the study's folder `study_uri` relative to it."""
    prefix = study_uri.rstrip("/") + "/"
    out = _summary_paths(summary, lambda v: v[len(prefix):] if v.startswith(prefix) else v)
    if out.get("path") == study_uri:
        out["path"] = "."
    return out


def placed_summary(summary: dict, location) -> dict:
    """`summary.json`'s `summary` read at `location` (a `launch.location.StudyLocation`): relative paths below the
    study's folder there. An older summary's absolute path below the folder it was written in is this folder's file
    when that is here (a copy reads its own checkpoints, a moved study finds them), else left as it is."""
    here, recorded = location.uri(), summary.get("path")
    prefix = recorded.rstrip("/") + "/" if isinstance(recorded, str) and _absolute(recorded) else None

    def place(value: str) -> str:
        if not value or not _absolute(value):
            return location.uri(value) if value else value
        if prefix and value.startswith(prefix) and recorded.rstrip("/") != here.rstrip("/"):
            own = location.at(value[len(prefix):])
            if own.exists():
                return own.uri
        return value

    return {**_summary_paths(summary, place), "path": here}


def read_state_json(location, what: str, advice: str):
    """The JSON of the study file at `location` (a `launch.storage.Location`), None when there is none; a file cut
    short or damaged is a StudyError of one line naming it, `what` it is and `advice` (what to do)."""
    text = location.read_text()
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError as err:
        found = f"{err.msg} at line {err.lineno} column {err.colno}" if isinstance(err, json.JSONDecodeError) else err
        raise StudyError(f"{location.uri}: {what} is not readable JSON ({found}: cut short or damaged); "
                         f"{advice}") from None


def read_summary(location, placed: bool = True) -> dict | None:
    """The study's `summary.json` (None: not written yet), placed at `location` (`placed_summary`) unless `placed`
    is False (to be written back as it is); a damaged one is one line naming it (`read_state_json`)."""
    summary = read_state_json(location.at(SUMMARY_FILE), "the study's summary",
                              f"`a2 study resume {location.name}` writes it again from the study's record "
                              f"(`a2 study check {location.name}` checks the rest)")
    if summary is not None and not isinstance(summary, dict):
        raise StudyError(f"{location.uri(SUMMARY_FILE)}: the study's summary is not a JSON object; `a2 study resume "
                         f"{location.name}` writes it again from the study's record")
    return placed_summary(summary, location) if summary is not None and placed else summary
