"""`-m tests.launched_stages sft prm`: the stages' own main(), one after the other, in each process of one launch
(test_distributed.py: one launch instead of one a stage; inside a launched process run_distributed trains here)."""
import importlib
import sys

if __name__ == "__main__":  # rl's vLLM engine starts in a spawned process, which imports this module again
    for stage in sys.argv[1:]:
        importlib.import_module(f"stages.{stage}").main()
