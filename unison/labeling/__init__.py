"""Labelling and evaluation: running judges and agents over episodes to score them (above the pure scorers of
unison/judge, below training): step labels, the LLM judge, judged rows, a system's metrics."""
