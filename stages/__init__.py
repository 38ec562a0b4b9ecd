"""The pipeline's stages, `python -m stages.<stage>`; importing the package first quiets third-party logs
(unison/quiet.py)."""
from unison.quiet import quiet

quiet()
