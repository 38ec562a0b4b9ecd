"""The pipeline's stages, `python -m stages.<stage>`; importing the package first quiets third-party logs
(unison/quiet.py) and spares each stage's process transformers' import of scikit-learn."""
import importlib.abc
import importlib.machinery
import sys

from unison.quiet import quiet


class TransformersWithoutSklearn(importlib.abc.MetaPathFinder):
    """transformers imports scikit-learn (~1.6 s of CPU) whenever it is installed (MLflow installs it), for assisted
    generation's ROC threshold, which no stage uses: transformers alone is told it is not installed."""

    def find_spec(self, name, path, target=None):
        if name != "transformers.utils.import_utils":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module  # the loader is this spec's own

        def load_without_sklearn(module):
            load(module)
            module.is_sklearn_available = lambda: False

        spec.loader.exec_module = load_without_sklearn
        return spec


quiet()
sys.meta_path.insert(0, TransformersWithoutSklearn())
