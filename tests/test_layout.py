"""The project's layout (unison/layout.py) is dvc.yaml's: every path a stage depends on or writes under data/, models/ and
reports/ is one of its constants, and each of its DVC paths is in dvc.yaml; the caches are never DVC's."""
from __future__ import annotations

import yaml

from unison import layout
from unison.config import ROOT

TRACKED = ("data/", "models/", "reports/")


def dvc_paths() -> dict[str, set[str]]:
    """Each stage's deps, outs, metrics and plots under data/, models/ and reports/."""
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    out = {}
    for name, stage in stages.items():
        entries = [e for key in ("deps", "outs", "metrics", "plots") for e in stage.get(key) or []]
        out[name] = {p for e in entries for p in ([e] if isinstance(e, str) else list(e)) if p.startswith(TRACKED)}
    return out


def test_dvc_yaml_and_the_code_share_one_layout():
    declared = {v for k, v in vars(layout).items() if k.isupper() and isinstance(v, str)}
    caches = {v for v in declared if v.startswith(layout.CACHE)}
    in_dvc = set().union(*dvc_paths().values())
    expected = ((declared - caches - {layout.STAGE_TIMES}) | {layout.report(s) for s in layout.STAGE_REPORTS}
                | {f(s) for s in layout.SYSTEMS for f in (layout.eval_rows, layout.eval_metrics)})
    assert in_dvc - expected == set(), "dvc.yaml paths missing from unison/layout.py"
    assert expected - in_dvc == {layout.VERL_DATA}, "unison/layout.py paths dvc.yaml does not know"  # inside data/export
    assert not any(p.startswith(layout.CACHE) for p in in_dvc)  # resumable state and answers stay out of DVC
    stages = dvc_paths()
    for stage in layout.STAGE_REPORTS:  # each stage that reports writes reports/<stage>.json
        assert layout.report(stage) in stages[stage], stage
    for system in layout.SYSTEMS:  # each row of evaluate is a stage of its own, which the stage evaluate reads
        assert {layout.eval_rows(system), layout.eval_metrics(system)} <= stages[f"evaluate_{system}"], system
        assert layout.eval_metrics(system) in stages["evaluate"], system


def test_each_row_of_evaluate_waits_on_its_own_system_only():
    """Evaluation computed once: a change re-runs what is downstream of it in dvc.yaml's DAG (as `dvc repro` and the
    Prefect flow read it), so a new RL student re-runs its own row and the tables, never the teacher's, the base model's
    or the other students' rows."""
    from flows.pipeline import read_dag

    dag = read_dag(ROOT)

    def upstream(stage: str) -> set[str]:
        found, todo = set(), list(dag[stage])
        while todo:
            if (s := todo.pop()) not in found:
                found.add(s)
                todo += dag[s]
        return found

    def downstream(stage: str) -> set[str]:
        return {s for s in dag if stage in upstream(s)}

    rows = {f"evaluate_{s}" for s in layout.SYSTEMS}
    assert rows <= upstream("evaluate") and "evaluate" in upstream("report")
    assert downstream("rl") & rows == {"evaluate_rl"} and {"evaluate", "flywheel", "report"} <= downstream("rl")
    assert downstream("sft") & rows == {"evaluate_sft", "evaluate_prm_rerank", "evaluate_dpo", "evaluate_rl"}
    assert downstream("teacher") & rows == rows  # the teacher's trajectories teach every student
    assert not upstream("evaluate_teacher") & {"sft", "dpo", "rl", "prm", "pareto"}
    assert not upstream("evaluate_base") & {"label", "sft", "dpo", "rl", "prm", "pareto"}
