"""The Anthropic Messages API (``/v1/messages``) on the router, served through its chat path."""
