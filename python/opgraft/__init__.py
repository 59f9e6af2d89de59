"""opgraft: faster kernels for stock vLLM, grafted in through its plugin system.

Importing this package is cheap: it loads neither torch nor vLLM nor libopgraft until asked.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
