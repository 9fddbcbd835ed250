"""The OpenAI Responses API (``/v1/responses``) on the router, with its Redis-backed, encrypted store."""
