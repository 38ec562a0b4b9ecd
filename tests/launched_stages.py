"""`-m tests.launched_stages sft prm`: the stages' own main(), one after the other, in each process of one launch
(test_distributed.py: one launch instead of one a stage; inside a launched process run_distributed trains here)."""
import importlib
import sys

for stage in sys.argv[1:]:
    importlib.import_module(f"tasks.{stage}").main()
