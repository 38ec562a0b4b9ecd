"""Every path the pipeline's stages read and write, relative to the project root: the one list dvc.yaml and the code
agree on (tests/test_layout.py checks that dvc.yaml's deps, outs, metrics and plots under data/, models/ and reports/
are these, and these are all of them); and the caches under data/.cache, which DVC never tracks."""
from __future__ import annotations

# data
RAW = "data/raw"  # download: the questions and the corpus
RAW_TRAIN = "data/raw/train.parquet"
RAW_TEST = "data/raw/test.parquet"
CORPUS = "data/raw/corpus.parquet"
INDEX = "data/index"  # index: the retrieval index the search tool reads
TRAJECTORIES = "data/trajectories/train.parquet"  # generate
TOPK = "data/trajectories/teacher_topk.parquet"  # generate: the teacher's top-k log-probs (generate.topk)
TOOLSET = "data/trajectories/tools.json"  # generate: the schemas of the tools its agents were given
LABELED = "data/labeled/train.parquet"  # label
RL_DATA = "data/rl"  # pareto: the RL prompts, a parquet per curriculum level
EXPORT = "data/export"  # export: LLaMA-Factory, verl and TRL datasets
VERL_DATA = "data/export/verl"
FLYWHEEL_DATA = "data/flywheel"

# models
BASE = "models/base"
TEACHER = "models/teacher"
TEACHERS = "models/teachers"  # teacher: the named teachers besides the `teacher` block (params `teachers`)
PRM = "models/prm"
SFT = "models/sft"
DPO = "models/dpo"
RL = "models/rl"
FLYWHEEL = "models/flywheel"

# reports
SYSTEMS = ("base", "teacher", "sft", "prm_rerank", "dpo", "rl")  # evaluate's rows, one stage each, in this order
TEACHER_EVALS = "reports/eval/teachers"  # evaluate_teacher: each teacher's own row, where several teach
METRICS = "reports/metrics.json"  # evaluate: every row's metrics
PAIRED = "reports/paired.json"  # evaluate: the systems compared question by question (exact McNemar on EM)
SFT_LOSS = "reports/sft_loss.csv"
PRM_LOSS = "reports/prm_loss.csv"
DPO_LOSS = "reports/dpo_loss.csv"
RL_CURVE = "reports/rl_curve.csv"
PARETO_ROLLOUTS = "reports/pareto_rollouts.parquet"
PARETO_FRONT = "reports/pareto_front.png"
FLYWHEEL_REPORT = "reports/flywheel.json"
FLYWHEEL_PLOT = "reports/flywheel.png"
REPORT_HTML = "reports/report.html"
SUMMARY = "reports/summary.md"
PLOTS = "reports/plots"
STAGE_TIMES = "reports/stage_times.json"  # make demo's clock; not a DVC output
STAGE_REPORTS = ("download", "index", "generate", "label", "prm", "sft", "pareto", "export", "dpo", "rl")


def teacher_dir(name: str) -> str:
    """Where stage teacher puts a teacher: models/teacher for the `teacher` block, models/teachers/<name> for the
    others."""
    return TEACHER if name == "teacher" else f"{TEACHERS}/{name}"


def teacher_rows(name: str) -> str:
    """evaluate_teacher: one teacher's labeled test episodes, where several teach (the team's are eval_rows)."""
    return f"{TEACHER_EVALS}/{name}.parquet"


def teacher_metrics(name: str) -> str:
    return f"{TEACHER_EVALS}/{name}.json"


def eval_rows(system: str) -> str:
    """evaluate_<system>: the system's labeled test episodes."""
    return f"reports/eval/{system}.parquet"


def eval_metrics(system: str) -> str:
    """evaluate_<system>: the system's metrics, or why it was not evaluated."""
    return f"reports/eval/{system}.json"


def report(stage: str) -> str:
    """A stage's figures, a DVC metrics file: reports/<stage>.json."""
    return f"reports/{stage}.json"


# caches (never DVC outputs: a stage's resumable state and content-addressed answers)
CACHE = "data/.cache"
GENERATE_CACHE = "data/.cache/generate"
FLYWHEEL_CACHE = "data/.cache/flywheel"
LLM_CACHE = "data/.cache/llm"
WEB_CACHE = "data/.cache/web"
TOOL_LOGS = "data/.cache/tool_logs"  # your MCP servers' stderr
VERL_WORK = "data/.cache/verl"
DIGESTS = "data/.cache/digests.json"
