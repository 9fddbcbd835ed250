"""Load generation against OpenAI-compatible endpoints (``kvferry bench serve``)."""
