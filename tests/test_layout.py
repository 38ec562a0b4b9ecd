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
    expected = (declared - caches - {layout.STAGE_TIMES}) | {layout.report(s) for s in layout.STAGE_REPORTS}
    assert in_dvc - expected == set(), "dvc.yaml paths missing from unison/layout.py"
    assert expected - in_dvc == {layout.VERL_DATA}, "unison/layout.py paths dvc.yaml does not know"  # inside data/export
    assert not any(p.startswith(layout.CACHE) for p in in_dvc)  # resumable state and answers stay out of DVC
    stages = dvc_paths()
    for stage in layout.STAGE_REPORTS:  # each stage that reports writes reports/<stage>.json
        assert layout.report(stage) in stages[stage], stage
