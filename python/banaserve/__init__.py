"""BanaServe: disaggregated prefill/decode LLM serving on SGLang.

Importing this package must stay cheap: a ``.pth`` file imports
``banaserve.platform.autoload`` at the start of every Python process.
"""

__version__ = "0.1.0"
