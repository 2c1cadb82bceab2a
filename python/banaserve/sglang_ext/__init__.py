"""BanaServe hooks into SGLang: classes SGLang loads by name (storage backends, ...)."""
