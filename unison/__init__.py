"""unison: distil a team of LLM agents into one tool-using model."""
__version__ = "0.1.0"
