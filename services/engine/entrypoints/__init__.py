"""The OpenAI HTTP app of an engine: routes, serving handlers, lifecycle, metrics, the role seam and the serve CLI."""
