"""Method studies beside the product: what the pipeline's methods do, measured on a finished demo
(research/README.md)."""
