"""One SGLang server with BanaServe's platform and defaults (``banaserve.launch_server``)."""
