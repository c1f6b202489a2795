"""``ddtree-rtc serve``: an OpenAI-compatible HTTP server over the engine (``pip install .[serve]``)."""
